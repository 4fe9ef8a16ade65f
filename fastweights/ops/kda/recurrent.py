"""Kimi Delta Attention (KDA), recurrent form: the float64 ground truth of every KDA op.

The gated delta rule with one decay per key channel (Kimi Team 2025, "Kimi Linear",
arXiv:2510.26692). Per head and token, state h stored K×V (the transpose of the papers'
W = Σ v kᵀ, read as hᵀq), α_t = exp(gk_t) ∈ (0, 1]^K::

    h'  = diag(α_t) h_{t−1}                                 decay each key channel
    h_t = h' + β_t k_t (v_t − h'ᵀ k_t)ᵀ                      the delta write, on the decayed state
        = (I − β_t k_t k_tᵀ) diag(α_t) h_{t−1} + β_t k_t v_tᵀ
    o_t = scale · h_tᵀ q_t                                  read after the write

The decay comes first and the correction is computed against the decayed state, as in
fla's ``naive_recurrent_kda`` and transformers' ``recurrent_kimi_delta_attention``. With
a per-key-channel decay the order matters: ``diag(α)(I − β k kᵀ)`` is a different rule,
because diag(α) and k kᵀ do not commute (for a scalar α, Gated DeltaNet, they do).

With ``gv`` (fla's per-value-channel decay) the decay is ``diag(α_t) h diag(exp(gv_t))``
before the write; only this form has it (README.md in this folder says why).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .._backend import backward_can_follow
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..delta_rule.recurrent import low_products_step
from ..step import kda_decay, kda_step, kda_update, scan_tokens


def kda_low_products_step(q, k, v, beta, gk, h, scale, gv=None, low=torch.bfloat16) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`~fastweights.ops.step.kda_update` with ``low`` product operands
    (``fastweights.ops.precision``): the decay ``diag(e^{gk}) h`` (and ``h diag(e^{gv})``) in h's
    dtype, then the delta rule's step with bf16 operands on the decayed state
    (:func:`~fastweights.ops.delta_rule.recurrent.low_products_step`: the reads hᵀk and hᵀq and the
    write k uᵀ take bf16 operands; sums and state in h's dtype)."""
    return low_products_step(q, k, v, beta, None, kda_decay(h, gk, gv).view(h.shape), scale, low)


def kda_recurrence(q, k, v, beta, gk, h0, scale, gv=None, low: Optional[torch.dtype] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA on head-first tensors ``[N, H, T, D]`` (``gk [N, H, T, K]``); returns ``(o, h_T)``.

    ``low`` (set by the front end under :func:`fastweights.ops.bf16_products` for bf16 inputs,
    which it leaves bf16) runs :func:`kda_low_products_step` instead, unless a backward may follow
    (then the inputs are widened to gk's dtype and the plain step runs)."""
    n, nh, t_len, dk = k.shape
    if low is not None and backward_can_follow(q, k, v, beta, gk, h0, gv):
        q, k, v = (t.to(gk.dtype) for t in (q, k, v))
        low = None
    h = h0 if h0 is not None else k.new_zeros(n, nh, dk, v.shape[-1], dtype=gk.dtype)  # bf16 k: fp32 state
    step = kda_update if low is None else functools.partial(kda_low_products_step, low=low)
    if gv is None:
        return scan_tokens(step, h, scale, q, k, v, beta, gk)
    return scan_tokens(lambda q, k, v, beta, gk, gv, h, scale: step(q, k, v, beta, gk, h, scale, gv), h, scale,
                       q, k, v, beta, gk, gv)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_KDA = OpSpec("recurrent_kda", Rule.DELTA, Form.RECURRENT, torch=kda_recurrence, low_products=True,
                       step=kda_step)


#: The public functions moved to api.py (the old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.kda.api", "recurrent_kda", "fused_recurrent_kda", "recurrent_kda_as")
