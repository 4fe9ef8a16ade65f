"""The DPLR delta rule, chunk form: KDA's chunk structure with the DPLR block terms.

Per chunk of C tokens, the block's state-free terms (:func:`_forward_terms`: the four decayed
products by recursive halving, :func:`~.._halving.halving_products_by_operand`, every exponential
of a number <= 0, each factor a product of the tokens' e^{gk} over its own span in the compute dtype; one
unit-triangular solve), then one sequential loop across chunks and the outputs
(:func:`chunk_dplr_fwd`: KDA's loop with the state-free V pseudo-rows taken out of it; no chunk
states kept without grad), group by group of :data:`GROUP_TOKENS` token-heads (fewer above K = 64),
the inputs copied straight into the products' operand-major buffers (the row operands scaled as
they are copied), one :class:`~.._halving.OperandPlan` per group size holding those buffers and
every view the halving levels use, made once per call.

No compiled CPU kernel runs it: KDA's (``ops/cpu/chunk_kda.cpp``) reads and writes the state
along one key per token, while the DPLR transition reads along a, writes along b and adds k vᵀ,
two write paths that kernel's block algebra does not have. The PyTorch forward is measured
against the recurrence in BENCHMARKS.md ("GDN-2, DeltaProduct and DPLR"): at B 1, T 2048,
fp32, 1 thread, C 32, 3.7–3.8× at H 4, K = V = 64 and 4.3–4.4× at H 8, K = V = 128 (medians of
interleaved runs on a shared machine; 2.9–3.1× and 3.1–3.5× before the last round); at H 4 about a
quarter of a call is still per-op cost (small blocks: C·K = 2048 numbers per chunk-head), not
arithmetic. Without a gradient the forward runs as its own custom op
(``fastweights::chunk_dplr_infer``), which takes a and b as they come instead of stacked.

The backward is written by hand end to end: KDA's adjoint loop across chunks (last chunk first,
from the saved chunk-entry states; :func:`~fastweights.ops.kda.chunk.chunk_kda_bwd`) over each
group's terms recomputed in KDA's 2L-pseudo-row shape (:func:`_backward_terms`), and their
adjoint :func:`~.parallel.dplr_block_terms_backward` (the solve's adjoint, then the halving
products' adjoint :func:`~.._halving.halving_products_backward`, the decay factors span by span).
Forward and backward are ``torch.library`` custom ops (``fastweights::chunk_dplr_fwd`` /
``_bwd``), the backward registered as the forward's autograd formula as KDA's, GDN-2's and
DeltaProduct's are; opaque to ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .._chunk import chunk_buffer, flat_chunks, from_chunk_buffer, put_chunks
from ..precision import autocast_off
from ..kda import chunk as kda_chunk
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import dplr_step
from .parallel import DplrSaved, block_terms_of, dplr_block_terms_backward
from .._halving import OperandPlan, halving_products_by_operand
from ..kda.parallel import cumulative_decay


class _Terms(NamedTuple):
    """A group of blocks' state-free terms, as :func:`_forward_terms` forms them."""

    read: Tensor      # e^c
    to_end: Tensor    # e^{c_L − c}
    q_scaled: Tensor  # scale·q
    a_qb: Tensor      # [Bt, L, L] scale·A_qb (diagonal included)
    a_qk: Tensor      # [Bt, L, L] scale·A_qk
    wu: Tensor        # [Bt, L, K + V] [W | U₀]
    neg_a_ab: Tensor  # [Bt, L, L] −A_ab (the diagonal is not −A_ab's: never read)
    exp_neg_gk: Tensor  # e^{−gk}
    a_shift: Tensor   # a ⊙ e^{−gk}
    a_ak: Tensor      # [Bt, L, L] A_ak, strictly lower


def _forward_terms(rows: Tensor, cols: Tensor, gk: Tensor, v: Tensor, scale: float,
                   exp_neg_gk: Optional[Tensor] = None, plan: Optional[OperandPlan] = None) -> _Terms:
    """The state-free terms of blocks given operand-major: ``rows [Bt, 2, L, K]`` holding (a, q) (written
    over: they become the row operands a ⊙ e^{−gk} and scale·q), ``cols [Bt, 2, L, K]`` holding (b, k),
    ``gk [Bt, L, K]``, ``v [Bt, L, V]`` (:func:`~.parallel.dplr_block_core`'s algebra, module docstring of
    ``parallel.py``). Given ``exp_neg_gk`` (e^{−gk}), ``rows`` already hold the row operands
    (a ⊙ e^{−gk}, scale·q), as :func:`_operands` writes them. Given ``plan`` (whose operand buffers
    ``rows`` and ``cols`` are), its buffers hold the products: the terms are valid until its next run.

    The four decayed products are formed together by recursive halving
    (:func:`~.._halving.halving_products_by_operand`: every exponential of a number <= 0; A_ab and A_ak
    strictly lower), and ``[W | U₀] = (I − A_ab)⁻¹ [A ⊙ e^{c − gk} | A_ak V]`` is one unit
    lower-triangular solve on −A_ab (LAPACK's substitution reads only the strict lower triangle)."""
    bt, _, length, dk = rows.shape
    # a_i e^{c_{i−1} − c_j} = (a_i e^{−gk_i}) e^{c_i − c_j}
    if exp_neg_gk is None:
        exp_neg_gk = torch.neg(gk).exp_()
        a_shift, q_scaled = rows[:, 0].mul_(exp_neg_gk), rows[:, 1].mul_(scale)
    else:
        a_shift, q_scaled = rows.unbind(1)
    products, ends = halving_products_by_operand(gk, rows, cols, diagonal_from=1) if plan is None else plan.run(gk)
    read, to_end = ends.unbind(1)
    a_ak = products[0, 1]
    rhs = rows.new_empty(bt, length, dk + v.shape[-1])
    torch.mul(a_shift, read, out=rhs[..., :dk])  # A ⊙ e^{c − gk} = (A ⊙ e^{−gk}) ⊙ e^c
    torch.bmm(a_ak, v, out=rhs[..., dk:])
    neg_a_ab = products[0, 0].neg_()
    wu = torch.linalg.solve_triangular(neg_a_ab, rhs, upper=False, unitriangular=True)
    return _Terms(read, to_end, q_scaled, products[1, 0], products[1, 1], wu, neg_a_ab, exp_neg_gk, a_shift, a_ak)


def _backward_terms(q, k, v, ab, gk, scale: float, solve=None):
    """KDA's :class:`~..kda.parallel.BlockTerms` (2L pseudo-rows) of :func:`_forward_terms`, for KDA's
    backward driver with :func:`~.parallel.dplr_block_terms_backward` (``solve`` unused)."""
    x = _forward_terms(torch.stack([ab[..., 0, :], q], dim=1), torch.stack([ab[..., 1, :], k], dim=1), gk, v, scale)
    saved = DplrSaved(cumulative_decay(gk), x.exp_neg_gk, x.a_shift, x.a_ak)
    return block_terms_of(q, k, v, ab, x.read, x.to_end, x.neg_a_ab, torch.cat([x.a_qb, x.a_qk], dim=-1), x.wu,
                          saved, scale)


#: Token-heads per group of the forward (C·N·H·chunks; KDA's driver, and the backward, take 64 chunk-heads)
#: at K <= :data:`GROUP_KEYS`, fewer in proportion above it (a group's transients grow as its tokens times K):
#: they stay within a core's caches, and there are few enough groups that the per-op costs do not dominate.
#: Measured at B 1, T 2048, C 32, fp32, 1 thread (BENCHMARKS.md): 1024 (32 chunk-heads) was fastest of 256
#: to 2048 at H 4, K = V = 64, 2048 clearly slower; at H 8, K = V = 128 groups of 512 were ~8 % faster than
#: of 1024 and 256.
GROUP_TOKENS = 1024
GROUP_KEYS = 64


class _Chunked:
    """The head-first inputs ``[N, H, T, ·]`` seen chunk-major, ``[NC, N, H, C, ·]``, as views of their whole
    chunks made once per call; :meth:`copy` copies a group of chunks (a partial last chunk zero-padded by
    :func:`~.._chunk.flat_chunks`). Per group, one slice and one copy per input (the per-group slicing
    and reshaping in Python cost about as much as the copies at the benchmark's sizes)."""

    def __init__(self, inputs, chunk_size: int) -> None:
        t_len = inputs[0].shape[2]
        self.inputs, self.chunk_size, self.whole = inputs, chunk_size, t_len // chunk_size
        self.views = [t.narrow(2, 0, self.whole * chunk_size).unflatten(2, (self.whole, chunk_size)).movedim(2, 0)
                      for t in inputs]

    def copy(self, i: int, c0: int, c1: int, out: Tensor) -> Tensor:
        """Input ``i``'s chunks ``c0 .. c1 − 1`` into ``out [(c1 − c0)·N·H, C, ·]`` (a view, e.g. an operand's slot)."""
        if c1 > self.whole:
            return flat_chunks(self.inputs[i], self.chunk_size, c0, c1, out=out)
        part = self.views[i].narrow(0, c0, c1 - c0)
        out.view(part.shape).copy_(part)
        return out

    def scaled(self, i: int, c0: int, c1: int, factor, out: Tensor) -> Tensor:
        """As :meth:`copy`, times ``factor`` (a number, or a tensor shaped as ``out``) in the same pass."""
        if c1 > self.whole:
            return self.copy(i, c0, c1, out).mul_(factor)
        part = self.views[i].narrow(0, c0, c1 - c0)
        torch.mul(part, factor.view(part.shape) if isinstance(factor, Tensor) else factor, out=out.view(part.shape))
        return out


def _operands(chunked: _Chunked, c0: int, c1: int, scale: float, plan: Optional[OperandPlan] = None):
    """Chunks ``c0 .. c1 − 1`` of the inputs ``(a, q, b, k, gk, v)`` written straight into :func:`_forward_terms`'s
    operand-major buffers, the row operands scaled as they are copied: ``(rows (a ⊙ e^{−gk}, scale·q),
    cols (b, k), gk, v, e^{−gk})``, ``[Bt, 2, L, K]``, ``[Bt, L, ·]``; rows and cols into ``plan``'s buffers if given."""
    q, v = chunked.inputs[1], chunked.inputs[5]
    bt, dk, length = (c1 - c0) * q.shape[0] * q.shape[1], q.shape[-1], chunked.chunk_size
    rows, cols = (q.new_empty(bt, 2, length, dk), q.new_empty(bt, 2, length, dk)) if plan is None else (plan.rows, plan.cols)
    gk = chunked.copy(4, c0, c1, q.new_empty(bt, length, dk))
    exp_neg_gk = torch.neg(gk).exp_()
    a_slot, q_slot = rows.unbind(1)
    chunked.scaled(0, c0, c1, exp_neg_gk, a_slot)
    chunked.scaled(1, c0, c1, scale, q_slot)
    for i, slot in zip((2, 3), cols.unbind(1)):
        chunked.copy(i, c0, c1, slot)
    return rows, cols, gk, chunked.copy(5, c0, c1, v.new_empty(bt, length, v.shape[-1])), exp_neg_gk


def chunk_dplr_fwd(q, k, v, ab, gk, h0, scale: float, chunk_size: int, keep_states: bool = True):
    """:func:`chunk_dplr_fwd_pair` with a and b stacked, ``ab [N, H, T, 2, K]``."""
    return chunk_dplr_fwd_pair(q, k, v, ab[..., 0, :], ab[..., 1, :], gk, h0, scale, chunk_size, keep_states)


def chunk_dplr_fwd_pair(q, k, v, a, b, gk, h0, scale: float, chunk_size: int, keep_states: bool = True):
    """Forward on head-first ``[N, H, T, ·]`` tensors, ``h0 [N·H, K, V]`` or
    None; returns KDA's ``(o, h_T, states)`` (:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd`,
    ``states[c]`` the state entering chunk c), group by group of chunks as KDA's driver.

    KDA's driver would run the 2L pseudo-rows ``[U; V]`` through its loop; here the V rows, which
    do not depend on the state, are taken out of it: per chunk the loop forms U = U₀ + W h and
    h' = e^{c_L} ⊙ h + (K ⊙ e^{c_L − c})ᵀ V + (B ⊙ e^{c_L − c})ᵀ U with the V term batched over
    the group beforehand, and the outputs A_qk V + A_qb U + Q̂ h are batched after it.

    ``keep_states=False`` (a forward no backward will follow) returns ``states`` with no chunks
    (``[0, N·H, K, V]``): the group's entry states go to one group-sized buffer used again by every
    group instead of T/C states written once each (fresh memory, faulted in page by page)."""
    n, nh, t_len, dk = q.shape
    dv = v.shape[-1]
    nc, rows = -(-t_len // chunk_size), n * nh
    per = max(1, (GROUP_TOKENS if dk <= GROUP_KEYS else GROUP_TOKENS * GROUP_KEYS // dk) // (rows * chunk_size))
    groups = [(c0, min(c0 + per, nc)) for c0 in range(0, nc, per)]
    states = v.new_empty(nc if keep_states else 0, rows, dk, dv)
    buffer = None if keep_states or not groups else v.new_empty(groups[0][1], rows, dk, dv)
    out = chunk_buffer(v, n, nh, nc, chunk_size, (dv,))
    h_final = v.new_empty(rows, dk, dv)
    if nc == 0:
        return from_chunk_buffer(out, t_len), (h_final.zero_() if h0 is None else h0), states
    h, carry = (v.new_zeros(rows, dk, dv) if h0 is None else h0), v.new_empty(rows, dk, dv)
    chunked = _Chunked((a, q, b, k, gk, v), chunk_size)
    plans = {}  # the halving products' buffers and views, one plan per group size (at most two), a power-of-two C
    for c0, c1 in groups:
        plan = None
        if chunk_size & (chunk_size - 1) == 0:
            bt = (c1 - c0) * rows
            plan = plans.get(bt) or plans.setdefault(bt, OperandPlan(q, bt, 2, 2, chunk_size, dk, diagonal_from=1))
        a_q, b_k, gf, vf, exp_neg_gk = _operands(chunked, c0, c1, scale, plan)
        read, to_end, q_scaled, a_qb, a_qk, wu, *_ = _forward_terms(a_q, b_k, gf, vf, scale, exp_neg_gk, plan)
        w, u0 = wu[..., :dk], wu[..., dk:]
        writes = (b_k * to_end.unsqueeze(1)).transpose(-1, -2)  # [Bt, 2, K, L]: (B ⊙ e^{c_L − c})ᵀ, (K ⊙ e^{c_L − c})ᵀ
        b_write_t = writes[:, 0]
        from_v = torch.bmm(writes[:, 1], vf)  # [Bt, K, V] (K ⊙ e^{c_L − c})ᵀ V
        last = read[:, -1].unsqueeze(-1)
        u = torch.empty_like(u0)
        entering = states[c0:c1] if keep_states else buffer[:c1 - c0]
        entering[0].copy_(h)
        # the one sequential loop: two small products per chunk, written in place (each chunk's views made
        # at once by unbind: per-chunk slicing in Python costs as much as the products at small sizes)
        per_chunk = (t.unflatten(0, (c1 - c0, rows)).unbind(0) for t in (u0, w, u, from_v, last, b_write_t))
        leaving = entering.unbind(0)[1:] + (h_final if c1 == nc else carry,)
        for u0_c, w_c, u_c, from_v_c, last_c, b_write_c, h_in, h in zip(*per_chunk, entering.unbind(0), leaving):
            torch.baddbmm(u0_c, w_c, h_in, out=u_c)
            torch.addcmul(from_v_c, last_c, h_in, out=h).baddbmm_(b_write_c, u_c)
        o = torch.bmm(a_qk, vf).baddbmm_(a_qb, u)
        put_chunks(out, o.baddbmm_(q_scaled * read, entering.view(-1, dk, dv)), c0)
    return from_chunk_buffer(out, t_len), h_final, states


@torch.library.custom_op("fastweights::chunk_dplr_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, ab: Tensor, gk: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int, keep_states: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = q.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    with autocast_off(q.device), torch.no_grad():
        return chunk_dplr_fwd(q, k, v, ab, gk, h0_, scale, chunk_size, keep_states)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, ab, gk, h0, scale, chunk_size, keep_states=True):
    o, h_final, states = kda_chunk._fwd_fake(q, k, v, ab, gk, h0, scale, chunk_size)
    return o, h_final, (states if keep_states else states.new_empty((0,) + tuple(states.shape[1:])))


@torch.library.custom_op("fastweights::chunk_dplr_bwd", mutates_args=())
def _bwd_op(q: Tensor, k: Tensor, v: Tensor, ab: Tensor, gk: Tensor, states: Tensor, do: Tensor,
            dh_final: Tensor, scale: float, chunk_size: int, keep_states: bool = True,
            ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(do.device):
        return kda_chunk.chunk_kda_bwd(q, k, v, ab, gk, states, do, dh_final, scale, chunk_size,
                                       terms=_backward_terms, terms_backward=dplr_block_terms_backward)


@_bwd_op.register_fake
def _bwd_fake(q, k, v, ab, gk, states, do, dh_final, scale, chunk_size, keep_states=True):
    return kda_chunk._bwd_fake(q, k, v, ab, gk, states, do, dh_final, scale, chunk_size)


kda_chunk.register_chunk_autograd(_fwd_op, _bwd_op, lambda q, k, v, ab, gk: v.new_zeros(v.shape))


@torch.library.custom_op("fastweights::chunk_dplr_infer", mutates_args=())
def _infer_op(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor, h0: Optional[Tensor],
              scale: float, chunk_size: int) -> Tuple[Tensor, Tensor]:
    """``(o [N, H, T, V], h_T [N·H, K, V])``: the forward when no gradient is asked for, with a and b as
    they come (no stacked copy for a backward) and no chunk states kept."""
    n, nh, _, dk = q.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    with autocast_off(q.device), torch.no_grad():
        o, h_final, _ = chunk_dplr_fwd_pair(q, k, v, a, b, gk, h0_, scale, chunk_size, keep_states=False)
        return o, (h_final.clone() if h_final is h0_ else h_final)  # T = 0: never an alias of an input


@_infer_op.register_fake
def _infer_fake(q, k, v, a, b, gk, h0, scale, chunk_size):
    o, h_final, _ = kda_chunk._fwd_fake(q, k, v, a, gk, h0, scale, chunk_size)
    return o, h_final


def dplr_chunk(q, k, v, beta, gk, h0, scale, chunk_size, *, a, b) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)``. With a gradient to
    follow, the forward op with its backward (a and b stacked, the chunk states kept); else the
    inference op (:func:`_infer_op`)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, a, b, gk, h0)):
        o, h_final, _ = _fwd_op(q, k, v, torch.stack([a, b], dim=-2), gk, h0, float(scale), int(chunk_size), True)
    else:
        o, h_final = _infer_op(q, k, v, a, b, gk, h0, float(scale), int(chunk_size))
    return o, h_final.view(q.shape[0], q.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``).
CHUNK_DPLR_DELTA_RULE = OpSpec("chunk_dplr_delta_rule", Rule.DELTA, Form.CHUNK, torch=dplr_chunk, step=dplr_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.dplr.api", "chunk_dplr_delta_rule")
