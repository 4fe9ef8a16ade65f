"""The seeds' worked examples, recomputed through ``fastweights.ops``.

Each example is computed by the library's own ops (never by hand-rolled
arithmetic) and carries the number its text prints. ``fastweights examples``
prints them side by side; ``tests/studies/test_golden_seeds.py`` asserts each one.

Layout note: the seeds write the memory as ``S = Σ v kᵀ`` (values × keys) and read
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
    """One number (vector or matrix) from a seed, and what the library computes for it."""

    seed: str  # which text, e.g. "001 ch. 4"
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


# The seeds' little memories, shared by the examples below and by ``fastweights lab``.
#: seed 002 §4.1: (key, value) of the two perpendicular writes and the overlapping third
SEED_002_PAIRS = (((1, 0), (3, 1)), ((0, 1), (-2, 4)), ((0.8, 0.6), (0, -5)))
#: seed 001 ch. 2-3: two orthogonal writes (W = [[5, 3], [2, 7]]) and the non-orthogonal third
SEED_001_PAIRS = (((1, 0), (5, 2)), ((0, 1), (3, 7)), ((0.6, 0.8), (9, 1)))
#: seed 001 ch. 4: the overwrite of k₁ with a new value at write strength β
SEED_001_OVERWRITE = {"key": (1, 0), "value": (11, 4), "beta": 0.8}


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


def seed_002() -> List[WorkedExample]:
    """Seed 002 §4.1, "Two writes and a read, with actual numbers" (here S is already keys × values)."""
    (k1, v1), (k2, v2), (k3, v3) = SEED_002_PAIRS
    s = write("sum", [k1, k2], [v1, v2])
    s3 = write("sum", [k3], [v3], state=s)
    return [
        WorkedExample("002 §4.1", "S after two perpendicular writes", s, t([[3, 1], [-2, 4]])),
        WorkedExample("002 §4.1", "read k₁ = (3, 1), exactly v₁", read(s, k1), t(v1)),
        WorkedExample("002 §4.1", "read k₂ = (-2, 4), exactly v₂", read(s, k2), t(v2)),
        WorkedExample("002 §4.1", "S after overlapping k₃ = (0.8, 0.6)", s3, t([[3, -3], [-2, 1]])),
        WorkedExample("002 §4.1", "read k₁ = (3, -3), inked by k₃", read(s3, k1), t([3, -3]), must_differ_from=t(v1)),
        WorkedExample("002 §4.1", "read k₃ = (1.2, -1.8), v₁ and v₂ bleed", read(s3, k3), t([1.2, -1.8]), must_differ_from=t(v3)),
    ]


def seed_001() -> List[WorkedExample]:
    """Seed 001 (Linear Transformers as Fast Weight Programmers), chapters 1-7."""
    out: List[WorkedExample] = []

    # ch. 1: three tokens, recurrent and parallel forms both give o₃ = (4, 5).
    keys, values = [(1, 0), (0, 1), (1, 1)], [(2, 0), (0, 3), (1, 1)]
    for form in (ops.recurrent_linear_attn, ops.parallel_linear_attn, ops.chunk_linear_attn):
        o, _ = form(_seq([(0, 0), (0, 0), (1, 1)]), _seq(keys), _seq(values), scale=1.0, chunk_size=2)
        out.append(WorkedExample("001 ch. 1", f"o₃ = (4, 5) via {form.__name__}", o[0, 2, 0], t([4, 5])))

    # ch. 2: two orthogonal keys, exact recall and the 50/50 blend.
    (k1, v1), (k2, v2), (k3, v3) = SEED_001_PAIRS
    w = write("sum", [k1, k2], [v1, v2])
    out += [
        WorkedExample("001 ch. 2", "W = [[5, 3], [2, 7]]", w.T, t([[5, 3], [2, 7]])),
        WorkedExample("001 ch. 2", "W k₁ = (5, 2)", read(w, k1), t(v1)),
        WorkedExample("001 ch. 2", "W k₂ = (3, 7)", read(w, k2), t(v2)),
        WorkedExample("001 ch. 2", "W (0.5, 0.5) = (4, 4.5), the blend", read(w, (0.5, 0.5)), t([4, 4.5])),
        WorkedExample("001 ch. 2", "d_value=3: v₁=(5, 2, 9) back from k₁", read(write("sum", [k1], [(5, 2, 9)]), k1), t([5, 2, 9])),
    ]

    # ch. 3: a third, non-orthogonal key: crosstalk.
    w3 = write("sum", [k3], [v3], state=w)
    out += [
        WorkedExample("001 ch. 3", "crosstalk: W k₃ = (14.4, 7.8), not (9, 1)", read(w3, k3), t([14.4, 7.8]), must_differ_from=t(v3)),
        WorkedExample("001 ch. 3", "crosstalk: W k₁ = (10.4, 2.6), not (5, 2)", read(w3, k1), t([10.4, 2.6]), must_differ_from=t(v1)),
    ]
    k4 = (1 / math.sqrt(3),) * 3
    w4 = write("sum", [(1, 0, 0), (0, 1, 0), (0, 0, 1), k4], [(1, 0), (0, 1), (1, 1), (4, 4)])
    out.append(WorkedExample("001 ch. 3", "4th key in 3-D: k₁ read picks up 0.577·v₄", read(w4, (1, 0, 0)) - t([1, 0]), t([4, 4]) / math.sqrt(3)))

    # ch. 4: the delta rule overwrites k₁ cleanly; the sum rule adds.
    over = SEED_001_OVERWRITE
    wd = write("delta", [over["key"]], [over["value"]], beta=[over["beta"]], state=w)
    out += [
        WorkedExample("001 ch. 4", "delta overwrite, β=0.8: W = [[9.8, 3], [3.6, 7]]", wd.T, t([[9.8, 3], [3.6, 7]])),
        WorkedExample("001 ch. 4", "after it, W k₂ = (3, 7) untouched", read(wd, k2), t(v2)),
        WorkedExample("001 ch. 4", "sum rule instead: W k₁ = (16, 6) = v₁ + v_new", read(write("sum", [k1], [(11, 4)], state=w), k1), t([16, 6])),
    ]
    # ch. 4: repairing k₁ (β=1) leaves k₂ corrupted.
    out.append(WorkedExample("001 ch. 4", "corrupted W_new = [[10.4, 10.2], [2.6, 7.8]]", w3.T, t([[10.4, 10.2], [2.6, 7.8]])))
    wr = write("delta", [k1], [v1], beta=[1.0], state=w3)
    out += [
        WorkedExample("001 ch. 4", "repair k₁ with β=1: W k₁ = (5, 2)", read(wr, k1), t(v1)),
        WorkedExample("001 ch. 4", "k₂ still corrupted: W k₂ = (10.2, 7.8)", read(wr, k2), t([10.2, 7.8]), must_differ_from=t(v2)),
    ]
    # ch. 4: gated rule W' = (1-β)W + β v kᵀ (a decayed sum rule) vs the delta rule, k₃ = k₂.
    beta, v_new = 0.8, (11, 4)
    wg = write("sum", [k2], [tuple(beta * x for x in v_new)], g=[math.log(1 - beta)], state=w)
    wdl = write("delta", [k2], [v_new], beta=[beta], state=w)
    out += [
        WorkedExample("001 ch. 4", "gated rule: W' k₂ = (9.4, 4.6)", read(wg, k2), t([9.4, 4.6])),
        WorkedExample("001 ch. 4", "gated rule: W' k₁ = (1, 0.4), k₁ faded", read(wg, k1), t([1, 0.4]), must_differ_from=t(v1)),
        WorkedExample("001 ch. 4", "delta rule: W' k₂ = (9.4, 4.6)", read(wdl, k2), t([9.4, 4.6])),
        WorkedExample("001 ch. 4", "delta rule: W' k₁ = (5, 2), k₁ left alone", read(wdl, k1), t(v1)),
    ]

    # ch. 5: sum normalization of k = (3, 1).
    out.append(WorkedExample("001 ch. 5", "sum-normalized (3, 1) = (0.75, 0.25)", ops.normalize_qk(t([3.0, 1.0]), "sum"), t([0.75, 0.25])))

    # ch. 6: Householder transitions. A delta write with β=1 and v=0 maps h ↦ (I − k kᵀ) h,
    # so writing into h₀ = I leaves the product of the transitions.
    eye = torch.eye(2, dtype=DTYPE)
    reflect = write("delta", [(1, 0)], [(0, 0)], beta=[1.0], state=eye)
    h21 = write("delta", [(1, 0), (0.6, 0.8)], [(0, 0), (0, 0)], beta=[1.0, 1.0], state=eye)  # H₂ H₁
    h12 = write("delta", [(0.6, 0.8), (1, 0)], [(0, 0), (0, 0)], beta=[1.0, 1.0], state=eye)  # H₁ H₂
    out += [
        WorkedExample("001 ch. 6", "(I − k kᵀ)(3, 5) = (0, 5) for k = (1, 0)", reflect @ t([3.0, 5.0]), t([0, 5])),
        WorkedExample("001 ch. 6", "H₁ H₂ = [[0, 0], [-0.48, 0.36]]", h12, t([[0, 0], [-0.48, 0.36]])),
        WorkedExample("001 ch. 6", "H₂ H₁ = [[0, -0.48], [0, 0.36]] ≠ H₁ H₂", h21, t([[0, -0.48], [0, 0.36]]), must_differ_from=h12),
    ]
    # ch. 6: the 4-token chunkwise identity for the sum rule, C = 2.
    keys4, values4 = [(1, 0), (0, 1), (1, 1), (1, 0)], [(2, 0), (0, 3), (1, 1), (2, 2)]
    _, s_chunk = ops.chunk_linear_attn(_seq(keys4), _seq(keys4), _seq(values4), scale=1.0, chunk_size=2, output_final_state=True)
    _, s_first = ops.chunk_linear_attn(_seq(keys4[:2]), _seq(keys4[:2]), _seq(values4[:2]), scale=1.0, chunk_size=2, output_final_state=True)
    out += [
        WorkedExample("001 ch. 6", "chunk C=2: S_[0] = [[2, 0], [0, 3]]", s_first[0, 0].T, t([[2, 0], [0, 3]])),
        WorkedExample("001 ch. 6", "chunk C=2: S_[1] = [[5, 1], [3, 4]]", s_chunk[0, 0].T, t([[5, 1], [3, 4]])),
        WorkedExample("001 ch. 6", "sequential S₄ = [[5, 1], [3, 4]]", write("sum", keys4, values4).T, t([[5, 1], [3, 4]])),
    ]
    # ch. 7: one WY chunk of C = 2 against the sequential delta rule.
    kw, vw, bw = [(1, 0), (0.6, 0.8)], [(11, 4), (9, 1)], [0.8, 1.0]
    b = t(bw)[None, :, None]
    _, s_wy = ops.chunk_delta_rule(_seq(kw), _seq(kw), _seq(vw), b, scale=1.0, chunk_size=2, output_final_state=True)
    wy_expected = t([[11.032, 2.976], [2.648, -0.736]])
    out += [
        WorkedExample("001 ch. 7", "WY chunk C=2: S = [[11.032, 2.976], [2.648, -0.736]]", s_wy[0, 0].T, wy_expected),
        WorkedExample("001 ch. 7", "sequential delta rule, same two tokens", write("delta", kw, vw, beta=bw).T, wy_expected),
    ]
    return out


def seed_000(seed: int = 0) -> List[WorkedExample]:
    """Seed 000 §17.1: softmax is the local-constant fit; a factorized kernel streams exactly."""
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
    out.append(WorkedExample("000 §17.1", "softmax output: gradient of the local fit = 0", m.grad, torch.zeros(d, dtype=DTYPE), tol=1e-12))

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
        WorkedExample("000 §17.1", "streaming (S, z) equals traversal, every prefix", streamed[0, :, 0], traversal, tol=1e-12),
        WorkedExample("000 §17.1", "chunked (S, z) equals traversal, every prefix", chunked[0, :, 0], traversal, tol=1e-12),
        WorkedExample("000 §17.1", "without z the streamed read is not the average", no_z[0, :, 0], None, must_differ_from=traversal),
    ]
    return out


def all_examples() -> List[WorkedExample]:
    return seed_002() + seed_001() + seed_000()


def _fmt(x: torch.Tensor) -> str:
    vals = [0.0 if abs(v) < 1e-12 else v for v in x.detach().reshape(-1).tolist()]
    body = ", ".join(f"{v:.4g}" for v in vals[:4]) + (f", … ({len(vals)} values)" if len(vals) > 4 else "")
    return f"({body})" if x.dim() <= 1 else "[" + body + "]"


def print_examples(examples: Optional[List[WorkedExample]] = None, out: Callable[[str], None] = print) -> bool:
    """Print each worked example beside the text's number; return True when all match."""
    examples = all_examples() if examples is None else examples
    width = max(len(e.name) for e in examples)
    seed = None
    for e in examples:
        if e.seed.split()[0] != seed:
            seed = e.seed.split()[0]
            out(f"\nseed {seed}")
            out(f"  {'where':10} {'example':{width}}  {'computed':30} {'text says':30}")
        flag = "ok" if e.ok else "MISMATCH"
        if e.expected is None:
            gap = (e.computed - e.must_differ_from).abs().max().item()
            expected, err = "≠ " + _fmt(e.must_differ_from), f"(max |gap| {gap:.1e})"
        else:
            expected, err = _fmt(e.expected), f"(max |err| {(e.computed - e.expected).abs().max().item():.1e})"
        out(f"  {e.seed:10} {e.name:{width}}  {_fmt(e.computed):30} {expected:30} {flag:8} {err}")
    n_ok = sum(e.ok for e in examples)
    out(f"\n{n_ok}/{len(examples)} worked examples match their text")
    return n_ok == len(examples)
