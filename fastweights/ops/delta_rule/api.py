"""The delta rule's public ops: each maps its arguments and hands its :class:`~.._spec.OpSpec` down.

The forms' maths and specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py`` (and the textbook
baseline in ``textbook.py``); a call descends from here through fla's options
(:func:`~.._fla_compat.run_fla`) to the one dispatcher and the form's solver, each module once
(docs/design.md, "The path of a call").
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._dispatch import run
from .._fla_compat import run_fla
from ..feature_maps import FeatureMapLike
from .chunk import CHUNK_DELTA_RULE
from .parallel import PARALLEL_DELTA_RULE
from .recurrent import RECURRENT_DELTA_RULE
from .textbook import TEXTBOOK_CHUNK_DELTA_RULE

__all__ = ["recurrent_delta_rule", "parallel_delta_rule", "chunk_delta_rule", "textbook_chunk_delta_rule"]


def recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    qk_norm: Optional[str] = None,
    feature_map: FeatureMapLike = None,
    use_qk_l2norm_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
    **extra,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule (DeltaNet), one token at a time: the reference form.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys. The rule is stable for unit keys
            and β in (0, 1) (use ``qk_norm="l2"`` unless the keys are normalized).
        v: ``[B, T, H, V]`` values.
        beta: ``[B, T, H]`` write strengths β_t, usually ``sigmoid(...)`` in (0, 1);
            ``None`` means β = 1 (fla's default).
        scale: read scale; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` offsets of N sequences packed along T (B must be 1).
        qk_norm: ``None``, ``"l2"`` or ``"sum"`` normalization of (φ(q), φ(k)).
        feature_map: optional φ applied to q and k first (as in Schlag et al. 2021,
            who pair the delta rule with DPFP and sum normalization).
        use_qk_l2norm_in_kernel: flash-linear-attention's spelling of ``qk_norm="l2"``.
        allow_neg_eigval: accept β in [0, 2] instead of [0, 1], so that I − β k kᵀ may
            have a negative eigenvalue (the layers' option of the same name).
        cu_seqlens_cpu: a host copy of ``cu_seqlens`` (fla's argument): the checks read the offsets
            from it without a device sync; used as ``cu_seqlens`` when that is None.
        max_seqlen: the longest of the packed sequences (FlashAttention's varlen hint). With it nothing
            reads tensor values, so ``torch.compile(..., fullgraph=True)`` has no graph break; eager
            mode refuses a ``max_seqlen`` below the longest sequence (under compile it is not checked:
            a smaller value would drop tokens).
        **extra: pass-through keywords (:mod:`fastweights.ops._fla_compat`); a bf16/fp16
            ``initial_state`` is cast to fp32.

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in the input dtype; the final
        state ``[N, H, K, V]`` or ``None``.

    Example::

        >>> B, T, H, K, V = 2, 100, 4, 32, 48
        >>> q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
        >>> v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
        >>> o, h = recurrent_delta_rule(q, k, v, beta, qk_norm="l2", output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
    """
    return run_fla(RECURRENT_DELTA_RULE, q, k, v, beta, None, initial_state, cu_seqlens, gated=False, qk_norm=qk_norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   cu_seqlens_cpu=cu_seqlens_cpu, extra=extra, scale=scale, output_final_state=output_final_state,
                   max_seqlen=max_seqlen, feature_map=feature_map)


def parallel_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    qk_norm: Optional[str] = None,
    feature_map: FeatureMapLike = None,
    use_qk_l2norm_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
    **extra,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule as one T×T triangular solve and mixing matrix.

    Equivalent to :func:`~fastweights.ops.recurrent_delta_rule` (same arguments,
    same returns). O(T²) memory: for short sequences
    and for reading the maths; :func:`chunk_delta_rule` is the fast path.
    """
    return run_fla(PARALLEL_DELTA_RULE, q, k, v, beta, None, initial_state, cu_seqlens, gated=False, qk_norm=qk_norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   cu_seqlens_cpu=cu_seqlens_cpu, extra=extra, scale=scale, output_final_state=output_final_state,
                   max_seqlen=max_seqlen, feature_map=feature_map)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
    feature_map: FeatureMapLike = None,
    use_qk_l2norm_in_kernel: bool = False,
    backend: str = "auto",
    allow_neg_eigval: bool = False,
    *,
    cu_seqlens_cpu: Optional[torch.LongTensor] = None,
    max_seqlen: Optional[int] = None,
    cp_group=None,
    return_intermediate_states: bool = False,
    state_block_size: Optional[int] = None,
    state_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    **extra,
) -> Tuple[Optional[torch.Tensor], ...]:
    """The delta rule, chunkwise parallel: the fast path for training.

    Equivalent to :func:`~fastweights.ops.recurrent_delta_rule` (same arguments
    and returns; see its docstring), to ~1e-12 relative in float64. Unlike
    flash-linear-attention's kernel it accepts fp32 and fp64 as well as bf16/fp16
    (low precision is computed in fp32) and runs on any device.

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (T need not be a multiple of C). The
            intra-chunk work is O(T·C·(K+V) + T·C²); the sequential loop has T/C steps.
            ``None`` (the default, and what the layers pass) runs
            :func:`fastweights.ops.default_chunk_size` of K and the device.
        backend: ``"auto"`` (Triton kernels for CUDA tensors when ``fastweights[triton]``
            is installed, the compiled CPU kernels for CPU tensors, PyTorch otherwise),
            ``"torch"`` (the PyTorch code, on every device), ``"cpu"`` (the compiled CPU
            kernels, ``fastweights/ops/cpu/``; the PyTorch code where they do not apply:
            fp16, kernels off or unbuilt) or ``"triton"`` (``fastweights/ops/triton/``:
            fp32/bf16/fp16, K, V <= 256, chunk size 64).

    Training: the PyTorch backend differentiates through
    :func:`delta_rule_chunk`, a hand-written backward (derived in
    ``delta_rule/README.md``) that keeps the inputs, [W | U'], the diagonal-block
    inverses and the T/C chunk-entry states -- O(T·(K+V) + (T/C)·K·V) per head --
    and recomputes the rest. Forward and backward are ``torch.library`` custom ops
    (``fastweights::chunk_delta_rule_fwd``/``_bwd``; inference: ``chunk_delta_rule_infer``):
    ``torch.compile`` calls them as they are, without a graph break. Under
    ``torch.autocast`` the op computes in fp32 and returns the inputs' dtype; ``cu_seqlens_cpu``/``max_seqlen`` as in
    :func:`~fastweights.ops.recurrent_delta_rule`.
    Gradients reach q, k, v, beta and initial_state (and g for the gated rule);
    double backward is not supported (use the recurrent or parallel form).
    ``benchmarks/chunk_speed.py`` (``fastweights bench``) measures it against the
    textbook chunk implementation and the recurrence.
    Context parallelism: ``cp_group`` (a ``torch.distributed.ProcessGroup``; None: off)
    splits T over the group's ranks, each holding one contiguous slice ``[B, L, ...]`` in
    rank order (``cu_seqlens``, if given, holds the *global* offsets, the same on every
    rank; a sequence may cross rank boundaries); any L (a partial last chunk is padded). The ranks
    exchange one ``[H, K, K + V]`` state summary per row instead of the sequence; ``o`` is
    the slice's output, final states come back on every rank, and ``initial_state[i]``
    is read (and gets its gradient) on the rank holding sequence i's first token
    (:mod:`fastweights.ops.context_parallel`, ``docs/context_parallel.md``).

    Serving (``docs/serving.md``): ``return_intermediate_states=True`` also returns fla's
    per-chunk states ``h [B, NT, H, K, V]`` (NT = ceil(T/C); ``h[:, c]`` is the state entering
    chunk c, i.e. after c·C tokens; with ``cu_seqlens`` ``[1, Σ NT_i, H, K, V]``, sequence by
    sequence) as a third return; ``state_block_size=m`` (a multiple of C) returns instead the
    states after m, 2m, ... tokens (``[B, T // m, H, K, V]``; ``[1, Σ T_i // m, ...]``), vLLM's
    block-aligned prefix cache. Only the states asked for are kept. ``state_indices [N]`` makes
    ``initial_state`` a pool ``[S, H, K, V]``: sequence i starts from ``pool[state_indices[i]]``
    (zeros where ``state_indices[i] = -1`` or ``has_initial_state[i]`` is False) and its final
    state is written back there in place (:mod:`fastweights.ops.state_pool`).
    """
    return run_fla(CHUNK_DELTA_RULE, q, k, v, beta, None, initial_state, cu_seqlens, gated=False, qk_norm=qk_norm,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, allow_neg_eigval=allow_neg_eigval,
                   cu_seqlens_cpu=cu_seqlens_cpu, extra=extra, scale=scale, output_final_state=output_final_state,
                   max_seqlen=max_seqlen, feature_map=feature_map,
                   chunk_size=chunk_size, backend=backend, cp_group=cp_group,
                   return_intermediate_states=return_intermediate_states, state_block_size=state_block_size,
                   state_indices=state_indices, has_initial_state=has_initial_state)


def textbook_chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    chunk_size: Optional[int] = None,
    qk_norm: Optional[str] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The (gated, with ``g``) delta rule by the textbook chunk algorithm, differentiated by autograd.

    Same arguments and returns as :func:`~fastweights.ops.chunk_delta_rule` (plus an
    optional ``g`` for the gated rule). Slow and memory-hungry on purpose: it is the
    baseline that ``benchmarks/chunk_speed.py`` measures the fast path against.
    """
    return run(TEXTBOOK_CHUNK_DELTA_RULE, q, k, v, beta=beta, g=g, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, qk_norm=qk_norm, requires_beta=True,
    )
