"""Linear attention, chunk form (seed 001, ch. 6, "What chunkwise already means").

Split T into chunks of C tokens. Inside a chunk the work is the parallel form;
across chunks only the state is carried:

    O_[c] = scale · (Q_[c] ⊙ e^b) h_[c] + scale · tril(Q_[c] K_[c]ᵀ ⊙ Γ) V_[c]
    h_[c+1] = e^{b_C} h_[c] + (K_[c] ⊙ e^{b_C − b})ᵀ V_[c]

C = T gives the parallel form, C = 1 the recurrence. All intra-chunk products
are computed for every chunk at once; only :func:`~fastweights.ops._chunk.chunk_scan`
loops, T/C times.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import block_terms, chunk_scan, from_chunks, to_chunks
from .._frontend import run_op
from ..feature_maps import FeatureMapLike


def linear_attn_chunk(q, k, v, beta, g, h0, scale, chunk_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise sum rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``."""
    t_len = q.shape[2]
    qc, kc, vc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, g))
    q_decayed, k_decayed, intra, chunk_decay, _ = block_terms(qc, kc, gc, scale)
    o, h = chunk_scan(q_decayed, k_decayed, vc, None, intra, chunk_decay, h0, scale)
    return from_chunks(o, t_len), h


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: int = 64,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    normalize: bool = False,
    eps: float = 1e-6,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal linear attention, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_linear_attn` (same arguments and
    returns; see its docstring). ``chunk_size`` (C) trades the O(T·C) intra-chunk
    work against T/C sequential state updates; T need not be a multiple of C.
    """
    return run_op(
        "chunk_linear_attn", linear_attn_chunk, q, k, v, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, feature_map=feature_map, qk_norm=qk_norm, normalize=normalize, eps=eps,
    )
