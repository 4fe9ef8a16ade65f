"""MQAR at Zoology's protocol: which memory recalls many keys at once (Arora et al. 2023).

Trains one :class:`fastweights.models.LM` per mixer (DeltaNet, Gated DeltaNet,
linear attention, softmax attention with RoPE; ``mixers`` also takes KDA and GDN-2) on
:class:`fastweights.tasks.mqar.MQAR` and reports each model's accuracy on the asked keys of
a held-out test set. At a large vocabulary the output layer dominates a step (Zoology's
8192 words: 1 GiB of logits per batch of 64 × 512); ``head_on_answers`` computes it at the
answered positions only, the same loss and gradients for ≈ 11× less time per step there.

The protocol is Zoology's:

- models: 2 layers, no MLP (``mlp_hidden=0``), one head, tied embeddings, the LM's
  normal initialisation (``init_std`` 0.02, GPT-2's); softmax
  attention gets rotary position embeddings (``rope_theta``); ``short_conv`` lists
  the settings to run of the short convolution on q, k, v (width 4): off for every
  mixer, or on for every mixer (softmax attention included:
  ``LMConfig.softmax_short_conv``). Without the convolution the fast-weight mixers
  have no positional signal at all and cannot bind a value to the key just before
  it, so the headline is the convolution-on table when it was run;
- data: keys in [1, V/2), values in [V/2, V), both without replacement, queries at
  power-law gaps, the loss on the answers only; fresh training batches every step
  (Zoology draws a fixed training set; with fresh batches no model can memorise);
- training: AdamW (weight decay 0.1 on matrices, β = 0.9, 0.98), cosine decay to 0
  over ``max_steps``, a sweep of learning rates (``lrs``: Zoology's 4 log-spaced
  values in 1e-4..1e-2, :data:`LRS`; the quick default the upper three), early stop
  once the validation accuracy reaches ``early_stop`` (0.99), evaluated every
  ``eval_every`` steps; and ordinary early stopping with ``patience``: a run ends
  when its validation loss has not fallen by ``min_delta`` (1 %, relative) below its
  last improvement for ``patience`` (4) evaluations in a row (its last model is
  tested; ``stop`` in the table says which rule ended it);
- selection: for each cell, mixer and convolution setting, the sweep runs on seed 0
  and the learning rate with the best validation accuracy (ties: the lower
  validation loss) is kept; seeds 1..n−1 then train at that rate. The headline is
  the test accuracy's mean and standard error over the ``seeds`` at the kept rate.

Every model of a cell and seed sees the same batches (the batch of step s is drawn
from a generator keyed by the root seed, the cell, the seed and s) and the same
validation and test sets. The runs are independent given their key, so ``workers``
(2) processes train them at once, each at ``threads`` (1) torch threads; the
results are bit-identical to a serial run (``workers=1``).

The quick default is CPU-sized, one cell: vocabulary 128, d_model 64, T = 128 with
8 pairs, the short convolution on for every mixer, and three learning rates
(:data:`QUICK_LRS`: Zoology's grid without 1e-4, which won none of the sweeps we ran
at the 1500-step budget) — 20 runs, about 9 minutes on 2 cores. ``full`` is the
paper's anchor: vocabulary 8192, T = 512, 64 pairs, d_model 64..512, both
convolution settings, Zoology's four rates, 3,000 test examples (a GPU job).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import check_int, flag
from ..tasks.mqar import MQAR
from ..tasks.recall import IGNORE
from ._report import CellCache, finish_study, format_table, keyed_seed, mean_se, pyplot, save_figure, study_command, torch_threads

MIXERS = ("deltanet", "gated_deltanet", "linear", "softmax")
# Every mixer the study can train (``--mixers``); the default runs :data:`MIXERS`.
ALL_MIXERS = MIXERS + ("kda", "gdn2")
LRS = tuple(float(f"{10 ** (-4 + 2 * i / 3):.3g}") for i in range(4))   # 1e-4, 4.64e-4, 2.15e-3, 1e-2
# The quick default's sweep: Zoology's grid without 1e-4, which a 1500-step cosine leaves too small to
# reach the early stop (it lost every sweep of our runs at this budget; see docs/studies.md).
QUICK_LRS = LRS[1:]
# Zoology (Arora et al. 2023, MQAR at T = 512, 64 pairs, vocabulary 8192), accuracy % at d_model 64/128/256/512.
PUBLISHED = {"deltanet": (100, 100, 100, 100), "gla": (22, 95, 100, 100), "retnet": (5, 87, 96, 97),
             "attention": (100, 100, 100, 100)}
TABLE_COLUMNS = ("short_conv", "mixer", "d_model", "seq_len", "num_kv_pairs", "seed", "lr", "val_accuracy",
                 "accuracy", "loss", "steps", "stop", "parameters", "seconds")


# ``--short-conv``: which short-convolution settings to run.
SHORT_CONV = {"off": (False,), "on": (True,), "both": (False, True)}


def _parse_cells(cells: List[str]) -> Tuple[Tuple[int, int], ...]:
    """``--cells`` entries ``T:D`` as ``((T, D), ...)``; a ``ValueError`` naming the flag otherwise."""
    try:
        parsed = tuple(tuple(int(x) for x in c.split(":")) for c in cells)
    except ValueError:
        parsed = ()
    if not parsed or any(len(c) != 2 for c in parsed):
        raise ValueError(f"`--cells` entries must be T:D (two ints), got {cells!r}")
    return parsed


@dataclass
class MQARConfig:
    """The sweep: every ``cells`` entry (seq_len, num_kv_pairs) × ``d_models`` × ``mixers`` ×
    ``short_conv`` setting, with the learning-rate sweep and ``seeds`` seeds (see the module docstring)."""

    root_seed: int = 0
    mixers: Tuple[str, ...] = field(default=MIXERS, metadata=flag(
        nargs="+", choices=ALL_MIXERS, parse=tuple, help=f"which models to train (default {' '.join(MIXERS)})"))
    d_models: Tuple[int, ...] = field(default=(64,), metadata=flag(
        "--d-model", type=int, nargs="+", parse=tuple, help="model widths (default 64)"))
    cells: Tuple[Tuple[int, int], ...] = field(default=((128, 8),), metadata=flag(
        nargs="+", metavar="T:D", parse=_parse_cells,
        help="sequence length and key-value pairs of each cell (default 128:8; --full: 512:64)"))
    short_conv: Tuple[bool, ...] = field(default=(True,), metadata=flag(
        choices=tuple(SHORT_CONV), parse=SHORT_CONV.get,
        help="short convolution on q, k, v of every mixer, softmax included (default on, the headline; --full: both)"))
    n_layers: int = 2
    n_heads: int = 1
    vocab_size: int = field(default=128, metadata=flag(type=int, help="vocabulary (default 128; --full: 8192)"))
    power_a: float = 0.01
    lrs: Tuple[float, ...] = field(default=QUICK_LRS, metadata=flag(
        type=float, nargs="+", parse=tuple, help=f"learning rates to sweep (default {' '.join(f'{x:g}' for x in QUICK_LRS)}; "
                                                 f"--full: {' '.join(f'{x:g}' for x in LRS)})"))
    seeds: int = field(default=3, metadata=flag(type=int, help="seeds at the kept learning rate (default 3)"))
    max_steps: int = field(default=1500, metadata=flag(type=int, help="step budget per model"))
    batch_size: int = field(default=32, metadata=flag(type=int, help="training sequences per step (default 32)"))
    weight_decay: float = 0.1
    eval_every: int = field(default=50, metadata=flag(type=int, help="steps between validations (default 50)"))
    early_stop: float = 0.99
    patience: Optional[int] = field(default=4, metadata=flag(
        type=int, parse=lambda v: v or None, help="stop a run after this many evaluations without a 1%% fall of its "
                                                  "validation loss (default 4; 0: never)"))
    min_delta: float = 0.01
    val_size: int = field(default=256, metadata=flag(type=int, help="validation sequences (default 256)"))
    test_size: int = field(default=1000, metadata=flag(type=int, help="test sequences (default 1000)"))
    head_on_answers: bool = field(default=False, metadata=flag(
        action="store_true", help="compute the output layer only at the answered positions: the same loss and "
                                  "accuracy, T / (pairs) times fewer logits (at Zoology's vocabulary 8192 the full "
                                  "logits dominate the step); off by default, which keeps the recorded tables bit "
                                  "for bit"))
    rope_theta: float = 10000.0
    init_std: float = 0.02
    threads: Optional[int] = field(default=1, metadata=flag(type=int, help="torch threads per training run (default 1)"))
    workers: int = field(default=2, metadata=flag(
        type=int, help="training runs at once, each in its own process (default 2; --full: 1); the results do not "
                       "depend on it"))

    def __post_init__(self) -> None:
        check_int("MQARConfig", "root_seed", self.root_seed, minimum=0, what="a non-negative int")
        unknown = [m for m in self.mixers if m not in ALL_MIXERS]
        if unknown or not self.mixers:
            raise ValueError(f"MQARConfig: unknown `mixers` {unknown}; expected a subset of {ALL_MIXERS}")
        for name in ("n_layers", "n_heads", "seeds", "max_steps", "batch_size", "eval_every", "val_size", "test_size",
                     "workers"):
            value = getattr(self, name)
            check_int("MQARConfig", name, value)
        for d in self.d_models:
            if d % self.n_heads:
                raise ValueError(f"MQARConfig: `d_models` entry {d} is not divisible by `n_heads`={self.n_heads}")
        if not self.cells:
            raise ValueError("MQARConfig: `cells` must list at least one (seq_len, num_kv_pairs)")
        for t, d in self.cells:  # every cell must be a valid task
            MQAR(self.vocab_size, t, d, self.power_a)
        if not self.lrs or any(not lr > 0 for lr in self.lrs):
            raise ValueError(f"MQARConfig: `lrs` must be positive learning rates, got {self.lrs!r}")
        if not self.short_conv or any(not isinstance(c, bool) for c in self.short_conv):
            raise ValueError(f"MQARConfig: `short_conv` must list True and/or False, got {self.short_conv!r}")
        if not 0 < self.early_stop <= 1:
            raise ValueError(f"MQARConfig: `early_stop` must be in (0, 1], got {self.early_stop!r}")
        check_int("MQARConfig", "patience", self.patience, none_ok=True, what="a positive int (evaluations) or None")
        if isinstance(self.init_std, bool) or not isinstance(self.init_std, (int, float)) or not self.init_std > 0:
            raise ValueError(f"MQARConfig: `init_std` must be a positive number, got {self.init_std!r}")
        if not 0 <= self.min_delta < 1:
            raise ValueError(f"MQARConfig: `min_delta` must be in [0, 1), got {self.min_delta!r}")

    @classmethod
    def full(cls, **overrides) -> "MQARConfig":
        """Zoology's anchor: vocabulary 8192, T = 512 with 64 pairs, d_model 64..512, both convolution
        settings, the four learning rates of :data:`LRS`, 3,000 test examples."""
        settings = dict(d_models=(64, 128, 256, 512), cells=((512, 64),), short_conv=(False, True), lrs=LRS,
                        vocab_size=8192, max_steps=20_000,
                        batch_size=64, eval_every=200, val_size=500, test_size=3000, threads=None, workers=1)
        settings.update(overrides)
        return cls(**settings)


def learning_rate(step: int, steps: int, lr: float) -> float:
    """Cosine decay from ``lr`` at step 0 to 0 at step ``steps``."""
    return lr * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))


def answer_logits(model, inputs: torch.Tensor, asked: torch.Tensor, head_on_answers: bool) -> torch.Tensor:
    """The logits ``[n_asked, V]`` at the ``asked`` positions (a bool mask ``[B, T]``) of ``inputs``.

    ``head_on_answers`` runs the model's blocks and applies its final norm and output layer to the
    asked positions only (the LM's own forward without the logits nobody reads; the same numbers up
    to the summation order of the output layer's gradient); otherwise the LM's forward, indexed."""
    if not head_on_answers:
        logits, _ = model(inputs, return_cache=False)
        return logits[asked]
    x = model.embed(inputs)  # (B, T, D)
    for block in model.blocks:
        x, _ = block(x, None, None, None)
    return model.lm_head(model.norm(x[asked]))  # (n_asked, V)


def _evaluate(model, batch, head_on_answers: bool = False) -> Tuple[float, float]:
    """(accuracy, loss) on the asked keys of ``batch``, in slices of 256 sequences (64 with
    ``head_on_answers`` off and a vocabulary above 1024: the full logits of 256 sequences of
    T = 512 over 8192 words would be 4 GiB)."""
    correct, total, loss_sum = 0, 0, 0.0
    vocab = model.lm_head.weight.shape[0]
    step = 256 if head_on_answers or vocab <= 1024 else 64
    with torch.no_grad():
        for i in range(0, batch.inputs.shape[0], step):
            targets = batch.targets[i:i + step]
            asked = targets != IGNORE
            logits = answer_logits(model, batch.inputs[i:i + step], asked, head_on_answers)
            correct += int((logits.argmax(-1) == targets[asked]).sum())
            loss_sum += float(F.cross_entropy(logits, targets[asked], reduction="sum"))
            total += int(asked.sum())
    return correct / total, loss_sum / total


def train_mqar_model(mixer: str, d_model: int, task: MQAR, config: MQARConfig, lr: float, seed: int,
                     short_conv: bool = False) -> Dict:
    """Train one LM on ``task`` at ``lr`` until the validation accuracy reaches ``config.early_stop``
    or ``config.max_steps`` are spent; return validation and test accuracy, test loss, steps, parameters,
    wall time and the validation curve. Bit-identical given ``seed`` and the thread count."""
    from ..models import LM, LMConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LM(LMConfig(vocab_size=task.vocab_size, d_model=d_model, n_layers=config.n_layers,
                            n_heads=config.n_heads, mixer=mixer, max_seq_len=task.seq_len, mlp_hidden=0,
                            use_short_conv=short_conv, softmax_short_conv=short_conv,
                            rope_theta=config.rope_theta, init_std=config.init_std))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98))
    def evaluate(model, batch):
        return _evaluate(model, batch, True) if config.head_on_answers else _evaluate(model, batch)

    val = task.sample(config.val_size, torch.Generator().manual_seed(seed ^ 0x5EED))
    test = task.sample(config.test_size, torch.Generator().manual_seed(seed ^ 0x7E57))
    start = time.perf_counter()
    history: List[Tuple[int, float, float]] = []
    val_acc, step, best, stale = 0.0, 0, float("inf"), 0
    stop = "max_steps"
    while step < config.max_steps:
        model.train()
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, config.max_steps, lr)
        batch = task.sample(config.batch_size, torch.Generator().manual_seed(seed + 1 + step))
        if config.head_on_answers:
            asked = batch.targets != IGNORE
            F.cross_entropy(answer_logits(model, batch.inputs, asked, True), batch.targets[asked]).backward()
        else:
            logits, _ = model(batch.inputs, return_cache=False)
            F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % config.eval_every == 0 or step == config.max_steps:
            model.eval()
            val_acc, val_loss = evaluate(model, val)
            history.append((step, val_acc, val_loss))
            if val_acc >= config.early_stop:
                stop = "target"
                break
            # patience: ordinary early stopping of a run whose validation loss has not fallen by
            # min_delta (relative) below its last improvement for `patience` evaluations. The loss,
            # not the accuracy: every run first sits for a while at the accuracy of a guess among
            # the values (the loss still falls there), and the accuracy would end it too early.
            if val_loss <= best * (1 - config.min_delta):
                best, stale = val_loss, 0
            else:
                stale += 1
            if config.patience is not None and stale >= config.patience:
                stop = "patience"
                break
    model.eval()
    accuracy, loss = evaluate(model, test)
    return {"val_accuracy": val_acc, "val_loss": history[-1][2] if history else float("nan"), "accuracy": accuracy,
            "loss": loss, "steps": step, "stop": stop, "parameters": model.num_parameters(),
            "seconds": round(time.perf_counter() - start, 3), "history": history}


def _worker_init(parent_pid: int) -> None:
    """In a worker process: die with the parent (Linux), so that a study killed by a signal
    that skips its clean-up (SIGTERM, SIGKILL) leaves no orphaned training run behind.

    A parent that died while this worker was still starting (importing torch takes seconds on
    a busy machine) is gone before the death signal could be asked for: the worker then finds
    itself re-parented and ends at once."""
    import os
    import sys

    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no prctl: the worker ends after its current run instead
            return
        if os.getppid() != parent_pid:  # the parent died before prctl: no signal will come
            os._exit(1)


def _train_job(mixer: str, d_model: int, task: MQAR, config: MQARConfig, lr: float, seed: int,
               short_conv: bool) -> Dict:
    """One training run in a worker process, at the study's thread count."""
    with torch_threads(config.threads):
        return train_mqar_model(mixer, d_model, task, config, lr, seed, short_conv)


class _Runs:
    """The study's training runs, in ``config.workers`` processes (or in this one when it is 1).

    A run is keyed ``(short_conv, d_model, T, pairs, mixer, lr, seed index)``; it is a
    function of its key and the config alone (its batches, validation and test sets and its
    initial weights come from seeds derived from the key, and every process trains at
    ``config.threads`` threads), so a result does not depend on which process ran it or
    when: the parallel study is bit-identical to the serial one. Finished runs go to the
    :class:`CellCache` (``--resume``) as they arrive.
    """

    def __init__(self, config: MQARConfig, cache: CellCache, finished) -> None:
        self.config, self.cache, self.finished = config, cache, finished
        self.results: Dict[Tuple, Dict] = {}
        self.queue: List[Tuple] = []
        self.running: Dict = {}
        self.pool = None
        if config.workers > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # spawn, not fork: a forked child inherits the parent's OpenMP/thread-pool state
            self.pool = ProcessPoolExecutor(config.workers, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_worker_init, initargs=(os.getpid(),))

    def _args(self, key: Tuple) -> Tuple:
        conv, d_model, t, kv, mixer, lr, i = key
        seed = keyed_seed(self.config.root_seed, 4, d_model, t, kv, i)  # shared by every mixer and lr
        return mixer, d_model, MQAR(self.config.vocab_size, t, kv, self.config.power_a), self.config, lr, seed, conv

    def _store(self, key: Tuple, compute) -> None:
        self.results[key] = self.cache.get(key, compute)
        self.finished(key, self.results[key])

    def add(self, keys: List[Tuple], first: bool = False) -> None:
        """Queue runs (``first``: ahead of the queued ones)."""
        keys = [k for k in keys if k not in self.results]
        self.queue = keys + self.queue if first else self.queue + keys

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    def wait(self) -> None:
        """Run queued runs until at least one more has finished (resumed ones count)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        while self.queue and (self.pool is None or len(self.running) < self.config.workers):
            key = self.queue.pop(0)
            if key in self.cache:
                self._store(key, None)
                return
            if self.pool is None:
                with torch_threads(self.config.threads):
                    self._store(key, lambda: train_mqar_model(*self._args(key)))
                return
            self.running[self.pool.submit(_train_job, *self._args(key))] = key
        if self.running:
            done, _ = wait(list(self.running), return_when=FIRST_COMPLETED)
            for future in done:
                self._store(self.running.pop(future), future.result)

    def close(self) -> None:
        """Shut the workers down; on an interruption (runs still in flight) stop them at once
        rather than wait for their runs (those are lost; finished ones are in the cache)."""
        if self.pool is None:
            return
        if self.running:
            for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                process.terminate()
        self.pool.shutdown(wait=True, cancel_futures=True)


def run_mqar(config: Optional[MQARConfig] = None, out_dir: Optional[str] = None, progress: bool = True,
             plots: bool = True, resume: bool = False) -> Dict:
    """Train every cell; with ``out_dir`` write ``mqar.json``, ``mqar.csv`` and ``mqar.png``
    (each trained model goes to ``mqar.partial.json`` first; ``resume`` continues from it).

    With ``config.workers > 1`` the runs go to spawned worker processes, which import the
    calling script again: call this from a script under ``if __name__ == "__main__":``
    (the ``fastweights study mqar`` command does), or set ``workers=1``."""
    from tqdm.auto import tqdm

    config = MQARConfig() if config is None else config
    start = time.perf_counter()
    # (`workers` changes no result, so a study may resume with another number of them)
    cache = CellCache(out_dir, "mqar", {k: v for k, v in asdict(config).items() if k != "workers"}, resume)
    groups = [(conv, d, t, kv, m) for conv in config.short_conv for d in config.d_models for t, kv in config.cells
              for m in config.mixers]
    bar = tqdm(total=len(groups) * (len(config.lrs) + config.seeds - 1), desc="mqar", disable=not progress, leave=False)

    def finished(key: Tuple, r: Dict) -> None:
        conv, _, t, _, mixer, lr, i = key
        bar.update(1)
        bar.set_postfix_str(f"{mixer} T={t} conv={conv} lr={lr:g} seed={i} acc={r['accuracy']:.3f}")

    runs = _Runs(config, cache, finished)
    best_lrs: Dict[Tuple, float] = {}
    try:
        # the sweep on seed 0 for every group; each group's other seeds once its sweep is in (ahead of
        # the queue, so groups finish early). The headline's groups first, the hardest cells next: the
        # order changes no result (a run is a function of its key), only what an interrupted study has.
        first = sorted(groups, key=lambda g: (g[0] != (True in config.short_conv), -g[2], -g[3], g[1]))
        for g in first:
            runs.add([g + (lr, 0) for lr in config.lrs])
        while not runs.idle:
            runs.wait()
            for g in groups:
                if g not in best_lrs and all(g + (lr, 0) in runs.results for lr in config.lrs):
                    sweep = {lr: runs.results[g + (lr, 0)] for lr in config.lrs}
                    best_lrs[g] = max(config.lrs, key=lambda lr: (sweep[lr]["val_accuracy"], -sweep[lr]["val_loss"]))
                    runs.add([g + (best_lrs[g], i) for i in range(1, config.seeds)], first=True)
    finally:
        runs.close()
        bar.close()

    rows: List[Dict] = []
    summary: List[Dict] = []
    for g in groups:  # in a fixed order, whatever order the runs finished in
        conv, d_model, t, kv, mixer = g
        best_lr = best_lrs[g]
        keys = [g + (lr, 0) for lr in config.lrs] + [g + (best_lr, i) for i in range(1, config.seeds)]
        for key in keys:
            r = runs.results[key]
            rows.append({"short_conv": conv, "mixer": mixer, "d_model": d_model, "seq_len": t, "num_kv_pairs": kv,
                         "seed": key[-1], "lr": key[-2], **{k: r[k] for k in TABLE_COLUMNS[7:] if k in r}})
        kept = [runs.results[g + (best_lr, i)] for i in range(config.seeds)]
        stat = mean_se([r["accuracy"] for r in kept])
        summary.append({"short_conv": conv, "mixer": mixer, "d_model": d_model, "seq_len": t, "num_kv_pairs": kv,
                        "best_lr": best_lr, "accuracy": stat["mean"], "accuracy_se": stat["se"],
                        "accuracy_per_seed": [r["accuracy"] for r in kept],
                        "steps_per_seed": [r["steps"] for r in kept],
                        "stop_per_seed": [r.get("stop") for r in kept],
                        "sweep_val_accuracy": {str(lr): runs.results[g + (lr, 0)]["val_accuracy"] for lr in config.lrs}})

    # The headline: the hardest configuration (largest T, then the most pairs, the smallest width),
    # with the short convolution on when that was run (see the module docstring).
    hardest = max(config.cells)
    conv = True in config.short_conv
    d_head = min(config.d_models)

    def headline(conv_setting: bool) -> Dict[str, Dict]:
        return {s["mixer"]: {"accuracy": s["accuracy"], "accuracy_se": s["accuracy_se"], "best_lr": s["best_lr"]}
                for s in summary if s["short_conv"] == conv_setting and (s["seq_len"], s["num_kv_pairs"]) == hardest
                and s["d_model"] == d_head}

    result = {
        "study": "mqar",
        "paper": "Arora et al. 2023, Zoology: multi-query associative recall",
        "config": asdict(config),
        "headline": headline(conv),
        "headline_config": {"seq_len": hardest[0], "num_kv_pairs": hardest[1], "d_model": d_head, "short_conv": conv},
        "headline_by_short_conv": {("on" if c else "off"): headline(c) for c in config.short_conv},
        "summary": summary,
        "published": {"seq_len": 512, "num_kv_pairs": 64, "vocab_size": 8192, "d_models": (64, 128, 256, 512),
                      "accuracy_percent": PUBLISHED},
        "table": rows,
        "files": [],
    }
    return finish_study(result, start, cache, out_dir, "mqar", rows, TABLE_COLUMNS, plot_mqar if plots else None)


def plot_mqar(result: Dict, out: Path) -> List[str]:
    """Test accuracy per mixer with standard-error bars: one panel per short-convolution setting,
    one group of bars per (T, pairs, d_model) configuration."""
    plt = pyplot()
    cfg = result["config"]
    convs = list(cfg["short_conv"])
    fig, axes = plt.subplots(1, len(convs), figsize=(5.6 * len(convs), 3.8), sharey=True, squeeze=False)
    configs = sorted({(s["seq_len"], s["num_kv_pairs"], s["d_model"]) for s in result["summary"]})
    width = 0.8 / len(cfg["mixers"])
    for ax, conv in zip(axes[0], convs):
        for i, mixer in enumerate(cfg["mixers"]):
            pts = {(s["seq_len"], s["num_kv_pairs"], s["d_model"]): s for s in result["summary"]
                   if s["short_conv"] == conv and s["mixer"] == mixer}
            xs = [j + i * width for j, c in enumerate(configs) if c in pts]
            ys = [pts[c]["accuracy"] for c in configs if c in pts]
            es = [pts[c]["accuracy_se"] for c in configs if c in pts]
            ax.bar(xs, ys, width=width, yerr=es, capsize=3, color=f"C{i}", label=mixer)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels([f"T={t}, D={kv}\nd={d}" for t, kv, d in configs], fontsize=8)
        ax.axhline(cfg["early_stop"], color="gray", ls=":", lw=1, label=f"early stop ({cfg['early_stop']})")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"short convolution {'on' if conv else 'off'} for every mixer", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel(f"test accuracy (mean ± se, {cfg['seeds']} seeds)")
    fig.suptitle(f"MQAR (Zoology protocol): vocab {cfg['vocab_size']}, {cfg['n_layers']} layers without MLP, "
                 f"best of lr {', '.join(f'{x:g}' for x in cfg['lrs'])}", fontsize=9)
    return [save_figure(fig, out / "mqar.png", dpi=80)]


def report(result: Dict) -> str:
    cfg = result["config"]
    lines = [f"MQAR study (Arora et al. 2023, Zoology protocol): vocab {cfg['vocab_size']}, power-law α = "
             f"{cfg['power_a']}, {cfg['n_layers']} layers × {cfg['n_heads']} head(s) without MLP, AdamW (wd "
             f"{cfg['weight_decay']}), cosine to 0 over {cfg['max_steps']} steps, early stop at val acc "
             f"{cfg['early_stop']}, lr sweep {list(cfg['lrs'])}, {cfg['seeds']} seeds"]
    rows = [{**s, "acc ± se": f"{s['accuracy']:.3f} ± {s['accuracy_se']:.3f}",
             "per seed": " ".join(f"{a:.3f}" for a in s["accuracy_per_seed"]),
             "steps": " ".join(map(str, s["steps_per_seed"]))} for s in result["summary"]]
    lines.append(format_table(rows, ("short_conv", "mixer", "d_model", "seq_len", "num_kv_pairs", "best_lr", "acc ± se",
                                     "per seed", "steps"), floatfmt=".3g", title="test accuracy on the asked keys"))
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study mqar``)

HELP = "multi-query associative recall (Arora et al. 2023): DeltaNet, Gated DeltaNet, linear and softmax LMs"
Config = MQARConfig
run = run_mqar
add_arguments, config_from_args = study_command(MQARConfig, order=("d_models", "mixers", "short_conv", "cells", "vocab_size",
                                                                  "lrs", "seeds", "max_steps", "threads", "workers"))
