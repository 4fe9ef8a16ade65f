"""What each memory keeps and what it costs: the per-solver audit, and the memory calculator.

Two parts.

**Per-solver audit** (the solver families of Wang, Shi & Fox 2025: "retained state and per-token work",
and the exercise "for each solver in the cost diagram, record state size, update
cost, query cost, and information that cannot be reconstructed"). For one head
with key width K, value width V (feature width D = K for the identity map) and a
context of T tokens, predicted by formula and measured on the ops:

=================  ===================  ======================  =====================
solver             state (numbers)      update (FLOPs/token)    query (FLOPs/token)
=================  ===================  ======================  =====================
softmax (KV)       T·(K + V)            0 (append one row)      2·T·(K + V) + 3·T  (grows)
linear (sum rule)  D·(V + 1)            2·D·(V + 1)             2·D·(V + 1) + V
delta rule         K·V                  4·K·V + 2·V             2·K·V
gated delta        K·V                  5·K·V + 2·V             2·K·V
exact RLS (γ)      K·V + K²             5·K² + 4·K·V + 3·K      2·K·V
=================  ===================  ======================  =====================

(a multiply-add counts 2 FLOPs; the softmax query counts the scores q·K (2·T·K),
max-subtract/exp/normalise (3·T) and the value read p·V (2·T·V); linear attention carries its normalizer as an extra value
column, as ``fastweights.ops`` does; RLS keeps the covariance P beside the map.)

Measured: the bytes of the state an op returns after prefilling T tokens
(``KVCache.nbytes`` for softmax, the state tensor otherwise; RLS in float64), and
the median wall time of one decode step (one write and one read of a single token,
``recurrent_*`` ops with the carried state; ``softmax_attn`` with the KV cache)
at each context length. Times are noisy on a shared machine; the table also gives
each step's time as a ratio to the delta rule's step measured in the same run. At
K = V = 64 a fixed-state step is ~10⁴ FLOPs, far below what a torch op call costs,
so the times measure op overhead, not work: the figure plots per-token FLOPs.

**Calculator** ("the calculator's runaway bar becomes a flat
line"): for a model config (layers, heads, head dims, dtypes) the memory one
session holds against context length: a softmax model's KV cache,
``layers · heads · T · (d_k + d_v) · bytes(kv dtype)``, against a fixed-state model,
``layers · heads · d_k · d_v · bytes(state dtype)`` whatever T, and optionally a
hybrid that keeps some softmax layers. The state dtype defaults to the KV cache's,
so the two are compared at the same precision (``--state-dtype float32`` is what
fastweights' ops keep). With ``weights`` the model's weights (:func:`model_weight_params`,
in ``weight_dtype``, default the KV cache's) are counted once per device, and the
sessions that fit are those of the budget left after them. The formula is checked against the
measured cache of :class:`fastweights.models.LM` (every mixer, a small config),
which also holds the short-convolution states and the per-sequence lengths.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..config import check_int, check_ints, flag
from ..ops import (
    KVCache,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_linear_attn,
    recurrent_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_linear_attn,
    softmax_attn,
)
from ._report import CellCache, branch_seed_sequence, finish_study, format_table, pyplot, save_figure, study_command, torch_generator, torch_threads
from .capacity import recursive_least_squares

SOLVERS = ("softmax", "linear", "delta", "gated_delta", "rls")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
LOST = {
    "softmax": "nothing within the context: every key-value row is kept (a read is still a convex mixture)",
    "linear": "the individual rows: only the factorized kernel's sums (S, z) remain; collisions cannot be undone",
    "delta": "associations overwritten or erased by later writes along overlapping keys; the write history",
    "gated_delta": "as the delta rule, plus whatever the decays α_t have faded",
    "rls": "the individual rows: it keeps the exact weighted least-squares fit and its covariance, not the data",
}
FORMULAS = {
    "softmax": ("T·(K+V)", "0 (append a row)", "2·T·(K+V) + 3·T"),
    "linear": ("D·(V+1)", "2·D·(V+1)", "2·D·(V+1) + V"),
    "delta": ("K·V", "4·K·V + 2·V", "2·K·V"),
    "gated_delta": ("K·V", "5·K·V + 2·V", "2·K·V"),
    "rls": ("K·V + K²", "5·K² + 4·K·V + 3·K", "2·K·V"),
}
TABLE_COLUMNS = ("solver", "context", "state_numbers", "state_bytes_predicted", "state_bytes_measured",
                 "update_flops", "query_flops", "step_us", "step_vs_delta", "prefill_us_per_token")


@dataclass
class CostsConfig:
    """Sizes of the audit (one head) and of the calculator's model.

    Audit: ``key_dim``/``value_dim`` per head, the context lengths, timing repeats.
    Calculator: ``layers``, ``heads``, ``head_dim_k``/``head_dim_v``, the KV-cache
    dtype ``kv_dtype``, the fixed state's ``state_dtype`` (None: the KV cache's, so
    both are compared at one precision; fastweights' ops keep states in fp32),
    ``softmax_layers`` of a hybrid (0: no hybrid line), the context lengths and a
    memory budget to count sessions against. ``weights``: also count the model's
    weights (``d_model`` default heads·head_dim_k, ``d_ff`` default the SwiGLU
    width 8/3·d_model rounded up to 256, ``vocab_size``, ``tied_embeddings``,
    ``weight_dtype`` default the KV cache's), held once and taken off the budget.
    """

    root_seed: int = 0
    key_dim: int = 64
    value_dim: int = 64
    contexts: Tuple[int, ...] = (256, 1024, 4096)
    repeats: int = 30
    gamma: float = 0.995
    layers: int = field(default=32, metadata=flag(type=int, help="calculator: layers (default 32)"))
    heads: int = field(default=32, metadata=flag(type=int, help="calculator: heads per layer (default 32)"))
    head_dim_k: int = field(default=128, metadata=flag("--head-dim", type=int, help="calculator: d_k = d_v per head (default 128)"))
    head_dim_v: int = field(default=128, metadata=flag(
        "--value-dim", type=int, parse=lambda v: v or None, default_from="head_dim_k",
        help="calculator: d_v if it differs from d_k"))
    kv_dtype: str = field(default="bfloat16", metadata=flag("--dtype", choices=sorted(DTYPE_BYTES), help="calculator: KV-cache dtype"))
    state_dtype: Optional[str] = field(default=None, metadata=flag(
        choices=sorted(DTYPE_BYTES), help="calculator: fixed-state dtype (default: the KV cache's, to compare at one precision; "
                                       "fastweights' ops keep float32)"))
    softmax_layers: int = field(default=4, metadata=flag(type=int, help="calculator: softmax layers of the hybrid (0: none)"))
    calc_contexts: Tuple[int, ...] = tuple(2**p for p in range(10, 21))
    budget_gib: float = field(default=80.0, metadata=flag(
        type=float, help="calculator: memory (GiB) to count sessions against"))
    weights: bool = field(default=False, metadata=flag(
        action="store_true", help="calculator: count the model's weights (once per device) against the budget"))
    d_model: Optional[int] = field(default=None, metadata=flag(
        type=int, help="calculator, --weights: d_model (default heads × head dim)"))
    d_ff: Optional[int] = field(default=None, metadata=flag(
        type=int, help="calculator, --weights: MLP width (default SwiGLU 8/3·d_model)"))
    vocab_size: int = field(default=32000, metadata=flag(
        type=int, help="calculator, --weights: vocabulary (default 32000)"))
    tied_embeddings: bool = False
    weight_dtype: Optional[str] = field(default=None, metadata=flag(
        choices=sorted(DTYPE_BYTES), help="calculator, --weights: dtype of the weights (default: the KV cache's)"))
    check_lm: bool = True
    threads: Optional[int] = 1

    def __post_init__(self) -> None:
        if self.state_dtype is None:
            self.state_dtype = self.kv_dtype
        if self.weight_dtype is None:
            self.weight_dtype = self.kv_dtype
        if self.d_model is None:
            self.d_model = self.heads * self.head_dim_k
        if self.d_ff is None:
            self.d_ff = swiglu_width(self.d_model) if isinstance(self.d_model, int) else self.d_model
        for name in ("key_dim", "value_dim", "repeats", "layers", "heads", "head_dim_k", "head_dim_v", "d_model",
                     "d_ff", "vocab_size"):
            value = getattr(self, name)
            check_int("CostsConfig", name, value)
        for name in ("contexts", "calc_contexts"):
            values = getattr(self, name)
            check_ints("CostsConfig", name, values)
        for name in ("kv_dtype", "state_dtype", "weight_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"CostsConfig: `{name}` must be one of {', '.join(DTYPE_BYTES)}, got {getattr(self, name)!r}")
        if not 0 <= self.softmax_layers <= self.layers:
            raise ValueError(f"CostsConfig: `softmax_layers` must be in [0, layers={self.layers}], got {self.softmax_layers!r}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"CostsConfig: `gamma` must be in (0, 1], got {self.gamma!r}")
        if not self.budget_gib > 0:
            raise ValueError(f"CostsConfig: `budget_gib` must be > 0, got {self.budget_gib!r}")

    @classmethod
    def full(cls, **overrides) -> "CostsConfig":
        """Longer contexts (to 16K) and more timing repeats."""
        settings = dict(contexts=(256, 1024, 4096, 16384), repeats=100)
        settings.update(overrides)
        return cls(**settings)


# ---------------------------------------------------------------------------
# formulas


def predicted_state_numbers(solver: str, context: int, key_dim: int, value_dim: int) -> int:
    """Numbers one head keeps after ``context`` tokens (table in the module docstring)."""
    k, v, t = key_dim, value_dim, context
    return {
        "softmax": t * (k + v),
        "linear": k * (v + 1),
        "delta": k * v,
        "gated_delta": k * v,
        "rls": k * v + k * k,
    }[solver]


def predicted_flops(solver: str, context: int, key_dim: int, value_dim: int) -> Tuple[int, int]:
    """(update, query) FLOPs of one token for one head at ``context`` tokens."""
    k, v, t = key_dim, value_dim, context
    return {
        "softmax": (0, 2 * t * k + 3 * t + 2 * t * v),   # scores q·K, softmax, value read p·V
        "linear": (2 * k * (v + 1), 2 * k * (v + 1) + v),
        "delta": (4 * k * v + 2 * v, 2 * k * v),
        "gated_delta": (5 * k * v + 2 * v, 2 * k * v),
        "rls": (5 * k * k + 4 * k * v + 3 * k, 2 * k * v),
    }[solver]


def _element_bytes(solver: str, dtype: torch.dtype) -> int:
    return 8 if solver == "rls" else torch.tensor([], dtype=dtype).element_size()


def predicted_state_bytes(solver: str, context: int, key_dim: int, value_dim: int, heads: int = 1, batch: int = 1,
                          dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the state an op returns (softmax adds the cache's int64 length per sequence)."""
    numbers = predicted_state_numbers(solver, context, key_dim, value_dim) * heads * batch
    extra = 8 * batch if solver == "softmax" else 0
    return numbers * _element_bytes(solver, dtype) + extra


def swiglu_width(d_model: int) -> int:
    """The SwiGLU MLP width of LLaMA-style models: 8/3·d_model rounded up to a multiple of 256."""
    return -(-(8 * d_model) // (3 * 256)) * 256


def model_weight_params(layers: int, heads: int, head_dim_k: int, head_dim_v: int, d_model: int, d_ff: int,
                        vocab_size: int, tied_embeddings: bool = False) -> int:
    """Parameters of a LLaMA-style decoder: per layer the projections q, k (d_model → heads·head_dim_k), v
    (→ heads·head_dim_v) and o (heads·head_dim_v → d_model), a SwiGLU MLP (3·d_model·d_ff) and two norm
    gains (2·d_model); the token embedding and the output head (vocab_size·d_model each, one if tied) and
    the final norm (d_model). A fixed-state layer's extra projections (β, gates, short convolutions) are
    left out: at d_model = 4096 with 32 heads they add about 0.1% (β: d_model·heads per layer)."""
    attention = d_model * heads * (2 * head_dim_k + head_dim_v) + heads * head_dim_v * d_model
    per_layer = attention + 3 * d_model * d_ff + 2 * d_model
    return layers * per_layer + (1 if tied_embeddings else 2) * vocab_size * d_model + d_model


def memory_per_session(context: int, layers: int, heads: int, head_dim_k: int, head_dim_v: int,
                       kv_dtype: str = "bfloat16", state_dtype: Optional[str] = None,
                       softmax_layers: int = 0) -> Dict[str, int]:
    """The memory calculator: bytes one session holds at ``context`` tokens.

    ``softmax``: every layer keeps a KV cache; ``fixed_state``: every layer keeps one
    ``d_k × d_v`` matrix per head; ``hybrid``: ``softmax_layers`` KV-cache layers and
    fixed states elsewhere. ``state_dtype`` None: the KV cache's dtype.
    """
    state_dtype = kv_dtype if state_dtype is None else state_dtype
    kv_layer = heads * context * (head_dim_k + head_dim_v) * DTYPE_BYTES[kv_dtype]
    state_layer = heads * head_dim_k * head_dim_v * DTYPE_BYTES[state_dtype]
    return {
        "softmax": layers * kv_layer,
        "fixed_state": layers * state_layer,
        "hybrid": softmax_layers * kv_layer + (layers - softmax_layers) * state_layer,
    }


def crossover_context(head_dim_k: int, head_dim_v: int, kv_dtype: str, state_dtype: Optional[str] = None) -> float:
    """The context at which a layer's KV cache equals its fixed state in bytes."""
    state_dtype = kv_dtype if state_dtype is None else state_dtype
    return head_dim_k * head_dim_v * DTYPE_BYTES[state_dtype] / ((head_dim_k + head_dim_v) * DTYPE_BYTES[kv_dtype])


def weight_params(config: "CostsConfig") -> int:
    """:func:`model_weight_params` of the calculator's model."""
    return model_weight_params(config.layers, config.heads, config.head_dim_k, config.head_dim_v, config.d_model,
                               config.d_ff, config.vocab_size, config.tied_embeddings)


def weight_bytes(config: "CostsConfig") -> int:
    """Bytes of the model's weights if ``config.weights`` (else 0)."""
    return DTYPE_BYTES[config.weight_dtype] * weight_params(config) if config.weights else 0


def calculator_row(config: "CostsConfig", context: int) -> Dict[str, int]:
    """One row of the calculator: bytes per session and sessions that fit in ``budget_gib`` (less the
    weights when they are counted), at ``context``."""
    mem = memory_per_session(context, config.layers, config.heads, config.head_dim_k, config.head_dim_v,
                             config.kv_dtype, config.state_dtype, config.softmax_layers)
    budget = max(0.0, config.budget_gib * 2**30 - weight_bytes(config))
    return {"context": context, **{f"{k}_bytes": v for k, v in mem.items()},
            **{f"{k}_sessions": int(budget // v) for k, v in mem.items()}}


def calculator(config: "CostsConfig") -> Dict:
    """The calculator part of the study (its ``result["calculator"]``): the model, crossover and one row per
    context of ``calc_contexts``. ``fastweights lab`` serves the same function."""
    return {
        "model": {k: getattr(config, k) for k in ("layers", "heads", "head_dim_k", "head_dim_v", "kv_dtype",
                                                  "state_dtype", "softmax_layers", "weights", "d_model", "d_ff",
                                                  "vocab_size", "tied_embeddings", "weight_dtype")},
        "weight_params": weight_params(config),
        "weight_bytes": weight_bytes(config),
        "crossover_context": crossover_context(config.head_dim_k, config.head_dim_v, config.kv_dtype,
                                               config.state_dtype),
        "budget_gib": config.budget_gib,
        "rows": [calculator_row(config, t) for t in config.calc_contexts],
    }


def predicted_lm_cache_bytes(config, batch: int, context: int) -> int:
    """Bytes of a :class:`~fastweights.models.LMCache` after ``context`` tokens (fp32 model)."""
    hd = config.d_model // config.n_heads
    total = 0
    for mixer in config.mixers:
        if mixer == "softmax":
            total += 2 * batch * config.n_heads * context * hd * 4 + 8 * batch
            continue
        extra_column = 1 if (mixer == "linear" and config.normalize) else 0
        total += batch * config.n_heads * hd * (hd + extra_column) * 4
        if mixer == "rwkv7":  # no short convolution: the token shift keeps the last token
            total += batch * config.d_model * 4
        elif config.use_short_conv:
            total += batch * (config.conv_size - 1) * 3 * config.d_model * 4
    return total


# ---------------------------------------------------------------------------
# measurements


def _nbytes(state) -> int:
    if isinstance(state, KVCache):
        return state.nbytes
    if isinstance(state, tuple):
        return sum(t.numel() * t.element_size() for t in state)
    return state.numel() * state.element_size()


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_solver(solver: str, context: int, key_dim: int, value_dim: int, repeats: int, gamma: float,
                   generator: torch.Generator) -> Dict[str, float]:
    """Prefill ``context`` tokens, then time one decode step; state bytes and times (s)."""
    b, h = 1, 1
    q, k = (torch.nn.functional.normalize(torch.randn(b, context + 1, h, key_dim, generator=generator), dim=-1)
            for _ in range(2))
    v = torch.randn(b, context + 1, h, value_dim, generator=generator)
    beta = torch.full((b, context + 1, h), 0.5)
    g = torch.full((b, context + 1, h), math.log(gamma))
    pre = slice(0, context)
    last = slice(context, context + 1)

    if solver == "softmax":
        def prefill():
            return softmax_attn(q[:, pre], k[:, pre], v[:, pre], output_final_state=True)[1]
        state = prefill()
        step = lambda: softmax_attn(q[:, last], k[:, last], v[:, last], initial_state=state, output_final_state=True)
    elif solver == "linear":
        def prefill():
            return chunk_linear_attn(q[:, pre], k[:, pre], v[:, pre], feature_map="elu", normalize=True,
                                     output_final_state=True)[1]
        state = prefill()
        step = lambda: recurrent_linear_attn(q[:, last], k[:, last], v[:, last], feature_map="elu", normalize=True,
                                             initial_state=state, output_final_state=True)
    elif solver == "delta":
        def prefill():
            return chunk_delta_rule(q[:, pre], k[:, pre], v[:, pre], beta[:, pre], output_final_state=True)[1]
        state = prefill()
        step = lambda: recurrent_delta_rule(q[:, last], k[:, last], v[:, last], beta[:, last], initial_state=state,
                                            output_final_state=True)
    elif solver == "gated_delta":
        def prefill():
            return chunk_gated_delta_rule(q[:, pre], k[:, pre], v[:, pre], g[:, pre], beta[:, pre],
                                          output_final_state=True)[1]
        state = prefill()
        step = lambda: recurrent_gated_delta_rule(q[:, last], k[:, last], v[:, last], g[:, last], beta[:, last],
                                                  initial_state=state, output_final_state=True)
    elif solver == "rls":
        kk, vv = k[:, :, 0], v[:, :, 0]

        def prefill():
            return recursive_least_squares(kk[:, pre], vv[:, pre], gamma, 1e-3, return_covariance=True)
        state = prefill()
        read_q = q[:, context, 0].to(torch.float64)  # [B, K]

        def step():
            hh, pp = recursive_least_squares(kk[:, last], vv[:, last], gamma, 1e-3, initial_state=state,
                                             return_covariance=True)
            return torch.einsum("bkv,bk->bv", hh, read_q), (hh, pp)
    else:
        raise ValueError(f"measure_solver: unknown `solver` {solver!r}; expected one of {SOLVERS}")

    prefill_s = _median_time(prefill, max(1, min(3, repeats)))
    return {
        "state_bytes": _nbytes(state),
        "step_s": _median_time(step, repeats),
        "prefill_s_per_token": prefill_s / context,
    }


def check_lm_calculator(contexts: Sequence[int] = (16, 64)) -> List[Dict]:
    """The calculator's formula against :class:`~fastweights.models.LM`'s measured cache, every mixer."""
    from ..layers import MIXERS
    from ..models import LM, LMConfig

    rows = []
    gen = torch.Generator().manual_seed(0)
    for mixer in MIXERS:
        config = LMConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, mixer=mixer)
        model = LM(config).eval()
        for t in contexts:
            with torch.no_grad():
                _, cache = model(torch.randint(0, 32, (2, t), generator=gen))
            rows.append({"mixer": mixer, "context": t, "predicted": predicted_lm_cache_bytes(config, 2, t),
                         "measured": cache.nbytes})
    return rows


# ---------------------------------------------------------------------------
# the study


def run_costs(config: Optional[CostsConfig] = None, out_dir: Optional[str] = None, progress: bool = True,
              plots: bool = True, resume: bool = False) -> Dict:
    """Run the audit and the calculator; with ``out_dir`` write ``costs.json``, ``costs.csv`` and the plots
    ``costs_solver_map.png`` (state and step time against context, per solver) and
    ``costs_calculator.png`` (memory per session against context)."""
    from tqdm.auto import tqdm

    config = CostsConfig() if config is None else config
    start = time.perf_counter()
    gen = torch_generator(branch_seed_sequence(config.root_seed, "dev1", 2))
    table: List[Dict] = []
    jobs = [(s, t) for t in config.contexts for s in SOLVERS]
    measured = {}
    cache = CellCache(out_dir, "costs", asdict(config), resume)  # each measurement saved as it finishes
    with torch_threads(config.threads):
        threads_used = torch.get_num_threads()
        for solver, t in tqdm(jobs, desc="costs", disable=not progress, leave=False):
            measured[(solver, t)] = cache.get((solver, t), lambda: measure_solver(
                solver, t, config.key_dim, config.value_dim, config.repeats, config.gamma, gen))
    for solver, t in jobs:
        m = measured[(solver, t)]
        update, query = predicted_flops(solver, t, config.key_dim, config.value_dim)
        table.append({
            "solver": solver, "context": t,
            "state_numbers": predicted_state_numbers(solver, t, config.key_dim, config.value_dim),
            "state_bytes_predicted": predicted_state_bytes(solver, t, config.key_dim, config.value_dim),
            "state_bytes_measured": m["state_bytes"],
            "update_flops": update, "query_flops": query,
            "step_us": 1e6 * m["step_s"], "prefill_us_per_token": 1e6 * m["prefill_s_per_token"],
        })
    for row in table:
        delta = next(r for r in table if r["solver"] == "delta" and r["context"] == row["context"])
        row["step_vs_delta"] = row["step_us"] / delta["step_us"]

    k, v = config.key_dim, config.value_dim
    result = {
        "study": "costs",
        "source": "the per-solver audit exercise; memory calculator",
        "config": asdict(config),
        "threads": threads_used,
        "formulas": {s: dict(zip(("state", "update", "query"), f)) for s, f in FORMULAS.items()},
        "cannot_reconstruct": dict(LOST),
        "matched": {
            "storage_matched_context": predicted_state_numbers("delta", 0, k, v) / (k + v),
            "compute_matched_context": (sum(predicted_flops("delta", 0, k, v))) / (2 * (k + v) + 3),
            "note": ("a softmax head holds as many numbers as a K×V fixed state after storage_matched_context "
                     "tokens, and its per-token query costs as much as a delta step (update + query) at "
                     "compute_matched_context tokens; a matched test compares memories at equal state size "
                     "(storage) or equal per-token FLOPs (compute), not both at once"),
        },
        "table": table,
        "state_bytes_exact": all(r["state_bytes_predicted"] == r["state_bytes_measured"] for r in table),
        "calculator": calculator(config),
        "files": [],
    }
    if config.check_lm:
        rows = check_lm_calculator()
        result["lm_check"] = {"rows": rows, "exact": all(r["predicted"] == r["measured"] for r in rows)}
    return finish_study(result, start, cache, out_dir, "costs", table, TABLE_COLUMNS, plot_costs if plots else None)


# Distinct marker, line style and size per solver: solvers whose curves coincide (delta and gated delta
# keep the same K·V state; linear's D·(V+1) is 1.6% above it) stay visible one above the other.
STYLE = {
    "softmax": dict(marker="o", ls="-", ms=6),
    "linear": dict(marker="s", ls="-", ms=9, mfc="none"),
    "delta": dict(marker="^", ls="--", ms=7),
    "gated_delta": dict(marker="x", ls=":", ms=9, mew=2),
    "rls": dict(marker="D", ls="-", ms=5),
}
JITTER = {"softmax": 1.0, "linear": 0.88, "delta": 0.94, "gated_delta": 1.06, "rls": 1.12}


def _label_line_ends(ax, ends: Dict[str, float], fmt) -> None:
    """Name the solvers at the right end of their curves (log y axis), one label per group of equal values,
    pushed apart vertically where they would overlap, so coinciding curves are named, not hidden."""
    groups: List[Tuple[float, List[str]]] = []
    for solver, y in sorted(ends.items(), key=lambda kv: kv[1]):
        if groups and y <= groups[-1][0] * 1.0001:
            groups[-1][1].append(solver)
        else:
            groups.append((y, [solver]))
    lo, hi = (math.log10(x) for x in ax.get_ylim())
    placed: List[float] = []
    for y, names in groups:
        frac = (math.log10(y) - lo) / (hi - lo)
        if placed and frac < placed[-1] + 0.06:
            frac = placed[-1] + 0.06
        placed.append(frac)
        ax.annotate(", ".join(names) + f": {fmt(y)}", xy=(1.0, (math.log10(y) - lo) / (hi - lo)),
                    xycoords="axes fraction", xytext=(1.02, frac), textcoords="axes fraction", va="center",
                    fontsize=7, arrowprops=dict(arrowstyle="-", lw=0.5, color="gray"))


def plot_costs(result: Dict, out: Path) -> List[str]:
    """``costs_solver_map.png``: state bytes (formula lines, measured markers) and per-token FLOPs (formula)
    against context; ``costs_calculator.png``: memory per session against context."""
    plt = pyplot()
    files = []
    table = result["table"]
    cfg = result["config"]
    k, v = cfg["key_dim"], cfg["value_dim"]
    measured_t = sorted({r["context"] for r in table})
    dense = [2**p for p in range(4, int(math.log2(max(measured_t))) + 3)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    state_ends, flop_ends = {}, {}
    for i, solver in enumerate(SOLVERS):
        style = dict(STYLE[solver], color=f"C{i}")
        marker_style = {key: val for key, val in style.items() if key != "ls"}
        rows = sorted((r for r in table if r["solver"] == solver), key=lambda r: r["context"])
        axes[0].plot(dense, [predicted_state_bytes(solver, t, k, v) for t in dense], ls=style["ls"], color=style["color"],
                     lw=1.2, label=f"{solver}: {FORMULAS[solver][0]}")
        # measured markers shifted sideways per solver (×0.88 … ×1.12), so equal states do not hide each other
        axes[0].plot([r["context"] * JITTER[solver] for r in rows], [r["state_bytes_measured"] for r in rows],
                     ls="none", **marker_style)
        flops = [sum(predicted_flops(solver, t, k, v)) for t in dense]
        axes[1].plot(dense, flops, lw=1.2, markevery=2, label=f"{solver}: {FORMULAS[solver][1]} + {FORMULAS[solver][2]}",
                     **style)
        state_ends[solver] = predicted_state_bytes(solver, dense[-1], k, v)
        flop_ends[solver] = flops[-1]
    for ax, ylabel in zip(axes, ("state bytes after T tokens (one head; fp32, RLS fp64)",
                                 "FLOPs per token: update + query (one head)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context T (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    _label_line_ends(axes[0], state_ends, _human)
    _label_line_ends(axes[1], flop_ends, lambda x: f"{x:.3g}")
    axes[0].set_title("lines: formula; markers: measured (shifted sideways)", fontsize=9)
    axes[1].set_title("formula; a multiply-add is 2 FLOPs", fontsize=9)
    fig.suptitle(f"Retained state and per-token work per solver, K = V = {k}", fontsize=10)
    fig.subplots_adjust(wspace=0.55, right=0.86)
    files.append(save_figure(fig, out / "costs_solver_map.png", dpi=80))

    calc = result["calculator"]
    m = calc["model"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    t = [r["context"] for r in calc["rows"]]
    gib = 2.0**30
    ax.plot(t, [r["softmax_bytes"] / gib for r in calc["rows"]], marker="o", label=f"softmax (KV cache, {m['kv_dtype']})")
    ax.plot(t, [r["fixed_state_bytes"] / gib for r in calc["rows"]], marker="o", label=f"fixed state ({m['state_dtype']})")
    if m["softmax_layers"]:
        ax.plot(t, [r["hybrid_bytes"] / gib for r in calc["rows"]], marker="o",
                label=f"hybrid: {m['softmax_layers']} softmax layers of {m['layers']}")
    ax.axhline(calc["budget_gib"], color="gray", ls="--", lw=1, label=f"{calc['budget_gib']:g} GiB budget")
    if m.get("weights"):
        ax.axhline(calc["weight_bytes"] / gib, color="black", ls=":", lw=1,
                   label=f"weights, once per device ({calc['weight_params'] / 1e9:.2f} B params, {m['weight_dtype']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("memory per session (GiB)")
    ax.set_title(f"{m['layers']} layers × {m['heads']} heads, d_k = d_v = {m['head_dim_k']}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    files.append(save_figure(fig, out / "costs_calculator.png", dpi=80))
    return files


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def report(result: Dict) -> str:
    cfg = result["config"]
    lines = [f"costs study: one head, K = {cfg['key_dim']}, V = {cfg['value_dim']}, fp32 (RLS fp64), CPU, "
             f"{result['threads']} thread(s), median of {cfg['repeats']} decode steps"]
    rows = [{"solver": s, "state": f[0], "update FLOPs": f[1], "query FLOPs": f[2]} for s, f in FORMULAS.items()]
    lines.append(format_table(rows, ("solver", "state", "update FLOPs", "query FLOPs"), title="formulas"))
    lines.append("")
    lines.append(format_table(
        [dict(r, state_pred=_human(r["state_bytes_predicted"]), state_meas=_human(r["state_bytes_measured"]))
         for r in result["table"]],
        ("solver", "context", "state_pred", "state_meas", "update_flops", "query_flops", "step_us", "step_vs_delta",
         "prefill_us_per_token"),
        floatfmt=".2f", title="predicted and measured (state bytes after T tokens; time per decode step)"))
    lines.append(f"state bytes: formula == measured for every row: {result['state_bytes_exact']}")
    mt = result["matched"]
    lines.append(f"storage-matched context {mt['storage_matched_context']:.0f} tokens; "
                 f"compute-matched context {mt['compute_matched_context']:.1f} tokens")
    lines.append("")
    lines.append(format_table([{"solver": s, "cannot be reconstructed": t} for s, t in result["cannot_reconstruct"].items()],
                              ("solver", "cannot be reconstructed"), title="audit: information lost"))
    calc = result["calculator"]
    m = calc["model"]
    lines.append("")
    lines.append(format_table(
        [{"context": r["context"], "softmax": _human(r["softmax_bytes"]), "fixed_state": _human(r["fixed_state_bytes"]),
          "hybrid": _human(r["hybrid_bytes"]), "sessions_softmax": r["softmax_sessions"],
          "sessions_fixed": r["fixed_state_sessions"]} for r in calc["rows"]],
        ("context", "softmax", "fixed_state", "hybrid", "sessions_softmax", "sessions_fixed"),
        title=(f"calculator: {m['layers']} layers × {m['heads']} heads, d_k={m['head_dim_k']}, d_v={m['head_dim_v']}, "
               f"KV {m['kv_dtype']}, state {m['state_dtype']}, hybrid with {m['softmax_layers']} softmax layers; "
               f"sessions in {calc['budget_gib']:g} GiB")))
    lines.append(f"crossover: the KV cache outgrows the fixed state after {calc['crossover_context']:.0f} tokens")
    if m.get("weights"):
        lines.append(f"weights counted: {calc['weight_params']:,} parameters = {_human(calc['weight_bytes'])} "
                     f"({m['weight_dtype']}), taken off the {calc['budget_gib']:g} GiB budget before sessions")
    if "lm_check" in result:
        lines.append(f"calculator formula vs LM's measured cache (every mixer): exact = {result['lm_check']['exact']}")
    lines.append(f"runtime {result['runtime_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# command line (``fastweights study costs``)

HELP = "the per-solver audit (state, update and query cost per solver) and the memory calculator"
Config = CostsConfig
run = run_costs
add_arguments, config_from_args = study_command(CostsConfig)
