"""Gated DeltaNet-2, chunk form: KDA's chunkwise UT/WY algorithm with GDN-2's block terms.

Per chunk of C tokens, the state-free terms of :func:`~.parallel.gdn2_block_terms` (KDA's
relative sub-block decay factors, every exponential of a number <= 0), then the one
sequential loop ``U' = U − W h``, ``h ← diag(e^{c_C}) h + (K ⊙ e^{c_C − c})ᵀ U'``, then the
outputs, batched. The forward (:func:`gdn2_chunk_fwd`) is KDA's
:func:`~fastweights.ops.kda.chunk.chunk_kda_fwd` with those terms, arranged for a forward
alone (:func:`_forward_terms`: S and P formed together by recursive halving,
:func:`~.._halving.halving_products`, every exponential still of a number <= 0; one
unit-triangular solve; nothing only the backward needs is kept, no chunk states without
grad); float64 agrees with that driver to rounding. The backward is KDA's hand-written one
(the adjoint loop, last chunk first) with :func:`~.parallel.gdn2_block_terms_backward`; both
are ``torch.library`` custom ops, opaque to ``torch.compile``.

On the CPU (backend ``"cpu"``, and ``"auto"`` there) the forward and the backward run on KDA's
compiled kernels (``ops/cpu/chunk_kda.cpp``). GDN-2's step
``h ← (I − k eᵀ) diag(e^g) h + k xᵀ`` is KDA's ``h ← (I − k (β k)ᵀ) diag(e^g) h + k (β v)ᵀ`` with
the erase key e in the place of β k and the written value x in the place of β v: the kernels take
e as an optional ``erase`` input (the rows of S and the left side of [W | U]; k stays the write
key: the columns of S and P, the state's update) with β = 1 and x as the values, and their
backward returns de beside dk. Without ``erase`` they are KDA's, bit for bit. The kernels keep
KDA's sub-block reference points (every exponential of a number <= 0). Backend ``"torch"`` (or
the kernels off or unbuilt, ``FASTWEIGHTS_CPU_KERNELS=0``) runs the PyTorch code below; both are
measured against the recurrence in BENCHMARKS.md.

The custom ops take the erase keys ``e = b ⊙ k`` and the gated values ``x = w ⊙ v``; those
two products, and their gradients to b, k, w and v, are ordinary autograd around them.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._chunk import chunk_buffer, flat_chunks, from_chunk_buffer, put_chunks
from .._halving import halving_products
from ..precision import autocast_off
from ..kda import chunk as kda_chunk
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

    The same algebra as :func:`~.parallel.gdn2_block_terms`, arranged for the forward alone: S and P
    are the decayed products of the rows (e, scale·q) with the keys, formed together by recursive
    halving (:func:`~.._halving.halving_products`: every exponential of a number <= 0, as KDA's
    sub-block reference points, with O(L·K) elementwise work per level instead of O(L²·K/s)), and
    nothing the backward would need is kept.
    """
    bt, length, dk = k.shape
    c = g.to(torch.float64).cumsum(-2)  # float64, as KDA's cumulative_decay
    read = c.to(k.dtype, copy=True).exp_()  # (a copy: c itself when the inputs are float64)
    to_end = torch.sub(c[:, -1:], c, out=torch.empty_like(k)).exp_()  # the float64 difference, rounded once
    rows = k.new_empty(bt, length, 2, dk)  # the row operands: e and scale·q
    rows[:, :, 0] = e
    q_scaled = torch.mul(q, scale, out=rows[:, :, 1])
    products = halving_products(c, rows, k.unsqueeze(2))
    # [W | U] = (I + S)⁻¹ [e ⊙ e^c | x]: a unit lower-triangular solve reads only S's strict lower
    # triangle (its diagonal e_r·k_r and the zero upper half are ignored); LAPACK's substitution, row by
    # row, is both faster here than the block substitution of the backward and backward stable in fp32
    rhs = k.new_empty(bt, length, dk + x.shape[-1])
    torch.mul(e, read, out=rhs[..., :dk])
    rhs[..., dk:] = x
    wu = torch.linalg.solve_triangular(products[0, 0], rhs, upper=False, unitriangular=True)
    return wu[..., :dk], wu[..., dk:], products[1, 0], q_scaled * read, k * to_end, read[:, -1]


def gdn2_chunk_fwd(q, k, e, x, g, h0, scale: float, chunk_size: int, keep_states: bool = True,
                   native: bool = False, decay_check=None):
    """Forward on head-first ``[N, H, T, ·]`` tensors (e = b ⊙ k, x = w ⊙ v), ``h0 [N·H, K, V]``
    or None; returns ``(o [N, H, T, V], h_T [N·H, K, V], states [NC, N·H, K, V])`` as KDA's
    :func:`~fastweights.ops.kda.chunk.chunk_kda_fwd` with GDN-2's terms, ``states[c]`` the state
    entering chunk c. Group by group: the group's terms (:func:`_forward_terms`), its part of the
    loop ``U' = U − W h``, ``h ← diag(e^{c_C}) h + K̄ᵀ U'``, its outputs ``P U' + Q̂ h``.

    ``keep_states=False`` (a forward no backward will follow) returns ``states`` with no chunks
    (``[0, N·H, K, V]``): the group's entry states go to one group-sized buffer used again by every
    group, instead of T/C states written once each (at B = 1, H = 8, K = V = 128, T = 2048: 32 MiB
    of fresh memory per call, faulted in page by page).

    ``native``: the compiled CPU kernel runs it where it applies (module docstring; it then keeps
    no states at all without ``keep_states``). ``decay_check``: ``(op, the caller's name for g)`` when
    the front end left g's checks (finite, <= 0) to the solver: the kernel's counts, else the
    front end's function (:func:`~fastweights.ops.kda.chunk.python_checks`)."""
    n, nh, t_len, dk = q.shape
    dv = x.shape[-1]
    nc, rows = -(-t_len // chunk_size), n * nh
    if native:
        compiled = kda_chunk._native_forward(q, k, x, None, g, h0, scale, chunk_size, keep_states, erase=e,
                                             decay_check=decay_check)
        if compiled is not None:
            o, h_final, states = compiled
            return o, h_final, (states if keep_states else x.new_empty(0, rows, dk, dv))
    kda_chunk.python_checks(q, k, x, g, decay_check=decay_check)
    per = max(1, GROUP // rows)
    states = x.new_empty(nc if keep_states else 0, rows, dk, dv)
    out = chunk_buffer(x, n, nh, nc, chunk_size, (dv,))
    h_final = x.new_empty(rows, dk, dv)
    if nc == 0:
        return from_chunk_buffer(out, t_len), (h_final.zero_() if h0 is None else h0), states
    buffer = None if keep_states else x.new_empty(min(per, nc), rows, dk, dv)  # one group's entry states
    h, carry = (x.new_zeros(rows, dk, dv) if h0 is None else h0), x.new_empty(rows, dk, dv)
    for c0 in range(0, nc, per):
        c1 = min(c0 + per, nc)
        flat = [flat_chunks(t, chunk_size, c0, c1) for t in (q, k, e, x, g)]
        w, u, scores, q_read, k_write, last = _forward_terms(*flat, scale, chunk_size)
        u_prime = torch.empty_like(u)
        k_write_t, last = k_write.transpose(-1, -2), last.unsqueeze(-1)
        entering = states[c0:c1] if keep_states else buffer[:c1 - c0]
        entering[0].copy_(h)
        for c in range(c1 - c0):  # the one sequential loop: two small products per chunk, written in place
            r = slice(c * rows, (c + 1) * rows)
            torch.baddbmm(u[r], w[r], entering[c], alpha=-1.0, out=u_prime[r])
            h = entering[c + 1] if c0 + c + 1 < c1 else (h_final if c1 == nc else carry)
            torch.mul(entering[c], last[r], out=h).baddbmm_(k_write_t[r], u_prime[r])
        put_chunks(out, torch.bmm(scores, u_prime).baddbmm_(q_read, entering.view(-1, dk, dv)), c0)
    return from_chunk_buffer(out, t_len), h_final, states


@torch.library.custom_op("fastweights::chunk_gdn2_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, e: Tensor, x: Tensor, g: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int, keep_states: bool = True, native: bool = False, check_decay: str = "",
            decay_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = k.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, x.shape[-1])
    with autocast_off(q.device):
        return gdn2_chunk_fwd(q, k, e, x, g, h0_, scale, chunk_size, keep_states, native,
                              (check_decay, decay_name) if check_decay else None)


@_fwd_op.register_fake
def _fwd_fake(q, k, e, x, g, h0, scale, chunk_size, keep_states=True, native=False, check_decay="", decay_name=""):
    o, h_final, states = kda_chunk._fwd_fake(q, k, x, e, g, h0, scale, chunk_size)
    return o, h_final, (states if keep_states else states.new_empty((0,) + tuple(states.shape[1:])))


@torch.library.custom_op("fastweights::chunk_gdn2_bwd", mutates_args=())
def _bwd_op(q: Tensor, k: Tensor, e: Tensor, x: Tensor, g: Tensor, states: Tensor, do: Tensor,
            dh_final: Tensor, scale: float, chunk_size: int, keep_states: bool = True, native: bool = False,
            check_decay: str = "", decay_name: str = "") -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(do.device):
        compiled = (kda_chunk._native_backward(q, k, x, None, g, states, do, dh_final, scale, chunk_size, erase=e)
                    if native else None)
        if compiled is not None:
            dq, dk, dx, de, dg, dh0 = compiled
        else:
            dq, dk, dx, de, dg, dh0 = kda_chunk.chunk_kda_bwd(q, k, x, e, g, states, do, dh_final, scale, chunk_size,
                                                              terms=gdn2_block_terms,
                                                              terms_backward=gdn2_block_terms_backward)
    return dq, dk, de, dx, dg, dh0


@_bwd_op.register_fake
def _bwd_fake(q, k, e, x, g, states, do, dh_final, scale, chunk_size, keep_states=True, native=False, check_decay="",
              decay_name=""):
    dq, dk, dx, de, dg, dh0 = kda_chunk._bwd_fake(q, k, x, e, g, states, do, dh_final, scale, chunk_size)
    return dq, dk, de, dx, dg, dh0


kda_chunk.register_chunk_autograd(_fwd_op, _bwd_op, lambda q, k, e, x, g: x.new_zeros(x.shape))


def gdn2_chunk(q, k, v, beta, g, h0, scale, chunk_size, *, b, w, native: bool = True, check_decay: str = "",
               decay_name: str = "g") -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form on head-first compute-dtype tensors; returns ``(o, h_T)`` (``beta`` unused).
    ``native``: whether the compiled CPU kernels may run forward and backward. ``check_decay`` (the
    op's name) and ``decay_name``: g's checks, left to the solver by the front end
    (:attr:`~.._spec.OpSpec.fused_decay_check`)."""
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, b, w, h0))
    o, h_final, _ = _fwd_op(q, k, b * k, w * v, g, h0, float(scale), int(chunk_size), keep, native,  # states: backward only
                            str(check_decay), str(decay_name))
    return o, h_final.view(k.shape[0], k.shape[1], *h_final.shape[1:])


#: The op, declared once (``fastweights/ops/_spec.py``): :func:`gdn2_chunk` without and with the compiled
#: CPU kernels.
CHUNK_GDN2 = OpSpec("chunk_gdn2", Rule.DELTA, Form.CHUNK, torch=functools.partial(gdn2_chunk, native=False),
                    cpu=gdn2_chunk, fused_decay_check=True, step=gdn2_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gdn2.api", "chunk_gdn2")
