"""Recall under a fixed capacity: a sealed mechanism test, and its exercise.

The reference protocol ("recall under a fixed capacity", docs/worked_examples.md §5) stores N random unit
key-value pairs in a memory, queries every stored key, decodes each read-out to
the nearest stored value, and compares three arms that share keys, values, order,
queries and decoder. Its frozen protocol, which this module runs unchanged:

=====================  ===================================================
η (step size)          0.20
priority rate          25% of the pairs carry a priority bit
ordinary write gate    0.10 (the selective arm writes ordinary pairs at 0.10·η)
widths d               (8, 16, 32)
loads N/d              (0.5, 1, 2, 4, 8)
repetitions            30 per (d, N/d) cell
seeds                  one root seed; two development branches (dev1, dev2)
                       and a disjoint held-out branch (heldout)
=====================  ===================================================

Glossary (code name: seed symbol):

- ``keys [R, N, d]``, ``values [R, N, d]``: the pairs (k_τ, v_τ), i.i.d. uniform on
  the unit sphere of R^d, written in draw order τ = 1..N; R = repetitions.
- ``eta``: η. ``ordinary_gate``: the 0.10 factor. ``gamma``: γ, the history weight
  of the fading-memory and least-squares arms (w_{t,τ} = γ^{t−τ}).
- state ``h [R, 1, d, d]``: the ops' K×V state, the transpose of the reference's
  ``H`` (``S = Σ v kᵀ`` for the sum rule); a read is ``o = hᵀ q``.

Arms (each reads every stored key after all N writes):

``softmax``
    exact softmax attention over all N pairs ("sharp"): ``softmax_attn`` with
    inverse temperature ``softmax_scale`` (default 1000, so the weight of the
    matching key dominates every other key by a factor e^{1000(1 − cos)}).
``delta``
    the plain delta state, ``h ← h + η k (v − hᵀk)ᵀ`` (``chunk_delta_rule``, β = η).
``selective``
    the selective delta arm: the same rule with the priority bit, β = η for a
    priority pair and β = 0.10·η for an ordinary pair. This is our reading of
    "writes ordinary pairs at only one-tenth strength" with "the 0.10 ordinary
    write gate": the gate multiplies the step size of ordinary writes; priority
    writes keep the full η of the plain arm.
``sum``
    the sum-rule (linear attention) state ``S = Σ v kᵀ`` (``chunk_linear_attn``,
    identity feature map, no normalizer; a positive rescaling of a read does not
    change its decoding).
``fading``
    the fading-memory delta, ``h ← γ (I − η k kᵀ) h + η k vᵀ``
    (``chunk_gated_delta_rule`` with g = log γ): the "writing γH_{t−1} into a
    one-step delta recurrence", a solver choice, not the minimizer below.
``rls``
    the exact minimizer of exponentially weighted least squares,
    ``M_t = argmin_M Σ_{τ≤t} γ^{t−τ} |M k_τ − v_τ|² + λ γ^t |M|²``, kept by recursive
    least squares (:func:`recursive_least_squares`): a covariance state P (d×d)
    beside the map, the "recursive least-squares covariance state" that
    the exact minimizer needs. Not an op of the library (no layer uses it), so it
    lives here.

Decoding: the read-out o_i of key i is decoded to ``argmax_j o_i·v_j`` over the N
stored values of the trial. For unit values this is both the nearest stored value
in Euclidean distance (|o − v_j|² = |o|² − 2 o·v_j + 1) and the argmax of cosine
similarity, and it is invariant to a positive rescaling of o. Recall is the
fraction of keys decoded to their own value ("top-1 identification", not exact
value recall; ``fidelity`` reports the mean cosine between o_i and v_i beside it),
overall and separately over priority and ordinary pairs.

The priority bit: in each trial exactly ``max(1, round(0.25·N))`` pairs, chosen
uniformly at random, are priority pairs (a fixed count, so that every trial has
both kinds; the bit is drawn for every arm but only the selective arm uses it).

How the ops read after writing: each trial is one sequence of 2N tokens, N writes
followed by N reads whose write is a no-op (β = 0 for the delta rules and k = v = 0
for the sum rule, g = 0). For softmax, the read tokens carry k = 0 and v = 0: they
add rows of value zero, which scale each read-out by a positive factor and so
leave its decoding exactly unchanged. All R repetitions of a cell run as one
batched op call (B = R, H = 1) in float64.

Seeds: the cell (d, N/d) of branch b draws its pairs and priority bits from
``SeedSequence(root_seed, spawn_key=(b, d, 1000·N/d))``
(:func:`~fastweights.studies._report.branch_seed_sequence`), so dev1, dev2 and
heldout are disjoint by construction, each is deterministic, and adding widths or
loads never moves another cell's numbers.

The headline (reference, held-out branch, N/d = 8, averaged over d): priority gain
+0.387, ordinary loss 0.124, gated overall 0.138, delta overall 0.134. Each of ours
is a mean over repetitions of the d-average, with its standard error over the R
repetitions.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config import check_int, check_ints, flag
from ..ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_linear_attn, softmax_attn
from ._report import (BRANCHES, CellCache, branch_seed_sequence, finish_study, format_table, mean_se, pyplot, save_figure,
                      study_command, torch_generator, torch_threads)

ARMS = ("softmax", "delta", "selective", "sum", "fading", "rls")
PROTOCOL_ARMS = ("softmax", "delta", "selective")
ARM_LABELS = {
    "softmax": "softmax (sharp, keeps all pairs)",
    "delta": "delta (plain)",
    "selective": "delta + priority bit",
    "sum": "sum rule (linear attn)",
    "fading": "fading delta (γ)",
    "rls": "exact RLS (γ)",
}
PUBLISHED_HEADLINE = {"priority_gain": 0.387, "ordinary_loss": 0.124, "gated_overall": 0.138, "delta_overall": 0.134}
TABLE_COLUMNS = ("d", "load", "N", "arm", "recall", "recall_se", "priority", "priority_se",
                 "ordinary", "ordinary_se", "fidelity")


@dataclass
class CapacityConfig:
    """Settings of the capacity study; the defaults are the reference protocol (docs/worked_examples.md §5).

    ``dims`` and ``loads`` are the protocol grid (the headline averages over
    ``dims`` at ``headline_load``); ``sweep_widths`` adds the widths of the exercise
    ("at least five state widths"), run on the same loads and arms.
    """

    root_seed: int = 0
    branch: str = field(default="heldout", metadata=flag(
        choices=BRANCHES, help="seed branch: the development branches dev1, dev2 or the held-out branch (default)"))
    eta: float = 0.20
    priority_rate: float = 0.25
    ordinary_gate: float = 0.10
    dims: Tuple[int, ...] = (8, 16, 32)
    loads: Tuple[float, ...] = (0.5, 1, 2, 4, 8)
    repetitions: int = field(default=30, metadata=flag(type=int, help="trials per cell (protocol: 30)"))
    headline_load: float = 8
    arms: Tuple[str, ...] = ARMS
    sweep_widths: Tuple[int, ...] = field(default=(4, 8, 16, 32, 64), metadata=flag(
        "--widths", type=int, nargs="+", parse=tuple, help="widths of the exercise's sweep (default 4 8 16 32 64; --full adds 128)"))
    softmax_scale: float = 1000.0
    gamma: float = field(default=0.995, metadata=flag(type=float, help="γ of the fading and RLS arms (default 0.995)"))
    ridge: float = 1e-6
    chunk_size: int = 64
    threads: Optional[int] = 1

    def __post_init__(self) -> None:
        if self.branch not in BRANCHES:
            raise ValueError(f"CapacityConfig: `branch` must be one of {', '.join(BRANCHES)}, got {self.branch!r}")
        check_int("CapacityConfig", "root_seed", self.root_seed, minimum=0, what="a non-negative int")
        if not 0 < self.eta <= 1:
            raise ValueError(f"CapacityConfig: `eta` must be in (0, 1], got {self.eta!r}")
        if not 0 < self.priority_rate < 1:
            raise ValueError(f"CapacityConfig: `priority_rate` must be in (0, 1), got {self.priority_rate!r}")
        if not 0 <= self.ordinary_gate <= 1:
            raise ValueError(f"CapacityConfig: `ordinary_gate` must be in [0, 1], got {self.ordinary_gate!r}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"CapacityConfig: `gamma` must be in (0, 1], got {self.gamma!r}")
        if self.repetitions < 2:
            raise ValueError(f"CapacityConfig: `repetitions` must be >= 2 (standard errors), got {self.repetitions!r}")
        for name in ("dims", "sweep_widths"):
            widths = getattr(self, name)
            if widths:
                check_ints("CapacityConfig", name, widths)
        if not self.dims:
            raise ValueError("CapacityConfig: `dims` must not be empty")
        if not self.loads or any(not load > 0 for load in self.loads):
            raise ValueError(f"CapacityConfig: `loads` must hold positive numbers, got {self.loads!r}")
        for d in self.widths:
            for load in self.loads:
                if int(round(load * d)) < 1:
                    raise ValueError(f"CapacityConfig: load {load} at width {d} stores no pair; raise `loads` or `dims`")
        if self.headline_load not in self.loads:
            raise ValueError(f"CapacityConfig: `headline_load` {self.headline_load!r} is not in `loads` {self.loads!r}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"CapacityConfig: unknown `arms` {unknown}; expected a subset of {ARMS}")
        if not {"delta", "selective"} <= set(self.arms):
            raise ValueError("CapacityConfig: `arms` must include 'delta' and 'selective' (the headline compares them)")

    @property
    def widths(self) -> Tuple[int, ...]:
        """Every width run: the protocol's ``dims`` and the exercise's ``sweep_widths``."""
        return tuple(sorted(set(self.dims) | set(self.sweep_widths)))

    @classmethod
    def full(cls, **overrides) -> "CapacityConfig":
        """The protocol plus a wider exercise: widths 4..128 and loads 0.25..16."""
        settings = dict(sweep_widths=(4, 8, 16, 32, 64, 128), loads=(0.25, 0.5, 1, 2, 4, 8, 16))
        settings.update(overrides)
        return cls(**settings)


# ---------------------------------------------------------------------------
# the one solver that is not an op: exact recursive least squares


def recursive_least_squares(
    keys: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    ridge: float = 1e-6,
    initial_state: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    return_covariance: bool = False,
):
    """Exact exponentially weighted least squares, one token at a time.

    Returns the state ``h_t = M_tᵀ`` (K×V, the layout of the ops) of

        M_t = argmin_M  Σ_{τ≤t} γ^{t−τ} |M k_τ − v_τ|²  +  λ γ^t |M|_F²

    after the last token, by the classical RLS recursion with the inverse
    covariance ``P_t = (Σ_τ γ^{t−τ} k_τ k_τᵀ + λγ^t I)⁻¹`` (Sherman–Morrison):

        g_t = P_{t−1} k_t / (γ + k_tᵀ P_{t−1} k_t)          gain
        h_t = h_{t−1} + g_t (v_t − h_{t−1}ᵀ k_t)ᵀ           the delta rule, with g_t for β k_t
        P_t = (P_{t−1} − g_t k_tᵀ P_{t−1}) / γ

    The update has the delta rule's shape; the covariance state P (K×K) is what
    turns its one gradient step into the exact minimizer (Wang, Shi & Fox 2025, solver 3).

    Args:
        keys: ``[B, T, K]``; values: ``[B, T, V]``; computed in float64.
        gamma: γ in (0, 1], the history weight; 1 is ordinary ridge regression.
        ridge: λ > 0, the initial ridge (P_0 = I/λ), decayed by γ^t as the data are.
        initial_state: ``(h [B, K, V], P [B, K, K])`` to resume from (as returned
            with ``return_covariance=True``); ``None`` starts from h = 0, P = I/λ.
        return_covariance: also return P, the rest of the solver's state.

    Returns:
        ``h [B, K, V]`` in float64, or ``(h, P)`` with ``return_covariance``.
    """
    if keys.dim() != 3 or values.dim() != 3 or keys.shape[:2] != values.shape[:2]:
        raise ValueError(f"recursive_least_squares: `keys` [B, T, K] and `values` [B, T, V] must agree in B, T; "
                         f"got {list(keys.shape)} and {list(values.shape)}")
    if not 0 < gamma <= 1:
        raise ValueError(f"recursive_least_squares: `gamma` must be in (0, 1], got {gamma!r}")
    if not ridge > 0:
        raise ValueError(f"recursive_least_squares: `ridge` must be > 0, got {ridge!r}")
    k = keys.to(torch.float64)
    v = values.to(torch.float64)
    b, t_len, dk = k.shape
    if initial_state is None:
        h = k.new_zeros(b, dk, v.shape[-1])
        p = torch.eye(dk, dtype=torch.float64).expand(b, dk, dk) / ridge
    else:
        h, p = (x.to(torch.float64) for x in initial_state)
        if h.shape != (b, dk, v.shape[-1]) or p.shape != (b, dk, dk):
            raise ValueError(f"recursive_least_squares: `initial_state` must be (h {[b, dk, v.shape[-1]]}, "
                             f"P {[b, dk, dk]}), got ({list(h.shape)}, {list(p.shape)})")
    for t in range(t_len):
        k_t = k[:, t]
        pk = torch.einsum("bij,bj->bi", p, k_t)  # P is symmetric: P k = (kᵀ P)ᵀ
        gain = pk / (gamma + (k_t * pk).sum(-1, keepdim=True))
        residual = v[:, t] - torch.einsum("bkv,bk->bv", h, k_t)
        h = h + gain[:, :, None] * residual[:, None, :]
        p = (p - gain[:, :, None] * pk[:, None, :]) / gamma
    return (h, p) if return_covariance else h


def weighted_least_squares(keys: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, ridge: float = 1e-6) -> torch.Tensor:
    """The same minimizer as :func:`recursive_least_squares`, by one direct solve (float64; for tests)."""
    k = keys.to(torch.float64)
    v = values.to(torch.float64)
    t_len, dk = k.shape[1], k.shape[2]
    w = gamma ** torch.arange(t_len - 1, -1, -1, dtype=torch.float64)  # γ^{t−τ}
    gram = torch.einsum("t,btk,btj->bkj", w, k, k) + ridge * gamma**t_len * torch.eye(dk, dtype=torch.float64)
    cross = torch.einsum("t,btk,btv->bkv", w, k, v)
    return torch.linalg.solve(gram, cross)  # h = Mᵀ = (Σ w k kᵀ + λγ^t I)⁻¹ Σ w k vᵀ


# ---------------------------------------------------------------------------
# one cell: R trials of N pairs at width d


def unit_vectors(shape: Sequence[int], generator: torch.Generator) -> torch.Tensor:
    """I.i.d. uniform on the unit sphere (normalized Gaussians), float64."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def draw_cell(config: CapacityConfig, d: int, load: float) -> Dict[str, torch.Tensor]:
    """The shared data of one (d, N/d) cell: keys, values (in write order) and priority bits."""
    n = int(round(load * d))
    gen = torch_generator(branch_seed_sequence(config.root_seed, config.branch, d, int(round(load * 1000))))
    r = config.repetitions
    keys = unit_vectors((r, n, d), gen)
    values = unit_vectors((r, n, d), gen)
    n_priority = max(1, int(round(config.priority_rate * n)))
    order = torch.rand(r, n, generator=gen, dtype=torch.float64).argsort(dim=1)
    priority = torch.zeros(r, n, dtype=torch.bool)
    priority.scatter_(1, order[:, :n_priority], True)
    return {"keys": keys, "values": values, "priority": priority}


def _write_then_read(keys: torch.Tensor, values: torch.Tensor):
    """Sequences of N writes then N reads of the same keys, ``[R, 2N, 1, d]``; reads write nothing."""
    zeros = torch.zeros_like(keys)
    q = torch.cat([keys, keys], dim=1)[:, :, None]
    k = torch.cat([keys, zeros], dim=1)[:, :, None]
    v = torch.cat([values, torch.zeros_like(values)], dim=1)[:, :, None]
    return q, k, v


def read_outs(arm: str, cell: Dict[str, torch.Tensor], config: CapacityConfig) -> torch.Tensor:
    """The read-out ``o [R, N, d]`` of every stored key under ``arm``, after all N writes."""
    keys, values, priority = cell["keys"], cell["values"], cell["priority"]
    r, n, _ = keys.shape
    q, k, v = _write_then_read(keys, values)

    def per_token(write: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, 2N, 1], zero on reads
        return torch.cat([write, torch.zeros_like(write)], dim=1)[:, :, None]

    eta = torch.full((r, n), config.eta, dtype=torch.float64)
    if arm == "softmax":
        o, _ = softmax_attn(q, k, v, scale=config.softmax_scale)
    elif arm == "delta":
        o, _ = chunk_delta_rule(q, k, v, per_token(eta), scale=1.0, chunk_size=config.chunk_size)
    elif arm == "selective":
        beta = torch.where(priority, eta, config.ordinary_gate * eta)
        o, _ = chunk_delta_rule(q, k, v, per_token(beta), scale=1.0, chunk_size=config.chunk_size)
    elif arm == "sum":
        o, _ = chunk_linear_attn(q, k, v, scale=1.0, chunk_size=config.chunk_size)
    elif arm == "fading":
        log_gamma = torch.full((r, n), math.log(config.gamma), dtype=torch.float64)
        o, _ = chunk_gated_delta_rule(q, k, v, per_token(log_gamma), per_token(eta), scale=1.0,
                                      chunk_size=config.chunk_size)
    elif arm == "rls":
        h = recursive_least_squares(keys, values, config.gamma, config.ridge)
        return torch.einsum("rkv,rnk->rnv", h, keys)
    else:
        raise ValueError(f"read_outs: unknown `arm` {arm!r}; expected one of {ARMS}")
    return o[:, n:, 0]


def decode(read: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the nearest stored value of each read-out: ``argmax_j o·v_j`` (unit values), ``[R, N]``."""
    return torch.einsum("rnv,rmv->rnm", read, values).argmax(dim=-1)


def score_cell(config: CapacityConfig, d: int, load: float, arms: Sequence[str]) -> Dict[str, Dict[str, np.ndarray]]:
    """Per-trial recall of each arm in one cell: ``{arm: {overall, priority, ordinary, fidelity}}`` of shape [R]."""
    cell = draw_cell(config, d, load)
    n = cell["keys"].shape[1]
    target = torch.arange(n)
    pri = cell["priority"]
    out = {}
    for arm in arms:
        read = read_outs(arm, cell, config)
        hit = (decode(read, cell["values"]) == target).to(torch.float64)
        cos = torch.nn.functional.cosine_similarity(read, cell["values"], dim=-1)
        out[arm] = {
            "overall": hit.mean(1).numpy(),
            "priority": ((hit * pri).sum(1) / pri.sum(1)).numpy(),
            "ordinary": ((hit * ~pri).sum(1) / (~pri).sum(1).clamp(min=1)).numpy(),
            "fidelity": cos.mean(1).numpy(),
        }
    return out


# ---------------------------------------------------------------------------
# the study


def run_capacity(config: Optional[CapacityConfig] = None, out_dir: Optional[str] = None, progress: bool = True,
                 plots: bool = True, resume: bool = False) -> Dict:
    """Run the capacity study; return its result and, with ``out_dir``, write its files.

    Files: ``capacity.json`` (config, headline beside the reference numbers, the full
    table, the width sweep), ``capacity.csv`` (the table), ``capacity_recall.png``
    (recall against N/d per protocol width, with the priority/ordinary split) and
    ``capacity_widths.png`` (the delta arm's recall against N and against N/d for
    every width). Each scored cell goes to ``capacity.partial.json`` first; ``resume``
    continues from it.
    """
    from tqdm.auto import tqdm

    config = CapacityConfig() if config is None else config
    start = time.perf_counter()
    cells = [(d, load) for d in config.widths for load in config.loads]
    scores: Dict[Tuple[int, float], Dict] = {}
    cache = CellCache(out_dir, "capacity", asdict(config), resume)
    as_arrays = lambda by_arm: {arm: {k: np.asarray(x) for k, x in s.items()} for arm, s in by_arm.items()}
    with torch_threads(config.threads):
        for d, load in tqdm(cells, desc="capacity", disable=not progress, leave=False):
            scores[(d, load)] = cache.get((d, load), lambda: score_cell(config, d, load, config.arms), as_arrays)

    table: List[Dict] = []
    for (d, load), by_arm in scores.items():
        for arm, s in by_arm.items():
            row = {"d": d, "load": float(load), "N": int(round(load * d)), "arm": arm}
            for name in ("overall", "priority", "ordinary"):
                ms = mean_se(s[name])
                key = "recall" if name == "overall" else name
                row[key], row[key + "_se"] = ms["mean"], ms["se"]
            row["fidelity"] = float(np.mean(s["fidelity"]))
            table.append(row)

    result = {
        "study": "capacity",
        "source": "recall under a fixed capacity (reference protocol: docs/worked_examples.md §5)",
        "config": {**asdict(config), "widths": list(config.widths)},
        "headline": headline(config, scores),
        "published_headline": dict(PUBLISHED_HEADLINE),
        "table": table,
        "width_sweep": width_sweep(config, scores),
        "runtime_s": None,
        "files": [],
    }
    return finish_study(result, start, cache, out_dir, "capacity", table, TABLE_COLUMNS, plot_capacity if plots else None)


def headline(config: CapacityConfig, scores) -> Dict[str, Dict[str, float]]:
    """The four headline numbers at N/d = ``headline_load``, averaged over ``dims``, with SEs over repetitions."""
    load = config.headline_load
    per_d = [scores[(d, load)] for d in config.dims]

    def d_average(f):  # per repetition: the mean over widths of f(cell)
        return np.mean([f(s) for s in per_d], axis=0)

    out = {
        "priority_gain": mean_se(d_average(lambda s: s["selective"]["priority"] - s["delta"]["priority"])),
        "ordinary_loss": mean_se(d_average(lambda s: s["delta"]["ordinary"] - s["selective"]["ordinary"])),
        "gated_overall": mean_se(d_average(lambda s: s["selective"]["overall"])),
        "delta_overall": mean_se(d_average(lambda s: s["delta"]["overall"])),
    }
    if "softmax" in config.arms:
        out["softmax_overall"] = mean_se(d_average(lambda s: s["softmax"]["overall"]))
    for name, ms in out.items():
        if name in PUBLISHED_HEADLINE:
            ms["published"] = PUBLISHED_HEADLINE[name]
            ms["difference"] = ms["mean"] - PUBLISHED_HEADLINE[name]
            ms["z"] = ms["difference"] / ms["se"] if ms["se"] > 0 else float("nan")
    out["load"] = float(load)
    out["dims"] = list(config.dims)
    out["branch"] = config.branch
    return out


def width_sweep(config: CapacityConfig, scores, arm: str = "delta") -> Dict:
    """The exercise: ``arm``'s recall per width and load, and how well the curves align.

    ``spread_at_load[load]`` is the range (max − min) of recall across widths at a
    fixed N/d; ``spread_at_n`` the same at a fixed N (for the N values that several
    widths share). Curves that align in N/d have a small spread at fixed load.
    """
    recall = {d: {float(load): float(np.mean(scores[(d, load)][arm]["overall"])) for load in config.loads}
              for d in config.widths}
    spread_load = {}
    for load in config.loads:
        vals = [recall[d][float(load)] for d in config.widths]
        spread_load[str(float(load))] = max(vals) - min(vals)
    by_n: Dict[int, List[float]] = {}
    for d in config.widths:
        for load in config.loads:
            by_n.setdefault(int(round(load * d)), []).append(recall[d][float(load)])
    spread_n = {str(n): max(v) - min(v) for n, v in sorted(by_n.items()) if len(v) > 1}
    return {
        "arm": arm,
        "widths": list(config.widths),
        "recall": {str(d): {str(k): v for k, v in r.items()} for d, r in recall.items()},
        "spread_at_load": spread_load,
        "spread_at_n": spread_n,
        "mean_spread_at_load": float(np.mean(list(spread_load.values()))),
        "mean_spread_at_n": float(np.mean(list(spread_n.values()))) if spread_n else float("nan"),
    }


def plot_capacity(result: Dict, out: Path) -> List[str]:
    """Draw ``capacity_recall.png`` and ``capacity_widths.png`` under ``out``."""
    plt = pyplot()
    cfg = result["config"]
    rows = result["table"]
    dims, arms = cfg["dims"], cfg["arms"]
    files = []

    def series(d, arm, key):
        pts = sorted((r["load"], r[key], r[key + "_se"]) for r in rows if r["d"] == d and r["arm"] == arm)
        return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]

    fig, axes = plt.subplots(2, len(dims), figsize=(3.6 * len(dims), 6.4), sharey=True, squeeze=False)
    for j, d in enumerate(dims):
        ax = axes[0, j]
        for arm in arms:
            x, y, e = series(d, arm, "recall")
            ax.errorbar(x, y, yerr=e, marker="o", ms=3, lw=1.2, capsize=2, label=ARM_LABELS[arm])
        ax.set_xscale("log", base=2)
        ax.set_title(f"d = {d}")
        ax.set_xlabel("load N/d")
        ax.grid(alpha=0.3)
        ax = axes[1, j]
        for arm, style in (("delta", "-"), ("selective", "--")):
            for key, color in (("priority", "C3"), ("ordinary", "C0")):
                x, y, e = series(d, arm, key)
                ax.errorbar(x, y, yerr=e, ls=style, color=color, marker="o", ms=3, lw=1.2, capsize=2,
                            label=f"{ARM_LABELS[arm]}: {key}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("load N/d")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("top-1 recall (all pairs)")
    axes[1, 0].set_ylabel("top-1 recall by pair kind")
    axes[0, -1].legend(fontsize=7, loc="lower left")
    axes[1, -1].legend(fontsize=7, loc="lower left")
    h = result["headline"]
    fig.suptitle(f"Recall under a fixed capacity ({cfg['branch']} branch, root seed {cfg['root_seed']}, "
                 f"{cfg['repetitions']} reps); at N/d={h['load']:g}: priority gain {h['priority_gain']['mean']:+.3f}, "
                 f"ordinary loss {h['ordinary_loss']['mean']:.3f}", fontsize=9)
    files.append(save_figure(fig, out / "capacity_recall.png", dpi=80))

    sweep = result["width_sweep"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for i, d in enumerate(sweep["widths"]):
        pts = sorted((float(load), r) for load, r in sweep["recall"][str(d)].items())
        x = [p[0] for p in pts]
        y = [p[1] for p in pts]
        color = plt.cm.viridis(i / max(1, len(sweep["widths"]) - 1))
        axes[0].plot([load * d for load in x], y, marker="o", ms=3, color=color, label=f"d = {d}")
        axes[1].plot(x, y, marker="o", ms=3, color=color, label=f"d = {d}")
    axes[0].set_xscale("log", base=2)
    axes[1].set_xscale("log", base=2)
    axes[0].set_xlabel("pairs stored N")
    axes[1].set_xlabel("load N/d")
    axes[0].set_ylabel(f"top-1 recall, {ARM_LABELS[sweep['arm']]}")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"Width sweep: recall follows N/d far more closely than N (mean spread across widths "
                 f"{sweep['mean_spread_at_load']:.3f} at fixed N/d, {sweep['mean_spread_at_n']:.3f} at fixed N)", fontsize=9)
    files.append(save_figure(fig, out / "capacity_widths.png", dpi=80))
    return files


def report(result: Dict) -> str:
    """The printed summary: the headline beside the reference numbers, then the protocol table."""
    h = result["headline"]
    cfg = result["config"]
    lines = [f"capacity study: reference protocol, branch {cfg['branch']}, root seed {cfg['root_seed']}, "
             f"{cfg['repetitions']} repetitions, η={cfg['eta']}, gate {cfg['ordinary_gate']}, "
             f"priority rate {cfg['priority_rate']}"]
    rows = []
    for name in ("priority_gain", "ordinary_loss", "gated_overall", "delta_overall", "softmax_overall"):
        if name in h:
            rows.append({"quantity": name, "ours": h[name]["mean"], "se": h[name]["se"],
                         "reference": h[name].get("published"), "z": h[name].get("z")})
    lines.append(format_table(rows, ("quantity", "ours", "se", "reference", "z"),
                              title=f"headline at N/d = {h['load']:g}, averaged over d in {h['dims']}"))
    proto = [r for r in result["table"] if r["d"] in cfg["dims"]]
    lines.append("")
    lines.append(format_table(proto, ("d", "load", "N", "arm", "recall", "priority", "ordinary", "fidelity"),
                              title="top-1 recall per cell (mean over repetitions)"))
    sweep = result["width_sweep"]
    lines.append("")
    lines.append(f"width sweep ({sweep['arm']} arm, widths {sweep['widths']}): mean spread of recall across widths "
                 f"{sweep['mean_spread_at_load']:.3f} at fixed N/d vs {sweep['mean_spread_at_n']:.3f} at fixed N")
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study capacity``)

HELP = "recall under a fixed capacity (sealed protocol, more arms, width sweep)"
Config = CapacityConfig
run = run_capacity
add_arguments, config_from_args = study_command(CapacityConfig, order=("branch", "repetitions", "gamma"))
