"""Linear attention, chunk form (Yang et al. 2024).

Split T into chunks of C tokens. Inside a chunk the work is the parallel form;
across chunks only the state is carried:

    O_[c] = scale · (Q_[c] ⊙ e^b) h_[c] + scale · tril(Q_[c] K_[c]ᵀ ⊙ Γ) V_[c]
    h_[c+1] = e^{b_C} h_[c] + (K_[c] ⊙ e^{b_C − b})ᵀ V_[c]

C = T gives the parallel form, C = 1 the recurrence. All intra-chunk products
are computed for every chunk at once; only :func:`~fastweights.ops._chunk.state_scan`
loops, T/C times (and not at all without decay: the states are then a running
sum over chunks, ``torch.cumsum``). :func:`linear_attn_chunk` carries a
hand-written backward that keeps the inputs and the T/C chunk-entry states only;
``delta_rule/README.md`` derives it (linear attention is the delta rule's chunk
algebra with W = 0, U = V). On the CPU (fp32/fp64) the forward and backward run compiled
(``fastweights/ops/cpu/chunk_linear_attn.cpp``, one (sequence, head) per task); this code
is the fallback (``FASTWEIGHTS_CPU_KERNELS=0``).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._chunk import (
    ChunkDecay, backward_only, chunk_buffer, flat_chunks, from_chunk_buffer, read_write_backward, reverse_cumsum, state_scan,
    state_scan_backward, unflat_chunks,
)
from .._backend import backward_can_follow, inference_op
from .._checks import check_qkv_finite
from ..precision import autocast_off
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..cpu import kernels_for, kernels_for_bf16, unit_last_stride
from ..step import linear_attn_step


def _terms(q, k, g, scale):
    """``(decay, P, Q_b, K̄)`` for flattened chunks ``[Bt, C, ·]``: P = scale·(Q Kᵀ ⊙ Γ)."""
    decay = ChunkDecay(g, k.shape[-2], k.device, k.dtype)
    scores = decay.mask_(q @ k.transpose(-1, -2)).mul_(scale)
    return decay, scores, decay.rows(q, decay.read), decay.rows(k, decay.to_end)


def chunk_linear_attn_fwd(q, k, v, g, h0, scale, n, nh):
    """Forward on flattened chunks ``[Bt, C, ·]``: ``(o [Bt, C, V], h_T [N·H, K, V], states [NC, N·H, K, V])``."""
    dk, dv = k.shape[-1], v.shape[-1]
    decay, scores, q_decayed, k_decayed = _terms(q, k, g, scale)
    nc = q.shape[0] // (n * nh)
    inject = (k_decayed.transpose(-1, -2) @ v).reshape(nc, n * nh, dk, dv)  # K̄ᵀ V
    last = None if decay.last is None else decay.last.reshape(nc, n * nh)
    states, h_final = state_scan(last, inject, h0)  # h ← e^{b_C} h + K̄ᵀ V
    o = torch.baddbmm(scores @ v, q_decayed, states.reshape(-1, dk, dv), alpha=scale)  # O = P V + scale·Q_b h
    return o, h_final, states


def chunk_linear_attn_bwd(q, k, v, g, states, do, dh_final, scale):
    """Backward on flattened chunks: ``(dq, dk, dv, dg_or_None, dh0)``; ``delta_rule/README.md`` derives it."""
    dk, dv = k.shape[-1], v.shape[-1]
    decay, scores, q_decayed, k_decayed = _terms(q, k, g, scale)
    grid = states.shape[:2]
    last = None if decay.last is None else decay.last.reshape(grid)
    inject_grad = (q_decayed.transpose(-1, -2) @ do).mul_(scale).reshape(grid + (dk, dv))  # Q̂ᵀ dO
    dh_next, dh0 = state_scan_backward(last, inject_grad, dh_final)
    states, dh_next = states.reshape(-1, dk, dv), dh_next.reshape(-1, dk, dv)
    dv_ = torch.baddbmm(scores.transpose(-1, -2) @ do, k_decayed, dh_next)
    d_last = None if decay.b is None else (states * dh_next).sum((-1, -2))
    dq, dk_, db = read_write_backward(
        q, k, decay, scores, q_decayed, k_decayed,
        d_scores=do @ v.transpose(-1, -2),
        d_q_decayed=(do @ states.transpose(-1, -2)).mul_(scale),
        d_k_decayed=v @ dh_next.transpose(-1, -2),
        d_last=d_last, scale=scale,
    )
    return dq, dk_, dv_, None if db is None else reverse_cumsum(db), dh0


# The chunk form as a differentiable custom op, opaque to torch.compile (as the delta
# rule's, ``delta_rule/chunk.py``): forward and backward are one call each.


def _not_aliasing(x: Tensor, source: Tensor) -> Tensor:
    """``x``, or a copy of it if it shares memory with ``source``."""
    return x.clone() if x.untyped_storage().data_ptr() == source.untyped_storage().data_ptr() else x


def _native_forward(q, k, v, g, h0, scale, chunk_size, keep: bool = True, check_finite: str = ""):
    """The custom op's forward by the compiled CPU kernel (``fastweights/ops/cpu/chunk_linear_attn.cpp``:
    the same algebra, one (sequence, head) per task, writing the kept flattened chunks as it gathers
    them), or None where it does not apply: T = 0, or not :func:`~fastweights.ops.cpu.kernels_for`
    the inputs. ``keep=False`` (no gradient asked for): nothing kept, the returned kept tensors empty.
    ``check_finite``: the op's name, for the finite check of q, k, v the kernel makes on each chunk's
    rows after its products ("" for none).

    Plain bf16 q, k, v (inference: ``keep=False``; g and h0 fp32): the fp32 kernel widens their rows
    as it gathers them and rounds o to bf16 once as it writes it (no pass converting the inputs
    first); o is then bf16, h_T fp32, bitwise what the fp32 kernel gives on the widened inputs with
    its output cast to bf16."""
    if k.shape[2] == 0:
        return None
    if v.dtype == torch.bfloat16 and not keep:  # plain bf16 inputs, widened in the gather
        mod = kernels_for_bf16(q, k, v, g, h0)
    else:
        mod = kernels_for(q, k, v, g, h0)
    if mod is None:
        return None
    n, nh, t_len, dk = k.shape
    q, k, v = unit_last_stride(q, k, v)
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    o, h_final, states, qc, kc, vc, gc = mod.chunk_linear_attn_fwd(q, k, v, g, h0_, float(scale), int(chunk_size), keep,
                                                                   check_finite)
    return from_chunk_buffer(o, t_len), h_final, states, qc, kc, vc, gc


def _native_backward(qc, kc, vc, gc, states, do, dh_final, scale, chunk_size):
    """The custom op's backward by the compiled CPU kernel, or None where it does not apply."""
    mod = kernels_for(qc, kc, vc, gc, states, do, dh_final)
    if mod is None:
        return None
    t_len = do.shape[2]
    do = unit_last_stride(do)
    dq, dk, dv, dg, dh0 = mod.chunk_linear_attn_bwd(qc, kc, vc, gc, states, do, dh_final, float(scale), int(chunk_size))
    grads = [from_chunk_buffer(x, t_len) for x in (dq, dk, dv)]
    grads.append(dg if gc is None else from_chunk_buffer(dg, t_len))
    return (*grads, dh0)


@torch.library.custom_op("fastweights::chunk_linear_attn_fwd", mutates_args=())
def _fwd_op(
    q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], h0: Optional[Tensor], scale: float, chunk_size: int,
    native: bool = True, check_finite: str = "",
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(o [N, H, T, V], h_T [N·H, K, V], states, qc, kc, vc, gc)``: the output and what the backward keeps
    (the flattened chunks of the inputs; ``gc`` empty without g). ``native``: the compiled CPU kernel
    may run it (backend ``"cpu"``); False runs the PyTorch code (backend ``"torch"``). ``check_finite``:
    the op's name when the front end left the finite check of q, k, v to the solver, else ""."""
    n, nh, t_len, dk = k.shape
    dv = v.shape[-1]
    with autocast_off(q.device):
        compiled = _native_forward(q, k, v, g, h0, scale, chunk_size, check_finite=check_finite) if native else None
        if compiled is not None:
            return compiled
        if check_finite:
            check_qkv_finite(check_finite, q, k, v)
        # flat_chunks returns the input itself when it is already laid out chunk-major (N = H = 1,
        # C dividing T); a custom op's outputs must not alias its inputs, so copy it then.
        qc, kc, vc, gc = (None if x is None else _not_aliasing(flat_chunks(x, chunk_size), x) for x in (q, k, v, g))
        h0_ = None if h0 is None else h0.reshape(n * nh, dk, dv)
        o, h_final, states = chunk_linear_attn_fwd(qc, kc, vc, gc, h0_, scale, n, nh)
        return unflat_chunks(o, n, nh, t_len), h_final, states, qc, kc, vc, q.new_empty(0) if gc is None else gc


@_fwd_op.register_fake
def _fwd_fake(q, k, v, g, h0, scale, chunk_size, native=True, check_finite=""):
    n, nh, t_len, dk = k.shape
    dv = v.shape[-1]
    nc = -(-t_len // chunk_size)
    qc, kc, vc = (x.new_empty(nc * n * nh, chunk_size, x.shape[-1]) for x in (q, k, v))
    gc = q.new_empty(0) if g is None else g.new_empty(nc * n * nh, chunk_size)
    o = from_chunk_buffer(chunk_buffer(v, n, nh, nc, chunk_size), t_len)
    return o, v.new_empty(n * nh, dk, dv), v.new_empty(nc, n * nh, dk, dv), qc, kc, vc, gc


@torch.library.custom_op("fastweights::chunk_linear_attn_bwd", mutates_args=())
def _bwd_op(
    qc: Tensor, kc: Tensor, vc: Tensor, gc: Optional[Tensor], states: Tensor, do: Tensor, dh_final: Tensor,
    scale: float, chunk_size: int, native: bool = True,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dh0)`` for ``do [N, H, T, V]``, head-first; ``dg`` empty without g."""
    n, nh, t_len = do.shape[:3]
    with autocast_off(do.device):
        compiled = _native_backward(qc, kc, vc, gc, states, do, dh_final, scale, chunk_size) if native else None
        if compiled is not None:
            return compiled
        doc = flat_chunks(do, chunk_size)
        dq, dk, dv, dg, dh0 = chunk_linear_attn_bwd(qc, kc, vc, gc, states, doc, dh_final, scale)
        grads = [unflat_chunks(x, n, nh, t_len) for x in (dq, dk, dv)]
        grads.append(do.new_empty(0) if dg is None else unflat_chunks(dg, n, nh, t_len))
        return (*grads, dh0)


@_bwd_op.register_fake
def _bwd_fake(qc, kc, vc, gc, states, do, dh_final, scale, chunk_size, native=True):
    n, nh, t_len = do.shape[:3]
    nc = states.shape[0]
    grads = [from_chunk_buffer(chunk_buffer(do, n, nh, nc, chunk_size, tail=(x.shape[-1],)), t_len) for x in (qc, kc, vc)]
    grads.append(do.new_empty(0) if gc is None else from_chunk_buffer(chunk_buffer(do, n, nh, nc, chunk_size, tail=()), t_len))
    return (*grads, torch.empty_like(dh_final))


def _setup_context(ctx, inputs, output):
    q, k, v, g, h0, scale, chunk_size, native, _ = inputs
    _, _, states, qc, kc, vc, gc = output
    ctx.save_for_backward(qc, kc, vc, None if g is None else gc, states)
    backward_only(ctx, states, qc, kc, vc, gc)
    ctx.scale, ctx.chunk_size, ctx.h0_shape, ctx.o_shape = scale, chunk_size, None if h0 is None else h0.shape, output[0].shape
    ctx.native = native


def _backward(ctx, do, dh_final, *unused):
    qc, kc, vc, gc, states = ctx.saved_tensors
    if dh_final is None:
        dh_final = states.new_zeros(states.shape[1:])
    if do is None:  # only h_T was used
        do = states.new_zeros(ctx.o_shape)
    dq, dk, dv, dg, dh0 = _bwd_op(qc, kc, vc, gc, states, do, dh_final, ctx.scale, ctx.chunk_size, ctx.native)
    dh0 = None if ctx.h0_shape is None else dh0.reshape(ctx.h0_shape)
    return dq, dk, dv, None if gc is None else dg, dh0, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


@inference_op("fastweights::chunk_linear_attn_infer")
def _infer_op(
    q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], h0: Optional[Tensor], scale: float, chunk_size: int,
    native: bool = True, check_finite: str = "",
) -> Tuple[Tensor, Tensor]:
    """``(o [N, H, T, V], h_T [N·H, K, V])``: the forward when no gradient is asked for, keeping
    nothing for a backward (the compiled kernel then reads the inputs where they lie). Plain bf16
    q, k, v (g, h0 fp32 or None): the fp32 forward on them widened, o in bf16 and h_T in fp32."""
    n, nh, t_len, dk = k.shape
    with autocast_off(q.device):
        compiled = _native_forward(q, k, v, g, h0, scale, chunk_size, False, check_finite=check_finite) if native else None
        if compiled is not None:
            return compiled[0], compiled[1]
        if check_finite:
            check_qkv_finite(check_finite, q, k, v)
        out_dtype = v.dtype
        if v.dtype == torch.bfloat16:  # plain bf16 inputs the compiled kernel did not take: widen here
            q, k, v = (t.float() for t in (q, k, v))
        qc, kc, vc, gc = (None if x is None else flat_chunks(x, chunk_size) for x in (q, k, v, g))
        h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
        o, h_final, _ = chunk_linear_attn_fwd(qc, kc, vc, gc, h0_, scale, n, nh)
        # h_T may be a view into the scan's stacked states: its own memory, as the fake says
        return unflat_chunks(o, n, nh, t_len).to(out_dtype), h_final.clone() if h_final.storage_offset() else h_final


@_infer_op.register_fake
def _infer_fake(q, k, v, g, h0, scale, chunk_size, native=True, check_finite=""):
    o, h_final, *_ = _fwd_fake(q, k, v, g, h0, scale, chunk_size, native)
    if v.dtype == torch.bfloat16:  # plain bf16 inputs: the state in fp32
        h_final = h_final.float()
    return o, h_final


def linear_attn_chunk(q, k, v, beta, g, h0, scale, chunk_size, native: bool = True,
                      check_finite: str = "") -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise sum rule on head-first compute-dtype tensors ``[N, H, T, D]``; returns ``(o, h_T)``.

    ``beta`` is unused (the solver signature of ``_frontend``); ``g``/``h0`` may be
    None. The hand-written backward keeps the inputs and the T/C chunk-entry states
    (O(T·(2K + V) + (T/C)·K·V) per head). Double backward is not supported.
    ``native``: whether the compiled CPU kernels may run forward and backward. ``check_finite``: the
    op's name when the front end left the finite check of q, k, v to the solver
    (:attr:`~fastweights.ops._spec.OpSpec.fused_finite_check`), else "".
    """
    if backward_can_follow(q, k, v, g, h0):
        o, h_final, *_ = _fwd_op(q, k, v, g, h0, float(scale), int(chunk_size), native, check_finite)
    else:  # inference: nothing kept for a backward
        o, h_final = _infer_op(q, k, v, g, h0, float(scale), int(chunk_size), native, check_finite)
    return o, h_final.view(k.shape[0], k.shape[1], *h_final.shape[1:])


#: Linear attention's chunk op, declared once (``fastweights/ops/_spec.py``): :func:`linear_attn_chunk`
#: without and with the compiled CPU kernels.
CHUNK_LINEAR_ATTN = OpSpec("chunk_linear_attn", Rule.SUM, Form.CHUNK, torch=functools.partial(linear_attn_chunk, native=False),
                           cpu=linear_attn_chunk, reads_bf16_inputs=True, fused_finite_check=True,
                           step=linear_attn_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.linear_attn.api", "chunk_linear_attn")
