"""The chunk (gated) delta rule on Triton: launchers, autograd.Function, front end.

Equivalent to :func:`fastweights.ops.delta_rule.chunk.delta_rule_chunk` (same
maths, same regrouping; ``_chunk_kernels.py`` lists the symbols) and therefore to
the recurrent reference ``recurrent_delta_rule`` / ``recurrent_gated_delta_rule``.

Forward (two launches)::

    _wy_fwd_kernel     [chunks, H]          b, A⁻ = (I + A)⁻¹, W, U      (fully parallel)
    _state_fwd_kernel  [N·H, V/BV]          U', O, h per chunk           (sequential in chunks)

Backward (two launches)::

    _state_bwd_kernel  [N·H, V/BV]          dU', dh per chunk, dh0       (sequential, reversed)
    _grads_kernel      [chunks, H]          dq, dk, dv, dβ, dg           (fully parallel)

Memory kept for the backward: the inputs, b, A⁻ (C per token), W and U (K + V
per token, fp32) and the state entering every chunk (``[chunks, H, K, V]``,
fp32) -- the same per-chunk states the PyTorch chunk form keeps.

The kernels read the inputs in their own layout ``[B, T, H, D]`` (no transposes,
no fp32 copies of bf16 inputs) and take varlen batches natively through
``cu_seqlens`` (a plain batch is B sequences of T tokens).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton

from .._backend import backward_can_follow
from .._frontend import check_op_args
from ..feature_maps import FeatureMapLike, Identity, normalize_qk
from . import CHUNK_SIZE, interpreting
from . import _chunk_kernels as kernels

BT = CHUNK_SIZE


#: (num_warps, num_stages) the autotuner may pick, per kernel; ``benchmarks/triton_resources.py``
#: compiles every one of them for sm_90 and checks that it fits.
CONFIGS = {
    "wy_fwd": [(4, 1), (8, 1)],  # no loop to pipeline
    "state_fwd": [(4, 2), (4, 3), (8, 2), (8, 3)],
    "state_bwd": [(4, 2), (4, 3), (8, 2), (8, 3)],
    "grads": [(4, 1), (8, 1)],
}


def _autotuned(kernel, name, key):
    """Autotune over ``CONFIGS[name]`` on a GPU; the kernel as is under the interpreter."""
    if interpreting():
        return kernel
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w, s in CONFIGS[name]]
    return triton.autotune(configs=configs, key=key)(kernel)


_KEY = ["K", "V", "BV", "GATED", "PREC"]
_wy_fwd = _autotuned(kernels._wy_fwd_kernel, "wy_fwd", _KEY)
_state_fwd = _autotuned(kernels._state_fwd_kernel, "state_fwd", _KEY + ["HAS_H0", "SAVE_STATES"])
_state_bwd = _autotuned(kernels._state_bwd_kernel, "state_bwd", _KEY + ["HAS_DHT", "STORE_DH0"])
_grads = _autotuned(kernels._grads_kernel, "grads", _KEY)


def _block(dim: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(dim)))


def _value_block(value_dim: int, key_block: int, n_programs: int, device: torch.device) -> int:
    """V-block of the sequential kernels: 64, or 32 for K > 128 (shared memory) or when
    (sequences × heads) would leave SMs idle."""
    bv = _block(value_dim, 64 if key_block <= 128 else 32)
    if bv == 64 and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if n_programs * triton.cdiv(value_dim, 64) < 2 * sms:
            bv = 32
    return bv


def chunk_tables(cu_seqlens: Optional[torch.Tensor], batch: int, length: int, device) -> Tuple[torch.Tensor, ...]:
    """``(cu_seqlens, chunk_indices [NT, 2], chunk_offsets [N + 1])`` for the kernels.

    A plain batch is B sequences of T tokens packed along B·T, so one code path
    serves both; chunk c of sequence n is global chunk ``chunk_offsets[n] + c``.
    """
    if cu_seqlens is None:
        n_chunks = triton.cdiv(length, BT)
        cu = torch.arange(0, batch + 1, device=device, dtype=torch.int64) * length
        counts = torch.full((batch,), n_chunks, device=device, dtype=torch.int64)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64).contiguous()
        counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.zeros(counts.numel() + 1, device=device, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    total = int(offsets[-1]) if cu_seqlens is not None else batch * triton.cdiv(length, BT)
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=total)
    within = torch.arange(total, device=device) - offsets[seq]
    return cu, torch.stack([seq, within], dim=1).to(torch.int32).contiguous(), offsets.to(torch.int32)


def _precision(v: torch.Tensor) -> str:
    """tl.dot input precision: fp32 inputs get fp32-accurate products from three tf32
    passes (plain "ieee" FMA dots compile for minutes); bf16/fp16 inputs get tf32,
    whose 10-bit mantissa is finer than the inputs' own rounding."""
    return "tf32x3" if v.dtype == torch.float32 else "tf32"


# The gradient kernel keeps [64, K] fp32 tiles; tf32 tensor-core operands for K > 128
# need more than Hopper's 227 KB of shared memory per block. There (GPU only; the
# interpreter has no such limit and tests the kernel at K = 256) the backward runs
# the PyTorch chunk form: correct, not fast.
MAX_KERNEL_BACKWARD_KEY_BLOCK = 128


def use_torch_backward_block(key_block: int) -> bool:
    return key_block > MAX_KERNEL_BACKWARD_KEY_BLOCK


def use_torch_backward(key_dim: int) -> bool:
    return not interpreting() and use_torch_backward_block(_block(key_dim, 256))


def sequential_grid(n_seqs: int, heads: int, value_dim: int, bv: int) -> Tuple[int, int]:
    """Grid of the two sequential kernels: (sequence, head) on axis 0, which CUDA allows up to
    2³¹ − 1 (axes 1 and 2 stop at 65,535, which N·H passes at 4,096 sequences of 16 heads)."""
    return n_seqs * heads, triton.cdiv(value_dim, bv)


def _launch_geometry(q, v, g, chunk_indices, chunk_offsets):
    """Sizes, block shapes and precision shared by the forward and backward launches."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    n_seqs = chunk_offsets.numel() - 1
    n_chunks = chunk_indices.shape[0]
    dev = q.device
    bk = _block(dk, 256)
    bv = _value_block(dv, bk, n_seqs * heads, dev)
    return batch, length, heads, dk, dv, n_seqs, n_chunks, dev, g is not None, bk, bv, _precision(v)


def chunk_fwd(q, k, v, beta, g, h0, scale, cu, chunk_indices, chunk_offsets, save_for_backward: bool):
    """Forward launches on ``[B, T, H, D]`` inputs; returns ``(o, h_T, saved)``."""
    batch, length, heads, dk, dv, n_seqs, n_chunks, dev, gated, bk, bv, prec = _launch_geometry(
        q, v, g, chunk_indices, chunk_offsets)
    tokens = batch * length

    bcum = torch.empty(tokens, heads, device=dev, dtype=torch.float32) if gated else beta
    ainv = torch.empty(tokens, heads, BT, device=dev, dtype=torch.float32)
    w = torch.empty(tokens, heads, dk, device=dev, dtype=torch.float32)
    u = torch.empty(tokens, heads, dv, device=dev, dtype=torch.float32)
    _wy_fwd[(n_chunks, heads)](
        k, v, beta, g if gated else beta, bcum, ainv, w, u, cu, chunk_indices,
        heads, K=dk, V=dv, BT=BT, BK=bk, BV=bv, GATED=gated, PREC=prec,
    )
    o = torch.empty_like(v)
    h_final = torch.empty(n_seqs, heads, dk, dv, device=dev, dtype=torch.float32)
    states = torch.empty(n_chunks if save_for_backward else 1, heads, dk, dv, device=dev, dtype=torch.float32)
    _state_fwd[sequential_grid(n_seqs, heads, dv, bv)](
        q, k, w, u, bcum, o, h0 if h0 is not None else h_final, h_final, states, cu, chunk_offsets, scale,
        heads, K=dk, V=dv, BT=BT, BK=bk, BV=bv, GATED=gated, HAS_H0=h0 is not None, STORE_FINAL=True,
        SAVE_STATES=save_for_backward, PREC=prec,
    )
    return o, h_final, (bcum, ainv, w, u, states)


def chunk_bwd(q, k, v, beta, g, h0, scale, cu, chunk_indices, chunk_offsets, saved, do, dh_final):
    """Backward launches; returns ``(dq, dk, dv, dbeta, dg, dh0)`` (``dg``/``dh0`` None when absent)."""
    bcum, ainv, w, u, states = saved
    batch, length, heads, dk, dv, n_seqs, n_chunks, dev, gated, bk, bv, prec = _launch_geometry(
        q, v, g, chunk_indices, chunk_offsets)

    # Cotangents arrive in any layout (``o.sum()`` gives a stride-0 one); the kernels
    # index every tensor as dense, so each one they read is made contiguous here.
    do = do.contiguous()
    dh_final = None if dh_final is None else dh_final.contiguous()
    dstates = torch.empty_like(states)
    du = torch.empty_like(u)
    dh0 = torch.empty_like(h0) if h0 is not None else None
    _state_bwd[sequential_grid(n_seqs, heads, dv, bv)](
        q, k, w, bcum, do, dh_final if dh_final is not None else du, dh0 if dh0 is not None else du,
        dstates, du, cu, chunk_offsets, scale,
        heads, K=dk, V=dv, BT=BT, BK=bk, BV=bv, GATED=gated, HAS_DHT=dh_final is not None,
        STORE_DH0=dh0 is not None, PREC=prec,
    )
    dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbeta = torch.empty_like(beta)
    dg = torch.empty_like(g) if gated else None
    _grads[(n_chunks, heads)](  # V-blocks of 32 keep its shared memory under 200 KB at K = 128
        q, k, v, beta, bcum, ainv, w, u, states, dstates, do, du,
        dq, dk_, dv_, dbeta, dg if gated else dbeta, cu, chunk_indices, scale,
        heads, K=dk, V=dv, BT=BT, BK=bk, BV=_block(dv, 32), GATED=gated, PREC=prec,
    )
    return dq, dk_, dv_, dbeta, dg, dh0


class ChunkDeltaRuleTriton(torch.autograd.Function):
    """``apply(q, k, v, beta, g, h0, scale, cu_seqlens, train) -> (o, h_T)`` on ``[B, T, H, D]`` tensors.

    ``g=None`` is the plain delta rule; ``h0`` may be None. ``cu_seqlens`` (B = 1)
    packs sequences along T. ``train`` (:func:`backward_can_follow`, decided by the
    caller: inside ``forward`` grad mode is always off and ``ctx.needs_input_grad``
    ignores ``no_grad``) says whether to keep the per-chunk states and the rest. Gradients reach q, k, v, beta, g and h0, and the
    cotangent of h_T is honoured. Double backward is not supported.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, g, h0, scale, cu_seqlens, train):
        q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
        g = None if g is None else g.contiguous()
        h0 = None if h0 is None else h0.contiguous()
        cu, chunk_indices, chunk_offsets = chunk_tables(cu_seqlens, q.shape[0], q.shape[1], q.device)
        keep_states = train and not use_torch_backward(q.shape[-1])
        o, h_final, saved = chunk_fwd(q, k, v, beta, g, h0, scale, cu, chunk_indices, chunk_offsets, keep_states)
        if train:
            ctx.save_for_backward(q, k, v, beta, g, h0, cu, chunk_indices, chunk_offsets, *saved)
            ctx.scale, ctx.cu_seqlens = scale, cu_seqlens
        ctx.set_materialize_grads(False)
        return o, h_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dh_final):
        q, k, v, beta, g, h0, cu, chunk_indices, chunk_offsets, *saved = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        if use_torch_backward(q.shape[-1]):
            return (*_torch_backward(q, k, v, beta, g, h0, ctx.scale, ctx.cu_seqlens, do, dh_final), None, None, None)
        dq, dk, dv, dbeta, dg, dh0 = chunk_bwd(
            q, k, v, beta, g, h0, ctx.scale, cu, chunk_indices, chunk_offsets, saved, do, dh_final,
        )
        return dq, dk, dv, dbeta, dg, dh0, None, None, None


def _torch_backward(q, k, v, beta, g, h0, scale, cu_seqlens, do, dh_final):
    """Gradients from the PyTorch chunk form (recomputes its forward); see ``use_torch_backward``."""
    from ..delta_rule.chunk import chunk_delta_rule

    with torch.enable_grad():
        leaves = [x.detach().requires_grad_(True) if x is not None else None for x in (q, k, v, beta, g, h0)]
        xq, xk, xv, xb, xg, xh = leaves
        if xg is not None:
            from ..gated_delta_rule.chunk import chunk_gated_delta_rule

            o, h_final = chunk_gated_delta_rule(xq, xk, xv, xg, xb, scale=scale, initial_state=xh,
                                                output_final_state=True, cu_seqlens=cu_seqlens, backend="torch")
        else:
            o, h_final = chunk_delta_rule(xq, xk, xv, xb, scale=scale, initial_state=xh,
                                          output_final_state=True, cu_seqlens=cu_seqlens, backend="torch")
        outputs, cotangents = [o], [do]
        if dh_final is not None:
            outputs.append(h_final)
            cotangents.append(dh_final)
        used = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad(outputs, used, cotangents, allow_unused=True))
    return tuple(next(grads) if x is not None else None for x in leaves)


def chunk_op_triton(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    beta: Optional[torch.Tensor],
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    chunk_size: int = CHUNK_SIZE,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    requires_g: bool = False,
    allow_neg_eigval: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The Triton path of ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` (same arguments and returns).

    Validation is the shared ``check_op_args``; ``select_backend`` has already
    checked dtype, head sizes and chunk size. Feature maps and q/k normalization
    run in PyTorch (fp32) in front of the kernels, as in ``run_op``.
    """
    phi = check_op_args(
        op, q, k, v, beta=beta, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        scale=scale, feature_map=feature_map, qk_norm=qk_norm, requires_beta=True, requires_g=requires_g,
        allow_neg_eigval=allow_neg_eigval,
    )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not isinstance(phi, Identity) or qk_norm is not None:
        q = normalize_qk(phi(q.float()), qk_norm, op)
        k = normalize_qk(phi(k.float()), qk_norm, op)
    o, h_final = ChunkDeltaRuleTriton.apply(q, k, v, beta, g, initial_state, scale, cu_seqlens,
                                            backward_can_follow(q, k, v, beta, g, initial_state))
    return o, (h_final if output_final_state else None)


# Argument types of the kernels for ahead-of-time compilation (benchmarks/triton_resources.py):
# "*in" is the input dtype; the rest as the launchers above allocate them.
_ARG_TYPES = {
    **dict.fromkeys(["q", "k", "v", "beta", "g", "o", "do", "dq", "dk", "dv", "dbeta", "dg"], "*in"),
    **dict.fromkeys(["ainv", "w", "u", "states", "dstates", "du", "h0", "h_final", "dh_final", "dh0"], "*fp32"),
    "cu_seqlens": "*i64", "chunk_indices": "*i32", "chunk_offsets": "*i32", "scale": "fp32", "H": "i32",
}


def kernel_specs(dtypes, dims, gated_modes):
    """``(name, jit fn, dtype, K, types, constexprs, configs)`` rows: every kernel as the launchers call it.

    Sizes are K = V = each of ``dims``; block sizes are the largest the launchers pick
    (the worst case for shared memory and registers); flags that add work are on.
    """
    from . import _decode_kernel

    prec = {"fp32": _precision(torch.empty(0)), "bf16": _precision(torch.empty(0, dtype=torch.bfloat16)),
            "fp16": _precision(torch.empty(0, dtype=torch.float16))}
    for dtype in dtypes:
        for dim in dims:
            bk = _block(dim, 256)
            bv = _block(dim, 64 if bk <= 128 else 32)
            for gated in gated_modes:
                types = dict(_ARG_TYPES, bcum="*fp32" if gated else "*in")
                common = dict(K=dim, V=dim, BT=BT, BK=bk, BV=bv, GATED=gated, PREC=prec[dtype])
                yield ("wy_fwd", kernels._wy_fwd_kernel, dtype, dim, gated, types, common, CONFIGS["wy_fwd"])
                yield ("state_fwd", kernels._state_fwd_kernel, dtype, dim, gated, types,
                       dict(common, HAS_H0=True, STORE_FINAL=True, SAVE_STATES=True), CONFIGS["state_fwd"])
                yield ("state_bwd", kernels._state_bwd_kernel, dtype, dim, gated, types,
                       dict(common, HAS_DHT=True, STORE_DH0=True), CONFIGS["state_bwd"])
                if not use_torch_backward_block(bk):
                    yield ("grads", kernels._grads_kernel, dtype, dim, gated, types,
                           dict(common, BV=_block(dim, 32)), CONFIGS["grads"])
                yield ("decode_step", _decode_kernel._delta_step_kernel, dtype, dim, gated,
                       dict(_ARG_TYPES, state="*fp32", K="i32", V="i32"),
                       dict(BK=bk, BV=min(32, bk), GATED=gated), _decode_kernel.CONFIGS)
