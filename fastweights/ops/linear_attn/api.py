"""Linear attention's public ops: each hands its :class:`~.._spec.OpSpec` to the one dispatcher.

The forms' maths and specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py``; a call descends
from here to the dispatcher and the form's solver, each module once (docs/design.md, "The path of
a call").
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._dispatch import run
from ..feature_maps import FeatureMapLike
from .chunk import CHUNK_LINEAR_ATTN
from .parallel import PARALLEL_LINEAR_ATTN
from .recurrent import RECURRENT_LINEAR_ATTN

__all__ = ["recurrent_linear_attn", "parallel_linear_attn", "chunk_linear_attn"]


def recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
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
    return run(RECURRENT_LINEAR_ATTN, q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen, feature_map=feature_map,
               qk_norm=qk_norm, normalize=normalize, eps=eps)


def parallel_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    feature_map: FeatureMapLike = None,
    qk_norm: Optional[str] = None,
    normalize: bool = False,
    eps: float = 1e-6,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Causal linear attention as one masked T×T matrix product.

    Equivalent to :func:`~fastweights.ops.recurrent_linear_attn` (same arguments,
    same returns). The causal mask, drawn for T = 4::

        scores = scale · φ(Q) φ(K)ᵀ ⊙ Γ ⊙ | 1 0 0 0 |
                                         | 1 1 0 0 |
                                         | 1 1 1 0 |
                                         | 1 1 1 1 |

    Time and memory are O(T²) per head: use it for short sequences and as a
    readable statement of the maths; :func:`chunk_linear_attn` is the fast path.
    """
    return run(PARALLEL_LINEAR_ATTN, q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen, feature_map=feature_map,
               qk_norm=qk_norm, normalize=normalize, eps=eps)


def chunk_linear_attn(
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
    cp_group=None,
    *,
    backend: str = "auto",
    return_intermediate_states: bool = False,
    state_block_size: Optional[int] = None,
    state_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
) -> Tuple[Optional[torch.Tensor], ...]:
    """Causal linear attention, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_linear_attn` (same arguments and
    returns; see its docstring). ``chunk_size`` (C) trades the O(T·C) intra-chunk
    work against T/C sequential state updates; T need not be a multiple of C.

    Training differentiates through :func:`linear_attn_chunk`, a
    hand-written backward that keeps the inputs and the T/C chunk-entry states
    only (``delta_rule/README.md``, with W = 0 and U = V); double backward is not
    supported (use the recurrent or parallel form). Forward and backward are
    ``torch.library`` custom ops (``fastweights::chunk_linear_attn_fwd``/``_bwd``), opaque
    to ``torch.compile``.

    Context parallelism: ``cp_group`` (a ``torch.distributed.ProcessGroup``; None: off)
    splits T over the group's ranks as in :func:`~fastweights.ops.chunk_delta_rule`; here
    a slice's summary is its decayed sum ``[H, K, V]`` (with the normalizer column when
    ``normalize``) and, with ``g``, one decay per head.

    ``backend``: ``"auto"`` (the compiled CPU kernels for CPU tensors, PyTorch elsewhere),
    ``"torch"`` (the PyTorch code) or ``"cpu"``, as in :func:`~fastweights.ops.chunk_delta_rule`.

    Serving options ``return_intermediate_states``, ``state_block_size``, ``state_indices``
    and ``has_initial_state`` as in :func:`~fastweights.ops.chunk_delta_rule` (with
    ``normalize`` the states carry the normalizer column, ``[.., K, V + 1]``).
    """
    return run(CHUNK_LINEAR_ATTN, q, k, v, g=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen, feature_map=feature_map,
               qk_norm=qk_norm, normalize=normalize, eps=eps, chunk_size=chunk_size,
               backend=backend, cp_group=cp_group, return_intermediate_states=return_intermediate_states,
               state_block_size=state_block_size, state_indices=state_indices, has_initial_state=has_initial_state)
