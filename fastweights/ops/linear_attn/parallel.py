"""Linear attention, parallel form: one masked T×T product, no state in the loop.

    O = scale · tril(Q Kᵀ ⊙ Γ) V + scale · (Q ⊙ e^b) h_0          (Schlag et al. 2021)
    h_T = e^{b_T} h_0 + (K ⊙ e^{b_T − b})ᵀ V

with b the cumulative log decay and Γ[t, s] = exp(b_t − b_s) (``_chunk.py``). It
equals :func:`~fastweights.ops.recurrent_linear_attn` by associativity of the
matrix product; costs O(T²) time and memory.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._chunk import block_terms
from .._dispatch import run
from .._spec import Form, OpSpec, Rule
from ..feature_maps import FeatureMapLike
from ..step import linear_attn_step


def linear_attn_parallel(q, k, v, beta, g, h0, scale, chunk_size=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Whole-sequence masked product on head-first tensors; returns ``(o, h_T)``."""
    q_decayed, k_decayed, scores, seq_decay, _ = block_terms(q, k, g, scale)
    o = scores @ v
    h = k_decayed.transpose(-1, -2) @ v
    if h0 is not None:
        o = o + scale * (q_decayed @ h0)
        h = h + (h0 if seq_decay is None else h0 * seq_decay[..., None, None])
    return o, h


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_LINEAR_ATTN = OpSpec("parallel_linear_attn", Rule.SUM, Form.PARALLEL, torch=linear_attn_parallel, step=linear_attn_step)


def parallel_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: Optional[int] = None,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    normalize: bool = False,
    eps: float = 1e-6,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal linear attention as one masked T×T matrix product.

    Equivalent to :func:`~fastweights.ops.recurrent_linear_attn` (same arguments,
    same returns; ``chunk_size`` is unused). The causal mask, drawn for T = 4::

        scores = scale · φ(Q) φ(K)ᵀ ⊙ Γ ⊙ | 1 0 0 0 |
                                         | 1 1 0 0 |
                                         | 1 1 1 0 |
                                         | 1 1 1 1 |

    Time and memory are O(T²) per head: use it for short sequences and as a
    readable statement of the maths; :func:`chunk_linear_attn` is the fast path.
    """
    return run(PARALLEL_LINEAR_ATTN, q, k, v, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen,
        chunk_size=chunk_size, feature_map=feature_map, qk_norm=qk_norm, normalize=normalize, eps=eps,
    )
