"""The worked examples, recomputed through ``fastweights.ops``.

Each example is computed by the library's own ops (never by hand-rolled
arithmetic) and carries the number docs/worked_examples.md gives. ``fastweights examples``
prints them side by side; ``tests/studies/test_worked_examples.py`` asserts each one.

Layout note: the papers write the memory as ``S = Σ v kᵀ`` (values × keys) and read
``S q``. The ops store its transpose ``h = Sᵀ`` (keys × values, as
flash-linear-attention does) and read ``hᵀ q``. Where a text prints S, the
example transposes the op's state back so the printed numbers match the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from .. import ops

DTYPE = torch.float64


@dataclass
class WorkedExample:
    """One number (vector or matrix) of docs/worked_examples.md, and what the library computes for it."""

    where: str  # the section of docs/worked_examples.md, e.g. "§2 delta rule"
    name: str
    computed: torch.Tensor
    expected: Optional[torch.Tensor]  # None for a claim that is only "must differ"
    tol: float = 1e-9
    #: for a claim that two things must differ (e.g. "k₂ stays corrupted"), the
    #: value it must not equal
    must_differ_from: Optional[torch.Tensor] = None

    @property
    def ok(self) -> bool:
        good = self.expected is None or torch.allclose(self.computed, self.expected, rtol=0.0, atol=self.tol)
        if self.must_differ_from is not None:
            good = good and not torch.allclose(self.computed, self.must_differ_from, atol=1e-6)
        return bool(good)


def t(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=DTYPE)


def _seq(rows: Sequence[Sequence[float]]) -> torch.Tensor:
    """Vectors of one sequence -> ``[B=1, T, H=1, D]``."""
    return t(rows)[None, :, None, :]


# The worked examples' little memories, shared by the examples below and by ``fastweights lab``.
#: docs/worked_examples.md §1: (key, value) of the two perpendicular writes and the overlapping third
LINEAR_PAIRS = (((1, 0), (3, 1)), ((0, 1), (-2, 4)), ((0.8, 0.6), (0, -5)))
#: docs/worked_examples.md §2: two orthogonal writes (W = [[5, 3], [2, 7]]) and the non-orthogonal third
FAST_WEIGHT_PAIRS = (((1, 0), (5, 2)), ((0, 1), (3, 7)), ((0.6, 0.8), (9, 1)))
#: docs/worked_examples.md §2: the overwrite of k₁ with a new value at write strength β
OVERWRITE = {"key": (1, 0), "value": (11, 4), "beta": 0.8}


def write(rule: str, keys, values, beta=None, state=None, g=None) -> torch.Tensor:
    """Write key-value pairs into a memory with the recurrent op; return the state ``[K, V]``.

    ``rule``: ``"sum"`` (with optional log-decays ``g``), ``"delta"`` (write strengths
    ``beta``) or ``"gated_delta"`` (both).
    """
    k, v = _seq(keys), _seq(values)
    h0 = None if state is None else state[None, None]
    if rule == "sum":
        gg = None if g is None else t(g)[None, :, None]
        _, h = ops.recurrent_linear_attn(k, k, v, g=gg, scale=1.0, initial_state=h0, output_final_state=True)
    elif rule == "delta":
        b = t(beta)[None, :, None]
        _, h = ops.recurrent_delta_rule(k, k, v, b, scale=1.0, initial_state=h0, output_final_state=True)
    elif rule == "gated_delta":
        b, gg = t(beta)[None, :, None], t(g)[None, :, None]
        _, h = ops.recurrent_gated_delta_rule(k, k, v, gg, b, scale=1.0, initial_state=h0, output_final_state=True)
    else:
        raise ValueError(f"write: unknown `rule` {rule!r}; expected 'sum', 'delta' or 'gated_delta'")
    return h[0, 0]


def read(state: torch.Tensor, query) -> torch.Tensor:
    """Read a memory at ``query`` through an op: one token whose key is 0 writes nothing."""
    q = _seq([query])
    zero_k = torch.zeros_like(q)
    zero_v = torch.zeros(1, 1, 1, state.shape[1], dtype=DTYPE)
    o, _ = ops.recurrent_linear_attn(q, zero_k, zero_v, scale=1.0, initial_state=state[None, None])
    return o[0, 0, 0]


def linear_attention_examples() -> List[WorkedExample]:
    """Linear attention: two writes and a read (docs/worked_examples.md §1) (here S is already keys × values)."""
    (k1, v1), (k2, v2), (k3, v3) = LINEAR_PAIRS
    s = write("sum", [k1, k2], [v1, v2])
    s3 = write("sum", [k3], [v3], state=s)
    return [
        WorkedExample("§1 linear", "S after two perpendicular writes", s, t([[3, 1], [-2, 4]])),
        WorkedExample("§1 linear", "read k₁ = (3, 1), exactly v₁", read(s, k1), t(v1)),
        WorkedExample("§1 linear", "read k₂ = (-2, 4), exactly v₂", read(s, k2), t(v2)),
        WorkedExample("§1 linear", "S after overlapping k₃ = (0.8, 0.6)", s3, t([[3, -3], [-2, 1]])),
        WorkedExample("§1 linear", "read k₁ = (3, -3), inked by k₃", read(s3, k1), t([3, -3]), must_differ_from=t(v1)),
        WorkedExample("§1 linear", "read k₃ = (1.2, -1.8), v₁ and v₂ bleed", read(s3, k3), t([1.2, -1.8]), must_differ_from=t(v3)),
    ]


def fast_weight_examples() -> List[WorkedExample]:
    """Fast weights and the delta rule (Schlag et al. 2021; Yang et al. 2024)."""
    out: List[WorkedExample] = []

    # three tokens, recurrent and parallel forms both give o₃ = (4, 5).
    keys, values = [(1, 0), (0, 1), (1, 1)], [(2, 0), (0, 3), (1, 1)]
    for form in (ops.recurrent_linear_attn, ops.parallel_linear_attn, ops.chunk_linear_attn):
        chunks = {"chunk_size": 2} if form is ops.chunk_linear_attn else {}  # only the chunk form has a chunk length
        o, _ = form(_seq([(0, 0), (0, 0), (1, 1)]), _seq(keys), _seq(values), scale=1.0, **chunks)
        out.append(WorkedExample("§2 forms", f"o₃ = (4, 5) via {form.__name__}", o[0, 2, 0], t([4, 5])))

    # two orthogonal keys, exact recall and the 50/50 blend.
    (k1, v1), (k2, v2), (k3, v3) = FAST_WEIGHT_PAIRS
    w = write("sum", [k1, k2], [v1, v2])
    out += [
        WorkedExample("§2 writes", "W = [[5, 3], [2, 7]]", w.T, t([[5, 3], [2, 7]])),
        WorkedExample("§2 writes", "W k₁ = (5, 2)", read(w, k1), t(v1)),
        WorkedExample("§2 writes", "W k₂ = (3, 7)", read(w, k2), t(v2)),
        WorkedExample("§2 writes", "W (0.5, 0.5) = (4, 4.5), the blend", read(w, (0.5, 0.5)), t([4, 4.5])),
        WorkedExample("§2 writes", "d_value=3: v₁=(5, 2, 9) back from k₁", read(write("sum", [k1], [(5, 2, 9)]), k1), t([5, 2, 9])),
    ]

    # a third, non-orthogonal key: crosstalk.
    w3 = write("sum", [k3], [v3], state=w)
    out += [
        WorkedExample("§2 crosstalk", "crosstalk: W k₃ = (14.4, 7.8), not (9, 1)", read(w3, k3), t([14.4, 7.8]), must_differ_from=t(v3)),
        WorkedExample("§2 crosstalk", "crosstalk: W k₁ = (10.4, 2.6), not (5, 2)", read(w3, k1), t([10.4, 2.6]), must_differ_from=t(v1)),
    ]
    k4 = (1 / math.sqrt(3),) * 3
    w4 = write("sum", [(1, 0, 0), (0, 1, 0), (0, 0, 1), k4], [(1, 0), (0, 1), (1, 1), (4, 4)])
    out.append(WorkedExample("§2 crosstalk", "4th key in 3-D: k₁ read picks up 0.577·v₄", read(w4, (1, 0, 0)) - t([1, 0]), t([4, 4]) / math.sqrt(3)))

    # the delta rule overwrites k₁ cleanly; the sum rule adds.
    over = OVERWRITE
    wd = write("delta", [over["key"]], [over["value"]], beta=[over["beta"]], state=w)
    out += [
        WorkedExample("§2 delta rule", "delta overwrite, β=0.8: W = [[9.8, 3], [3.6, 7]]", wd.T, t([[9.8, 3], [3.6, 7]])),
        WorkedExample("§2 delta rule", "after it, W k₂ = (3, 7) untouched", read(wd, k2), t(v2)),
        WorkedExample("§2 delta rule", "sum rule instead: W k₁ = (16, 6) = v₁ + v_new", read(write("sum", [k1], [(11, 4)], state=w), k1), t([16, 6])),
    ]
    # repairing k₁ (β=1) leaves k₂ corrupted.
    out.append(WorkedExample("§2 delta rule", "corrupted W_new = [[10.4, 10.2], [2.6, 7.8]]", w3.T, t([[10.4, 10.2], [2.6, 7.8]])))
    wr = write("delta", [k1], [v1], beta=[1.0], state=w3)
    out += [
        WorkedExample("§2 delta rule", "repair k₁ with β=1: W k₁ = (5, 2)", read(wr, k1), t(v1)),
        WorkedExample("§2 delta rule", "k₂ still corrupted: W k₂ = (10.2, 7.8)", read(wr, k2), t([10.2, 7.8]), must_differ_from=t(v2)),
    ]
    # gated rule W' = (1-β)W + β v kᵀ (a decayed sum rule) vs the delta rule, k₃ = k₂.
    beta, v_new = 0.8, (11, 4)
    wg = write("sum", [k2], [tuple(beta * x for x in v_new)], g=[math.log(1 - beta)], state=w)
    wdl = write("delta", [k2], [v_new], beta=[beta], state=w)
    out += [
        WorkedExample("§2 delta rule", "gated rule: W' k₂ = (9.4, 4.6)", read(wg, k2), t([9.4, 4.6])),
        WorkedExample("§2 delta rule", "gated rule: W' k₁ = (1, 0.4), k₁ faded", read(wg, k1), t([1, 0.4]), must_differ_from=t(v1)),
        WorkedExample("§2 delta rule", "delta rule: W' k₂ = (9.4, 4.6)", read(wdl, k2), t([9.4, 4.6])),
        WorkedExample("§2 delta rule", "delta rule: W' k₁ = (5, 2), k₁ left alone", read(wdl, k1), t(v1)),
    ]

    # sum normalization of k = (3, 1).
    out.append(WorkedExample("§2 sum norm", "sum-normalized (3, 1) = (0.75, 0.25)", ops.normalize_qk(t([3.0, 1.0]), "sum"), t([0.75, 0.25])))

    # Householder transitions. A delta write with β=1 and v=0 maps h ↦ (I − k kᵀ) h,
    # so writing into h₀ = I leaves the product of the transitions.
    eye = torch.eye(2, dtype=DTYPE)
    reflect = write("delta", [(1, 0)], [(0, 0)], beta=[1.0], state=eye)
    h21 = write("delta", [(1, 0), (0.6, 0.8)], [(0, 0), (0, 0)], beta=[1.0, 1.0], state=eye)  # H₂ H₁
    h12 = write("delta", [(0.6, 0.8), (1, 0)], [(0, 0), (0, 0)], beta=[1.0, 1.0], state=eye)  # H₁ H₂
    out += [
        WorkedExample("§3 parallel", "(I − k kᵀ)(3, 5) = (0, 5) for k = (1, 0)", reflect @ t([3.0, 5.0]), t([0, 5])),
        WorkedExample("§3 parallel", "H₁ H₂ = [[0, 0], [-0.48, 0.36]]", h12, t([[0, 0], [-0.48, 0.36]])),
        WorkedExample("§3 parallel", "H₂ H₁ = [[0, -0.48], [0, 0.36]] ≠ H₁ H₂", h21, t([[0, -0.48], [0, 0.36]]), must_differ_from=h12),
    ]
    # the 4-token chunkwise identity for the sum rule, C = 2.
    keys4, values4 = [(1, 0), (0, 1), (1, 1), (1, 0)], [(2, 0), (0, 3), (1, 1), (2, 2)]
    _, s_chunk = ops.chunk_linear_attn(_seq(keys4), _seq(keys4), _seq(values4), scale=1.0, chunk_size=2, output_final_state=True)
    _, s_first = ops.chunk_linear_attn(_seq(keys4[:2]), _seq(keys4[:2]), _seq(values4[:2]), scale=1.0, chunk_size=2, output_final_state=True)
    out += [
        WorkedExample("§3 parallel", "chunk C=2: S_[0] = [[2, 0], [0, 3]]", s_first[0, 0].T, t([[2, 0], [0, 3]])),
        WorkedExample("§3 parallel", "chunk C=2: S_[1] = [[5, 1], [3, 4]]", s_chunk[0, 0].T, t([[5, 1], [3, 4]])),
        WorkedExample("§3 parallel", "sequential S₄ = [[5, 1], [3, 4]]", write("sum", keys4, values4).T, t([[5, 1], [3, 4]])),
    ]
    # one WY chunk of C = 2 against the sequential delta rule.
    kw, vw, bw = [(1, 0), (0.6, 0.8)], [(11, 4), (9, 1)], [0.8, 1.0]
    b = t(bw)[None, :, None]
    _, s_wy = ops.chunk_delta_rule(_seq(kw), _seq(kw), _seq(vw), b, scale=1.0, chunk_size=2, output_final_state=True)
    wy_expected = t([[11.032, 2.976], [2.648, -0.736]])
    out += [
        WorkedExample("§3 WY", "WY chunk C=2: S = [[11.032, 2.976], [2.648, -0.736]]", s_wy[0, 0].T, wy_expected),
        WorkedExample("§3 WY", "sequential delta rule, same two tokens", write("delta", kw, vw, beta=bw).T, wy_expected),
    ]
    return out


def regression_examples(seed: int = 0) -> List[WorkedExample]:
    """Attention as regression (Wang, Shi & Fox 2025): softmax is the local-constant fit; a factorized kernel streams exactly."""
    gen = torch.Generator().manual_seed(seed)
    n, d = 12, 4
    keys = torch.randn(n, d, generator=gen, dtype=DTYPE)
    values = torch.randn(n, d, generator=gen, dtype=DTYPE)
    query = torch.randn(d, generator=gen, dtype=DTYPE)
    out: List[WorkedExample] = []

    # Solver 1: the gradient of Σ κ_τ |v_τ − m|² vanishes at the softmax output.
    q = query.expand(n, d)[None, :, None]
    o, _ = ops.softmax_attn(q, keys[None, :, None], values[None, :, None], scale=d ** -0.5)
    m = o[0, -1, 0].clone().requires_grad_(True)
    kappa = torch.exp(keys @ query / math.sqrt(d) - (keys @ query / math.sqrt(d)).max())
    (kappa * ((values - m) ** 2).sum(-1)).sum().backward()
    out.append(WorkedExample("§4 regression", "softmax output: gradient of the local fit = 0", m.grad, torch.zeros(d, dtype=DTYPE), tol=1e-12))

    # Solver 2: with φ = elu+1 and the normalizer, streaming (S, z) equals a traversal
    # of every prefix; drop z and the equality fails.
    phi = ops.EluPlusOne()
    kernel = phi(query) @ phi(keys).T  # [n]: κ(q, k_τ) for every stored pair
    traversal = torch.stack([(kernel[: i + 1, None] * values[: i + 1]).sum(0) / kernel[: i + 1].sum() for i in range(n)])
    qs, ks, vs = query.expand(n, d)[None, :, None], keys[None, :, None], values[None, :, None]
    streamed, _ = ops.recurrent_linear_attn(qs, ks, vs, feature_map="elu", normalize=True, eps=0.0)
    chunked, _ = ops.chunk_linear_attn(qs, ks, vs, feature_map="elu", normalize=True, eps=0.0, chunk_size=5)
    no_z, _ = ops.recurrent_linear_attn(qs, ks, vs, feature_map="elu", scale=1.0)
    out += [
        WorkedExample("§4 regression", "streaming (S, z) equals traversal, every prefix", streamed[0, :, 0], traversal, tol=1e-12),
        WorkedExample("§4 regression", "chunked (S, z) equals traversal, every prefix", chunked[0, :, 0], traversal, tol=1e-12),
        WorkedExample("§4 regression", "without z the streamed read is not the average", no_z[0, :, 0], None, must_differ_from=traversal),
    ]
    return out


def all_examples() -> List[WorkedExample]:
    return linear_attention_examples() + fast_weight_examples() + regression_examples()


def _fmt(x: torch.Tensor) -> str:
    vals = [0.0 if abs(v) < 1e-12 else v for v in x.detach().reshape(-1).tolist()]
    body = ", ".join(f"{v:.4g}" for v in vals[:4]) + (f", … ({len(vals)} values)" if len(vals) > 4 else "")
    return f"({body})" if x.dim() <= 1 else "[" + body + "]"


def print_examples(examples: Optional[List[WorkedExample]] = None, out: Callable[[str], None] = print) -> bool:
    """Print each worked example beside the number the docs give; return True when all match."""
    examples = all_examples() if examples is None else examples
    width = max(len(e.name) for e in examples)
    section = None
    for e in examples:
        if e.where.split()[0] != section:
            section = e.where.split()[0]
            out(f"\ndocs/worked_examples.md {section}")
            out(f"  {'where':14} {'example':{width}}  {'computed':30} {'docs say':30}")
        flag = "ok" if e.ok else "MISMATCH"
        if e.expected is None:
            gap = (e.computed - e.must_differ_from).abs().max().item()
            expected, err = "≠ " + _fmt(e.must_differ_from), f"(max |gap| {gap:.1e})"
        else:
            expected, err = _fmt(e.expected), f"(max |err| {(e.computed - e.expected).abs().max().item():.1e})"
        out(f"  {e.where:14} {e.name:{width}}  {_fmt(e.computed):30} {expected:30} {flag:8} {err}")
    n_ok = sum(e.ok for e in examples)
    out(f"\n{n_ok}/{len(examples)} worked examples match docs/worked_examples.md")
    return n_ok == len(examples)


# Earlier names of this module's public functions and constants (when it was
# ``fastweights.examples``); they still resolve, with a DeprecationWarning.
_RENAMED = {
    "seed_002": "linear_attention_examples", "seed_001": "fast_weight_examples", "seed_000": "regression_examples",
    "SEED_002_PAIRS": "LINEAR_PAIRS", "SEED_001_PAIRS": "FAST_WEIGHT_PAIRS", "SEED_001_OVERWRITE": "OVERWRITE",
}


def __getattr__(name: str):
    if name in _RENAMED:
        import warnings

        warnings.warn(f"fastweights.studies.worked_examples.{name} is now {_RENAMED[name]}", DeprecationWarning,
                      stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
