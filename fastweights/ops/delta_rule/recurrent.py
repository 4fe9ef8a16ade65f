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
from typing import Tuple

import torch

from .._backend import backward_can_follow
from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..step import delta_rule_step, delta_update, scan_tokens


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


def delta_rule_recurrence(q, k, v, beta, g, h0, scale, low=None) -> Tuple[torch.Tensor, torch.Tensor]:
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
    return scan_tokens(step, h, scale, q, k, v, beta, g)


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_DELTA_RULE = OpSpec("recurrent_delta_rule", Rule.DELTA, Form.RECURRENT, torch=delta_rule_recurrence, low_products=True, step=delta_rule_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.delta_rule.api", "recurrent_delta_rule")
