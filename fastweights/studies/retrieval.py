"""Trainable associative retrieval at the protocol of Schlag et al. (2021, §6.1).

A single-layer memory learns keys it can write S key-value pairs with and read
back. Setting 1 sweeps S to find the largest S a memory retrieves *cleanly* (its
capacity S*); setting 2 re-assigns keys and asks for the latest value, which the
delta rule can do and the sum rule cannot.

The protocol is the paper's (glossary code name: paper symbol)::

    e_t = key_embed(key_t)                 learned, dimension E = int(2S·1.1)
    k_t = W_k e_t,  q = W_k e_query        (d_key, "tied": the quick default); the query is a key symbol
    k_t = W_k [v_t; e_t] + b_k,  q = W_q e_query + b_q    ("paper": Schlag et al.'s code; ``--full``)
    v_t = onehot(value_t)                  frozen, dimension S: no value embedding, no read-out
    β_t = σ(w_β · e_t + b_β)               delta rule only: write strength
    sum rule   (arms linear, dpfp1..3, favor):  W = Σ v_t ⊗ φ(k_t), z = Σ φ(k_t)
               ŷ = W φ(q) / (z · φ(q))                                    chunk_linear_attn(normalize=True)
    delta rule (setting 2):  φ̄ = φ / Σ_i φ_i (sum normalisation, the delta rule's only)
               W_t = W_{t−1} + β_t (v_t − W_{t−1} φ̄(k_t)) ⊗ φ̄(k_t),  ŷ = W φ̄(q)  chunk_delta_rule
    softmax    ŷ = Σ_t softmax_t(k_t · q / √d_key) v_t                    (the unbounded reference)
    loss       0.5 · ‖onehot(y) − ŷ‖²  per query;  "clean": evaluation loss ≤ 0.001

The ops return the final state; the read is ``φ(q)`` against it (one product).

Feature maps (Schlag et al. 2021): ``linear`` is φ(x) = elu(x) + 1 (d_dot = d_key);
``dpfp1..3`` are DPFP(ν) (d_dot = 2·d_key·ν); ``favor``, ``favor2``, ``favor8`` are
FAVOR+ with m = 1, 2, 8 × d_key random features (d_dot = 2m; the paper's 64, 128,
512 at d_key = 64). As in the paper's code, FAVOR+ is φ(x) = [exp(ωᵀx − |x|²/2),
exp(−ωᵀx − |x|²/2)]/√(2m) of the key itself (no 1/√d_key inside: it estimates
exp(kᵀq)), with orthogonal ω of χ-distributed norms, no further stabiliser, the
normaliser z, and ω redrawn at every forward pass, evaluation included (from the
run's seeded stream, so reruns are identical). The evaluation batch is read in
``eval_forwards`` = 20 forwards (the paper: 20 sequences, at least one forward
each), so FAVOR+'s evaluation loss averages 20 draws of ω rather than one.

Training (paper: Adam 1e-3, batch 32, evaluation every 100 steps): train until
the loss on a fixed evaluation batch is clean, or it has not improved by 1% for
``patience`` evaluations, or ``max_steps`` are spent. For each seed the sweep over
S stops after ``sweep_patience`` consecutive unclean sizes; S* of a seed is the
largest clean S (0 if none); the headline is its mean and standard error over
seeds, and S*/d_dot.

What the paper's logs give (d_key = 64; :data:`PUBLISHED`): the first size that
was no longer clean. The quick default shrinks d_key to 8 (so d_dot, and S*,
shrink 8-fold: compare S*/d_dot), uses a coarse S grid, asks every stored key per
training sequence (the same memory, more training signal per step), and trains
with Adam 1e-2, evaluating every 50 steps, stopping after 6 evaluations without a
1% gain (the paper's 1e-3 needs budgets a quick run does not have), with tied
projections (under that budget the paper's separate W_q left DPFP-1 unclean even
at S = 4: see docs/studies.md); ``full`` is the paper's d_key = 64, S = 20..600 by
20, one query per sequence, the paper's projections.

Setting 2 uses the paper's sizes (20 keys, 40 writes with replacement, the target
is the value of the key's last write) and DPFP-1 for both rules, at a d_key
whose d_dot exceeds 20 (16 in the quick default, 64 in ``full``), so capacity does
not limit either rule: only the update rule differs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import NESTED_FLAGS, check_int, flag, is_int
from ..ops import DPFP, EluPlusOne, FavorPlus, chunk_delta_rule, chunk_linear_attn
from ..ops.feature_maps import normalize_qk
from ..tasks.retrieval import RetrievalBatch, RetrievalTask
from ._report import CellCache, finish_study, format_table, keyed_seed, mean_se, pyplot, save_figure, study_command, torch_threads

# FAVOR+ with m = 1, 2, 8 × d_key random features: the paper's 64/128/512 at d_key = 64.
FAVOR_FEATURES = {"favor": 1, "favor2": 2, "favor8": 8}
FEATURE_MAPS = ("linear", "dpfp1", "dpfp2", "dpfp3") + tuple(FAVOR_FEATURES)
# Setting 1: the sum rule with each φ, and softmax attention. The order keys each arm's seeds (ARMS.index),
# so arms added later go last.
ARMS = ("linear", "dpfp1", "dpfp2", "dpfp3", "favor", "softmax", "favor2", "favor8")
RULES = ("sum", "delta", "softmax")
PROJECTIONS = ("paper", "tied")
SETTING2_RULES = ("delta", "sum")
CLEAN_LOSS = 1e-3
# What the paper's logs give at d_key = 64 (read from Schlag et al.'s published logs): for setting 1 the
# largest S that was clean and the first S that was not (None: never clean / clean to the end of the
# sweep, S = 600); for setting 2 the final loss at S = 20.
PUBLISHED = {
    "setting1": {
        "linear": {"d_dot": 64, "clean_to": 40, "fails_at": 60},
        "dpfp1": {"d_dot": 128, "clean_to": 100, "fails_at": None},
        "dpfp2": {"d_dot": 256, "clean_to": 240, "fails_at": None},
        "dpfp3": {"d_dot": 384, "clean_to": 340, "fails_at": None},
        "favor": {"d_dot": 128, "clean_to": 0, "fails_at": 20, "note": "64 features: never clean"},
        "softmax": {"d_dot": None, "clean_to": None, "fails_at": None, "note": "loss <= 0.03 up to S = 600"},
        "favor2": {"d_dot": 256, "clean_to": 0, "fails_at": 20, "note": "128 features: never clean"},
        "favor8": {"d_dot": 1024, "clean_to": 0, "fails_at": 20, "note": "512 features: never clean"},
    },
    "setting2": {"delta": {"loss": 0.0008}, "sum": {"loss": 0.097}},
}
TABLE_COLUMNS = ("setting", "arm", "rule", "feature_map", "seed", "d_dot", "S", "clean", "loss", "accuracy", "steps",
                 "seconds")


def make_feature_map(name: str, d_key: int, seed: int = 0):
    """The φ of ``name`` (see :data:`FEATURE_MAPS`) for keys of width ``d_key``."""
    if name == "linear":
        return EluPlusOne()
    if name in ("dpfp1", "dpfp2", "dpfp3"):
        return DPFP(int(name[-1]))
    if name in FAVOR_FEATURES:
        # input_scale 1: the paper's features estimate exp(kᵀq), not exp(kᵀq/√d_key) (the learned key
        # projection could absorb the factor, but not its effect on the initial scale and the step size).
        return FavorPlus(d_key, num_features=FAVOR_FEATURES[name] * d_key, seed=seed, input_scale=1.0)
    raise ValueError(f"unknown `feature_map` {name!r}; expected one of {', '.join(FEATURE_MAPS)}")


def arm_memory(arm: str) -> Tuple[str, Optional[str]]:
    """``(rule, feature_map)`` of a setting-1 arm: the sum rule with φ = ``arm``, or softmax."""
    if arm == "softmax":
        return "softmax", None
    if arm in FEATURE_MAPS:
        return "sum", arm
    raise ValueError(f"unknown arm {arm!r}; expected one of {', '.join(ARMS)}")


class FastWeightRetriever(nn.Module):
    """The single-layer memory of the module docstring.

    ``forward(keys [B, L], values [B, L], queries [B, Q]) -> ŷ [B, Q, S]`` (the raw
    memory output read against one-hot values of dimension S = ``num_keys``).

    ``projections``: ``"paper"`` as Schlag et al.'s code: the key (and the delta
    rule's β) is projected from the written pair [onehot(v); e_key] with a bias, the
    query by its own projection W_q e_query + b, weights uniform in ±1/√d_key;
    ``"tied"``: one bias-free matrix W_k e serves the write and the read.
    """

    def __init__(self, num_keys: int, d_key: int = 64, rule: str = "sum", feature_map: Optional[str] = "linear",
                 seed: int = 0, chunk_size: int = 64, num_values: Optional[int] = None,
                 projections: str = "paper") -> None:
        super().__init__()
        if rule not in RULES:
            raise ValueError(f"FastWeightRetriever: unknown `rule` {rule!r}; expected one of {', '.join(RULES)}")
        if projections not in PROJECTIONS:
            raise ValueError(f"FastWeightRetriever: unknown `projections` {projections!r}; expected one of "
                             f"{', '.join(PROJECTIONS)}")
        self.projections = projections
        self.rule = rule
        self.num_values = num_keys if num_values is None else num_values
        self.phi = None if rule == "softmax" else make_feature_map(feature_map, d_key, seed)
        self.d_dot = None if self.phi is None else self.phi.output_dim(d_key)
        self.chunk_size = chunk_size
        embed_dim = int(2 * num_keys * 1.1)                               # the paper's key embedding width
        self.key_embed = nn.Embedding(num_keys, embed_dim)
        if projections == "tied":
            self.k_proj = nn.Linear(embed_dim, d_key, bias=False)
            self.q_proj = None
            self.beta_proj = nn.Linear(embed_dim, 1) if rule == "delta" else None
        else:
            self.k_proj = nn.Linear(self.num_values + embed_dim, d_key)
            self.q_proj = nn.Linear(embed_dim, d_key)
            self.beta_proj = nn.Linear(self.num_values + embed_dim, 1) if rule == "delta" else None
            if rule != "softmax":  # the paper's linear-attention init (its softmax model keeps Xavier's)
                for proj in (self.k_proj, self.q_proj):
                    nn.init.uniform_(proj.weight, -d_key ** -0.5, d_key ** -0.5)

    def project(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor):
        """``(k [B, L, d_key], q [B, Q, d_key], v [B, L, S], x [B, L, ·])``: keys, queries, one-hot values and
        the input of the write (what β is computed from)."""
        v = F.one_hot(values, self.num_values).to(self.key_embed.weight.dtype)  # frozen
        e = self.key_embed(keys)                                                 # (B, L, E)
        if self.projections == "tied":
            return self.k_proj(e), self.k_proj(self.key_embed(queries)), v, e
        x = torch.cat([v, e], dim=-1)                                            # the written pair
        return self.k_proj(x), self.q_proj(self.key_embed(queries)), v, x

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        if isinstance(self.phi, FavorPlus):
            self.phi.redraw()                                             # the paper redraws ω every forward
        k, q, v, x = self.project(keys, values, queries)
        if self.rule == "softmax":
            return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
        head = (slice(None), slice(None), None)                           # (B, T, d) -> (B, T, 1, d)
        if self.rule == "sum":
            _, h = chunk_linear_attn(k[head], k[head], v[head], scale=1.0, feature_map=self.phi, normalize=True,
                                     output_final_state=True, chunk_size=self.chunk_size)
            phi_q = self.phi(q)
            read = phi_q @ h[:, 0]                                        # (B, Q, S + 1) = [W φ(q) | z·φ(q)]
            return read[..., :-1] / (read[..., -1:] + 1e-6)
        beta = torch.sigmoid(self.beta_proj(x))                           # (B, L, 1)
        _, h = chunk_delta_rule(k[head], k[head], v[head], beta, scale=1.0, feature_map=self.phi, qk_norm="sum",
                                output_final_state=True, chunk_size=self.chunk_size)
        return normalize_qk(self.phi(q), "sum") @ h[:, 0]                 # (B, Q, S)


def retrieval_loss(y_hat: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0.5·‖onehot(y) − ŷ‖² per query, averaged over queries (the paper's criterion)."""
    return 0.5 * (F.one_hot(targets, y_hat.shape[-1]).to(y_hat.dtype) - y_hat).pow(2).sum(-1).mean()


def sum_rule_floor(task: RetrievalTask, samples: int = 20_000, seed: int = 0) -> float:
    """The lowest loss any sum rule with normaliser z can reach on setting-2 ``task``.

    With perfectly separated keys the z-normalised read of a key is the mean of the
    one-hot values written to it, whatever their order; the latest value is only one
    of them. This is that read's expected loss, over ``samples`` sequences.
    """
    b = task.sample(samples, torch.Generator().manual_seed(seed))
    v = F.one_hot(b.values, task.num_values).double()                         # (B, L, S)
    writes = (b.keys[:, None, :] == b.queries[:, :, None]).double()            # (B, Q, L)
    y_hat = (writes @ v) / writes.sum(-1, keepdim=True)
    return float(retrieval_loss(y_hat, b.targets))


@dataclass
class MemoryTrainConfig:
    """How one memory is trained: Adam until the evaluation loss is clean (≤ ``clean_loss``),
    or has not improved by 1% for ``patience`` evaluations, or ``max_steps`` are spent."""

    d_key: int = field(default=8, metadata=flag(type=int, help="key width (default 8; --full: 64, the paper's)"))
    batch_size: int = 32
    lr: float = 1e-2
    max_steps: int = field(default=3000, metadata=flag(type=int, help="step budget per memory"))
    eval_every: int = 50
    eval_batch: int = 128
    eval_forwards: int = 20
    patience: int = 6
    projections: str = field(default="tied", metadata=flag(
        choices=PROJECTIONS, help="key/query projections: tied (one W_k, the quick default) or paper (W_k [onehot(v); e] + b "
                                  "and a separate W_q + b, as Schlag et al.'s code; the --full default)"))
    clean_loss: float = CLEAN_LOSS

    def __post_init__(self) -> None:
        for name in ("d_key", "batch_size", "max_steps", "eval_every", "eval_batch", "eval_forwards", "patience"):
            value = getattr(self, name)
            check_int("MemoryTrainConfig", name, value)
        if not self.lr > 0:
            raise ValueError(f"MemoryTrainConfig: `lr` must be > 0, got {self.lr!r}")
        if self.projections not in PROJECTIONS:
            raise ValueError(f"MemoryTrainConfig: `projections` must be one of {', '.join(PROJECTIONS)}, "
                             f"got {self.projections!r}")
        if not self.clean_loss > 0:
            raise ValueError(f"MemoryTrainConfig: `clean_loss` must be > 0, got {self.clean_loss!r}")


def train_memory(task: RetrievalTask, rule: str, feature_map: Optional[str], train: MemoryTrainConfig, seed: int) -> Dict:
    """Train one :class:`FastWeightRetriever` on ``task``; bit-identical given ``seed`` (and the thread count).

    Returns the final evaluation loss and accuracy, whether it is clean, the steps
    taken, the wall time, d_dot and the evaluation history. The global torch RNG is
    left as it was: every draw comes from generators seeded by ``seed``.
    """
    gen = torch.Generator().manual_seed(seed)
    eval_batch = task.sample(train.eval_batch, torch.Generator().manual_seed(seed + 1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FastWeightRetriever(task.num_keys, train.d_key, rule, feature_map, seed=seed,
                                    num_values=task.num_values, projections=train.projections)
    opt = torch.optim.Adam(model.parameters(), lr=train.lr)
    start = time.perf_counter()

    parts = [RetrievalBatch(*p) for p in zip(*(x.tensor_split(train.eval_forwards) for x in eval_batch))]
    parts = [p for p in parts if p.keys.shape[0]]

    def evaluate() -> Tuple[float, float]:
        # Several forwards, as the paper's evaluation (20 sequences, one or more forwards each): FAVOR+ draws
        # fresh features at every forward, so its loss is an average over draws, not one lucky draw.
        loss = correct = 0.0
        with torch.no_grad():
            for p in parts:
                y_hat = model(p.keys, p.values, p.queries)
                loss += retrieval_loss(y_hat, p.targets).item() * p.keys.shape[0]
                correct += (y_hat.argmax(-1) == p.targets).float().mean().item() * p.keys.shape[0]
        return loss / train.eval_batch, correct / train.eval_batch

    loss, acc = evaluate()
    history = [(0, loss)]
    best, stale, step = loss, 0, 0
    while loss > train.clean_loss and step < train.max_steps and stale < train.patience:
        batch = task.sample(train.batch_size, gen)
        retrieval_loss(model(batch.keys, batch.values, batch.queries), batch.targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % train.eval_every == 0 or step == train.max_steps:
            loss, acc = evaluate()
            history.append((step, loss))
            best, stale = (loss, 0) if loss < 0.99 * best else (best, stale + 1)
    return {"loss": loss, "accuracy": acc, "steps": step, "clean": loss <= train.clean_loss,
            "seconds": round(time.perf_counter() - start, 3), "d_dot": model.d_dot, "history": history}


@dataclass
class RetrievalConfig:
    """Setting 1 (the S sweep of every arm, ``seeds`` times) and setting 2 (the update test).

    ``queries``: keys asked per training sequence in setting 1 (None: every stored
    key). ``sweep_patience``: consecutive unclean sizes that end an arm's sweep.
    ``threads``: torch threads while training (these models are tiny: one is fastest).
    """

    root_seed: int = 0
    seeds: int = field(default=3, metadata=flag(type=int, help="seeds per arm (default 3)"))
    train: MemoryTrainConfig = field(default_factory=MemoryTrainConfig, metadata=NESTED_FLAGS)
    arms: Tuple[str, ...] = ARMS
    sizes: Tuple[int, ...] = (4, 8, 12, 16, 24, 32, 40, 48, 64)
    sweep_patience: int = 1
    queries: Optional[int] = None
    setting2_rules: Tuple[str, ...] = SETTING2_RULES
    setting2_feature_map: str = "dpfp1"
    setting2_d_key: int = 16
    setting2_keys: int = 20
    setting2_pairs: int = 40
    setting2_queries: int = 4
    setting2_max_steps: int = 3000
    threads: Optional[int] = field(default=1, metadata=flag(type=int, help="torch threads while training (default 1)"))

    def __post_init__(self) -> None:
        for name in ("root_seed", "seeds", "sweep_patience", "setting2_d_key", "setting2_max_steps"):
            value = getattr(self, name)
            check_int("RetrievalConfig", name, value, minimum=0 if name == "root_seed" else 1,
                      what="a non-negative int" if name == "root_seed" else None)
        for arm in self.arms:
            if arm not in ARMS:
                raise ValueError(f"RetrievalConfig: unknown arm {arm!r} in `arms`; expected one of {ARMS}")
        for rule in self.setting2_rules:
            if rule not in SETTING2_RULES:
                raise ValueError(f"RetrievalConfig: unknown rule {rule!r} in `setting2_rules`; "
                                 f"expected one of {SETTING2_RULES}")
        if self.setting2_feature_map not in FEATURE_MAPS:
            raise ValueError(f"RetrievalConfig: unknown `setting2_feature_map` {self.setting2_feature_map!r}")
        if not self.sizes or not all(is_int(x) and x >= 1 for x in self.sizes) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"RetrievalConfig: `sizes` must be increasing positive ints, got {self.sizes!r}")
        # Setting 2 must be a valid task.
        RetrievalTask(2, self.setting2_keys, num_pairs=self.setting2_pairs, num_queries=self.setting2_queries)

    @classmethod
    def full(cls, **overrides) -> "RetrievalConfig":
        """The paper's sweep: d_key = 64, S = 20..600 by 20, one query per sequence, Adam 1e-3,
        evaluation every 100 steps, up to 200k steps per memory (a GPU job; see docs/studies.md)."""
        settings = dict(
            train=MemoryTrainConfig(d_key=64, lr=1e-3, max_steps=200_000, eval_every=100, eval_batch=256, patience=20,
                              projections="paper"),
            sizes=tuple(range(20, 601, 20)), sweep_patience=2, queries=1, setting2_d_key=64, setting2_queries=1,
            setting2_max_steps=200_000, threads=None,
        )
        settings.update(overrides)
        return cls(**settings)


def _d_dot(arm: str, d_key: int) -> Optional[int]:
    rule, fmap = arm_memory(arm)
    return None if fmap is None else make_feature_map(fmap, d_key).output_dim(d_key)


def run_retrieval(config: Optional[RetrievalConfig] = None, out_dir: Optional[str] = None, progress: bool = True,
                  plots: bool = True, resume: bool = False) -> Dict:
    """Run both settings; with ``out_dir`` write ``retrieval.json``, ``retrieval.csv`` and
    ``retrieval_loss_vs_S.png`` / ``retrieval_setting2.png``. Each trained memory goes to
    ``retrieval.partial.json`` first; ``resume`` continues from it."""
    from tqdm.auto import tqdm

    config = RetrievalConfig() if config is None else config
    start = time.perf_counter()
    cache = CellCache(out_dir, "retrieval", asdict(config), resume)
    rows: List[Dict] = []
    with torch_threads(config.threads):
        bar = tqdm(total=len(config.arms) * config.seeds, desc="retrieval setting 1", disable=not progress, leave=False)
        s_stars: Dict[str, List[int]] = {arm: [] for arm in config.arms}
        for arm in config.arms:
            rule, fmap = arm_memory(arm)
            for i in range(config.seeds):
                misses, best = 0, 0
                for s in config.sizes:
                    queries = s if config.queries is None else min(config.queries, s)
                    task = RetrievalTask(1, s, num_queries=queries)
                    seed = keyed_seed(config.root_seed, 1, ARMS.index(arm), s, i)
                    r = cache.get((1, arm, i, s), lambda: train_memory(task, rule, fmap, config.train, seed))
                    rows.append({"setting": 1, "arm": arm, "rule": rule, "feature_map": fmap, "seed": i, "S": s,
                                 **{k: r[k] for k in ("d_dot", "clean", "loss", "accuracy", "steps", "seconds")}})
                    bar.set_postfix_str(f"{arm} seed {i} S={s} loss={r['loss']:.4f}")
                    misses, best = (0, s) if r["clean"] else (misses + 1, best)
                    if misses >= config.sweep_patience:
                        break
                s_stars[arm].append(best)
                bar.update(1)
        bar.close()

        setting2_rows: Dict[str, List[Dict]] = {rule: [] for rule in config.setting2_rules}
        train2 = MemoryTrainConfig(**{**asdict(config.train), "d_key": config.setting2_d_key,
                                "max_steps": config.setting2_max_steps})
        task2 = RetrievalTask(2, config.setting2_keys, num_pairs=config.setting2_pairs,
                              num_queries=config.setting2_queries)
        for rule in tqdm(config.setting2_rules, desc="retrieval setting 2", disable=not progress, leave=False):
            for i in range(config.seeds):
                seed = keyed_seed(config.root_seed, 2, SETTING2_RULES.index(rule), i)
                r = cache.get((2, rule, i), lambda: train_memory(task2, rule, config.setting2_feature_map, train2, seed))
                setting2_rows[rule].append(r)
                rows.append({"setting": 2, "arm": rule, "rule": rule, "feature_map": config.setting2_feature_map,
                             "seed": i, "S": config.setting2_keys,
                             **{k: r[k] for k in ("d_dot", "clean", "loss", "accuracy", "steps", "seconds")}})

    d_key = config.train.d_key
    setting1 = {}
    for arm, stars in s_stars.items():
        stat = mean_se(stars)
        d_dot = _d_dot(arm, d_key)
        pub = PUBLISHED["setting1"][arm]
        setting1[arm] = {
            "s_star": stat["mean"], "s_star_se": stat["se"], "d_dot": d_dot,
            "s_star_over_d_dot": None if d_dot is None else stat["mean"] / d_dot,
            "clean": any(x > 0 for x in stars), "s_star_per_seed": stars,
            "published_clean_to": pub["clean_to"], "published_fails_at": pub["fails_at"],
            "published_over_d_dot": None if pub["d_dot"] is None or pub["clean_to"] is None
            else pub["clean_to"] / pub["d_dot"],
        }
    setting2 = {}
    floor = round(sum_rule_floor(task2, seed=config.root_seed), 6)
    for rule, rs in setting2_rows.items():
        stat = mean_se([r["loss"] for r in rs])
        setting2[rule] = {"loss": stat["mean"], "loss_se": stat["se"], "clean": all(r["clean"] for r in rs),
                          "loss_per_seed": [r["loss"] for r in rs], "published_loss": PUBLISHED["setting2"][rule]["loss"],
                          "sum_rule_floor": floor,
                          "history": [r["history"] for r in rs]}
    result = {
        "study": "retrieval",
        "source": "Schlag et al. 2021, section 6.1, settings 1 and 2",
        "config": asdict(config),
        "headline": {"setting1": setting1, "setting2": setting2},
        "published": PUBLISHED,
        "table": rows,
        "files": [],
    }
    return finish_study(result, start, cache, out_dir, "retrieval", rows, TABLE_COLUMNS, plot_retrieval if plots else None)


def plot_retrieval(result: Dict, out: Path) -> List[str]:
    """The cliff: loss against S (log axes) with the clean line, one panel per φ family, softmax in each;
    and setting 2's learning curves."""
    plt = pyplot()
    cfg = result["config"]
    rows = [r for r in result["table"] if r["setting"] == 1]
    families = [("linear", ("linear",)), ("DPFP", ("dpfp1", "dpfp2", "dpfp3")), ("FAVOR+", tuple(FAVOR_FEATURES))]
    families = [(n, tuple(a for a in arms if a in cfg["arms"])) for n, arms in families]
    families = [f for f in families if f[1]]
    colors = {"linear": "C0", "dpfp1": "C1", "dpfp2": "C2", "dpfp3": "C3", "favor": "C4", "favor2": "C6",
              "favor8": "C8", "softmax": "C5"}
    fig, axes = plt.subplots(1, len(families), figsize=(4.6 * len(families), 4.4), sharey=True, squeeze=False)
    for ax, (family, arms) in zip(axes[0], families):
        for arm in arms + (("softmax",) if "softmax" in cfg["arms"] else ()):
            color = colors[arm]
            per_seed = [dict((r["S"], max(r["loss"], 1e-7)) for r in rows if r["arm"] == arm and r["seed"] == i)
                        for i in range(cfg["seeds"])]
            for pts in per_seed:  # thin: each seed's sweep (it stops at its first unclean S)
                if pts:
                    ax.plot(*zip(*sorted(pts.items())), marker="o", ms=2.5, lw=0.7, color=color, alpha=0.45,
                            ls="--" if arm == "softmax" else "-")
            sizes = sorted({s for pts in per_seed for s in pts})
            if not sizes:
                continue
            # bold: the geometric mean over the seeds that reached S; band: their min .. max
            seen = [[pts[s] for pts in per_seed if s in pts] for s in sizes]
            mean = [float(torch.tensor(v).log().mean().exp()) for v in seen]
            h = result["headline"]["setting1"][arm]
            bound = "unbounded" if h["d_dot"] is None else f"d_dot={h['d_dot']}"
            ax.plot(sizes, mean, marker="o", ms=4, lw=2, color=color, ls="--" if arm == "softmax" else "-",
                    label=f"{arm} ({bound}): S* = {h['s_star']:.1f} ± {h['s_star_se']:.1f}")
            ax.fill_between(sizes, [min(v) for v in seen], [max(v) for v in seen], color=color, alpha=0.15, lw=0)
        ax.axhline(cfg["train"]["clean_loss"], color="black", ls=":", lw=1, label="clean: loss 0.001")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(cfg["sizes"]))
        ax.set_xticklabels([str(x) for x in cfg["sizes"]], fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("unique keys S (log axis)")
        ax.set_title(f"{family}, d_key = {cfg['train']['d_key']}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    axes[0][0].set_ylabel("evaluation loss 0.5‖onehot − ŷ‖² (log axis)")
    fig.suptitle(f"Setting 1, sum rule with z (and softmax): the capacity cliff; {cfg['seeds']} seeds "
                 f"(thin: each seed; bold: geometric mean; band: min–max)", fontsize=9)
    files = [save_figure(fig, out / "retrieval_loss_vs_S.png", dpi=90)]

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for j, (rule, r) in enumerate(result["headline"]["setting2"].items()):
        for i, hist in enumerate(r["history"]):
            steps, losses = zip(*hist)
            ax.plot(steps, [max(x, 1e-7) for x in losses], marker=".", color=f"C{j}",
                    label=f"{rule} rule (final {r['loss']:.4f} ± {r['loss_se']:.4f}; paper {r['published_loss']})"
                    if i == 0 else None)
    ax.axhline(cfg["train"]["clean_loss"], color="gray", ls=":", lw=1, label="clean (0.001)")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("evaluation loss")
    ax.set_title(f"Setting 2: {cfg['setting2_keys']} keys re-assigned over {cfg['setting2_pairs']} writes, "
                 f"φ = {cfg['setting2_feature_map']}, d_key = {cfg['setting2_d_key']}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    files.append(save_figure(fig, out / "retrieval_setting2.png", dpi=80))
    return files


def report(result: Dict) -> str:
    cfg = result["config"]
    t = cfg["train"]
    lines = [f"retrieval study (Schlag et al. 2021 §6.1): d_key = {t['d_key']}, frozen one-hot values, "
             f"loss 0.5‖onehot − ŷ‖², clean ≤ {t['clean_loss']}, Adam lr {t['lr']}, batch {t['batch_size']}, "
             f"{cfg['seeds']} seeds"]
    rows = [{"arm": arm, **h, "S* ± se": f"{h['s_star']:.1f} ± {h['s_star_se']:.1f}",
             "per seed": " ".join(map(str, h["s_star_per_seed"]))}
            for arm, h in result["headline"]["setting1"].items()]
    lines.append(format_table(rows, ("arm", "d_dot", "S* ± se", "per seed", "s_star_over_d_dot", "published_clean_to",
                                     "published_fails_at", "published_over_d_dot"), floatfmt=".2f",
                              title="setting 1: S* = largest clean S (published: d_key = 64)"))
    lines.append("")
    rows = [{"rule": rule, "loss ± se": f"{h['loss']:.4f} ± {h['loss_se']:.4f}", "clean": h["clean"],
             "published": f"{h['published_loss']:g}", "sum-rule floor": h["sum_rule_floor"]}
            for rule, h in result["headline"]["setting2"].items()]
    lines.append(format_table(rows, ("rule", "loss ± se", "clean", "published", "sum-rule floor"),
                              title=f"setting 2: {cfg['setting2_keys']} keys, {cfg['setting2_pairs']} writes with "
                                    f"replacement, φ = {cfg['setting2_feature_map']}, d_key = {cfg['setting2_d_key']}"))
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study retrieval``)

HELP = "trainable associative retrieval (Schlag et al. 2021 settings 1 and 2), capacity sweep over S"
Config = RetrievalConfig
run = run_retrieval
add_arguments, config_from_args = study_command(RetrievalConfig, order=("train.d_key", "train.max_steps", "seeds", "threads"))
