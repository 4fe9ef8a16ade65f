"""Load a flash-linear-attention layer's weights into our DeltaNet / Gated DeltaNet.

fla's ``DeltaNet`` and ``GatedDeltaNet`` layers (fla 0.6.0) keep the same projections
as ours under the same names (``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``,
``a_proj``, ``g_proj``, ``o_proj``, ``o_norm``, ``A_log``, ``dt_bias``) but three
separate short convolutions ``q_conv1d``/``k_conv1d``/``v_conv1d`` with weights
``[C, 1, W]``; ours is one depthwise convolution over the concatenated q|k|v channels
with weight ``[C_q + C_k + C_v, W]``. Both are causal with tap W − 1 on the current
token, so the weights concatenate as they are.

Build the layer with the fla layer's sizes (fla's constructor names are accepted,
but pass fla's ``norm_eps`` — its default is 1e-5, ours 1e-6), then load::

    ours = GatedDeltaNet(hidden_size=1024, num_heads=4, head_dim=128, expand_v=2,
                         num_v_heads=8, norm_eps=1e-5)
    load_fla_state_dict(ours, fla_layer.state_dict())
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch

from .base import FastWeightMixer

__all__ = ["load_fla_state_dict", "fla_state_dict_to_ours"]

_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def fla_state_dict_to_ours(state_dict: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Rename/reshape an fla DeltaNet/GatedDeltaNet state dict to ours (see module docstring)."""
    out = {k: v for k, v in state_dict.items() if not k.startswith(_CONVS)}
    biases = [f"{c}.bias" for c in _CONVS if f"{c}.bias" in state_dict]
    if biases:
        raise ValueError(
            f"load_fla_state_dict: the fla layer has convolution biases ({', '.join(biases)}; conv_bias=True); "
            f"our short convolution has none"
        )
    present = [c for c in _CONVS if f"{c}.weight" in state_dict]
    if present and len(present) != 3:
        raise ValueError(f"load_fla_state_dict: expected all of q/k/v_conv1d.weight, got only {present}")
    if present:
        weights = [state_dict[f"{c}.weight"] for c in _CONVS]
        for c, w in zip(_CONVS, weights):
            if w.dim() != 3 or w.shape[1] != 1:
                raise ValueError(f"load_fla_state_dict: `{c}.weight` must be [C, 1, W], got {list(w.shape)}")
        out["conv.weight"] = torch.cat([w[:, 0] for w in weights], dim=0)  # [C_q + C_k + C_v, W]
    return out


def load_fla_state_dict(layer: FastWeightMixer, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load an fla ``DeltaNet``/``GatedDeltaNet`` state dict into ``layer`` (in place).

    Every tensor must find its place and every parameter of ``layer`` must be given;
    otherwise a ``ValueError`` lists the missing and unexpected names or the shapes that
    differ (build ``layer`` with the fla layer's sizes).
    """
    if not isinstance(layer, FastWeightMixer):
        raise TypeError(f"load_fla_state_dict: `layer` must be a DeltaNet or GatedDeltaNet, got {type(layer).__name__}")
    ours = fla_state_dict_to_ours(state_dict)
    own = layer.state_dict()
    missing = sorted(set(own) - set(ours))
    unexpected = sorted(set(ours) - set(own))
    wrong = [f"{k}: ours {list(own[k].shape)}, fla {list(ours[k].shape)}"
             for k in sorted(set(own) & set(ours)) if own[k].shape != ours[k].shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"load_fla_state_dict: the fla state dict does not fit this {type(layer).__name__}: "
            f"missing {missing}, unexpected {unexpected}, shapes {wrong}"
        )
    layer.load_state_dict(ours)
