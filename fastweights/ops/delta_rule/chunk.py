"""The delta rule, chunk form: the WY/UT algorithm (Yang et al. 2024; seed 001, ch. 7).

For chunks of C tokens with incoming state h (DESIGN.md, "The chunk form"):

    A = tril(diag(β) K Kᵀ, −1)       C×C, strictly lower          } one batched
    T = (I + A)⁻¹ diag(β)            forward substitution          } computation
    W = T K,  U = T V                the WY / UT representation    } over all chunks
    U' = U − W h                     pseudo-values given the state  ]
    O  = scale·Q h + tril(scale·Q Kᵀ) U'                             ] T/C sequential
    h ← h + Kᵀ U'                                                   ] steps

The gated rule multiplies in the cumulative decays (``wy.py`` derives them). One
solver serves both; ``g=None`` is the plain rule.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import block_terms, chunk_scan, from_chunks, to_chunks
from .._frontend import run_op
from ..feature_maps import FeatureMapLike
from .wy import ut_transform


def delta_rule_chunk(q, k, v, beta, g, h0, scale, chunk_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise (gated) delta rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``."""
    t_len = q.shape[2]
    qc, kc, vc, bc, gc = (to_chunks(x, chunk_size) for x in (q, k, v, beta, g))
    q_decayed, k_decayed, intra, chunk_decay, b = block_terms(qc, kc, gc, scale)
    w, u = ut_transform(kc, vc, bc, b)  # every chunk at once
    o, h = chunk_scan(q_decayed, k_decayed, u, w, intra, chunk_decay, h0, scale)
    return from_chunks(o, t_len), h


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: int = 64,
    qk_norm: Optional[str] = None,
    feature_map: FeatureMapLike = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_delta_rule` (same arguments
    and returns; see its docstring), to ~1e-12 relative in float64. Unlike
    flash-linear-attention's kernel it accepts fp32 and fp64 as well as bf16/fp16
    (low precision is computed in fp32) and runs on any device.

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (T need not be a multiple of C). The
            intra-chunk work is O(T·C·(K+V) + T·C²); the sequential loop has T/C steps.
    """
    return run_op(
        "chunk_delta_rule", delta_rule_chunk, q, k, v, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm, requires_beta=True,
    )
