"""State tracking: what each memory can track (parity, sums mod m, permutation groups).

Trains one small :class:`fastweights.models.LM` per (task, arm, seed) on a word problem of
:mod:`fastweights.tasks.state_tracking` (the running product, labelled at every position) at
lengths up to ``train_max_length``, then tests it on longer sequences. An *arm* is a mixer with
its write-strength range and, for DeltaProduct, its number of Householder steps per token:

==========================  ==================================================================
arm                         what it is
==========================  ==================================================================
``linear``                  linear attention (transitions: the identity; eigenvalues 1)
``deltanet[0,1]``           DeltaNet, β ∈ [0, 1]: each step I − β k kᵀ has eigenvalues in [0, 1]
``deltanet[0,2]``           DeltaNet, β ∈ [0, 2] (``allow_neg_eigval``): β = 2 is a reflection
``gated_deltanet[0,1|2]``   Gated DeltaNet, both ranges
``kda[0,1|2]``              KDA (per-key-channel decays), both ranges
``deltaproductN[0,1|2]``    DeltaProduct with n_h = N Householder steps per token, both ranges
``softmax``                 softmax attention (RoPE)
==========================  ==================================================================

The published claims this checks (at a CPU-sized scale; docs/studies.md has the numbers side
by side): Grazzi et al. (2025, arXiv 2411.12537) — with β ∈ [0, 1] no DeltaNet solves parity
at every length, with β ∈ [0, 2] it can; Siems et al. (2025, DeltaProduct, arXiv 2502.10297) —
more Householder steps per token track harder groups (S3, S4, A5, S5) and extrapolate in length.

Protocol: every model has the same size (``d_model``, ``n_layers``, one head, SwiGLU MLP, no
short convolution: the convolution would let a layer see a few tokens at once, which is not
the question asked), trains ``max_steps`` AdamW steps on fresh batches of length
``train_max_length`` (per-position labels, so every shorter prefix is trained too; with
``curriculum_start`` the length ramps up to it over the first half of the steps), with a linear
warm-up and a cosine decay, at one learning rate. Each model is then tested on ``test_size``
sequences at every ``test_lengths`` entry: *sequence accuracy* is the fraction of test sequences
whose every position is right, *token accuracy* the fraction of positions. Rows report the mean
and standard error over ``seeds``. A run is a function of its key (task, arm, seed) and the
config, so ``workers`` processes give bit-identical results to one.
"""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import check_int, check_ints, flag
from ..tasks.state_tracking import TASKS, make_state_tracking_task
from ._report import CellCache, finish_study, format_table, keyed_seed, mean_se, pyplot, save_figure, study_command, torch_threads

QUICK_ARMS = ("linear", "deltanet[0,1]", "deltanet[0,2]")
FULL_ARMS = ("linear", "deltanet[0,1]", "deltanet[0,2]", "gated_deltanet[0,1]", "gated_deltanet[0,2]", "kda[0,1]",
             "kda[0,2]", "deltaproduct2[0,1]", "deltaproduct2[0,2]", "deltaproduct3[0,1]", "deltaproduct3[0,2]",
             "deltaproduct4[0,1]", "deltaproduct4[0,2]", "softmax")
TABLE_COLUMNS = ("task", "arm", "mixer", "beta_range", "n_householder", "test_length", "seq_accuracy",
                 "seq_accuracy_se", "token_accuracy", "token_accuracy_se", "seeds")
_ARM = re.compile(r"^(?P<mixer>[a-z_]+?)(?P<n>\d*)(?:\[(?P<range>0,[12])\])?$")
_BETA_MIXERS = ("deltanet", "gated_deltanet", "kda", "deltaproduct")

# What the papers report, for the table beside ours (docs/studies.md).
PUBLISHED = {
    "parity": "Grazzi et al. 2025 (Table 2 / Fig. 3): DeltaNet [0,1] fails to extrapolate; DeltaNet [-1,1] "
              "(our [0,2]) solves parity and extrapolates; linear attention and mLSTM/Mamba with positive "
              "eigenvalues fail",
    "mod3": "Grazzi et al. 2025: modular counting needs non-triangular / non-symmetric transitions; "
            "DeltaNet [-1,1] improves over [0,1] but does not solve it at every length",
    "S3": "Siems et al. 2025 (DeltaProduct, Fig. 4): one layer of DeltaProduct_{n_h} [-1,1] solves S3 for "
          "n_h >= 2, DeltaNet (n_h = 1) does not",
    "S4": "Siems et al. 2025: n_h >= 2 with [-1,1] solves S4 (rotations in 3-D)",
    "A5": "Siems et al. 2025: A5 needs n_h >= 4 in one layer; accuracy grows with n_h",
    "S5": "Siems et al. 2025: S5 needs n_h >= 4 in one layer; accuracy grows with n_h",
}


def parse_arm(arm: str) -> Dict:
    """``"deltaproduct3[0,2]"`` → ``{"mixer": "deltaproduct", "n_householder": 3, "beta_range": "[0,2]"}``;
    a ``ValueError`` naming ``arms`` for anything else."""
    m = _ARM.match(arm) if isinstance(arm, str) else None
    if m is None:
        raise ValueError(f"StateTrackingConfig: `arms` entry {arm!r} is not MIXER, MIXER[0,1] or MIXER[0,2]")
    mixer, n, rng = m.group("mixer"), m.group("n"), m.group("range")
    if mixer not in _BETA_MIXERS + ("linear", "softmax"):
        raise ValueError(f"StateTrackingConfig: `arms` entry {arm!r} names an unknown mixer {mixer!r}; expected one of "
                         f"{', '.join(_BETA_MIXERS + ('linear', 'softmax'))}")
    if (mixer in _BETA_MIXERS) != (rng is not None):
        raise ValueError(f"StateTrackingConfig: `arms` entry {arm!r}: "
                         + ("give the write-strength range, [0,1] or [0,2]" if mixer in _BETA_MIXERS
                            else f"{mixer} has no write strength to range over"))
    if (mixer == "deltaproduct") != bool(n) or (n and int(n) < 1):
        raise ValueError(f"StateTrackingConfig: `arms` entry {arm!r}: only deltaproduct takes a number of Householder "
                         "steps, and it needs one (e.g. deltaproduct2[0,2])")
    return {"mixer": mixer, "n_householder": int(n) if n else (1 if mixer in _BETA_MIXERS else None),
            "beta_range": f"[{rng}]" if rng else None}


def _parse_lengths(values) -> Tuple[int, ...]:
    return tuple(sorted(set(int(v) for v in values)))


@dataclass
class StateTrackingConfig:
    """The sweep: every ``tasks`` entry × ``arms`` entry × ``seeds`` (see the module docstring)."""

    root_seed: int = 0
    tasks: Tuple[str, ...] = field(default=("parity",), metadata=flag(
        nargs="+", choices=tuple(TASKS), parse=tuple, help="word problems to train on (default parity; --full: all)"))
    arms: Tuple[str, ...] = field(default=QUICK_ARMS, metadata=flag(
        nargs="+", metavar="ARM", parse=tuple,
        help=f"mixers with their β range, e.g. deltanet[0,2] or deltaproduct3[0,1] (default {' '.join(QUICK_ARMS)})"))
    train_max_length: int = field(default=64, metadata=flag(type=int, help="training length (default 64)"))
    test_lengths: Tuple[int, ...] = field(default=(64, 128, 256), metadata=flag(
        type=int, nargs="+", parse=_parse_lengths, help="test lengths (default 64 128 256; --full adds 512)"))
    d_model: int = field(default=32, metadata=flag(type=int, help="model width (default 32)"))
    n_layers: int = field(default=1, metadata=flag(type=int, help="layers (default 1)"))
    qk_activation: str = field(default="silu", metadata=flag(
        choices=("silu", "identity", "relu", "elu"),
        help="activation of the delta-rule mixers' queries and keys before their L2 norm (default silu, the LM's: "
             "its outputs stay above -0.28, where its gradient vanishes, so negative key components come slowly; "
             "identity: the normalized key is a linear function's direction)"))
    seeds: int = field(default=2, metadata=flag(type=int, help="seeds per arm and task (default 2; --full: 3)"))
    max_steps: int = field(default=800, metadata=flag(type=int, help="training steps per model (default 800)"))
    lr: float = field(default=3e-3, metadata=flag(type=float, help="peak learning rate (default 3e-3)"))
    warmup_steps: int = field(default=100, metadata=flag(type=int, help="linear warm-up steps (default 100)"))
    batch_size: int = field(default=32, metadata=flag(type=int, help="training sequences per step (default 32)"))
    curriculum_start: int = field(default=0, metadata=flag(
        type=int, help="0 (default): train every step at --train-max-length; L > 0: a length curriculum, the "
                       "training length grows linearly from L to --train-max-length over the first half of the steps"))
    weight_decay: float = 0.01
    test_size: int = field(default=256, metadata=flag(type=int, help="test sequences per length (default 256)"))
    threads: Optional[int] = field(default=1, metadata=flag(type=int, help="torch threads per training run (default 1)"))
    workers: int = field(default=2, metadata=flag(
        type=int, help="training runs at once, each in its own process (default 2); the results do not depend on it"))

    def __post_init__(self) -> None:
        check_int("StateTrackingConfig", "root_seed", self.root_seed, minimum=0, what="a non-negative int")
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise ValueError(f"StateTrackingConfig: `tasks` must be a non-empty subset of {', '.join(TASKS)}, got {self.tasks!r}")
        if not self.arms:
            raise ValueError("StateTrackingConfig: `arms` must list at least one arm")
        for arm in self.arms:
            parse_arm(arm)
        for name in ("train_max_length", "d_model", "n_layers", "seeds", "max_steps", "batch_size", "test_size", "workers"):
            check_int("StateTrackingConfig", name, getattr(self, name))
        check_int("StateTrackingConfig", "warmup_steps", self.warmup_steps, minimum=0)
        check_int("StateTrackingConfig", "curriculum_start", self.curriculum_start, minimum=0)
        if self.curriculum_start > self.train_max_length:
            raise ValueError(f"StateTrackingConfig: `curriculum_start` must be at most `train_max_length` "
                             f"({self.train_max_length}), got {self.curriculum_start}")
        check_ints("StateTrackingConfig", "test_lengths", self.test_lengths)
        if not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"StateTrackingConfig: `lr` must be a positive number, got {self.lr!r}")

    @classmethod
    def full(cls, **overrides) -> "StateTrackingConfig":
        """Every task, every arm (:data:`FULL_ARMS`), 3 seeds, tests up to 512 = 8× the training length."""
        settings = dict(tasks=tuple(TASKS), arms=FULL_ARMS, seeds=3, max_steps=1500, test_lengths=(64, 128, 256, 512))
        settings.update(overrides)
        return cls(**settings)


def learning_rate(step: int, config: StateTrackingConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then a cosine decay to 0 at ``max_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    return config.lr * 0.5 * (1 + math.cos(math.pi * min(step - config.warmup_steps, span) / span))


def training_length(step: int, config: StateTrackingConfig) -> int:
    """The length of step ``step``'s training batch: ``train_max_length``, or with a curriculum
    (``curriculum_start`` = L₀ > 0) a linear ramp from L₀ at step 0 to ``train_max_length`` at half of
    ``max_steps``, held there after: short words first, where a wrong product costs fewer positions,
    then the long ones."""
    if config.curriculum_start == 0:
        return config.train_max_length
    ramp = max(1, config.max_steps // 2)
    grown = (config.train_max_length - config.curriculum_start) * min(step, ramp) / ramp
    return config.curriculum_start + int(grown)


def build_model(task_name: str, arm: str, config: StateTrackingConfig):
    """The study's LM for one task and arm (one head, no short convolution, SwiGLU MLP)."""
    from ..models import LM, LMConfig

    spec = parse_arm(arm)
    options = dict(vocab_size=make_state_tracking_task(task_name).vocab_size, d_model=config.d_model,
                   n_layers=config.n_layers, n_heads=1, mixer=spec["mixer"], use_short_conv=False,
                   qk_activation=config.qk_activation,
                   max_seq_len=max(config.test_lengths + (config.train_max_length,)))
    if spec["beta_range"] is not None:
        options["allow_neg_eigval"] = spec["beta_range"] == "[0,2]"
    if spec["mixer"] == "deltaproduct":
        options["num_householder"] = spec["n_householder"]
    return LM(LMConfig(**options))


def evaluate(model, task, length: int, size: int, generator: torch.Generator) -> Tuple[float, float]:
    """(sequence accuracy, token accuracy) on ``size`` fresh sequences of ``length``, in slices of 128."""
    all_right, tokens_right = 0, 0
    with torch.no_grad():
        for i in range(0, size, 128):
            batch = task.sample(min(128, size - i), length, generator)
            logits, _ = model(batch.inputs, return_cache=False)
            right = logits.argmax(-1) == batch.targets
            all_right += int(right.all(dim=1).sum())
            tokens_right += int(right.sum())
    return all_right / size, tokens_right / (size * length)


def fit_state_tracking_model(task_name: str, arm: str, config: StateTrackingConfig, seed: int):
    """Train one model on ``task_name`` at ``config.train_max_length``; returns ``(model in eval mode,
    the last batch's loss)``. Bit-identical given ``seed`` and the thread count."""
    task = make_state_tracking_task(task_name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(task_name, arm, config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=(0.9, 0.98))
    data = torch.Generator().manual_seed(seed + 1)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(config.max_steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, config)
        batch = task.sample(config.batch_size, training_length(step, config), data)
        logits, _ = model(batch.inputs, return_cache=False)
        loss = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval(), float(loss.detach())


def train_state_tracking_model(task_name: str, arm: str, config: StateTrackingConfig, seed: int) -> Dict:
    """Train one model (:func:`fit_state_tracking_model`) and test it at every ``config.test_lengths``;
    returns per-length accuracies, the final training loss, parameters and seconds."""
    start = time.perf_counter()
    model, loss = fit_state_tracking_model(task_name, arm, config, seed)
    task = make_state_tracking_task(task_name)
    by_length = {}
    for length in config.test_lengths:
        seq, tok = evaluate(model, task, length, config.test_size, torch.Generator().manual_seed(seed ^ (0x7E57 + length)))
        by_length[str(length)] = {"seq_accuracy": seq, "token_accuracy": tok}
    return {"by_length": by_length, "train_loss": loss, "parameters": model.num_parameters(),
            "seconds": round(time.perf_counter() - start, 3)}


def _run_key(config: StateTrackingConfig, task_name: str, arm: str, i: int) -> int:
    """The seed of run (task, arm, seed index): shared by every arm, so all arms see the same data."""
    return keyed_seed(config.root_seed, 33, list(TASKS).index(task_name), i)


def _train_job(task_name: str, arm: str, config: StateTrackingConfig, seed: int) -> Dict:
    with torch_threads(config.threads):
        return train_state_tracking_model(task_name, arm, config, seed)


def run_state_tracking(config: Optional[StateTrackingConfig] = None, out_dir: Optional[str] = None,
                       progress: bool = True, plots: bool = True, resume: bool = False) -> Dict:
    """Train and test every (task, arm, seed); with ``out_dir`` write ``state_tracking.json``,
    ``state_tracking.csv``, ``state_tracking.png`` and, for several arms, ``state_tracking_grid.png`` (finished runs go to
    ``state_tracking.partial.json`` as they arrive; ``resume`` continues from it).

    With ``config.workers > 1`` the runs go to spawned worker processes, which import the
    calling script again: call this under ``if __name__ == "__main__":`` or set ``workers=1``."""
    from tqdm.auto import tqdm

    from .mqar import _worker_init

    config = StateTrackingConfig() if config is None else config
    start = time.perf_counter()
    cache = CellCache(out_dir, "state_tracking", {k: v for k, v in asdict(config).items() if k != "workers"}, resume)
    keys = [(t, a, i) for t in config.tasks for a in config.arms for i in range(config.seeds)]
    results: Dict[Tuple, Dict] = {}
    bar = tqdm(total=len(keys), desc="state-tracking", disable=not progress, leave=False)

    def store(key: Tuple, compute) -> None:
        results[key] = cache.get(key, compute)
        r = results[key]["by_length"][str(max(config.test_lengths))]
        bar.update(1)
        bar.set_postfix_str(f"{key[0]} {key[1]} seed={key[2]} seq@{max(config.test_lengths)}={r['seq_accuracy']:.3f}")

    pool = None
    try:
        todo = [k for k in keys if k not in cache]
        for k in keys:
            if k in cache:
                store(k, None)
        if config.workers > 1 and len(todo) > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor, as_completed

            pool = ProcessPoolExecutor(min(config.workers, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_worker_init, initargs=(os.getpid(),))
            futures = {pool.submit(_train_job, t, a, config, _run_key(config, t, a, i)): (t, a, i) for t, a, i in todo}
            for future in as_completed(futures):
                store(futures[future], future.result)
        else:
            for t, a, i in todo:
                store((t, a, i), lambda: _train_job(t, a, config, _run_key(config, t, a, i)))
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        bar.close()

    rows: List[Dict] = []
    for t in config.tasks:
        for a in config.arms:
            spec = parse_arm(a)
            runs = [results[(t, a, i)] for i in range(config.seeds)]
            for length in config.test_lengths:
                seq = mean_se([r["by_length"][str(length)]["seq_accuracy"] for r in runs])
                tok = mean_se([r["by_length"][str(length)]["token_accuracy"] for r in runs])
                rows.append({"task": t, "arm": a, **spec, "test_length": length, "seq_accuracy": seq["mean"],
                             "seq_accuracy_se": seq["se"], "token_accuracy": tok["mean"], "token_accuracy_se": tok["se"],
                             "seeds": config.seeds,
                             "seq_accuracy_per_seed": [r["by_length"][str(length)]["seq_accuracy"] for r in runs]})
    result = {
        "study": "state_tracking",
        "papers": ["Grazzi et al. 2025, Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues, arXiv 2411.12537",
                   "Siems et al. 2025, DeltaProduct, arXiv 2502.10297"],
        "config": asdict(config),
        "train_max_length": config.train_max_length,
        "results": rows,
        "runs": [{"task": t, "arm": a, "seed": i, "train_loss": results[(t, a, i)]["train_loss"],
                  "parameters": results[(t, a, i)]["parameters"], "seconds": results[(t, a, i)]["seconds"]}
                 for t, a, i in keys],
        "published": {t: PUBLISHED[t] for t in config.tasks if t in PUBLISHED},
        "files": [],
    }
    return finish_study(result, start, cache, out_dir, "state_tracking", rows, TABLE_COLUMNS, plot_state_tracking if plots else None)


def plot_state_tracking(result: Dict, out: Path) -> List[str]:
    """Sequence accuracy (solid) and token accuracy (dotted) against test length, one panel per
    task, one colour per arm; the training length is marked."""
    plt = pyplot()
    cfg = result["config"]
    tasks = list(cfg["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks), 3.6), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for i, a in enumerate(cfg["arms"]):
            pts = [r for r in result["results"] if r["task"] == t and r["arm"] == a]
            xs = [r["test_length"] for r in pts]
            ax.errorbar(xs, [r["seq_accuracy"] for r in pts], yerr=[r["seq_accuracy_se"] for r in pts], color=f"C{i % 10}",
                        marker="o", ms=3, capsize=2, label=a)
            ax.plot(xs, [r["token_accuracy"] for r in pts], color=f"C{i % 10}", ls=":", lw=1)
        ax.axvline(result["train_max_length"], color="gray", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(f"{t} (trained on length {result['train_max_length']})", fontsize=9)
        ax.set_xlabel("test length")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"sequence accuracy (solid), token (dotted); {cfg['seeds']} seeds")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    files = [save_figure(fig, out / "state_tracking.png", dpi=80)]
    if len(cfg["arms"]) > 1:
        files.append(plot_state_tracking_grid(result, out / "state_tracking_grid.png"))
    return files


def plot_state_tracking_grid(result: Dict, path: Path) -> str:
    """One heat map for a sweep of many arms: rows are arms, columns (task, test length); each
    cell is the mean sequence accuracy over the seeds (colour and number) with the token
    accuracy under it; the columns at the training length are marked."""
    plt = pyplot()
    cfg = result["config"]
    tasks, arms, lengths = list(cfg["tasks"]), list(cfg["arms"]), sorted(cfg["test_lengths"])
    cell = {(r["task"], r["arm"], r["test_length"]): r for r in result["results"]}
    cols = [(t, n) for t in tasks for n in lengths]
    grid = [[cell[(t, a, n)]["seq_accuracy"] for t, n in cols] for a in arms]
    fig, ax = plt.subplots(figsize=(1.0 + 0.62 * len(cols), 0.9 + 0.36 * len(arms)))
    ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for i, a in enumerate(arms):
        for j, (t, n) in enumerate(cols):
            r = cell[(t, a, n)]
            ax.text(j, i, f"{r['seq_accuracy']:.2f}\n{r['token_accuracy']:.2f}", ha="center", va="center", fontsize=5.5,
                    color="black" if r["seq_accuracy"] > 0.6 else "white")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{t}\n{n}" + ("*" if n == result["train_max_length"] else "") for t, n in cols], fontsize=6)
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels(arms, fontsize=7)
    for j in range(len(lengths), len(cols), len(lengths)):
        ax.axvline(j - 0.5, color="white", lw=2)
    ax.set_title(f"sequence accuracy (top) and token accuracy (bottom), mean of {cfg['seeds']} seeds; "
                 f"* = training length", fontsize=8)
    return save_figure(fig, path, dpi=110)


def report(result: Dict) -> str:
    cfg = result["config"]
    lines = [f"State tracking (Grazzi et al. 2025; Siems et al. 2025): {cfg['n_layers']} layer(s), d_model "
             f"{cfg['d_model']}, one head, trained {cfg['max_steps']} steps at length {cfg['train_max_length']}, "
             f"lr {cfg['lr']:g}, {cfg['seeds']} seeds"]
    rows = [{**r, "seq acc ± se": f"{r['seq_accuracy']:.3f} ± {r['seq_accuracy_se']:.3f}",
             "token acc": f"{r['token_accuracy']:.3f}"} for r in result["results"]]
    lines.append(format_table(rows, ("task", "arm", "test_length", "seq acc ± se", "token acc"),
                              title="accuracy by test length (sequence: every position right)"))
    for t, claim in result.get("published", {}).items():
        lines.append(f"published, {t}: {claim}")
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study state-tracking``)

HELP = "state tracking (Grazzi et al. 2025; Siems et al. 2025): parity, sums mod m and group word problems"
Config = StateTrackingConfig
run = run_state_tracking
add_arguments, config_from_args = study_command(StateTrackingConfig, order=("tasks", "arms", "seeds", "max_steps", "test_lengths"))
