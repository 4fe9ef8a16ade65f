"""The training loop: steps, evaluations and checkpoints with exact resume, data-parallel or not.

Determinism is by construction, so that a resumed run follows the loss trajectory
of an uninterrupted one exactly:

- the batch of step s is a pure function of ``(seed, s)`` (its own ``torch.Generator``),
  never of how many batches a process has drawn before;
- a checkpoint holds the weights, the optimizer moments, the step, the loss history,
  the global RNG state and (fp16) the gradient scaler's scale and growth counter, and
  the learning rate is a function of the step. An fp16 step whose gradients
  overflowed is skipped by the scaler (the optimizer does not step): its history
  record says ``"skipped": true``, so the optimizer's own step count is known.

Data parallelism (``torchrun --nproc_per_node=P``, gloo on the CPU): every process
draws the same global batch of step s and keeps its 1/P slice; the loss is the sum
of token losses divided by the global number of target tokens, and gradients are
summed across processes, so P processes take exactly the step one process takes
on the whole batch (up to the order of float additions). Every collective has a
deadline (``ddp_timeout``): a rank that stops answering (stopped, swapped out,
deadlocked) ends the job on every other rank with a message naming it, from the
per-step heartbeats the ranks leave in the process group's store; rank 0 also logs
a heartbeat line while the job runs.

FSDP2 and context parallelism (``--fsdp``, ``--context-parallel``; :mod:`.parallel`): the
processes form a ``dp × cp`` grid, each keeps its rows and, within its context-parallel
group, its contiguous token slice of them; gradients are summed over all ranks, by FSDP's
reduce-scatter when the model is sharded. A sharded model's checkpoints are written by every
rank through DCP (:mod:`.dcp_checkpoint`) and resume on any number of processes.

The run folder belongs to one run at a time (``run_folder.py``: lock, run id,
pruning within the run; ``signals.py``: SIGINT/SIGTERM saving a checkpoint before exiting).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..models import LM, LMConfig
from ..tasks import IGNORE
from ..tasks.adapters import make_task, step_generator
from ..io.checkpoint import save_checkpoint
from .config import TrainConfig
from ..io.dcp_checkpoint import load_sharded, save_sharded
from .distributed import Heartbeat, all_reduce_, collective, current_heartbeat, dist_info, maybe_init_distributed, set_heartbeat
from .errors import CheckpointWriteError, RunFolderError
from .data_files import BusErrorGuard, DataWatch, check_data_files, data_fingerprints
from .evaluation import evaluate_global, token_losses
from ..io.listing import mark_latest, remove_folder
from .metrics import rewrite_metrics, write_metrics
from .optim import learning_rate, make_optimizer
from .parallel import ParallelPlan, init_single_process_group, plan_parallel, shard_model
from .precision import DTYPES, check_precision, make_scaler
from .run_folder import RunLock, claim_run_folder, describe_latest, new_run_id, prune_checkpoints
from .signals import StopSignals, TrainingInterrupted
from .train_state import check_training_tensors, load_training_checkpoint, optimizer_from_flat, optimizer_to_flat
from ..io.checkpoint import load_weights

__all__ = ["TrainResult", "train"]


@dataclass
class TrainResult:
    model: LM
    history: List[Dict[str, Any]]
    evals: List[Dict[str, Any]]
    seconds: float
    task: Any
    rank: int = 0  # of the process that returns it: only rank 0 reports a distributed run


def _progress(total: int, initial: int, enabled: Optional[bool], desc: str):
    from tqdm.auto import tqdm

    if enabled is None:  # auto: only on a terminal, never under CI
        enabled = sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true")
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, mininterval=0.5,
                dynamic_ncols=True, leave=True)


def train(
    model_config: LMConfig,
    config: TrainConfig,
    out_dir: Optional[str] = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: Optional[bool] = None,
    log: Callable[[str], None] = print,
    desc: str = "train",
    allow_data_change: bool = False,
) -> TrainResult:
    """Train an LM of ``model_config`` as ``config`` says; checkpoints go to ``out_dir``.

    Args:
        model_config: the model; its ``vocab_size`` must equal the task's.
        config: the :class:`TrainConfig`.
        out_dir: run folder for checkpoints and ``metrics.jsonl`` (``None``: write nothing).
        resume: continue from ``out_dir``'s latest checkpoint; the stored configs are
            used (only ``steps`` and the eval/save cadence may differ).
        overwrite: replace the run ``out_dir`` holds (without it, or ``resume``, a
            folder with another run's checkpoints is refused).
        progress: show a progress bar (``None``: only on a terminal and not under CI).
        allow_data_change: resume even though the data files differ from the ones the run
            recorded (:mod:`fastweights.training.data_files`; refused otherwise).
        log: where evaluation lines go.

    Raises:
        RunFolderError: ``out_dir`` is locked by another trainer, or holds another run.
        TrainingInterrupted: SIGINT/SIGTERM stopped the run after a step (and a
            checkpoint); its ``exit_code`` is 130 or 143.
        DistributedTimeout: a data-parallel rank went silent for ``ddp_timeout`` s.

    Returns:
        :class:`TrainResult` with the model, the per-step losses and the evaluations.
    """
    if resume and out_dir is None:
        raise ValueError("train: `resume` needs the run folder `out_dir`")
    created = maybe_init_distributed(config.ddp_timeout)
    rank, world = dist_info()
    threads = torch.get_num_threads()
    lock = RunLock(out_dir) if out_dir is not None and rank == 0 else None
    try:
        if config.fsdp and world == 1 and not dist.is_initialized():  # FSDP needs a process group, even of one
            created = init_single_process_group(config.ddp_timeout)
        # --context-parallel is checked on every rank before any collective: all raise, none waits
        plan = plan_parallel(rank, world, config.context_parallel, config.fsdp)
        if lock is not None:
            error = None
            try:
                lock.acquire(log)
                claim_run_folder(out_dir, resume=resume, overwrite=overwrite, log=log)
            except ValueError as e:
                error = e
            if world > 1:  # every rank learns whether rank 0 may use the folder
                flag = torch.tensor([float(error is not None)])
                dist.broadcast(flag, 0)
            if error is not None:
                raise error
        elif world > 1 and out_dir is not None:
            flag = torch.tensor([0.0])
            dist.broadcast(flag, 0)
            if flag.item():
                raise RunFolderError(f"train: rank 0 could not take the run folder {out_dir}; see its message")
        set_heartbeat(Heartbeat(rank, world, min(60.0, config.ddp_timeout / 2), log,
                                pulse=min(1.0, config.ddp_timeout / 10)).start_pulse())
        if config.threads:
            torch.set_num_threads(config.threads)
        release = lock.release if lock is not None else lambda: None
        with StopSignals(on_force=release) as stop, BusErrorGuard(None, on_fault=release) as guard:
            quiet = log if rank == 0 else (lambda _: None)  # one rank speaks for the job
            return _train(model_config, config, out_dir, resume, progress, quiet, desc, rank, world, stop=stop,
                          allow_data_change=allow_data_change, plan=plan, guard=guard)
    finally:
        if current_heartbeat() is not None:
            current_heartbeat().stop_pulse()
        set_heartbeat(None)
        torch.set_num_threads(threads)  # a setting of this run, not of the caller's process
        if lock is not None:
            lock.release()
        if created:
            dist.destroy_process_group()


def _train(model_config, config, out_dir, resume, progress, log, desc, rank, world, stop=None,
           allow_data_change=False, plan=None, guard=None) -> TrainResult:
    plan = plan or ParallelPlan(rank, world, dp=world, cp=1)
    task = make_task(config)
    plan.check_batch(config.batch_size, task.seq_len)
    data_files = data_fingerprints(config)  # recorded in every checkpoint, checked on resume
    # the mapped files' sizes, checked before every step and evaluation (a truncated mapping is SIGBUS)
    watch = DataWatch({k: fp["path"] for k, fp in data_files.items()},
                      (lambda: describe_latest(out_dir)) if out_dir is not None and rank == 0 else (lambda: ""))
    if guard is not None:
        guard.watch = watch  # closed by the guard
    if model_config.vocab_size != task.vocab_size:
        raise ValueError(
            f"train: the model's `vocab_size`={model_config.vocab_size} does not match the data's "
            f"vocabulary of {task.vocab_size} tokens ({config.data})"
        )
    if "softmax" in model_config.mixers and model_config.max_seq_len < task.seq_len:
        raise ValueError(f"train: `max_seq_len`={model_config.max_seq_len} is shorter than the data's sequences ({task.seq_len} tokens)")
    dtype = DTYPES[config.dtype]
    torch.manual_seed(config.seed)
    model = LM(model_config).to(dtype)
    device = next(model.parameters()).device
    check_precision(config.precision, device)
    if plan.fsdp:
        shard_model(model, plan, config.precision)
    optimizer = make_optimizer(model, config)
    # fp16 gradients can underflow: scale the loss up, unscale before clipping (a no-op otherwise)
    scaler = make_scaler(config, device)
    start, history, evals, run_id = 0, [], [], new_run_id()

    if resume:
        ckpt = load_training_checkpoint(out_dir)
        check_data_files(ckpt.train.get("data_files"), data_files, allow_data_change, log)
        run_id = ckpt.train.get("run_id") or run_id  # checkpoints from before run ids get one now
        if ckpt.sharded != plan.fsdp:
            kind = "with" if ckpt.sharded else "without"
            raise ValueError(f"train: {ckpt.path} was written by a run {kind} --fsdp; resume it {kind} --fsdp")
        if ckpt.sharded:  # every rank reads its own slices, whatever world size wrote them
            collective("loading the sharded checkpoint", load_sharded, ckpt.path, model, optimizer, ckpt.train)
        else:
            check_training_tensors(ckpt, optimizer)
            load_weights(model, ckpt.weights, ckpt.path)
            optimizer.load_state_dict(optimizer_from_flat(ckpt.train_tensors, ckpt.train["optimizer"]))
            torch.set_rng_state(ckpt.train_tensors["rng.torch"])
        if scaler.is_enabled():  # the scale the killed run had reached, not a fresh one
            scaler.load_state_dict(ckpt.train["grad_scaler"])
        start, history, evals = ckpt.train["step"], ckpt.train["history"], ckpt.train["evals"]
        if rank == 0:  # drop what the killed run logged after its last checkpoint
            rewrite_metrics(out_dir, history, evals)
        log(f"resumed {ckpt.path} at step {start}")

    # with FSDP or context parallelism the forward and backward passes run collectives too
    guarded = collective if world > 1 and (plan.fsdp or plan.cp > 1) else (lambda what, fn, *a, **k: fn(*a, **k))
    collective_eval = collective if world > 1 else guarded  # the evaluation's sums are all-reduced
    tokens_per_step = config.batch_size * task.seq_len
    bar = _progress(config.steps, start, progress if rank == 0 else False, desc)
    model.train()
    t0 = time.perf_counter()
    seconds_before = history[-1]["seconds"] if history else 0.0
    step_seconds = 0.0  # time in training steps since this process started (evaluations excluded)
    for step in range(start, config.steps):
        step_t0 = time.perf_counter()
        watch.check()
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = task.sample(config.batch_size, step_generator(config.seed, step))
        inputs, targets = plan.local_batch(inputs, targets)  # rows of this data-parallel group, tokens of this rank
        loss_sum, _ = guarded("the forward pass", token_losses, model, inputs, targets, config.precision,
                              cp_group=plan.cp_group)
        # The third entry counts the ranks that got SIGINT/SIGTERM: all stop after the same step.
        stopping = stop is not None and stop.requested is not None
        counts = torch.tensor([float(loss_sum.detach()), float((targets != IGNORE).sum()), float(stopping)], dtype=torch.float64)
        all_reduce_([counts])
        guarded("the backward pass", scaler.scale(loss_sum / counts[1].to(loss_sum.dtype)).backward)
        if not plan.fsdp:  # FSDP reduce-scattered the gradients (as sums) in the backward pass
            all_reduce_([p.grad for p in model.parameters() if p.grad is not None])
        scaler.unscale_(optimizer)
        if config.grad_clip:  # sharded gradients: the norm is all-reduced
            guarded("the gradient norm", torch.nn.utils.clip_grad_norm_, model.parameters(), config.grad_clip, foreach=False)
        scale = scaler.get_scale() if scaler.is_enabled() else None
        scaler.step(optimizer)  # skipped (and the scale lowered) when fp16 gradients overflowed
        scaler.update()
        skipped = scale is not None and scaler.get_scale() < scale
        optimizer.zero_grad(set_to_none=True)
        step_seconds += time.perf_counter() - step_t0

        loss = float(counts[0] / counts[1])
        if not math.isfinite(loss):
            raise FloatingPointError(f"train: the loss became {loss} at step {step + 1}; lower `lr`")
        elapsed = time.perf_counter() - t0
        tok_s = tokens_per_step * (step + 1 - start) / max(step_seconds, 1e-9)
        # seconds: wall time since the run began (resumes included); tok_s: training tokens
        # per second of step time since this process started
        record = {"step": step + 1, "loss": loss, "lr": lr, "seconds": seconds_before + elapsed, "tok_s": round(tok_s, 1)}
        if skipped:  # the optimizer did not step (fp16 overflow); the scaler lowered its scale
            record["skipped"] = True
        history.append(record)
        if rank == 0:
            write_metrics(out_dir, record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
        heartbeat = current_heartbeat()
        if heartbeat is not None:
            heartbeat.beat(step + 1)

        last = step + 1 == config.steps
        evaluating = (config.eval_every and (step + 1) % config.eval_every == 0) or last
        if evaluating:  # every rank takes part and gets the global figures (evaluate_global)
            watch.check()
            result = {"step": step + 1, **collective_eval("the evaluation", evaluate_global, model, task, config,
                                                          rank, world, plan.fsdp)}
            evals.append(result)
        if evaluating and rank == 0:
            write_metrics(out_dir, result)
            message = (f"step {step + 1}: loss {loss:.4f}, eval loss {result['eval_loss']:.4f}"
                       + (f" ({result['eval_bpb']:.3f} bits/byte)" if "eval_bpb" in result else "")
                       + f", eval accuracy {result['eval_accuracy']:.3f}, {tok_s:,.0f} tok/s, {record['seconds']:.1f} s")
            if bar.disable:
                log(message)
            else:
                bar.write(message)
        interrupted = counts[2] > 0
        saved = None
        if out_dir is not None and ((config.save_every and (step + 1) % config.save_every == 0) or last or interrupted):
            if plan.fsdp:  # every rank writes its shards
                saved = _save_sharded(out_dir, model, optimizer, model_config, config, task, step + 1, history, evals,
                                      run_id, rank, data_files)
            elif rank == 0:
                saved = _save(out_dir, model, optimizer, scaler, model_config, config, task, step + 1, history, evals, run_id,
                              data_files)
            if world > 1:
                collective("the barrier after a checkpoint", dist.barrier)
        if interrupted and not last:
            bar.close()
            raise TrainingInterrupted(stop.requested if stop is not None and stop.requested else signal.SIGTERM,
                                      step + 1, saved if rank == 0 else None)
    bar.close()
    return TrainResult(model, history, evals, time.perf_counter() - t0, task, rank)


def _train_json(config, task, step, history, evals, run_id, data_files=None) -> Dict[str, Any]:
    state = {"run_id": run_id, "step": step, "train_config": config.to_dict(), "tokenizer": task.tokenizer,
             "history": history, "evals": evals}
    if data_files:  # absolute paths and fingerprints of the text files (training/data_files.py)
        state["data_files"] = data_files
    return state


def _save_sharded(out_dir, model, optimizer, model_config, config, task, step, history, evals, run_id, rank,
                  data_files=None) -> Optional[str]:
    """Every rank writes its shards of ``ckpt-<step>``; rank 0 then marks it ``latest`` and prunes."""
    try:
        path = collective("writing a sharded checkpoint", save_sharded, os.path.join(out_dir, f"ckpt-{step:06d}"), model,
                          optimizer, model_config.to_json(),
                          _train_json(config, task, step, history, evals, run_id, data_files), rank=rank)
    except CheckpointWriteError as e:  # a full disk: one line; nothing was replaced
        raise CheckpointWriteError(f"train: {e}; {describe_latest(out_dir)}") from None
    if rank != 0:
        return None
    _publish(out_dir, path, config, run_id)
    return path


def _save(out_dir, model, optimizer, scaler, model_config, config, task, step, history, evals, run_id,
          data_files=None) -> str:
    """Write ``ckpt-<step>`` (with ``run_id``), point ``latest`` at it, prune this run's older ones."""
    tensors, optimizer_info = optimizer_to_flat(optimizer)
    tensors["rng.torch"] = torch.get_rng_state()
    train_state = {**_train_json(config, task, step, history, evals, run_id, data_files), "optimizer": optimizer_info}
    if scaler.is_enabled():  # scale, growth factors and interval, steps since the last overflow: plain numbers
        train_state["grad_scaler"] = scaler.state_dict()
    try:
        path = save_checkpoint(os.path.join(out_dir, f"ckpt-{step:06d}"), model, train=train_state, train_tensors=tensors)
    except CheckpointWriteError as e:  # a full disk: say so in one line; nothing was replaced
        raise CheckpointWriteError(f"train: {e}; {describe_latest(out_dir)}") from None
    _publish(out_dir, path, config, run_id)
    return path


def _publish(out_dir, path, config, run_id) -> None:
    """Point ``latest`` at the checkpoint ``path`` just written, then prune this run's older ones."""
    try:
        mark_latest(out_dir, path)
    except OSError as e:  # `latest` still names the previous checkpoint: drop the unmarked one
        remove_folder(path)
        raise CheckpointWriteError(
            f"train: could not point {os.path.join(out_dir, 'latest')} at {os.path.basename(path)}: "
            f"{e.strerror or e}; {describe_latest(out_dir)}") from None
    prune_checkpoints(out_dir, run_id, config.keep_checkpoints, latest=path)
