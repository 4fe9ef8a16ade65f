"""Trainable associative retrieval: Schlag et al. (2021) settings 1 and 2 (seed 001).

A single-layer fast-weight model learns to write key-value pairs into its memory
and read them back. Setting 1 sweeps the number S of unique keys to find where
each memory stops reaching a loss threshold (its capacity); setting 2 re-assigns
keys and asks for the latest value, which the delta rule can do and the sum rule
cannot (seed 001, ch. 3–5).

The model (:class:`FastWeightRetriever`; glossary code name: paper symbol)::

    e_t = key_embed(key_t)                      key symbol -> R^{d_key}
    k_t = W_k e_t,  q = W_q e_query             (d_key)
    v_t = value_embed(value_t)                  value symbol -> R^{d_value}
    β_t = σ(w_β · e_t + b_β)                    delta rule only: write strength
    φ   = feature map, then sum normalization   φ(x) / Σ_i φ(x)_i  (paper §4.2)
    memory (the op, state W = Σ ... ):
        sum rule:   W_t = W_{t−1} + v_t ⊗ φ(k_t)                     chunk_linear_attn
        delta rule: W_t = W_{t−1} + β_t (v_t − W_{t−1} φ(k_t)) ⊗ φ(k_t)  chunk_delta_rule
    logits = W_out (W_L φ(q))                   read after all L writes; cross-entropy

The ops store the transpose of W (K×V). Reads are extra tokens after the writes
whose write is a no-op (v = 0 and β = 0), so one op call writes and reads.

Feature maps (seed 001, ch. 3): ``linear`` is the Linear Transformer's
φ(x) = elu(x) + 1 (d_dot = d_key), ``dpfp1..3`` are DPFP(ν) (d_dot = 2·d_key·ν),
``favor`` is FAVOR+ with m = d_key random features (d_dot = 2m), a fixed draw
from the run's seed.

Training: Adam, cross-entropy on the queried values, until the loss on a fixed
evaluation batch is below ``loss_threshold`` or ``max_steps`` is spent. The
threshold S* of a memory is the largest S of the sweep at which it reached the
threshold (the sweep of a memory stops after ``patience`` consecutive misses).

The published comparison is at d_key = 64 (``--full``): linear S* ≈ 60, DPFP
ν = 1/2/3 S* ≈ 128/256/384, i.e. S* ≈ d_dot. The quick default keeps CPU time to
minutes by shrinking the model to d_key = 8 (so d_dot, and the expected S*,
shrink by 8; compare S*/d_dot), by a coarser grid of S, by training the delta
rule with three feature maps only, and by asking every stored key after the
writes instead of one (``num_queries``): the memory that must hold the S pairs
is the same, only the training signal per sequence grows.

Setting 2 uses the paper's sizes (20 keys, 40 writes) and one feature map for
both rules (DPFP-2 at d_key = 8, d_dot = 32 > 20 keys, so capacity is not what
limits either rule: only the update rule differs).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import DPFP, EluPlusOne, FavorPlus, chunk_delta_rule, chunk_linear_attn
from ..tasks.retrieval import RetrievalTask
from ._report import CellCache, format_table, keyed_seed, pyplot, save_figure, save_result, torch_threads

FEATURE_MAPS = ("linear", "dpfp1", "dpfp2", "dpfp3", "favor")
RULES = ("sum", "delta")
PUBLISHED_THRESHOLDS = {"linear": 60, "dpfp1": 128, "dpfp2": 256, "dpfp3": 384}  # at d_key = 64 (seed 001)
TABLE_COLUMNS = ("setting", "rule", "feature_map", "d_dot", "S", "reached", "loss", "accuracy", "steps", "seconds")


def make_feature_map(name: str, d_key: int, seed: int = 0):
    """The φ of ``name`` (see :data:`FEATURE_MAPS`) for keys of width ``d_key``."""
    if name == "linear":
        return EluPlusOne()
    if name in ("dpfp1", "dpfp2", "dpfp3"):
        return DPFP(int(name[-1]))
    if name == "favor":
        return FavorPlus(d_key, num_features=d_key, seed=seed)
    raise ValueError(f"unknown `feature_map` {name!r}; expected one of {', '.join(FEATURE_MAPS)}")


class FastWeightRetriever(nn.Module):
    """The single-layer fast-weight model of the module docstring.

    ``forward(keys [B, L], values [B, L], queries [B, Q]) -> logits [B, Q, num_values]``.
    """

    def __init__(self, num_keys: int, num_values: int, d_key: int = 64, d_value: int = 64, rule: str = "sum",
                 feature_map: str = "linear", seed: int = 0, chunk_size: int = 64) -> None:
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"FastWeightRetriever: unknown `rule` {rule!r}; expected one of {', '.join(RULES)}")
        self.rule = rule
        self.phi = make_feature_map(feature_map, d_key, seed)
        self.d_dot = self.phi.output_dim(d_key)
        self.chunk_size = chunk_size
        self.key_embed = nn.Embedding(num_keys, d_key)
        self.value_embed = nn.Embedding(num_values, d_value)
        self.k_proj = nn.Linear(d_key, d_key, bias=False)
        self.q_proj = nn.Linear(d_key, d_key, bias=False)
        self.beta_proj = nn.Linear(d_key, 1) if rule == "delta" else None
        self.readout = nn.Linear(d_value, num_values)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        e = self.key_embed(keys)                                      # (B, L, d_key)
        k = self.k_proj(e)
        v = self.value_embed(values)                                  # (B, L, d_value)
        q_read = self.q_proj(self.key_embed(queries))                 # (B, Q, d_key)
        n_read = q_read.shape[1]
        # One sequence: L writes, then Q reads that write nothing (v = 0, β = 0).
        q = torch.cat([k, q_read], dim=1)[:, :, None]                 # (B, L + Q, 1, d_key)
        k = torch.cat([k, torch.zeros_like(q_read)], dim=1)[:, :, None]
        v = torch.cat([v, v.new_zeros(v.shape[0], n_read, v.shape[2])], dim=1)[:, :, None]
        if self.rule == "sum":
            o, _ = chunk_linear_attn(q, k, v, scale=1.0, feature_map=self.phi, qk_norm="sum", chunk_size=self.chunk_size)
        else:
            beta = torch.sigmoid(self.beta_proj(e))[..., 0]           # (B, L)
            beta = torch.cat([beta, beta.new_zeros(beta.shape[0], n_read)], dim=1)[:, :, None]
            o, _ = chunk_delta_rule(q, k, v, beta, scale=1.0, feature_map=self.phi, qk_norm="sum",
                                    chunk_size=self.chunk_size)
        return self.readout(o[:, -n_read:, 0])                        # (B, Q, num_values)


@dataclass
class TrainConfig:
    """How one model is trained: Adam until the evaluation loss is below ``loss_threshold``
    or ``max_steps`` is spent (the evaluation batch is fixed, drawn from the run's seed)."""

    d_key: int = 8
    d_value: int = 64
    batch_size: int = 32
    lr: float = 3e-3
    max_steps: int = 1500
    eval_every: int = 50
    eval_batch: int = 256
    loss_threshold: float = 0.05

    def __post_init__(self) -> None:
        for name in ("d_key", "d_value", "batch_size", "max_steps", "eval_every", "eval_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig: `{name}` must be a positive int, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig: `lr` must be > 0, got {self.lr!r}")
        if not self.loss_threshold > 0:
            raise ValueError(f"TrainConfig: `loss_threshold` must be > 0, got {self.loss_threshold!r}")


def train_memory(task: RetrievalTask, rule: str, feature_map: str, train: TrainConfig, seed: int) -> Dict:
    """Train one :class:`FastWeightRetriever` on ``task``; deterministic given ``seed``.

    Returns the final evaluation loss and accuracy, whether the loss threshold was
    reached, the steps taken, the wall time, d_dot and the evaluation history.
    The global torch RNG is left as it was.
    """
    gen = torch.Generator().manual_seed(seed)
    eval_batch = task.sample(train.eval_batch, torch.Generator().manual_seed(seed + 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FastWeightRetriever(task.num_keys, task.num_values, train.d_key, train.d_value, rule, feature_map,
                                    seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=train.lr)
    start = time.perf_counter()

    def evaluate() -> Tuple[float, float]:
        with torch.no_grad():
            logits = model(eval_batch.keys, eval_batch.values, eval_batch.queries)
            loss = F.cross_entropy(logits.flatten(0, 1), eval_batch.targets.flatten()).item()
            acc = (logits.argmax(-1) == eval_batch.targets).float().mean().item()
        return loss, acc

    loss, acc = evaluate()
    history = [(0, loss)]
    step = 0
    while loss >= train.loss_threshold and step < train.max_steps:
        batch = task.sample(train.batch_size, gen)
        logits = model(batch.keys, batch.values, batch.queries)
        F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % train.eval_every == 0 or step == train.max_steps:
            loss, acc = evaluate()
            history.append((step, loss))
    return {"loss": loss, "accuracy": acc, "steps": step, "reached": loss < train.loss_threshold,
            "seconds": round(time.perf_counter() - start, 3), "d_dot": model.d_dot, "history": history}


@dataclass
class RetrievalConfig:
    """The sweep (setting 1) and the update test (setting 2).

    Setting 1 trains every memory in ``memories`` (pairs ``(rule, feature_map)``)
    at each S of ``sizes`` in order, stopping a memory after ``patience``
    consecutive misses. Setting 2 trains ``setting2_rules`` with
    ``setting2_feature_map`` on ``setting2_keys`` keys and ``setting2_pairs`` writes.
    ``queries`` is the number of keys asked per training sequence (None: every
    stored key in setting 1, 4 in setting 2). ``threads`` is the torch thread count
    while training (these models are tiny: one thread is fastest).
    """

    root_seed: int = 0
    train: TrainConfig = field(default_factory=TrainConfig)
    memories: Tuple[Tuple[str, str], ...] = (
        ("sum", "linear"), ("sum", "dpfp1"), ("sum", "dpfp2"), ("sum", "dpfp3"), ("sum", "favor"),
        ("delta", "linear"), ("delta", "dpfp1"), ("delta", "dpfp2"),
    )
    sizes: Tuple[int, ...] = (8, 12, 16, 24, 32, 48, 64, 96)
    patience: Optional[int] = 2
    queries: Optional[int] = None
    setting2_rules: Tuple[str, ...] = RULES
    setting2_feature_map: str = "dpfp2"
    setting2_keys: int = 20
    setting2_pairs: int = 40
    setting2_queries: int = 4
    threads: Optional[int] = 1

    def __post_init__(self) -> None:
        if isinstance(self.root_seed, bool) or not isinstance(self.root_seed, int) or self.root_seed < 0:
            raise ValueError(f"RetrievalConfig: `root_seed` must be a non-negative int, got {self.root_seed!r}")
        for rule, fmap in self.memories:
            if rule not in RULES:
                raise ValueError(f"RetrievalConfig: unknown rule {rule!r} in `memories`; expected one of {RULES}")
            if fmap not in FEATURE_MAPS:
                raise ValueError(f"RetrievalConfig: unknown feature map {fmap!r} in `memories`; expected one of {FEATURE_MAPS}")
        for rule in self.setting2_rules:
            if rule not in RULES:
                raise ValueError(f"RetrievalConfig: unknown rule {rule!r} in `setting2_rules`; expected one of {RULES}")
        if self.setting2_feature_map not in FEATURE_MAPS:
            raise ValueError(f"RetrievalConfig: unknown `setting2_feature_map` {self.setting2_feature_map!r}")
        if not self.sizes or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.sizes) \
                or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"RetrievalConfig: `sizes` must be increasing positive ints, got {self.sizes!r}")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"RetrievalConfig: `patience` must be >= 1 or None, got {self.patience!r}")
        # Setting 2 must be a valid task.
        RetrievalTask(2, self.setting2_keys, num_pairs=self.setting2_pairs, num_queries=self.setting2_queries)

    @classmethod
    def full(cls, **overrides) -> "RetrievalConfig":
        """The paper's sweep: d_key = 64, S = 20..600 in steps of 20, every rule × feature map, one
        query per sequence, longer training (hours on a CPU)."""
        settings = dict(
            train=TrainConfig(d_key=64, max_steps=20000, eval_every=200),
            memories=tuple((r, m) for r in RULES for m in FEATURE_MAPS),
            sizes=tuple(range(20, 601, 20)), patience=2, queries=1, setting2_feature_map="dpfp1", threads=None,
        )
        settings.update(overrides)
        return cls(**settings)


def _memory_name(rule: str, fmap: str) -> str:
    return f"{rule}/{fmap}"


def run_retrieval(config: Optional[RetrievalConfig] = None, out_dir: Optional[str] = None, progress: bool = True,
                  plots: bool = True, resume: bool = False) -> Dict:
    """Run both settings; with ``out_dir`` write ``retrieval.json``, ``retrieval.csv`` and
    ``retrieval_loss_vs_S.png`` (setting 1) / ``retrieval_setting2.png`` (learning curves).
    Each trained memory goes to ``retrieval.partial.json`` first; ``resume`` continues from it."""
    from tqdm.auto import tqdm

    config = RetrievalConfig() if config is None else config
    start = time.perf_counter()
    cache = CellCache(out_dir, "retrieval", asdict(config), resume)
    with torch_threads(config.threads):
        rows: List[Dict] = []
        thresholds: Dict[str, Dict] = {}
        bar = tqdm(total=len(config.memories) * len(config.sizes), desc="retrieval setting 1", disable=not progress,
                   leave=False)
        for rule, fmap in config.memories:
            misses, best, d_dot = 0, None, None
            for s in config.sizes:
                queries = s if config.queries is None else min(config.queries, s)
                task = RetrievalTask(1, s, num_queries=queries)
                seed = keyed_seed(config.root_seed, 1, RULES.index(rule), FEATURE_MAPS.index(fmap), s)
                r = cache.get((1, rule, fmap, s), lambda: train_memory(task, rule, fmap, config.train, seed))
                d_dot = r["d_dot"]
                rows.append({"setting": 1, "rule": rule, "feature_map": fmap, "S": s,
                             **{k: r[k] for k in ("d_dot", "reached", "loss", "accuracy", "steps", "seconds")}})
                bar.update(1)
                bar.set_postfix_str(f"{_memory_name(rule, fmap)} S={s} loss={r['loss']:.3f}")
                if r["reached"]:
                    misses, best = 0, s
                else:
                    misses += 1
                    if config.patience is not None and misses >= config.patience:
                        break
            bar.update(len(config.sizes) - sum(1 for x in rows if (x["rule"], x["feature_map"]) == (rule, fmap)))
            published = PUBLISHED_THRESHOLDS.get(fmap) if rule == "sum" else None
            thresholds[_memory_name(rule, fmap)] = {
                "rule": rule, "feature_map": fmap, "d_dot": d_dot, "threshold_S": best,
                "threshold_over_d_dot": None if best is None else best / d_dot,
                "published_S_at_d_key_64": published,
                "published_over_d_dot": None if published is None else published / (
                    make_feature_map(fmap, 64).output_dim(64)),
            }
        bar.close()

        setting2 = {}
        for rule in tqdm(config.setting2_rules, desc="retrieval setting 2", disable=not progress, leave=False):
            task = RetrievalTask(2, config.setting2_keys, num_pairs=config.setting2_pairs,
                                 num_queries=config.setting2_queries)
            seed = keyed_seed(config.root_seed, 2, RULES.index(rule), FEATURE_MAPS.index(config.setting2_feature_map))
            r = cache.get((2, rule), lambda: train_memory(task, rule, config.setting2_feature_map, config.train, seed))
            setting2[rule] = r
            rows.append({"setting": 2, "rule": rule, "feature_map": config.setting2_feature_map,
                         "S": config.setting2_keys,
                         **{k: r[k] for k in ("d_dot", "reached", "loss", "accuracy", "steps", "seconds")}})

    result = {
        "study": "retrieval",
        "seed_text": "seed 001, ch. 3 and 5 (Schlag et al. 2021, section 6.1, settings 1 and 2)",
        "config": asdict(config),
        "thresholds": thresholds,
        "setting2": {rule: {k: v for k, v in r.items()} for rule, r in setting2.items()},
        "table": rows,
        "files": [],
    }
    result["runtime_s"] = round(time.perf_counter() - start, 3)
    save_result(result, out_dir, "retrieval", rows, TABLE_COLUMNS, plot_retrieval if plots else None)
    cache.finish()
    return result


def plot_retrieval(result: Dict, out: Path) -> List[str]:
    plt = pyplot()
    cfg = result["config"]
    files = []
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for i, (name, th) in enumerate(result["thresholds"].items()):
        pts = [(r["S"], r["loss"]) for r in result["table"]
               if r["setting"] == 1 and r["rule"] == th["rule"] and r["feature_map"] == th["feature_map"]]
        ls = "-" if th["rule"] == "sum" else "--"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, ls=ls, color=f"C{FEATURE_MAPS.index(th['feature_map'])}",
                label=f"{name} (d_dot={th['d_dot']}, S*={th['threshold_S']})")
    ax.axhline(cfg["train"]["loss_threshold"], color="gray", ls=":", lw=1, label="loss threshold")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("unique keys S")
    ax.set_ylabel("evaluation loss after training (nats)")
    ax.set_title(f"Setting 1: capacity of each memory, d_key = {cfg['train']['d_key']} "
                 f"(solid: sum rule, dashed: delta rule)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    files.append(save_figure(fig, out / "retrieval_loss_vs_S.png", dpi=80))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for rule, r in result["setting2"].items():
        steps, losses = zip(*r["history"])
        ax.plot(steps, losses, marker=".", label=f"{rule} rule (final acc {r['accuracy']:.2f})")
    ax.axhline(cfg["train"]["loss_threshold"], color="gray", ls=":", lw=1, label="loss threshold")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("evaluation loss (nats)")
    ax.set_title(f"Setting 2: {cfg['setting2_keys']} keys re-assigned over {cfg['setting2_pairs']} writes, "
                 f"φ = {cfg['setting2_feature_map']}; the latest value must be read", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    files.append(save_figure(fig, out / "retrieval_setting2.png", dpi=80))
    return files


def report(result: Dict) -> str:
    cfg = result["config"]
    t = cfg["train"]
    lines = [f"retrieval study (seed 001; Schlag et al. 2021 §6.1): d_key = {t['d_key']}, Adam lr {t['lr']}, batch "
             f"{t['batch_size']}, until eval loss < {t['loss_threshold']} or {t['max_steps']} steps"]
    rows = []
    for name, th in result["thresholds"].items():
        rows.append({"memory": name, "d_dot": th["d_dot"], "S*": th["threshold_S"],
                     "S*/d_dot": th["threshold_over_d_dot"], "published S* (d_key=64)": th["published_S_at_d_key_64"],
                     "published S*/d_dot": th["published_over_d_dot"]})
    lines.append(format_table(rows, ("memory", "d_dot", "S*", "S*/d_dot", "published S* (d_key=64)", "published S*/d_dot"),
                              floatfmt=".2f", title="setting 1: largest S that reached the loss threshold"))
    lines.append("")
    lines.append(format_table([r for r in result["table"] if r["setting"] == 1],
                              ("rule", "feature_map", "d_dot", "S", "reached", "loss", "accuracy", "steps", "seconds"),
                              floatfmt=".3f", title="setting 1: every run"))
    lines.append("")
    lines.append(format_table([r for r in result["table"] if r["setting"] == 2],
                              ("rule", "feature_map", "S", "reached", "loss", "accuracy", "steps", "seconds"),
                              floatfmt=".3f", title=f"setting 2: {cfg['setting2_keys']} keys, {cfg['setting2_pairs']} "
                                                    f"writes with replacement, latest value"))
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study retrieval``)

HELP = "seed 001: trainable associative retrieval (Schlag et al. 2021 settings 1 and 2), capacity sweep over S"
Config = RetrievalConfig
run = run_retrieval


def add_arguments(parser) -> None:
    parser.add_argument("--d-key", type=int, default=None, help="key width (default 8; --full: 64, the paper's)")
    parser.add_argument("--max-steps", type=int, default=None, help="step budget per model")
    parser.add_argument("--threshold", type=float, default=None, help="loss threshold (default 0.05 nats)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads while training (default 1)")


def config_from_args(args) -> RetrievalConfig:
    base = RetrievalConfig.full() if args.full else RetrievalConfig()
    train = base.train
    updates = {k: v for k, v in (("d_key", args.d_key), ("max_steps", args.max_steps),
                                 ("loss_threshold", args.threshold)) if v is not None}
    overrides = {"root_seed": args.root_seed, "train": TrainConfig(**{**asdict(train), **updates})}
    if args.threads is not None:
        overrides["threads"] = args.threads
    return RetrievalConfig(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **overrides})
