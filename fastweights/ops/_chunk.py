"""Pieces shared by the parallel and chunk forms of every rule.

Notation (per head, one block of L tokens; the parallel form is one block of
length T, the chunk form has blocks of length C):

- ``b_r = g_1 + ... + g_r``, the cumulative log decay inside the block, so the
  decay from token i to token r (i <= r) is ``Γ[r, i] = exp(b_r − b_i) <= 1`` and
  from the block start to token r it is ``exp(b_r)``.
- A rule without decay has g = 0: every Γ entry of the causal triangle is 1.

The sequential part, :func:`chunk_scan`, is the only loop across chunks. Given
per-chunk quantities computed for all chunks at once, it carries the state:

    U' = U − W h                         (pseudo-values given the incoming state)
    O  = scale · (Q ⊙ e^b) h + P U'      (P = scale · tril(Q Kᵀ ⊙ Γ), diagonal included)
    h  ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ U'

For linear attention U = V and W = 0; for the delta rules U and W come from the
UT transform (``delta_rule/wy.py``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F


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
    """The inter-chunk recurrence: the only part of a chunk form that is sequential.

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
