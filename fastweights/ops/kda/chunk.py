"""Kimi Delta Attention, chunk form: the UT transform per chunk, in the relative-decay form.

For chunks of C tokens (README.md in this folder derives every line; ``parallel.py`` holds
the state-free terms, :func:`~.parallel.block_terms`):

    b = cumsum(gk) inside the chunk                    [C, K], one column per key channel
    S, P = decayed key products and scores             relative form: every exp(·) ≤ 1
    [W | U] = (I + diag(β) S)⁻¹ diag(β) [K ⊙ e^b | V]   } one batched computation
                                                        } over all chunks
    U' = U − W h                                       ] T/C sequential steps
    h ← diag(e^{b_C}) h + (K ⊙ e^{b_C − b})ᵀ U'         ]
    O  = scale·(Q ⊙ e^b) h + P U'                      batched again, from the saved states

The cumulative decays are measured from inside the chunk (b starts at 0 at every chunk),
and every exponential taken is of a number ≤ 0, so neither e^b, e^{b_C − b} nor the
relative factors of S and P can overflow, however strong the decay and however long
the chunk (tested with α = 1e-3 per token and C = 128).

The backward is written by hand: the adjoint of the loop runs last chunk first,
``dU'_c = Pᵀ dO_c + K̄_c dh_{c+1}``, ``dh_c = diag(e^{b_C}) dh_{c+1} + Q̂ᵀ dO_c − W_cᵀ dU'_c``,
then :func:`~.parallel.block_terms_backward` takes the cotangents of W, U, P, Q̂, K̄ and
e^{b_C} back to q, k, v, β and gk for all chunks at once. The forward keeps only the
inputs and the T/C states entering the chunks; the backward recomputes the rest. Forward
and backward are ``torch.library`` custom ops, opaque to ``torch.compile`` (no graph break).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .._backend import backward_can_follow, inference_op
from .._checks import bf16_operands, check_decay, check_decay_stats, check_qkv_finite
from .._chunk import backward_only, chunk_buffer, flat_chunks, from_chunk_buffer, put_chunks
from ..precision import autocast_off
from ..cpu import kernels_for, kernels_for_bf16, unit_last_stride
from ..delta_rule.wy import block_substitution, diagonal_block_inverses, ut_solve
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from .parallel import block_terms, block_terms_backward, sub_block
from ..step import kda_step

#: Row blocks of the UT solve (``delta_rule/wy.py``'s block substitution).
UT_BLOCKS = 4


def _solve_blocks(s, beta, rhs):
    """The UT transform by block substitution; keeps the diagonal-block inverses for the adjoint."""
    inverses = diagonal_block_inverses(s, beta, UT_BLOCKS)
    return ut_solve(s, beta, inverses, rhs), inverses


def _solve_blocks_adjoint(a, inverses, dy):
    """``(I + A)⁻ᵀ dY`` with the forward's diagonal-block inverses."""
    return block_substitution(a, inverses, dy, transpose=True)


#: Chunk-heads per group: the forward and the backward work through the chunks in groups of
#: this many (chunk, head) pairs, so the transient tensors (the sub-block decay factors are
#: O(C·(s + C/s)·K) per chunk-head) stay bounded, independent of T.
GROUP = 64


def _groups(nc: int, rows: int):
    """``(c0, c1)`` ranges of chunks, about :data:`GROUP` chunk-heads each."""
    per = max(1, GROUP // rows)
    return [(c0, min(c0 + per, nc)) for c0 in range(0, nc, per)]


def _chunk_terms(q, k, v, beta, gk, scale, chunk_size, c0, c1, terms=block_terms):
    """Chunks ``c0 .. c1 − 1`` flattened (``[NC'·N·H, C, ·]``, chunk-major) and their
    :class:`~.parallel.BlockTerms` (``terms``: :func:`~.parallel.block_terms` or a rule's own)."""
    flat = [flat_chunks(t, chunk_size, c0, c1) for t in (q, k, v, beta, gk)]
    return flat, terms(*flat, scale, solve=_solve_blocks)


def _native_forward(q, k, v, beta, gk, h0, scale, chunk_size, keep: bool = True, *, erase=None, check_finite="",
                    decay_check=None):
    """:func:`chunk_kda_fwd` by the compiled CPU kernel (``fastweights/ops/cpu/chunk_kda.cpp``: the
    same algebra and sub-block reference points, one (sequence, head) per task), or None where it
    does not apply: T = 0, or not :func:`~fastweights.ops.cpu.kernels_for` the inputs.
    ``keep=False`` (no gradient asked for): the chunk states are not kept (``states`` is empty).

    GDN-2 (``ops/gdn2/chunk.py``) runs on the same kernel: ``erase`` its erase keys ``b ⊙ k``
    ``[N, H, T, K]`` (the kernel's erase side, where KDA has β k), ``v`` its written values
    ``w ⊙ v`` and ``beta`` None (β = 1).

    The kernel makes the ops' input checks on the rows it reads: ``check_finite`` (the op's name)
    the finite check of q, k, v; ``decay_check`` (``(op, the caller's name for gk)``) the checks of
    gk (finite, <= 0: :func:`~.._checks.check_decay_stats` on the kernel's counts).

    Plain bf16 q, k, v (inference: ``keep=False``, KDA only, beta, gk and h0 fp32): the fp32 kernel
    widens their rows as it gathers them and rounds o to bf16 once as it writes it (no pass converting
    the inputs first); o is then bf16, h_T fp32, bitwise what the fp32 kernel gives on the widened
    inputs with its output cast to bf16."""
    if k.shape[2] == 0:
        return None
    if v.dtype == torch.bfloat16 and not keep and erase is None:  # plain bf16 inputs, widened in the gather
        mod = kernels_for_bf16(q, k, v, beta, gk, h0)
    else:
        mod = kernels_for(q, k, v, beta, gk, h0, erase)
    if mod is None:
        return None
    q, k, v, gk, erase = unit_last_stride(q, k, v, gk, erase)
    o, h, states, stats = mod.chunk_kda_fwd(q, k, v, beta, gk, h0, float(scale), int(chunk_size), sub_block(chunk_size),
                                            keep, erase, check_finite, decay_check is not None)
    if decay_check is not None:
        check_decay_stats(*decay_check, stats)
    return from_chunk_buffer(o, k.shape[2]), h, states


def _native_forward_bf16(q, k, v, beta, gk, h0, scale, chunk_size, *, check_finite="", decay_check=None):
    """The bf16-products inference forward (:func:`fastweights.ops.bf16_products`) by the compiled
    kernel (``fastweights/ops/cpu/chunk_kda_bf16.cpp``: the decayed rows Q e^b, K e^b, K e^{−b}
    formed in fp32 and rounded to bf16 once, every product on bf16 operands with fp32
    accumulation; the state, the decays, the solve and the sums fp32; chunks with extreme decays
    take S and P pair by pair in fp32): ``(o [N, H, T, V] bf16, h_T [N·H, K, V] fp32)``, or None
    where it does not apply: T = 0, v not bf16, or not :func:`~fastweights.ops.cpu.kernels_for`
    beta, gk, h0 as fp32 CPU tensors. ``check_finite``, ``decay_check``: as for :func:`_native_forward`."""
    mod = kernels_for_bf16(q, k, v, beta, gk, h0, operands=True) if k.shape[2] > 0 else None
    if mod is None:
        return None
    q, k, check_finite = bf16_operands(check_finite, q, k, v)
    q, k, v, gk = unit_last_stride(q, k, v, gk)
    o, h, stats = mod.chunk_kda_fwd_bf16(q, k, v, beta, gk, h0, float(scale), int(chunk_size), check_finite,
                                         decay_check is not None)
    if decay_check is not None:
        check_decay_stats(*decay_check, stats)
    return from_chunk_buffer(o, k.shape[2]), h


def _check_args(check_finite: str, check_decay: str, decay_name: str):
    """The custom ops' check arguments as :func:`_native_forward` takes them: ``(check_finite, decay_check)``."""
    return check_finite, ((check_decay, decay_name) if check_decay else None)


def python_checks(q, k, v, gk, check_finite: str = "", decay_check=None) -> None:
    """The checks the front end left to the solver, where the compiled kernel does not make them:
    the same functions the front end calls (:func:`~.._checks.check_qkv_finite`, :func:`~.._checks.check_decay`)."""
    if check_finite:
        check_qkv_finite(check_finite, q, k, v)
    if decay_check is not None:
        check_decay(*decay_check, gk)


def chunk_kda_fwd(q, k, v, beta, gk, h0, scale: float, chunk_size: int, terms=block_terms, native: bool = True,
                  check_finite: str = "", decay_check=None):
    """Forward on head-first ``[N, H, T, ·]`` tensors, ``h0 [N·H, K, V]`` or None.

    ``terms`` computes a block's :class:`~.parallel.BlockTerms` from the five per-token
    inputs; another rule with KDA's block structure (GDN-2: ``ops/gdn2``) passes its own.

    Returns ``(o [N, H, T, V], h_T [N·H, K, V], states [NC, N·H, K, V])``, ``states[c]`` the
    state entering chunk c. Group by group (:data:`GROUP`): the group's block terms, its part
    of the loop, its outputs. On the CPU the compiled kernel runs it where it applies, unless
    ``native`` is False (backend ``"torch"``). ``check_finite``, ``decay_check``: the input checks
    the front end left to the solver (:func:`_native_forward`; else :func:`python_checks`).
    """
    # the compiled kernel is KDA's own block terms (another rule's terms run the PyTorch code below)
    compiled = (_native_forward(q, k, v, beta, gk, h0, scale, chunk_size, check_finite=check_finite,
                                decay_check=decay_check) if native and terms is block_terms else None)
    if compiled is not None:
        return compiled
    python_checks(q, k, v, gk, check_finite, decay_check)
    n, nh, t_len, dk = q.shape  # (k may carry more per token: DeltaProduct's sub-steps)
    dv = v.shape[-1]
    nc, rows = -(-t_len // chunk_size), n * nh
    states = v.new_empty(nc, rows, dk, dv)
    out = chunk_buffer(v, n, nh, nc, chunk_size, (dv,))  # one output row per token, whatever v carries per token
    h = v.new_zeros(rows, dk, dv) if h0 is None else h0
    for c0, c1 in _groups(nc, rows):
        _, x = _chunk_terms(q, k, v, beta, gk, scale, chunk_size, c0, c1, terms)
        w, u = x.wu[..., :dk], x.wu[..., dk:]
        u_prime = torch.empty_like(u)
        k_write_t, last = x.k_write.transpose(-1, -2), x.last.unsqueeze(-1)
        for c in range(c1 - c0):  # the one sequential loop: two small products per chunk
            r = slice(c * rows, (c + 1) * rows)
            states[c0 + c] = h
            torch.baddbmm(u[r], w[r], h, alpha=-1.0, out=u_prime[r])
            h = torch.baddbmm(last[r] * h, k_write_t[r], u_prime[r])
        entering = states[c0:c1].view(-1, dk, dv)
        put_chunks(out, torch.bmm(x.scores, u_prime).baddbmm_(x.q_read, entering), c0)
    return from_chunk_buffer(out, t_len), h, states


def _native_backward(q, k, v, beta, gk, states, do, dh_final, scale, chunk_size, *, erase=None):
    """:func:`chunk_kda_bwd` by the compiled CPU kernel (one (sequence, head) per task, last chunk
    first, the state-free terms recomputed per chunk), or None where it does not apply.
    ``erase`` (GDN-2, as in :func:`_native_forward`, ``beta`` None): the erase keys' gradient is
    returned in β's place, ``(dq, dk, dv, d_erase, dgk, dh0)``."""
    if k.shape[2] == 0:
        return None
    mod = kernels_for(q, k, v, beta, gk, states, do, dh_final, erase)
    if mod is None:
        return None
    t_len = k.shape[2]
    q, k, v, gk, do, erase = unit_last_stride(q, k, v, gk, do, erase)
    grads = mod.chunk_kda_bwd(q, k, v, beta, gk, states, do, dh_final, float(scale), int(chunk_size), sub_block(chunk_size),
                              erase)
    dq, dk, dv, dbeta, dgk, dh0, d_erase = grads
    return (*(from_chunk_buffer(g, t_len) for g in (dq, dk, dv, dbeta if erase is None else d_erase, dgk)), dh0)


def chunk_kda_bwd(q, k, v, beta, gk, states, do, dh_final, scale: float, chunk_size: int,
                  terms=block_terms, terms_backward=block_terms_backward, native: bool = True):
    """Backward on head-first tensors; returns ``(dq, dk, dv, dbeta, dgk, dh0)`` (module docstring);
    ``terms``/``terms_backward`` as in :func:`chunk_kda_fwd`.

    Group by group, last group first: recompute the group's block terms and U' (from the saved
    states), run the group's part of the adjoint loop, then its input gradients. On the CPU the
    compiled kernel runs KDA's own terms where it applies."""
    compiled = (_native_backward(q, k, v, beta, gk, states, do, dh_final, scale, chunk_size)
                if native and terms is block_terms and terms_backward is block_terms_backward else None)
    if compiled is not None:
        return compiled
    n, nh, t_len, dk = q.shape  # (k may carry more per token: DeltaProduct's sub-steps)
    nc, rows, _, dv = states.shape
    buffers = [chunk_buffer(t, n, nh, nc, chunk_size) for t in (q, k, v, beta, gk)]
    dh = dh_final
    for c0, c1 in reversed(_groups(nc, rows)):
        (qf, kf, vf, bf, _), x = _chunk_terms(q, k, v, beta, gk, scale, chunk_size, c0, c1, terms)
        w, u = x.wu[..., :dk], x.wu[..., dk:]
        entering = states[c0:c1].view(-1, dk, dv)
        u_prime = torch.baddbmm(u, w, entering, alpha=-1.0)
        do_ = flat_chunks(do, chunk_size, c0, c1)
        du = x.scores.transpose(-1, -2) @ do_  # Pᵀ dO, then dU' in the loop
        from_outputs = torch.bmm(x.q_read.transpose(-1, -2), do_)  # Q̂ᵀ dO: each chunk's own pull on its state
        dh_next = states.new_empty((c1 - c0,) + states.shape[1:])
        w_t, last = w.transpose(-1, -2), x.last.unsqueeze(-1)
        for c in range(c1 - c0 - 1, -1, -1):  # adjoint of the loop, last chunk first
            r = slice(c * rows, (c + 1) * rows)
            dh_next[c] = dh
            du[r].baddbmm_(x.k_write[r], dh)
            dh = torch.baddbmm(last[r] * dh + from_outputs[r], w_t[r], du[r], alpha=-1.0)
        leaving = dh_next.view(-1, dk, dv)
        d_wu = torch.cat([-(du @ entering.transpose(-1, -2)), du], dim=-1)  # dW = −dU' hᵀ, dU = dU'
        d_scores = do_ @ u_prime.transpose(-1, -2)
        d_q_read = do_ @ entering.transpose(-1, -2)
        d_k_write = u_prime @ leaving.transpose(-1, -2)
        d_last = (entering * leaving).sum(-1)
        grads = terms_backward(qf, kf, vf, bf, x, d_wu, d_scores, d_q_read, d_k_write, d_last, scale,
                                     _solve_blocks_adjoint)
        for buffer, grad in zip(buffers, grads):
            put_chunks(buffer, grad, c0)
    return (*(from_chunk_buffer(b, t_len) for b in buffers), dh)


# -- custom ops: torch.compile calls the forward and the backward as they are ---------------------


@torch.library.custom_op("fastweights::chunk_kda_fwd", mutates_args=())
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gk: Tensor, h0: Optional[Tensor],
            scale: float, chunk_size: int, native: bool = True, check_finite: str = "", check_decay: str = "",
            decay_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    n, nh, _, dk = k.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    finite, decay = _check_args(check_finite, check_decay, decay_name)
    with autocast_off(q.device):
        return chunk_kda_fwd(q, k, v, beta, gk, h0_, scale, chunk_size, native=native, check_finite=finite,
                             decay_check=decay)


def _like_chunks(x, n, nh, nc, chunk_size, t_len, tail=None):
    return from_chunk_buffer(chunk_buffer(x, n, nh, nc, chunk_size, tail), t_len)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, beta, gk, h0, scale, chunk_size, native=True, check_finite="", check_decay="", decay_name=""):
    n, nh, t_len, dk = k.shape
    dv, nc = v.shape[-1], -(-t_len // chunk_size)
    return _like_chunks(v, n, nh, nc, chunk_size, t_len), v.new_empty(n * nh, dk, dv), v.new_empty(nc, n * nh, dk, dv)


@torch.library.custom_op("fastweights::chunk_kda_bwd", mutates_args=())
def _bwd_op(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gk: Tensor, states: Tensor, do: Tensor,
            dh_final: Tensor, scale: float, chunk_size: int, native: bool = True, check_finite: str = "",
            check_decay: str = "", decay_name: str = "") -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with autocast_off(do.device):
        return chunk_kda_bwd(q, k, v, beta, gk, states, do, dh_final, scale, chunk_size, native=native)


@_bwd_op.register_fake
def _bwd_fake(q, k, v, beta, gk, states, do, dh_final, scale, chunk_size, native=True, check_finite="", check_decay="",
              decay_name=""):
    n, nh, t_len, dk = k.shape
    nc = states.shape[0]
    grads = tuple(_like_chunks(t, n, nh, nc, chunk_size, t_len) for t in (q, k, v, beta, gk))
    return grads + (torch.empty_like(dh_final),)


def register_chunk_autograd(fwd_op, bwd_op, zero_output) -> None:
    """The backward of a chunk op with KDA's shape, shared by KDA, GDN-2 and DeltaProduct:
    ``fwd_op(*five inputs, h0, scale, chunk_size, *flags) -> (o, h_T, states)`` and ``bwd_op(*five
    inputs, states, do, dh_final, scale, chunk_size, *flags) -> (the five inputs' gradients, dh0)``;
    only the chunk states are kept beside the inputs. ``flags``: non-tensor options the backward
    takes as the forward did (KDA's ``native`` and the input checks left to the forward). ``zero_output(*five inputs)``: a zero ``o`` for a
    loss that used only ``h_T``."""

    def setup_context(ctx, inputs, output):
        q, k, v, beta, gk, h0, scale, chunk_size, *flags = inputs
        tensors = (q, k, v, beta, gk)
        states = output[2]
        ctx.save_for_backward(*tensors, states)
        backward_only(ctx, states)
        ctx.scale, ctx.chunk_size, ctx.h0_shape = scale, chunk_size, None if h0 is None else h0.shape
        ctx.flags = tuple(flags)

    def backward(ctx, do, dh_final, _states):
        *tensors, states = ctx.saved_tensors
        if dh_final is None:
            dh_final = states.new_zeros(states.shape[1:])
        if do is None:  # only h_T was used
            do = zero_output(*tensors)
        *grads, dh0 = bwd_op(*tensors, states, do, dh_final, ctx.scale, ctx.chunk_size, *ctx.flags)
        return (*grads, None if ctx.h0_shape is None else dh0.reshape(ctx.h0_shape), None, None,
                *(None for _ in ctx.flags))

    fwd_op.register_autograd(backward, setup_context=setup_context)


register_chunk_autograd(_fwd_op, _bwd_op, lambda q, k, v, beta, gk: v.new_zeros(v.shape))


@inference_op("fastweights::chunk_kda_infer")
def _infer_op(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gk: Tensor, h0: Optional[Tensor],
              scale: float, chunk_size: int, native: bool = True, check_finite: str = "", check_decay: str = "",
              decay_name: str = "", bf16_products: bool = False) -> Tuple[Tensor, Tensor]:
    """``(o [N, H, T, V], h_T [N·H, K, V])``: the forward when no gradient is asked for (the chunk
    states, which only the backward reads, are not kept). ``bf16_products`` (bf16 q, k, v under
    :func:`fastweights.ops.bf16_products`): the compiled bf16-products kernel where it applies,
    else the fp32 forward on q, k, v widened (o returned in v's dtype either way). Plain bf16 q, k, v
    (no ``bf16_products``): the fp32 kernel widens them as it gathers them (:func:`_native_forward`),
    else they are widened here for the PyTorch forward."""
    n, nh, _, dk = k.shape
    h0_ = None if h0 is None else h0.reshape(n * nh, dk, v.shape[-1])
    finite, decay = _check_args(check_finite, check_decay, decay_name)
    out_dtype = v.dtype
    with autocast_off(q.device):
        if bf16_products:
            compiled = (_native_forward_bf16(q, k, v, beta, gk, h0_, scale, chunk_size, check_finite=finite,
                                             decay_check=decay) if native else None)
            if compiled is not None:
                return compiled
        # plain bf16 q, k, v (also bf16 products without their kernel): widened in the fp32 kernel's gather
        compiled = (_native_forward(q, k, v, beta, gk, h0_, scale, chunk_size, False, check_finite=finite,
                                    decay_check=decay) if native else None)
        if compiled is not None:
            return compiled[0].to(out_dtype), compiled[1]
        q, k, v = (t if t.dtype == beta.dtype else t.to(beta.dtype) for t in (q, k, v))
        o, h, _ = chunk_kda_fwd(q, k, v, beta, gk, h0_, scale, chunk_size, native=False, check_finite=finite,
                                decay_check=decay)
        return o.to(out_dtype), h


@_infer_op.register_fake
def _infer_fake(q, k, v, beta, gk, h0, scale, chunk_size, native=True, check_finite="", check_decay="", decay_name="",
                bf16_products=False):
    o, h, _ = _fwd_fake(q, k, v, beta, gk, h0, scale, chunk_size, native)
    return o, h.new_empty(h.shape, dtype=beta.dtype)


def kda_chunk(q, k, v, beta, gk, h0, scale, chunk_size, native: bool = True, check_finite: str = "",
              check_decay: str = "", decay_name: str = "gk", low: Optional[torch.dtype] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The chunk form with its hand-written backward on head-first compute-dtype tensors; returns ``(o, h_T)``.
    ``native``: whether the compiled CPU kernels may run forward and backward. ``check_finite``,
    ``check_decay`` (the op's name) and ``decay_name``: the input checks the front end left to the
    solver (:attr:`~.._spec.OpSpec.fused_finite_check`, ``fused_decay_check``). ``low=torch.bfloat16``
    (set by the front end under :func:`fastweights.ops.bf16_products` for bf16 inputs, which it then
    leaves bf16): bf16 product operands in inference (:func:`_native_forward_bf16`; without the
    compiled kernel, the fp32 forward on the inputs widened); ignored, the inputs widened, when a
    backward may follow."""
    checks = (str(check_finite), str(check_decay), str(decay_name))
    grad = backward_can_follow(q, k, v, beta, gk, h0)
    if grad or low not in (None, torch.bfloat16):  # widened: a backward may follow, or no kernel for `low`
        q, k, v = (t if t.dtype == beta.dtype else t.to(beta.dtype) for t in (q, k, v))
        low = None
    if grad:
        o, h_final, _ = _fwd_op(q, k, v, beta, gk, h0, float(scale), int(chunk_size), native, *checks)
    else:  # inference: no chunk states kept for a backward
        o, h_final = _infer_op(q, k, v, beta, gk, h0, float(scale), int(chunk_size), native, *checks, low is not None)
    return o, h_final.view(k.shape[0], k.shape[1], *h_final.shape[1:])


#: KDA's chunk op, declared once (``fastweights/ops/_spec.py``): :func:`kda_chunk` without and with
#: the compiled CPU kernels.
CHUNK_KDA = OpSpec("chunk_kda", Rule.DELTA, Form.CHUNK, torch=functools.partial(kda_chunk, native=False), cpu=kda_chunk,
                   low_products=True, reads_bf16_inputs=True, fused_finite_check=True, fused_decay_check=True,
                   step=kda_step)


#: The public function moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.kda.api", "chunk_kda")
