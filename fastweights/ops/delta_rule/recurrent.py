"""The delta rule, recurrent form: the float64 ground truth for every delta op.

Per head, state h stored K×V (the transpose of the papers' W = Σ v kᵀ):

    v̄_t = h_{t−1}ᵀ k_t                               retrieve (Schlag et al. 2021)
    h_t = h_{t−1} + β_t k_t (v_t − v̄_t)ᵀ             write the correction (step 3)
        = (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ   (a generalized Householder transition, ch. 6)
    o_t = scale · h_tᵀ q_t                           read after the write

The gated delta rule (Yang, Kautz & Hatamizadeh 2024) multiplies in the decay
α_t = exp(g_t) first: ``h_t = α_t (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ``.
One function serves both: ``g=None`` is the plain delta rule.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .._backend import backward_can_follow
from .._fla_compat import fla_inputs
from .._dispatch import run
from .._spec import Form, OpSpec, Rule
from ..feature_maps import FeatureMapLike
from ..step import delta_rule_step, delta_update


def low_products_step(q, k, v, beta, g, h, scale, low=torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~fastweights.ops.step.delta_update` with ``low`` product operands
    (``fastweights.ops.precision``): the reads hᵀk and hᵀq take k, q and h rounded to ``low``,
    the write k uᵀ takes k and u rounded to ``low``; every sum and the state stay in h's dtype (a product of two bf16 numbers is exact
    in fp32, so the write is exactly a bf16-operand product)."""
    shape, (dk, dv) = h.shape, h.shape[-2:]
    h = h.reshape(-1, dk, dv)
    if g is not None:
        h = h * torch.exp(g).reshape(-1, 1, 1)
    k = k.reshape(-1, 1, dk).to(low)
    read = torch.bmm(k, h.to(low)).to(h.dtype)
    u = (v.reshape(-1, 1, dv) - read).mul_(beta.reshape(-1, 1, 1)).to(low)
    h = torch.addcmul(h, k.transpose(1, 2).to(h.dtype), u.to(h.dtype))
    o = torch.bmm(q.reshape(-1, 1, dk).to(low), h.to(low)).to(h.dtype).mul_(scale)
    return o.view(shape[:-2] + (dv,)), h.view(shape)


def delta_rule_recurrence(q, k, v, beta, g, h0, scale, chunk_size=None, low=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token (gated) delta rule on head-first tensors ``[N, H, T, D]``; returns ``(o, h_T)``.
    Each token is the public step's arithmetic (:func:`fastweights.ops.step.delta_update`).

    ``low`` (set by the front end under :func:`fastweights.ops.bf16_products` for bf16
    inputs) runs :func:`low_products_step` instead, unless a backward may follow.
    """
    n, nh, t_len, dk = k.shape
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1], dtype=beta.dtype)  # bf16 k: fp32 state
    step = delta_update
    if low is not None and not backward_can_follow(q, k, v, beta, g, h0):
        step = functools.partial(low_products_step, low=low)
    outputs = []
    for t in range(t_len):
        o_t, h = step(
            q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], None if g is None else g[:, :, t], h, scale
        )
        outputs.append(o_t)
    o = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return o, h



#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_DELTA_RULE = OpSpec("recurrent_delta_rule", Rule.DELTA, Form.RECURRENT, torch=delta_rule_recurrence, low_products=True, step=delta_rule_step)


def recurrent_delta_rule(
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
        chunk_size: accepted so that every form takes the same arguments; unused here.
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
    q, k, beta, _, initial_state, cu_seqlens = fla_inputs(  # fla's options -> plain inputs
        "recurrent_delta_rule", q, k, v, beta, None, initial_state, cu_seqlens, gated=False, cu_seqlens_cpu=cu_seqlens_cpu, kwargs=extra,
    )
    return run(RECURRENT_DELTA_RULE, q, k, v, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, max_seqlen=max_seqlen,
        chunk_size=chunk_size, feature_map=feature_map,
        qk_norm="l2" if use_qk_l2norm_in_kernel else qk_norm, requires_beta=True,
        allow_neg_eigval=allow_neg_eigval,
    )
