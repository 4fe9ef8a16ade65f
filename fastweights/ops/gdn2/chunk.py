"""Gated DeltaNet-2, chunk form: KDA's chunkwise UT/WY algorithm with GDN-2's block terms.

Per chunk of C tokens, the state-free terms of :func:`~.parallel.gdn2_block_terms` (KDA's
relative sub-block decay factors, every exponential of a number <= 0), then the one
sequential loop ``U' = U − W h``, ``h ← diag(e^{c_C}) h + (K ⊙ e^{c_C − c})ᵀ U'``, then the
outputs, batched. The forward (:func:`gdn2_chunk_fwd`) is KDA's
:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd` with those terms, arranged for a forward
alone (:func:`_forward_terms`: S and P share their key factors, none of the zero upper
half of the cross-sub-block factors is formed, nothing only the backward needs is kept);
float64 agrees with that driver to rounding. The backward is KDA's hand-written one (the
adjoint loop, last chunk first) with :func:`~.parallel.gdn2_block_terms_backward`; both are
``torch.library`` custom ops, opaque to ``torch.compile``.

The custom ops take the erase keys ``e = b ⊙ k`` and the gated values ``x = w ⊙ v``; those
two products, and their gradients to b, k, w and v, are ordinary autograd around them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._chunk import chunk_buffer, flat_chunks, from_chunk_buffer, put_chunks
from ..precision import autocast_off
from ..kda import chunk as kda_chunk
from ..kda.parallel import sub_block
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .recurrent import gdn2_step
from .parallel import gdn2_block_terms, gdn2_block_terms_backward


#: Chunk-heads per group of the forward: its transient tensors (the largest, the right-hand decay
#: factors, C²·K/s per chunk-head) stay bounded independent of T, and the batched work per group
#: is large enough that Python overhead does not dominate (64 measured fastest of 32 to 256).
GROUP = 64


def _forward_terms(q, k, e, x, g, scale: float, chunk_size: int):
    """The state-free terms a forward needs for blocks ``q, k, e, g [Bt, L, K]``, ``x [Bt, L, V]``:
    ``(W, U, P, Q ⊙ e^c · scale, K ⊙ e^{c_L − c}, e^{c_L})``.

    The same algebra and reference points as :func:`~.parallel.gdn2_block_terms` (KDA's
    :class:`~..kda.parallel.RelativeDecay`), arranged for the forward alone: S and P share the
    write keys' right-hand factors, formed per sub-block j for the columns before it only
    (``k_i e^{c_m(j) − c_i}``, i < js: none of the zero half), the pairs inside a sub-block
    multiply the shared ``e^{c_r − c_i} k_i`` by e and q in one product, and nothing the
    backward would need is kept.
    """
    bt, length, dk = k.shape
    dtype = k.dtype
    s = sub_block(length)
    nb = length // s
    c = g.to(torch.float64).cumsum(-2)  # float64, as KDA's cumulative_decay
    cb = c.view(bt, nb, s, dk)
    ends = cb[:, :, -1]  # [Bt, nb, K] c at each sub-block's last token
    refs = torch.cat([c.new_zeros(bt, 1, dk), ends[:, :-1]], dim=1)  # c at the token before each sub-block
    local = (cb - refs.unsqueeze(2)).to(dtype)  # c_r − c_m(r) <= 0, [Bt, nb, s, K]
    e_left = torch.exp(local)
    read = torch.exp(c.to(dtype))
    last = read[:, -1]
    to_end = torch.exp((c[:, -1:] - c).to(dtype))
    # columns in sub-block j' < j seen from sub-block j: e^{c_m(j) − c_e(j')} · e^{c_e(j') − c_i}
    sub_end = torch.exp((ends.unsqueeze(2) - cb).to(dtype)).mul_(k.view(bt, nb, s, dk))  # k_i e^{c_e(j') − c_i}
    # e^{c_m(j) − c_e(j')}, used for j' < j only (exponent <= 0 there; the rest clamped, never read)
    across = torch.exp_((refs.unsqueeze(2) - ends.unsqueeze(1)).to(dtype).clamp_max_(0.0))  # [Bt, nb(j), nb(j'), K]
    left = e_left.view(bt, length, dk)
    e_left_, q_left = e * left, q * left
    sm, scores = k.new_zeros(bt, length, length), k.new_zeros(bt, length, length)
    for j in range(1, nb):  # sub-block j's rows against the columns before it, i < js (no zero factors formed)
        rows, before = slice(j * s, (j + 1) * s), j * s
        right_t = (across[:, j, :j].unsqueeze(2) * sub_end[:, :j]).view(bt, before, dk).transpose(-1, -2)
        sm[:, rows, :before].baddbmm_(e_left_[:, rows], right_t)
        scores[:, rows, :before].baddbmm_(q_left[:, rows], right_t)
    # inside a sub-block: e^{c_r − c_i} from the local exponents (differences of numbers <= 0 within s
    # tokens, each rounded once as KDA's are). Above the diagonal (i > r) the exponent is >= 0: clamped
    # to 0 (no exponential of a positive number, nothing infinite), and the entry is overwritten by tril_.
    diff = (local.unsqueeze(3) - local.unsqueeze(2)).clamp_max_(0.0)  # [Bt, nb, s(r), s(i), K]
    ky = torch.exp_(diff).mul_(k.view(bt, nb, 1, s, dk))  # e^{c_r − c_i} k_i
    xs = torch.stack([e.view(bt, nb, s, dk), q.view(bt, nb, s, dk)], dim=-1)  # [Bt, nb, s, K, 2]
    diag = torch.matmul(ky, xs)  # [Bt, nb, s(r), s(i), 2]
    sm.view(bt, nb, s, nb, s).diagonal(dim1=1, dim2=3).add_(diag[..., 0].permute(0, 2, 3, 1))
    scores.view(bt, nb, s, nb, s).diagonal(dim1=1, dim2=3).add_(diag[..., 1].permute(0, 2, 3, 1))
    sm.tril_(-1)
    scores.tril_().mul_(scale)
    rhs = x.new_empty(bt, length, dk + x.shape[-1])
    torch.mul(e, read, out=rhs[..., :dk])
    rhs[..., dk:] = x
    wu, _ = kda_chunk._solve_blocks(sm, q.new_ones(bt, length), rhs)
    return wu[..., :dk], wu[..., dk:], scores, q * read * scale, k * to_end, last


def gdn2_chunk_fwd(q, k, e, x, g, h0, scale: float, chunk_size: int):
    """Forward on head-first ``[N, H, T, ·]`` tensors (e = b ⊙ k, x = w ⊙ v), ``h0 [N·H, K, V]``
    or None; returns ``(o [N, H, T, V], h_T [N·H, K, V], states [NC, N·H, K, V])`` as KDA's
    :func:`~fastweights.ops.kda.chunk.chunk_kda_fwd` with GDN-2's terms, ``states[c]`` the state
    entering chunk c. Group by group: the group's terms (:func:`_forward_terms`), its part of the
    loop ``U' = U − W h``, ``h ← diag(e^{c_C}) h + K̄ᵀ U'``, its outputs ``P U' + Q̂ h``."""
    n, nh, t_len, dk = q.shape
    dv = x.shape[-1]
    nc, rows = -(-t_len // chunk_size), n * nh
    states = x.new_empty(nc, rows, dk, dv)
    out = chunk_buffer(x, n, nh, nc, chunk_size, (dv,))
    if nc == 0:
        return from_chunk_buffer(out, t_len), (x.new_zeros(rows, dk, dv) if h0 is None else h0), states
    if h0 is None:
        states[0].zero_()
    else:
        states[0].copy_(h0)
    h_final = x.new_empty(rows, dk, dv)
    per = max(1, GROUP // rows)
    for c0 in range(0, nc, per):
        c1 = min(c0 + per, nc)
        flat = [flat_chunks(t, chunk_size, c0, c1) for t in (q, k, e, x, g)]
        w, u, scores, q_read, k_write, last = _forward_terms(*flat, scale, chunk_size)
        u_prime = torch.empty_like(u)
        k_write_t, last = k_write.transpose(-1, -2), last.unsqueeze(-1)
        for c in range(c1 - c0):  # the one sequential loop: two small products per chunk, written in place
            r, i = slice(c * rows, (c + 1) * rows), c0 + c
            h = states[i]
            torch.baddbmm(u[r], w[r], h, alpha=-1.0, out=u_prime[r])
            torch.mul(h, last[r], out=states[i + 1] if i + 1 < nc else h_final).baddbmm_(k_write_t[r], u_prime[r])
        entering = states[c0:c1].view(-1, dk, dv)
        put_chunks(out, torch.bmm(scores, u_prime).baddbmm_(q_read, entering), c0)
    return from_chunk_buffer(out, t_len), h_final, states


@torch.library.custom_op("fastweights::chunk_gdn2_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, e: Tensor, x: Tensor, g: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = k.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, x.shape[-1])
    with autocast_off(q.device):
        return gdn2_chunk_fwd(q, k, e, x, g, h0_, scale, chunk_size)


@_fwd_op.register_fake
def _fwd_fake(q, k, e, x, g, h0, scale, chunk_size):
    return kda_chunk._fwd_fake(q, k, x, e, g, h0, scale, chunk_size)


@torch.library.custom_op("fastweights::chunk_gdn2_bwd", mutates_args=())
def _bwd_op(q: Tensor, k: Tensor, e: Tensor, x: Tensor, g: Tensor, states: Tensor, do: Tensor,
            dh_final: Tensor, scale: float, chunk_size: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(do.device):
        dq, dk, dx, de, dg, dh0 = kda_chunk.chunk_kda_bwd(q, k, x, e, g, states, do, dh_final, scale, chunk_size,
                                                          terms=gdn2_block_terms,
                                                          terms_backward=gdn2_block_terms_backward)
    return dq, dk, de, dx, dg, dh0


@_bwd_op.register_fake
def _bwd_fake(q, k, e, x, g, states, do, dh_final, scale, chunk_size):
    dq, dk, dx, de, dg, dh0 = kda_chunk._bwd_fake(q, k, x, e, g, states, do, dh_final, scale, chunk_size)
    return dq, dk, de, dx, dg, dh0


kda_chunk.register_chunk_autograd(_fwd_op, _bwd_op, lambda q, k, e, x, g: x.new_zeros(x.shape))


def gdn2_chunk(q, k, v, beta, g, h0, scale, chunk_size, *, b, w) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)`` (``beta`` unused)."""
    o, h_final, _ = _fwd_op(q, k, b * k, w * v, g, h0, float(scale), int(chunk_size))
    return o, h_final.view(k.shape[0], k.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``).
CHUNK_GDN2 = OpSpec("chunk_gdn2", Rule.DELTA, Form.CHUNK, torch=gdn2_chunk, step=gdn2_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gdn2.api", "chunk_gdn2")
