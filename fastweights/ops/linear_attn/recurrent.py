"""Linear attention (the sum rule), recurrent form: the float64 ground truth.

Per head, with the state h stored K×V (the transpose of the papers' S = Σ v kᵀ,
which is V×K; we read hᵀq where the papers read S q):

    h_t = α_t h_{t−1} + φ(k_t) v_tᵀ           (Schlag et al. 2021)
    o_t = scale · h_tᵀ φ(q_t)                 (read after the write)

and, with ``normalize=True``, the normalizer of Katharopoulos et al. 2020,
``z_t = α_t z_{t−1} + φ(k_t)``, ``o_t ← o_t / (scale · φ(q_t)ᵀ z_t + eps)``.
α_t = exp(g_t) is an optional decay (``g=None`` means α = 1).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._dispatch import run
from .._spec import Form, OpSpec, Rule
from ..feature_maps import FeatureMapLike
from ..step import linear_attn_step, sum_update


def linear_attn_recurrence(q, k, v, beta, g, h0, scale, chunk_size=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token sum rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``."""
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1])
    outputs = []
    for t in range(t_len):
        o_t, h = sum_update(q[:, :, t], k[:, :, t], v[:, :, t], None if g is None else g[:, :, t], h, scale)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return o, h


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_LINEAR_ATTN = OpSpec("recurrent_linear_attn", Rule.SUM, Form.RECURRENT, torch=linear_attn_recurrence, step=linear_attn_step)


def recurrent_linear_attn(
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
    """Causal linear attention (the sum rule), one token at a time.

    This is the reference that :func:`parallel_linear_attn` and
    :func:`chunk_linear_attn` are tested against; it is also the right form for
    decoding one token at a time from a carried state.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H]`` log decays, α_t = exp(g_t) ≤ 1; ``None`` for no decay.
        scale: read scale; ``None`` means ``K ** -0.5``. With ``normalize=True`` it
            cancels (numerator and denominator are both scaled).
        initial_state: ``[N, H, D, V]`` (``[N, H, D, V + 1]`` with ``normalize``, the
            last column holding z), fp32 (fp64 for fp64 inputs). D is φ's output size.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed along T (B must be 1).
        chunk_size: accepted so that every form takes the same arguments; unused here.
        feature_map: φ, applied to q and k: ``None``/``"identity"``, ``"elu"``,
            ``"relu"``, ``"dpfp"``, ``"taylor"`` or a :class:`~fastweights.ops.FeatureMap`
            such as ``DPFP(nu=3)`` or ``FavorPlus(K, m, seed)``.
        qk_norm: ``None``, ``"l2"`` or ``"sum"``, applied to φ(q) and φ(k).
        normalize: divide each read by ``φ(q_t)ᵀ z_t + eps`` (the sufficient pair (S, z)).
        eps: added to the normalizer's denominator.
        cu_seqlens_cpu: the same offsets as a CPU tensor, so the checks read them without a device sync.
        max_seqlen: the longest of the packed sequences (FlashAttention's varlen hint). With it nothing
            reads tensor values, so ``torch.compile(..., fullgraph=True)`` has no graph break; eager
            mode refuses a ``max_seqlen`` below the longest sequence (under compile it is not checked:
            a smaller value would drop tokens).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in the input dtype; the final state
        ``[N, H, D, V(+1)]`` or ``None``.

    Example::

        >>> q = k = torch.randn(2, 100, 4, 16); v = torch.randn(2, 100, 4, 32)
        >>> o, h = recurrent_linear_attn(q, k, v, feature_map="elu", normalize=True,
        ...                              output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 32]), torch.Size([2, 4, 16, 33]))
    """
    return run(RECURRENT_LINEAR_ATTN, q, k, v, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen,
        chunk_size=chunk_size, feature_map=feature_map, qk_norm=qk_norm, normalize=normalize, eps=eps,
    )
