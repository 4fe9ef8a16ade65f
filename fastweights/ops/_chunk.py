"""Pieces shared by the parallel and chunk forms of every rule.

Notation (per head, one block of L tokens; the parallel form is one block of
length T, the chunk form has blocks of length C):

- ``b_r = g_1 + ... + g_r``, the cumulative log decay inside the block, so the
  decay from token i to token r (i <= r) is ``Γ[r, i] = exp(b_r − b_i) <= 1`` and
  from the block start to token r it is ``exp(b_r)``.
- A rule without decay has g = 0: every Γ entry of the causal triangle is 1.

:func:`chunk_scan` is the textbook loop across chunks (``delta_rule/textbook.py``,
the benchmark's baseline). Given per-chunk quantities computed for all chunks at
once, it carries the state with four matmuls per chunk:

    U' = U − W h                         (pseudo-values given the incoming state)
    O  = scale · (Q ⊙ e^b) h + P U'      (P = scale · tril(Q Kᵀ ⊙ Γ), diagonal included)
    h  ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ U'

For linear attention U = V and W = 0; for the delta rules U and W come from the
UT transform (``delta_rule/wy.py``).

The fast chunk forms regroup the same update by the incoming state and keep one
matmul per chunk in the loop (:func:`state_scan`, below); the pieces of their
hand-written backward passes shared by all rules live here too.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import check_int


def to_chunks(x: Optional[torch.Tensor], chunk_size: int) -> Optional[torch.Tensor]:
    """``[N, H, T, ...]`` -> ``[N, H, T/C, C, ...]``, zero-padding T up to a multiple of C.

    Zero padding is a no-op token for every rule (k = v = 0, β = 0, g = 0), so the
    state after the padded tail equals the state after the last real token.
    """
    if x is None:
        return None
    t = x.shape[2]
    pad = (-t) % chunk_size
    if pad:
        widths = [0, 0] * (x.dim() - 3) + [0, pad]
        x = F.pad(x, widths)
    return x.reshape(x.shape[:2] + (x.shape[2] // chunk_size, chunk_size) + x.shape[3:])


def from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[N, H, T/C, C, ...]`` -> ``[N, H, T, ...]``, dropping the padded tail."""
    return x.flatten(2, 3)[:, :, :length]


#: Chunk length C of the chunk ops when they are not given one (``chunk_size=None``, the
#: default of every chunk op, layer and ``LMConfig``): on the CPU, 32 for key sizes up to
#: :data:`SHORT_CHUNK_MAX_KEY_DIM`, else 64; on other devices 64. Measured on the CPU (fp32, one
#: thread, CPU time, d_model 128; ``benchmarks/lm_speed.py``'s shapes): a DeltaNet layer's
#: forward+backward at B=8, T=256 took 30.2 ms with C=32 against 35.1 ms with C=64 at
#: K=32, 31.0 against 34.9 at K=64, but 38.9 against 36.6 at K=128; Gated DeltaNet
#: 34.7 against 38.3 (K=32). The C² work per token shrinks with C while the T/C-step
#: loop grows, and at small K the C² work is most of it.
#:
#: :data:`LONG_CHUNK` is also the Triton kernels' one chunk length (so ``auto`` finds the default
#: C on a GPU runnable by them) and the shortest chunk a long chunk is capped to
#: (:func:`~._checks.effective_chunk_size`: no default C ever depends on T). One number, one name.
SHORT_CHUNK, LONG_CHUNK, SHORT_CHUNK_MAX_KEY_DIM = 32, 64, 64


def default_chunk_size(key_dim: int, device: torch.device) -> int:
    """The chunk-length policy: C for key size ``key_dim`` on ``device`` (see :data:`SHORT_CHUNK`).
    :func:`resolve_chunk_size` is the one function that applies it to a ``chunk_size=None``."""
    if torch.device(device).type == "cpu" and key_dim <= SHORT_CHUNK_MAX_KEY_DIM:
        return SHORT_CHUNK
    return LONG_CHUNK


def resolve_chunk_size(chunk_size: Optional[int], key_dim: Optional[int], device, backend: str = "auto") -> Optional[int]:
    """The one owner of ``chunk_size``: the value itself when given, else the chunk length a chunk op
    (and a layer, which passes None on) runs for key size ``key_dim`` on ``device`` --
    :func:`default_chunk_size`, or the Triton kernels' one length :data:`LONG_CHUNK` for a call
    that insists on ``backend="triton"``. ``key_dim=None`` (a malformed ``q``) leaves it None, for the
    input checks to name."""
    if chunk_size is None and key_dim is not None:
        chunk_size = LONG_CHUNK if backend == "triton" else default_chunk_size(key_dim, device)
    return chunk_size


def check_chunk_option(owner: str, chunk_size) -> None:
    """The check of a ``chunk_size`` a layer or a model config holds until a call: a positive int, or
    None (left to :func:`resolve_chunk_size` at each call: the layers and :class:`LMConfig` pass it on
    as it is)."""
    check_int(owner, "chunk_size", chunk_size, none_ok=True, what="a positive int or None (chosen per key size)")


def causal_mask(length: int, device, diagonal: int = 0) -> torch.Tensor:
    """Boolean lower-triangular ``[L, L]`` mask, ``j <= i + diagonal``."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril(diagonal)


def decay_matrix(b: Optional[torch.Tensor], length: int, device, dtype, diagonal: int = 0) -> torch.Tensor:
    """Γ ⊙ causal mask, ``[..., L, L]`` with ``Γ[r, i] = exp(b_r − b_i)`` for ``i <= r + diagonal``, else 0.

    With ``b=None`` (no decay) this is the 0/1 causal mask. The mask is applied
    before the exp so the (positive) upper triangle can never overflow.
    """
    mask = causal_mask(length, device, diagonal)
    if b is None:
        return mask.to(dtype)
    diff = b.unsqueeze(-1) - b.unsqueeze(-2)
    return torch.exp(diff.masked_fill(~mask, float("-inf")))


def chunk_scan(
    q_decayed: torch.Tensor,
    k_decayed: torch.Tensor,
    u: torch.Tensor,
    w: Optional[torch.Tensor],
    intra: torch.Tensor,
    chunk_decay: Optional[torch.Tensor],
    h0: Optional[torch.Tensor],
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The inter-chunk recurrence as the textbook writes it (autograd-friendly, four matmuls per chunk).

    Args (``NC`` chunks of ``C`` tokens, per batch N and head H):
        q_decayed: ``[N, H, NC, C, K]``, Q ⊙ e^b (the read of the incoming state).
        k_decayed: ``[N, H, NC, C, K]``, K ⊙ e^{b_C − b} (the write to the outgoing state).
        u: ``[N, H, NC, C, V]`` pseudo-values before the state correction.
        w: ``[N, H, NC, C, K]`` or None; the correction U' = U − W h.
        intra: ``[N, H, NC, C, C]``, scale · tril(Q Kᵀ ⊙ Γ).
        chunk_decay: ``[N, H, NC]`` = e^{b_C}, or None for no decay.
        h0: ``[N, H, K, V]`` or None.

    Returns: ``(o [N, H, NC, C, V], h_T [N, H, K, V])``.
    """
    n, nh, nc = u.shape[:3]
    h = h0
    if h is None:
        h = u.new_zeros(n, nh, k_decayed.shape[-1], u.shape[-1])
    outputs = []
    for c in range(nc):
        u_c = u[:, :, c] if w is None else u[:, :, c] - w[:, :, c] @ h
        outputs.append(scale * (q_decayed[:, :, c] @ h) + intra[:, :, c] @ u_c)
        decayed = h if chunk_decay is None else h * chunk_decay[:, :, c, None, None]
        h = decayed + k_decayed[:, :, c].transpose(-1, -2) @ u_c
    return torch.stack(outputs, dim=2), h


def block_terms(
    q: torch.Tensor, k: torch.Tensor, g: Optional[torch.Tensor], scale: float
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Decay-weighted terms of blocks ``[..., L, D]`` (the last two dims are a block).

    Returns ``(q_decayed, k_decayed, intra, block_decay, b)``: Q ⊙ e^b,
    K ⊙ e^{b_L − b}, scale · tril(Q Kᵀ ⊙ Γ), e^{b_L} and b itself (None without g).
    """
    length = q.shape[-2]
    b = None if g is None else g.cumsum(-1)
    gamma = decay_matrix(b, length, q.device, q.dtype)
    intra = scale * (q @ k.transpose(-1, -2)) * gamma
    if b is None:
        return q, k, intra, None, None
    q_decayed = q * torch.exp(b).unsqueeze(-1)
    k_decayed = k * torch.exp(b[..., -1:] - b).unsqueeze(-1)
    return q_decayed, k_decayed, intra, torch.exp(b[..., -1]), b


# --------------------------------------------------------------------------------------
# The fast chunk path (hand-written backward): shared pieces.
#
# Regrouping the chunk update by the incoming state h_c exposes what truly depends on
# the previous chunk. For every rule,
#
#     h_{c+1} = M_c h_c + B_c          O_c = Q̂_c h_c + P_c U_c
#
# with, for the delta rules, M_c = e^{b_C} I − K̄ᵀ W (K×K), B_c = K̄ᵀ U, Q̂ = scale·Q_b − P W;
# for linear attention M_c = e^{b_C} (a scalar; 1 without decay), B_c = K̄ᵀ V, Q̂ = scale·Q_b.
# M, B and Q̂ are batched matmuls over all chunks; only h_{c+1} = M_c h_c + B_c is a
# loop, one matmul per step. Its adjoint is the same loop run backwards with Mᵀ:
#     dh_c = M_cᵀ dh_{c+1} + Q̂_cᵀ dO_c.
# (The delta rules' ``delta_rule/chunk.py`` runs the ungrouped form instead,
# U' = U − W h and h ← e^{b_C} h + K̄ᵀ U', two products per chunk in the loop: it
# needs fewer products overall than forming M, B and Q̂.)
# The fast path works on flattened chunks ``[N·H·NC, C, D]`` ("Bt" below) so that
# every batched product is one ``bmm`` on contiguous memory.
# --------------------------------------------------------------------------------------


def with_initial_state(o: torch.Tensor, h: torch.Tensor, h0: Optional[torch.Tensor], q_decayed: torch.Tensor,
                       seq_decay: Optional[torch.Tensor], scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """A block's output and final state from a zero start (``o``, ``h``) plus what the initial state
    ``h0`` adds (:func:`block_terms`' names): its read ``scale · (Q ⊙ e^b) h0`` and its decayed carry
    ``e^{b_L} h0``. Without ``h0``, ``(o, h)`` as they are."""
    if h0 is None:
        return o, h
    return o + scale * (q_decayed @ h0), h + (h0 if seq_decay is None else h0 * seq_decay[..., None, None])


def backward_only(ctx, *tensors: Optional[torch.Tensor]) -> None:
    """In a chunk op's ``setup_context``: ``tensors`` (outputs the op returns only so that its
    backward can have them: chunk states, gathered inputs) get no gradient.

    Otherwise autograd hands the backward a zero-filled gradient for each of them, megabytes
    of fill per call (at B=8, T=256, H=4, K=V=32, C=32 the delta rule's kept tensors are
    ~7 MB). The backward then gets ``None`` for every output that received no gradient,
    the real ones included (``do``/``dh_final``): it must fill in zeros itself.
    """
    ctx.mark_non_differentiable(*(t for t in tensors if t is not None))
    ctx.set_materialize_grads(False)


def flat_chunks(
    x: Optional[torch.Tensor], chunk_size: int, start: int = 0, stop: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """``[N, H, T, ...]`` -> contiguous ``[NC·N·H, C, ...]``, chunk-major, zero-padding T (see :func:`to_chunks`).

    Chunk-major order makes each chunk's slice of every per-chunk tensor (and of
    the states, ``[NC, N·H, K, V]``) contiguous, so the loop's products take the
    fast batched path. ``start``/``stop`` select chunks ``start, ..., stop − 1``
    only (a group of chunks, copied while it is needed). ``out`` (``[NC·N·H, C, ...]``,
    e.g. a column slice of a wider buffer) receives the copy instead of new memory.
    """
    if x is None:
        return None
    if start or stop is not None:
        t = x.shape[2]
        stop = -(-t // chunk_size) if stop is None else stop
        x = x[:, :, start * chunk_size : min(stop * chunk_size, t)]
    x = to_chunks(x, chunk_size).movedim(2, 0)
    if out is not None:
        out.view(x.shape).copy_(x)
        return out
    return x.reshape((-1,) + x.shape[3:]).contiguous()


def chunk_buffer(
    like: torch.Tensor, n: int, nh: int, chunks: int, chunk_size: int, tail: Optional[Tuple[int, ...]] = None
) -> torch.Tensor:
    """An empty ``[N, NC·C, H, ...]`` buffer (the front end's token-major layout) for :func:`put_chunks`.

    ``like`` is ``[N, H, T, ...]`` and gives the dtype, device and (unless ``tail``
    is given) the trailing dims.
    """
    tail = tuple(like.shape[3:]) if tail is None else tuple(tail)
    return like.new_empty((n, chunks * chunk_size, nh) + tail)


def put_chunks(buffer: torch.Tensor, x: torch.Tensor, start: int) -> None:
    """Copy flattened chunks ``x [NC'·N·H, C, ...]`` into chunks ``start, ..., start + NC' − 1`` of ``buffer``."""
    n, nh = buffer.shape[0], buffer.shape[2]
    count, c, rest = x.shape[0] // (n * nh), x.shape[1], tuple(x.shape[2:])
    dest = buffer[:, start * c : (start + count) * c].unflatten(1, (count, c))  # [N, NC', C, H, ...]
    dest.copy_(x.view((count, n, nh, c) + rest).permute((1, 0, 3, 2) + tuple(range(4, 4 + len(rest)))))


def from_chunk_buffer(buffer: torch.Tensor, length: int) -> torch.Tensor:
    """``[N, NC·C, H, ...]`` -> the head-first view ``[N, H, T, ...]``, dropping the padded tail."""
    return buffer[:, :length].transpose(1, 2)


def unflat_chunks(x: torch.Tensor, n: int, nh: int, length: int) -> torch.Tensor:
    """Inverse of :func:`flat_chunks`: ``[NC·N·H, C, ...]`` -> ``[N, H, T, ...]``.

    One copy, into memory laid out as ``[N, T, H, ...]`` (the front end's layout), so
    that its ``transpose(1, 2)`` back is contiguous and autograd keeps the gradients
    as they are instead of copying them again.
    """
    chunks = x.shape[0] // (n * nh)
    buffer = x.new_empty((n, chunks * x.shape[1], nh) + tuple(x.shape[2:]))
    put_chunks(buffer, x, 0)
    return from_chunk_buffer(buffer, length)


class ChunkDecay:
    """The decay factors of a gate inside every chunk (all None without a gate).

    From ``g [Bt, C]``: ``b = cumsum(g)``, ``e^b`` (reads of the incoming state),
    ``e^{b_C − b}`` (writes to the outgoing state), ``e^{b_C}`` (``[Bt]``) and
    ``Γ[r, i] = exp(b_r − b_i)`` on the causal triangle (``[Bt, C, C]``).
    """

    def __init__(self, g: Optional[torch.Tensor], length: int, device, dtype) -> None:
        self.b = self.read = self.to_end = self.last = self.gamma = None
        if g is not None:
            self.b = g.cumsum(-1)
            self.read = torch.exp(self.b)
            self.to_end = torch.exp(self.b[..., -1:] - self.b)
            self.last = self.read[..., -1]
            self.gamma = decay_matrix(self.b, length, device, dtype)

    def rows(self, x: torch.Tensor, factor: Optional[torch.Tensor]) -> torch.Tensor:
        """``x ⊙ factor`` row by row (``x`` itself without a gate)."""
        return x if factor is None else x * factor.unsqueeze(-1)

    def mask_(self, m: torch.Tensor, diagonal: int = 0) -> torch.Tensor:
        """In place: ``m ⊙ Γ`` on the causal triangle (strictly below it for ``diagonal=-1``)."""
        if self.gamma is not None:
            m.mul_(self.gamma)
        return m.tril_(diagonal)


def state_scan(
    transition: Optional[torch.Tensor], inject: torch.Tensor, h0: Optional[torch.Tensor]
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run ``h_{c+1} = M_c h_c + B_c`` over the chunks; the one sequential loop of the fast path.

    Args (chunk-major, NH = N·H):
        transition: M, ``[NC, NH, K, K]`` (delta rules), ``[NC, NH]`` (a scalar
            decay) or None (the identity: a running sum, computed by ``cumsum``).
        inject: B, ``[NC, NH, K, V]``.
        h0: ``[NH, K, V]`` or None (zeros).

    Returns:
        ``(states, h_T)``: ``states[c]`` is the state entering chunk c
        (``[NC, NH, K, V]``, the only per-chunk state the backward keeps), and the
        state after the last chunk. Not differentiable by autograd (it writes into
        a preallocated buffer); the callers' backward passes differentiate it.
    """
    nc, nh, dk, dv = inject.shape
    h = inject.new_zeros(nh, dk, dv) if h0 is None else h0
    if transition is None:  # a plain running sum: no loop at all
        ends = inject.cumsum(0).add_(h)
        return torch.cat([h.unsqueeze(0), ends[:-1]], dim=0), ends[-1]
    states = inject.new_empty(nc, nh, dk, dv)
    states[0] = h
    for c in range(nc):
        out = states[c + 1] if c + 1 < nc else None
        if transition.dim() == 2:
            h = torch.addcmul(inject[c], transition[c, :, None, None], states[c], out=out)
        else:
            h = torch.baddbmm(inject[c], transition[c], states[c], out=out)
    return states, h


def state_scan_backward(
    transition: Optional[torch.Tensor], inject_grad: torch.Tensor, dh_final: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Adjoint of :func:`state_scan`: ``dh_c = M_cᵀ dh_{c+1} + G_c``, from the last chunk down.

    Args:
        transition: as in :func:`state_scan`.
        inject_grad: G, ``[NC, NH, K, V]``, the gradient reaching each chunk's
            incoming state from that chunk's own outputs (``Q̂_cᵀ dO_c``).
        dh_final: ``[NH, K, V]``, the cotangent of the final state.

    Returns:
        ``(dh_next, dh0)``: ``dh_next[c]`` is the gradient with respect to the
        state *leaving* chunk c (``[NC, NH, K, V]``), and the gradient with respect
        to the initial state.
    """
    nc = inject_grad.shape[0]
    if transition is None:  # adjoint of the running sum: a reversed running sum
        starts = inject_grad.flip(0).cumsum(0).flip(0).add_(dh_final)
        return torch.cat([starts[1:], dh_final.unsqueeze(0)], dim=0), starts[0]
    dh_next = torch.empty_like(inject_grad)
    dh_next[-1] = dh_final
    dh = dh_final
    for c in range(nc - 1, -1, -1):
        out = dh_next[c - 1] if c > 0 else None
        if transition.dim() == 2:
            dh = torch.addcmul(inject_grad[c], transition[c, :, None, None], dh_next[c], out=out)
        else:
            dh = torch.baddbmm(inject_grad[c], transition[c].transpose(-1, -2), dh_next[c], out=out)
    return dh_next, dh


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    """``y_j = Σ_{r ≥ j} x_r`` along the last dim: the adjoint of ``cumsum``."""
    return x.flip(-1).cumsum(-1).flip(-1)


def decay_pair_grad(e: torch.Tensor) -> torch.Tensor:
    """Gradient of b through a matrix ``M[r, i] = X[r, i] · exp(b_r − b_i)``, given ``E = dM ⊙ M``.

    ``∂M[r, i]/∂b_r = M[r, i]`` and ``∂M[r, i]/∂b_i = −M[r, i]``, so
    ``db_r = Σ_i E[r, i] − Σ_i E[i, r]`` (row sums minus column sums).
    """
    return e.sum(-1) - e.sum(-2)


def read_write_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    decay: ChunkDecay,
    scores: torch.Tensor,
    q_decayed: torch.Tensor,
    k_decayed: torch.Tensor,
    d_scores: torch.Tensor,
    d_q_decayed: torch.Tensor,
    d_k_decayed: torch.Tensor,
    d_last: Optional[torch.Tensor],
    scale: float,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Gradients through the terms every rule shares, per chunk (``[Bt, C, ·]``).

    The forward terms are ``P = scale · (Q Kᵀ ⊙ Γ)`` (causal, diagonal included),
    ``Q_b = Q ⊙ e^b``, ``K̄ = K ⊙ e^{b_C − b}`` and ``e^{b_C}``. Given their
    cotangents (``d_scores`` need not be masked; it is overwritten, and so are
    ``d_q_decayed`` and ``d_k_decayed``, which must be contiguous), returns
    ``(dq, dk, db)`` with ``db`` the gradient of the cumulative log decay b
    (None without a gate).
    """
    db = None
    if decay.b is not None:
        write = (d_k_decayed * k_decayed).sum(-1)  # ∂/∂(b_C − b_r) of K̄
        db = (d_q_decayed * q_decayed).sum(-1) - write + decay_pair_grad(d_scores * scores)
        db[..., -1] += write.sum(-1) + d_last * decay.last
    d_qk = decay.mask_(d_scores).mul_(scale)  # dP ⊙ Γ ⊙ scale, in place
    dq = decay.rows(d_q_decayed, decay.read).baddbmm_(d_qk, k)  # in place (no copy) without a gate
    dk = decay.rows(d_k_decayed, decay.to_end).baddbmm_(d_qk.transpose(-1, -2), q)
    return dq, dk, db
