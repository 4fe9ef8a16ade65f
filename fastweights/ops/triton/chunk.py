"""The chunk (gated) delta rule on Triton: launchers, autograd.Function, front end.

Equivalent to :func:`fastweights.ops.delta_rule.chunk.delta_rule_chunk` (same
maths, same regrouping; ``_chunk_kernels.py`` lists the symbols) and therefore to
the recurrent reference ``recurrent_delta_rule`` / ``recurrent_gated_delta_rule``.

Forward (two launches)::

    _wy_fwd_kernel     [chunks, H]          b, A⁻ = (I + A)⁻¹, W, U      (fully parallel)
    _state_fwd_kernel  [N·H, V/BV]          U', O, h per chunk           (sequential in chunks)

Backward (three launches)::

    _state_bwd_kernel    [N·H, V/BV]        dU', dh per chunk, dh0       (sequential, reversed)
    _grads_intra_kernel  [chunks, H]        dZ_U, dv, dP, dA; dβ, db parts (fully parallel)
    _grads_key_kernel    [chunks, H]        dq, dk, dβ, dg, K in blocks of 64 (fully parallel)

Memory kept for the backward (only when one can follow: ``backward_can_follow``):
the inputs, b (fp32, gated only), and in the input dtype A⁻ (C per token), W and
U' (K + V per token) and the state entering every chunk (``[chunks, H, K, V]``;
fp32 for fp32 inputs, half that for bf16/fp16). Every K, V <= 256 runs its
backward in the kernels.

The kernels read the inputs in their own layout ``[B, T, H, D]`` (no transposes,
no fp32 copies of bf16 inputs) and take varlen batches natively through
``cu_seqlens`` (a plain batch is B sequences of T tokens).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton

from .._backend import backward_can_follow
from .._checks import resolve_scale
from .._frontend import check_op_args
from ..feature_maps import FeatureMapLike, Identity, normalize_qk
from . import CHUNK_SIZE
from . import _chunk_kernels as kernels
from ._tuning import autotuned, capped

BT = CHUNK_SIZE


#: (num_warps, num_stages) the autotuner may pick, per kernel; ``benchmarks/triton_resources.py``
#: compiles every one of them for sm_90 and checks that it fits.
#: Four warps spill in the sequential and gradient kernels (up to 1.3 KB/thread, gated, K = V = 128,
#: bf16; 676 B in the intra-chunk gradients at K = 256); the kernels without a runtime loop have
#: nothing to pipeline (one stage).
CONFIGS = {
    "wy_fwd": [(4, 1), (8, 1)],
    "state_fwd": [(8, 2), (8, 3)],  # stages capped per launch: sequential_stages()
    "state_bwd": [(8, 2), (8, 3)],
    "grads_intra": [(8, 1)],
    "grads_key": [(8, 1)],
}


#: The config each kernel runs when autotuning is off (``_tuning.py``): per kernel, the one that spills
#: least at K = V = 128, bf16, in ``docs/results/triton_resources.json``.
PINNED = {"wy_fwd": (8, 1), "state_fwd": (8, 3), "state_bwd": (8, 3), "grads_intra": (8, 1), "grads_key": (8, 1)}


#: sm_90's shared memory per block, less what the sequential kernels use besides their pipelined tiles.
SHARED_BYTES = 232_448
SEQUENTIAL_OVERHEAD_BYTES = 32 * 1024


def sequential_stages(block_k: int, block_v: int, itemsize: int) -> int:
    """Pipeline stages (1-3) of the two sequential kernels that fit in sm_90's shared memory.

    Each stage buffers one chunk's [64, BK] tiles of q, k, w and a [64, BV] tile
    (u or dO) in the input dtype: 3 stages at K <= 128 in bf16, 1 at K = 256 in bf16 and
    for fp32 at K >= 128 (``benchmarks/triton_resources.py`` measures that they fit; the
    state adjoint needed 237,568 B at K = 256, bf16, 2 stages, over the limit).
    """
    per_stage = BT * (3 * block_k + block_v) * itemsize
    return max(1, min(3, (SHARED_BYTES - SEQUENTIAL_OVERHEAD_BYTES) // per_stage))


def _sequential_cap(named_args, kwargs) -> int:
    return sequential_stages(kwargs["BK"], kwargs["BV"], named_args["q"].element_size())


def _autotuned(kernel, name, key, stage_cap=None):
    return autotuned(kernel, CONFIGS[name], PINNED[name], key, stage_cap=stage_cap)


_KEY = ["K", "V", "BV", "GATED", "PREC"]
_wy_fwd = _autotuned(kernels._wy_fwd_kernel, "wy_fwd", _KEY)
_state_fwd = _autotuned(kernels._state_fwd_kernel, "state_fwd", _KEY + ["HAS_H0", "SAVE_STATES"], _sequential_cap)
_state_bwd = _autotuned(kernels._state_bwd_kernel, "state_bwd", _KEY + ["HAS_DHT", "STORE_DH0"], _sequential_cap)
_grads_intra = _autotuned(kernels._grads_intra_kernel, "grads_intra", _KEY)
_grads_key = _autotuned(kernels._grads_key_kernel, "grads_key", _KEY + ["BK"])


#: Column blocks of the parallel kernels (the sequential ones: ``_value_block``): the WY and
#: intra-chunk gradient kernels take V in blocks of 64; the key-gradient kernel takes K in
#: blocks of 64 (its three [64, BK] fp32 accumulators) and V in blocks of 32.
PARALLEL_VALUE_BLOCK = 64
KEY_GRAD_BLOCKS = (64, 32)


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
    Cached (about 15 small ops, every call of every layer otherwise): by (B, T, device)
    for a plain batch and by the offsets' values for a packed one (read on the host;
    the input check has read them already). The tables are read-only.
    """
    if cu_seqlens is None:
        return _cached_tables(None, batch, length, torch.device(device))
    return _cached_tables(tuple(cu_seqlens.tolist()), 1, length, torch.device(device))


@functools.lru_cache(maxsize=64)
def _cached_tables(offsets: Optional[Tuple[int, ...]], batch: int, length: int, device: torch.device):
    if offsets is None:
        n_chunks = triton.cdiv(length, BT)
        cu = torch.arange(0, batch + 1, device=device, dtype=torch.int64) * length
        counts = torch.full((batch,), n_chunks, device=device, dtype=torch.int64)
        total = batch * n_chunks
    else:
        cu = torch.tensor(offsets, device=device, dtype=torch.int64)
        lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:])]
        counts = torch.tensor([triton.cdiv(n, BT) for n in lengths], device=device, dtype=torch.int64)
        total = sum(triton.cdiv(n, BT) for n in lengths)
    chunk_offsets = torch.zeros(counts.numel() + 1, device=device, dtype=torch.int64)
    chunk_offsets[1:] = counts.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=total)
    within = torch.arange(total, device=device) - chunk_offsets[seq]
    return cu, torch.stack([seq, within], dim=1).to(torch.int32).contiguous(), chunk_offsets.to(torch.int32)


def _precision(v: torch.Tensor) -> str:
    """``input_precision`` of the kernels' fp32-operand ``tl.dot`` calls (``PREC``).

    - fp32 inputs: every product has fp32 operands and runs as ``"tf32x3"``: each
      operand is split into a tf32 high part and a tf32 remainder, and three tf32
      tensor-core products are summed, which recovers close to fp32 accuracy (not
      bit-equal to fp32 FMA). ``"ieee"`` (plain FMA, no tensor cores) was not chosen
      because those kernels compile for minutes and run several times slower. The
      device accuracy of this choice is checked by ``benchmarks/gpu_chunk_delta.py``
      (fp32 against float64); Triton's interpreter computes every dot exactly in fp32
      whatever this says, so the CPU tests cannot see it.
    - bf16/fp16 inputs: products take bf16/fp16 operands (PREC does not apply to
      them) with fp32 accumulation; the only fp32-operand products left are the
      16×16 blocks of the UT inverse, which run as ``"tf32"`` (10-bit mantissa, as
      fine as fp16 and finer than bf16).
    """
    return "tf32x3" if v.dtype == torch.float32 else "tf32"


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

    # A⁻, W, U (U' after the state kernel) and the chunk states in the input dtype: they are
    # tensor-core operands, rounded to it anyway (_chunk_kernels.py, "Precision").
    bcum = torch.empty(tokens, heads, device=dev, dtype=torch.float32) if gated else beta
    ainv = q.new_empty(tokens, heads, BT)
    w = q.new_empty(tokens, heads, dk)
    u = q.new_empty(tokens, heads, dv)
    _wy_fwd[(n_chunks, heads)](
        k, v, beta, g if gated else beta, bcum, ainv, w, u, cu, chunk_indices,
        heads, K=dk, V=dv, BT=BT, BK=bk, BV=_block(dv, PARALLEL_VALUE_BLOCK), GATED=gated, PREC=prec,
    )
    o = torch.empty_like(v)
    h_final = torch.empty(n_seqs, heads, dk, dv, device=dev, dtype=torch.float32)
    states = q.new_empty(n_chunks if save_for_backward else 1, heads, dk, dv)
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
    dstates = torch.empty(states.shape, device=dev, dtype=torch.float32)
    du = torch.empty(u.shape, device=dev, dtype=torch.float32)  # dU', then dZ_U
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
    # Between the two gradient kernels: dQK and dS' (C×C per chunk, input dtype: product
    # operands) and the parts of dβ and db that need all of K (fp32).
    d_qk, d_gram = q.new_empty(q.shape[0] * q.shape[1], heads, BT), q.new_empty(q.shape[0] * q.shape[1], heads, BT)
    dbeta_part = torch.empty(beta.shape, device=dev, dtype=torch.float32)
    db_part = torch.empty(beta.shape, device=dev, dtype=torch.float32) if gated else dbeta_part
    _grads_intra[(n_chunks, heads)](
        q, k, v, beta, bcum, ainv, u, do, du, dv_, d_qk, d_gram, dbeta_part, db_part, cu, chunk_indices,
        scale, heads, K=dk, V=dv, BT=BT, BK=bk, BV=_block(dv, PARALLEL_VALUE_BLOCK), GATED=gated, PREC=prec,
    )
    key_bk, key_bv = KEY_GRAD_BLOCKS
    _grads_key[(n_chunks, heads)](
        q, k, beta, bcum, states, dstates, do, u, du, d_qk, d_gram, dbeta_part, db_part,
        dq, dk_, dbeta, dg if gated else dbeta, cu, chunk_indices, scale,
        heads, K=dk, V=dv, BT=BT, BK=_block(dk, key_bk), BV=_block(dv, key_bv), GATED=gated, PREC=prec,
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
        o, h_final, saved = chunk_fwd(q, k, v, beta, g, h0, scale, cu, chunk_indices, chunk_offsets, train)
        if train:
            ctx.save_for_backward(q, k, v, beta, g, h0, cu, chunk_indices, chunk_offsets, *saved)
            ctx.scale = scale
        ctx.set_materialize_grads(False)
        return o, h_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dh_final):
        q, k, v, beta, g, h0, cu, chunk_indices, chunk_offsets, *saved = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dbeta, dg, dh0 = chunk_bwd(
            q, k, v, beta, g, h0, ctx.scale, cu, chunk_indices, chunk_offsets, saved, do, dh_final,
        )
        return dq, dk, dv, dbeta, dg, dh0, None, None, None


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
    scale = resolve_scale(scale, q.shape[-1])
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
    **dict.fromkeys(["ainv", "w", "u", "states", "d_qk", "d_gram"], "*in"),
    **dict.fromkeys(["du", "dstates", "h0", "h_final", "dh_final", "dh0", "dbeta_part", "db_part"], "*fp32"),
    "cu_seqlens": "*i64", "chunk_indices": "*i32", "chunk_offsets": "*i32", "scale": "fp32", "H": "i32",
}


ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}


def kernel_specs(dtypes, dims, gated_modes):
    """``(name, jit fn, dtype, K, gated, types, constexprs, configs)`` rows: every kernel as the launchers call it.

    Sizes are K = V = each of ``dims``; block sizes are the largest the launchers pick
    (the worst case for shared memory and registers); flags that add work are on.
    """
    from . import _decode_kernel

    prec = {"fp32": _precision(torch.empty(0)), "bf16": _precision(torch.empty(0, dtype=torch.bfloat16)),
            "fp16": _precision(torch.empty(0, dtype=torch.float16))}
    for dtype in dtypes:
        for dim in dims:
            bk = _block(dim, 256)
            for gated in gated_modes:
                types = dict(_ARG_TYPES, bcum="*fp32" if gated else "*in")
                common = dict(K=dim, V=dim, BT=BT, BK=bk, GATED=gated, PREC=prec[dtype])
                wide = dict(common, BV=_block(dim, PARALLEL_VALUE_BLOCK))
                seq = dict(common, BV=_value_block(dim, bk, 1 << 30, torch.device("cpu")))
                yield ("wy_fwd", kernels._wy_fwd_kernel, dtype, dim, gated, types, wide, CONFIGS["wy_fwd"])
                cap = sequential_stages(bk, seq["BV"], ITEMSIZE[dtype])
                yield ("state_fwd", kernels._state_fwd_kernel, dtype, dim, gated, types,
                       dict(seq, HAS_H0=True, STORE_FINAL=True, SAVE_STATES=True), capped(CONFIGS["state_fwd"], cap))
                yield ("state_bwd", kernels._state_bwd_kernel, dtype, dim, gated, types,
                       dict(seq, HAS_DHT=True, STORE_DH0=True), capped(CONFIGS["state_bwd"], cap))
                yield ("grads_intra", kernels._grads_intra_kernel, dtype, dim, gated, types, wide,
                       CONFIGS["grads_intra"])
                yield ("grads_key", kernels._grads_key_kernel, dtype, dim, gated, types,
                       dict(common, BK=_block(dim, KEY_GRAD_BLOCKS[0]), BV=_block(dim, KEY_GRAD_BLOCKS[1])),
                       CONFIGS["grads_key"])
                yield ("decode_step", _decode_kernel._delta_step_kernel, dtype, dim, gated,
                       dict(_ARG_TYPES, state="*fp32", K="i32", V="i32"),
                       dict(BK=bk, BV=min(32, bk), GATED=gated), _decode_kernel.CONFIGS)
