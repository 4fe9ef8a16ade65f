"""Training: the loop, evaluation, checkpoints with exact resume, and data parallelism.

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

The run folder belongs to one run at a time (``run_folder.py``: lock, run id,
pruning within the run, SIGINT/SIGTERM saving a checkpoint before exiting).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import (
    CheckpointWriteError, check_training_tensors, load_training_checkpoint, load_weights, mark_latest,
    optimizer_from_flat, optimizer_to_flat, remove_folder, save_checkpoint,
)
from .config import Config, atomic_write_text
from .models import LM, LMConfig
from .run_folder import (
    RunFolderError, RunLock, StopSignals, TrainingInterrupted, claim_run_folder, describe_latest, new_run_id,
    prune_checkpoints,
)
from .tasks import IGNORE, AssociativeRecall, ByteText

__all__ = ["TrainConfig", "train", "make_task", "evaluate", "evaluate_tokens", "autocast", "TrainResult", "DTYPES",
           "PRECISIONS"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
# --precision: the autocast dtype of the forward pass (None: plain fp32). The weights, the
# optimizer and the memories' states stay fp32; fp16 adds a gradient scaler.
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainConfig(Config):
    """How to train; checked on construction.

    Args:
        data: ``"recall"`` (the built-in associative recall with overwrites) or the path
            of a text file (byte-level tokens).
        seq_len: tokens per training window (text only; recall's length follows its sizes).
        recall_keys, recall_values, recall_pairs, recall_active_keys, recall_queries:
            the sizes of :class:`~fastweights.tasks.AssociativeRecall`.
        steps: optimizer steps in total (a resumed run continues up to this).
        batch_size: sequences per step, over all processes together.
        lr, min_lr_ratio, warmup_steps: linear warmup to ``lr``, then cosine decay to
            ``lr · min_lr_ratio`` at ``steps``.
        weight_decay: AdamW decay of the matrices (not of norms, biases, decay parameters).
        grad_clip: clip the global gradient norm (0: off).
        eval_every: evaluate every N steps (and at the end); 0: only at the end.
        eval_batches: (recall) how many batches each evaluation scores.
        eval_tokens: (text) how many held-out tokens each evaluation scores, in consecutive
            windows of ``seq_len`` from the start of the held-out text; 0: all of it.
        val_data: a text file to evaluate on; ``None``: the last 10% of ``data`` is held out.
        save_every: write a checkpoint every N steps (and at the end); 0: only at the end.
        keep_checkpoints: how many of the newest checkpoints to keep.
        seed: seeds the initialization, the data order and the evaluation data.
        dtype: ``"float32"`` or ``"float64"``: the weights' dtype.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``: autocast of the forward pass (bf16 and
            fp16 need ``dtype="float32"``; fp16 needs a CUDA device and uses a gradient scaler).
        threads: torch intra-op threads (0: leave torch's default).
        ddp_timeout: seconds a data-parallel collective may wait for the other ranks
            before every rank gives up, naming the silent one.
    """

    data: str = "recall"
    seq_len: int = 128
    recall_keys: int = 16
    recall_values: int = 16
    recall_pairs: int = 16
    recall_active_keys: int = 6
    recall_queries: int = 4
    steps: int = 1000
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_batches: int = 4
    eval_tokens: int = 32768
    val_data: Optional[str] = None
    save_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    dtype: str = "float32"
    precision: str = "fp32"
    threads: int = 0
    ddp_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.data, str) or not self.data:
            raise ValueError(f"TrainConfig: `data` must be 'recall' or a text file path, got {self.data!r}")
        for name in ("seq_len", "steps", "batch_size", "eval_batches", "keep_checkpoints",
                     "recall_keys", "recall_values", "recall_pairs", "recall_active_keys", "recall_queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TrainConfig: `{name}` must be a positive int, got {value!r}")
        for name in ("warmup_steps", "eval_every", "eval_tokens", "save_every", "seed", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TrainConfig: `{name}` must be an int >= 0, got {value!r}")
        if isinstance(self.ddp_timeout, bool) or not isinstance(self.ddp_timeout, (int, float)) \
                or not math.isfinite(self.ddp_timeout) or self.ddp_timeout <= 0:
            raise ValueError(f"TrainConfig: `ddp_timeout` must be a finite number of seconds > 0, got {self.ddp_timeout!r}")
        for name in ("lr", "weight_decay", "grad_clip", "min_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or not math.isfinite(value):
                raise ValueError(f"TrainConfig: `{name}` must be a finite number >= 0, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig: unknown `dtype` {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig: unknown `precision` {self.precision!r} (--precision); expected one of {', '.join(PRECISIONS)}")
        if self.precision != "fp32" and self.dtype != "float32":
            raise ValueError(
                f"TrainConfig: `precision`={self.precision!r} (--precision {self.precision}) autocasts float32 weights; "
                f"it cannot be combined with `dtype`={self.dtype!r} (autocast does not lower float64); use --dtype float32"
            )
        if self.val_data is not None and (not isinstance(self.val_data, str) or not self.val_data):
            raise ValueError(f"TrainConfig: `val_data` must be a text file path or None, got {self.val_data!r}")
        if self.val_data is not None and self.data == "recall":
            raise ValueError("TrainConfig: `val_data` (--val-data) is a held-out text file; the recall task makes its own held-out data")


# -- data ---------------------------------------------------------------------------------


class RecallData:
    """The recall task behind the interface the loop uses: ``sample(B, generator, split)``."""

    tokenizer = "recall"

    def __init__(self, config: TrainConfig) -> None:
        self.task = AssociativeRecall(config.recall_keys, config.recall_values, config.recall_pairs,
                                      config.recall_active_keys, config.recall_queries)
        self.vocab_size, self.seq_len = self.task.vocab_size, self.task.seq_len - 1

    def sample(self, batch_size, generator, split="train"):
        b = self.task.sample(batch_size, generator)
        return b.inputs, b.targets

    def encode(self, text):
        return self.task.encode(text)

    def decode(self, ids):
        return self.task.decode(ids)


class TextData(ByteText):
    tokenizer = "bytes"


def make_task(config: TrainConfig):
    """The data source of ``config.data``: recall, or a text file as bytes (held out: the
    file ``config.val_data``, or the last 10% of ``config.data``)."""
    if config.data == "recall":
        return RecallData(config)
    return TextData(config.data, config.seq_len, val_source=config.val_data)


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """The generator of one batch: a pure function of (seed, step, stream)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + stream * 7_919 + step) % (2**63 - 1))


# -- distributed ----------------------------------------------------------------------------


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _maybe_init_distributed(timeout: float = 300.0) -> bool:
    """Join the process group torchrun set up (WORLD_SIZE > 1); True if this call created it.
    ``timeout``: seconds any collective may wait before it fails."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        return True
    return False


class DistributedTimeout(RuntimeError):
    """A collective failed or timed out: a rank is silent or gone."""


class Heartbeat:
    """Per-rank liveness in the process group's store: ``beat(step)`` after every step.

    When a collective fails, :meth:`silent_ranks` says which ranks stopped beating
    (the oldest beats); rank 0 logs a heartbeat line every ``interval`` seconds.
    The store is the one ``init_process_group`` made; without it (one process,
    or a store that cannot be reached) the messages just say less.
    """

    KEY = "fastweights/heartbeat/{}"

    def __init__(self, rank: int, world: int, interval: float, log: Callable[[str], None]) -> None:
        self.rank, self.world, self.interval, self.log = rank, world, interval, log
        self.store = None
        if world > 1:
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except Exception:  # a private hook; the timeout still works without it
                self.store = None
        self.last_log = time.time()

    def beat(self, step: int) -> None:
        if self.store is None:
            return
        now = time.time()
        self.store.set(self.KEY.format(self.rank), f"{step} {now}")
        if self.rank == 0 and now - self.last_log >= self.interval:
            self.last_log = now
            beats = self.beats()
            slowest = min(beats, key=lambda r: beats[r]) if beats else None
            self.log(f"heartbeat: step {step}; {len(beats)} of {self.world} ranks reported"
                     + (f", the last one rank {slowest} at step {beats[slowest][0]}, {now - beats[slowest][1]:.1f} s ago"
                        if slowest is not None else ""))

    def beats(self):
        """``{rank: (step, unix time)}`` of the ranks that have beaten."""
        found = {}
        for r in range(self.world):
            key = self.KEY.format(r)
            try:
                if self.store.check([key]):
                    step, when = self.store.get(key).decode().split()
                    found[r] = (int(step), float(when))
            except Exception:  # the store itself may be gone with a dead rank
                break
        return found

    def failure(self, what: str, error: BaseException) -> DistributedTimeout:
        """The error to raise when a collective failed: which ranks went silent, and since when."""
        beats = self.beats() if self.store is not None else {}
        now = time.time()
        others = [r for r in range(self.world) if r != self.rank]
        mine = beats.get(self.rank, (None, now))[0]
        behind = [r for r in others if r not in beats or (mine is not None and beats[r][0] < mine)]
        if not behind and beats:
            behind = [min(others, key=lambda r: beats.get(r, (0, 0.0))[1])]
        if behind:
            described = ", ".join(
                f"rank {r} (silent for {now - beats[r][1]:.1f} s, last heartbeat at step {beats[r][0]})" if r in beats
                else f"rank {r} (no heartbeat)" for r in behind)
        else:
            described = "a rank that could not be identified (the store is unreachable)"
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        return DistributedTimeout(
            f"train: rank {self.rank} gave up on {what}: waiting for {described}; "
            f"the job stops on every rank (--ddp-timeout; {reason})"
        )


_HEARTBEAT: Optional[Heartbeat] = None  # the running loop's, for the collectives below


def _collective(what: str, fn, *args) -> None:
    """Run one collective; a failure (timeout, a rank gone) becomes :class:`DistributedTimeout`."""
    try:
        fn(*args)
    except RuntimeError as e:
        if _HEARTBEAT is None or isinstance(e, DistributedTimeout):
            raise
        raise _HEARTBEAT.failure(what, e) from None


def _all_reduce_(tensors: List[torch.Tensor]) -> None:
    """Sum tensors across processes in place, as one flat buffer."""
    if _dist_info()[1] == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    _collective("an all-reduce", dist.all_reduce, flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


# -- the loop -------------------------------------------------------------------------------


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from ``lr`` to ``lr · min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: LM, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norm weights, conv kernels' biases, A_log, dt_bias) do not."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), foreach=False)


def make_scaler(config: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """The gradient scaler of ``config.precision``: torch's defaults for fp16, disabled otherwise
    (a disabled scaler passes the loss and the step through unchanged)."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=config.precision == "fp16")


def check_precision(precision: str, device: torch.device) -> None:
    """fp16 autocast is a CUDA feature here (on a CPU, bf16 is the low precision to use)."""
    if precision == "fp16" and torch.device(device).type != "cuda":
        raise ValueError(
            f"`precision`='fp16' (--precision fp16) needs a CUDA device (fp16 autocast with a gradient scaler); "
            f"this run is on {torch.device(device).type}: use --precision bf16 or fp32"
        )


def autocast(precision: str, device: torch.device):
    """The forward pass's context for ``precision``: nothing for fp32, else ``torch.autocast``."""
    dtype = PRECISIONS[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


def token_losses(model: LM, inputs: torch.Tensor, targets: torch.Tensor, precision: str = "fp32"):
    """(sum of token cross-entropies, logits) over targets that are not ``IGNORE``; the forward
    pass runs under ``precision``'s autocast, the loss in fp32 (or the logits' wider dtype)."""
    with autocast(precision, inputs.device):
        logits, _ = model(inputs, return_cache=False)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss_sum, logits


def _score(model, inputs, targets, precision, totals) -> None:
    s, logits = token_losses(model, inputs, targets, precision)
    keep = targets != IGNORE
    totals[0] += float(s)
    totals[1] += int(((logits.argmax(-1) == targets) & keep).sum())
    totals[2] += int(keep.sum())


@torch.no_grad()
def evaluate_tokens(
    model: LM, tokens: torch.Tensor, seq_len: int, batch_size: int, precision: str = "fp32", max_tokens: int = 0,
) -> Dict[str, float]:
    """Next-token loss over a token stream, every token scored once.

    ``tokens [N]`` is cut into consecutive windows of ``seq_len + 1`` tokens that overlap by
    one (window i reads tokens ``[i·L, (i+1)·L)`` and predicts ``[i·L + 1, (i+1)·L]``), so
    each of the ``N − 1`` predicted tokens is scored exactly once, with the context of its
    own window; the last window may be shorter. ``max_tokens`` > 0 scores only the first
    that many predictions.

    Returns ``{"loss": mean nats per token, "accuracy", "tokens": how many were scored}``.
    """
    n = len(tokens) - 1 if not max_tokens else min(len(tokens) - 1, max_tokens)
    if n < 1:
        raise ValueError(f"evaluate_tokens: the data has {len(tokens)} token(s); at least 2 are needed to score one prediction")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = tokens.to(device=device, dtype=torch.long)
    full = n // seq_len
    totals = [0.0, 0, 0]
    windows_in, windows_out = tokens[:full * seq_len].view(full, seq_len), tokens[1:full * seq_len + 1].view(full, seq_len)
    for i in range(0, full, batch_size):
        _score(model, windows_in[i:i + batch_size], windows_out[i:i + batch_size], precision, totals)
    if n > full * seq_len:  # the last, shorter window
        a = full * seq_len
        _score(model, tokens[a:n][None], tokens[a + 1:n + 1][None], precision, totals)
    model.train(was_training)
    return {"loss": totals[0] / totals[2], "accuracy": totals[1] / totals[2], "tokens": totals[2]}


@torch.no_grad()
def evaluate(model: LM, task, config: TrainConfig, batches: Optional[int] = None) -> Dict[str, float]:
    """Loss and next-token accuracy on held-out data (the same data at every call).

    Text: the first ``eval_tokens`` tokens of the held-out text, every one scored once
    (:func:`evaluate_tokens`), also as bits per byte. Recall: ``eval_batches`` batches.
    """
    if isinstance(task, ByteText):
        r = evaluate_tokens(model, task.val, config.seq_len, config.batch_size, config.precision, config.eval_tokens)
        return {"eval_loss": r["loss"], "eval_accuracy": r["accuracy"], "eval_bpb": r["loss"] / math.log(2),
                "eval_tokens": r["tokens"]}
    was_training = model.training
    model.eval()
    totals = [0.0, 0, 0]
    for i in range(batches or config.eval_batches):
        inputs, targets = task.sample(config.batch_size, step_generator(config.seed, i, stream=1), split="val")
        _score(model, inputs, targets, config.precision, totals)
    model.train(was_training)
    return {"eval_loss": totals[0] / max(totals[2], 1), "eval_accuracy": totals[1] / max(totals[2], 1)}


@dataclass
class TrainResult:
    model: LM
    history: List[Dict[str, Any]]
    evals: List[Dict[str, Any]]
    seconds: float
    task: Any


def _progress(total: int, initial: int, enabled: Optional[bool], desc: str):
    from tqdm.auto import tqdm

    if enabled is None:  # auto: only on a terminal, never under CI
        enabled = sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true")
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, mininterval=0.5,
                dynamic_ncols=True, leave=True)


def _metrics_path(out_dir: str) -> str:
    return os.path.join(out_dir, "metrics.jsonl")


def _write_metrics(out_dir: Optional[str], record: Dict[str, Any]) -> None:
    if out_dir is not None:
        try:
            with open(_metrics_path(out_dir), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: one line, not a traceback
            raise RunFolderError(f"train: could not append to {_metrics_path(out_dir)}: {e.strerror or e}") from None


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
        log: where evaluation lines go.

    Raises:
        RunFolderError: ``out_dir`` is locked by another trainer, or holds another run.
        TrainingInterrupted: SIGINT/SIGTERM stopped the run after a step (and a
            checkpoint); its ``exit_code`` is 130 or 143.
        DistributedTimeout: a data-parallel rank went silent for ``ddp_timeout`` s.

    Returns:
        :class:`TrainResult` with the model, the per-step losses and the evaluations.
    """
    global _HEARTBEAT
    if resume and out_dir is None:
        raise ValueError("train: `resume` needs the run folder `out_dir`")
    created = _maybe_init_distributed(config.ddp_timeout)
    rank, world = _dist_info()
    threads = torch.get_num_threads()
    lock = RunLock(out_dir) if out_dir is not None and rank == 0 else None
    try:
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
        _HEARTBEAT = Heartbeat(rank, world, min(60.0, config.ddp_timeout / 2), log)
        if config.threads:
            torch.set_num_threads(config.threads)
        with StopSignals(on_force=lock.release if lock is not None else lambda: None) as stop:
            return _train(model_config, config, out_dir, resume, progress, log, desc, rank, world, stop=stop)
    finally:
        _HEARTBEAT = None
        torch.set_num_threads(threads)  # a setting of this run, not of the caller's process
        if lock is not None:
            lock.release()
        if created:
            dist.destroy_process_group()


def _train(model_config, config, out_dir, resume, progress, log, desc, rank, world, stop=None) -> TrainResult:
    if config.batch_size % world:
        raise ValueError(f"train: `batch_size`={config.batch_size} must be divisible by the number of processes ({world})")
    task = make_task(config)
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
    optimizer = make_optimizer(model, config)
    # fp16 gradients can underflow: scale the loss up, unscale before clipping (a no-op otherwise)
    scaler = make_scaler(config, device)
    start, history, evals, run_id = 0, [], [], new_run_id()

    if resume:
        ckpt = load_training_checkpoint(out_dir)
        run_id = ckpt.train.get("run_id") or run_id  # checkpoints from before run ids get one now
        check_training_tensors(ckpt, optimizer)
        load_weights(model, ckpt.weights, ckpt.path)
        optimizer.load_state_dict(optimizer_from_flat(ckpt.train_tensors, ckpt.train["optimizer"]))
        torch.set_rng_state(ckpt.train_tensors["rng.torch"])
        if scaler.is_enabled():  # the scale the killed run had reached, not a fresh one
            scaler.load_state_dict(ckpt.train["grad_scaler"])
        start, history, evals = ckpt.train["step"], ckpt.train["history"], ckpt.train["evals"]
        if rank == 0:  # drop what the killed run logged after its last checkpoint
            _rewrite_metrics(out_dir, history, evals)
        log(f"resumed {ckpt.path} at step {start}")

    per_rank = config.batch_size // world
    tokens_per_step = config.batch_size * task.seq_len
    bar = _progress(config.steps, start, progress if rank == 0 else False, desc)
    model.train()
    t0 = time.perf_counter()
    seconds_before = history[-1]["seconds"] if history else 0.0
    step_seconds = 0.0  # time in training steps since this process started (evaluations excluded)
    for step in range(start, config.steps):
        step_t0 = time.perf_counter()
        lr = learning_rate(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = task.sample(config.batch_size, step_generator(config.seed, step))
        inputs, targets = inputs[rank * per_rank:(rank + 1) * per_rank], targets[rank * per_rank:(rank + 1) * per_rank]
        loss_sum, _ = token_losses(model, inputs, targets, config.precision)
        # The third entry counts the ranks that got SIGINT/SIGTERM: all stop after the same step.
        stopping = stop is not None and stop.requested is not None
        counts = torch.tensor([float(loss_sum.detach()), float((targets != IGNORE).sum()), float(stopping)], dtype=torch.float64)
        _all_reduce_([counts])
        scaler.scale(loss_sum / counts[1].to(loss_sum.dtype)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        _all_reduce_(grads)
        scaler.unscale_(optimizer)
        if config.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip, foreach=False)
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
            _write_metrics(out_dir, record)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
        if _HEARTBEAT is not None:
            _HEARTBEAT.beat(step + 1)

        last = step + 1 == config.steps
        if rank == 0 and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
            result = {"step": step + 1, **evaluate(model, task, config)}
            evals.append(result)
            _write_metrics(out_dir, result)
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
            if rank == 0:
                saved = _save(out_dir, model, optimizer, scaler, model_config, config, task, step + 1, history, evals, run_id)
            if world > 1:
                _collective("the barrier after a checkpoint", dist.barrier)
        if interrupted and not last:
            bar.close()
            raise TrainingInterrupted(stop.requested if stop is not None and stop.requested else signal.SIGTERM,
                                      step + 1, saved if rank == 0 else None)
    bar.close()
    return TrainResult(model, history, evals, time.perf_counter() - t0, task)


def _rewrite_metrics(out_dir: str, history, evals) -> None:
    records = sorted(history + evals, key=lambda r: (r["step"], "eval_loss" in r))
    try:
        atomic_write_text(_metrics_path(out_dir), "".join(json.dumps(r) + "\n" for r in records))
    except OSError as e:  # a full disk: one line; the old metrics file is untouched
        raise RunFolderError(f"train: could not rewrite {_metrics_path(out_dir)}: {e.strerror or e}") from None


def _save(out_dir, model, optimizer, scaler, model_config, config, task, step, history, evals, run_id) -> str:
    """Write ``ckpt-<step>`` (with ``run_id``), point ``latest`` at it, prune this run's older ones."""
    tensors, optimizer_info = optimizer_to_flat(optimizer)
    tensors["rng.torch"] = torch.get_rng_state()
    train_state = {
        "run_id": run_id, "step": step, "train_config": config.to_dict(), "tokenizer": task.tokenizer,
        "optimizer": optimizer_info, "history": history, "evals": evals,
    }
    if scaler.is_enabled():  # scale, growth factors and interval, steps since the last overflow: plain numbers
        train_state["grad_scaler"] = scaler.state_dict()
    try:
        path = save_checkpoint(os.path.join(out_dir, f"ckpt-{step:06d}"), model, train=train_state, train_tensors=tensors)
    except CheckpointWriteError as e:  # a full disk: say so in one line; nothing was replaced
        raise CheckpointWriteError(f"train: {e}; {describe_latest(out_dir)}") from None
    try:
        mark_latest(out_dir, path)
    except OSError as e:  # `latest` still names the previous checkpoint: drop the unmarked one
        remove_folder(path)
        raise CheckpointWriteError(
            f"train: could not point {os.path.join(out_dir, 'latest')} at {os.path.basename(path)}: "
            f"{e.strerror or e}; {describe_latest(out_dir)}") from None
    prune_checkpoints(out_dir, run_id, config.keep_checkpoints, latest=path)
    return path
