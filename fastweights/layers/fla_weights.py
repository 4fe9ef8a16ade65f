"""Load a flash-linear-attention layer's weights into ours.

**DeltaNet, GatedDeltaNet.** fla's ``DeltaNet`` and ``GatedDeltaNet`` layers (fla 0.6.0) keep the
same projections as ours under the same names (``q_proj``, ``k_proj``, ``v_proj``, ``b_proj``,
``a_proj``, ``g_proj``, ``o_proj``, ``o_norm``, ``A_log``, ``dt_bias``) but three
separate short convolutions ``q_conv1d``/``k_conv1d``/``v_conv1d`` with weights
``[C, 1, W]``; ours is one depthwise convolution over the concatenated q|k|v channels
with weight ``[C_q + C_k + C_v, W]``. Both are causal with tap W − 1 on the current
token, so the weights concatenate as they are.

**GatedDeltaNet2** (fla's ``GatedDeltaNet2``). Build ours with ``fla_gate=True`` (fla's output gate
is ``sigmoid(W_g2 W_g1 x + bias)``: loaded as the product W_g2 W_g1 into ``g_proj`` and the bias
into ``gate_bias``). fla's decay map ``f_proj.0``/``f_proj.1`` is our ``f_a_proj``/``f_b_proj``.
fla keeps the erase gate and the decay per key head and repeats them over a head's value heads;
ours are per value head, so with grouped value heads (``num_v_heads`` > ``num_heads``) their rows
are repeated likewise (the same numbers reach the op). ``expand_v = 1`` (the decay map's rank is
fla's V, ours K).

**DeltaProduct** (fla's ``GatedDeltaProduct``). fla's ``k_proj``/``v_proj`` give all n_h steps'
keys and values (``[n_h · H · K, D]``, step-major): step 1's rows are our ``k_proj``/``v_proj``,
the rest our ``ks_proj``/``vs_proj``. fla convolves every step's keys and values; ours only
the first step's, so a layer with short convolutions loads only for ``num_householder = 1``.

**RWKV7Attention** (fla's ``RWKV7Attention``). fla's ``x_r … x_g`` are the rows of our
``token_mix``, ``k_k``/``k_a``/``r_k`` our ``removal_key_scale``/``replacement_rate``/``bonus``,
and each ``*_lora.lora.0``/``.lora.2`` our ``*_lora.down``/``.up``; the rest has fla's names.
Build ours with fla's ``layer_idx`` (0 or not: whether ``v_lora`` exists) and low-rank sizes.

Build the layer with the fla layer's sizes (fla's constructor names are accepted,
but pass fla's ``norm_eps`` — its default is 1e-5, ours 1e-6), then load::

    ours = GatedDeltaNet(hidden_size=1024, num_heads=4, head_dim=128, expand_v=2,
                         num_v_heads=8, norm_eps=1e-5)
    load_fla_state_dict(ours, fla_layer.state_dict())
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch
import torch.nn as nn

from .base import FastWeightMixer

__all__ = ["load_fla_state_dict", "fla_state_dict_to_ours"]

_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def fla_state_dict_to_ours(state_dict: Mapping[str, torch.Tensor], layer: nn.Module = None) -> Dict[str, torch.Tensor]:
    """Rename/reshape an fla layer's state dict to ours (see module docstring); ``layer`` (ours)
    says which of fla's layers it is (None: DeltaNet/GatedDeltaNet)."""
    from .delta_product import DeltaProduct
    from .gdn2 import GatedDeltaNet2
    from .rwkv7 import MIX_ROWS, RWKV7Attention

    if isinstance(layer, RWKV7Attention):
        return _rwkv7_to_ours(state_dict, MIX_ROWS)
    state_dict = dict(state_dict)
    if isinstance(layer, GatedDeltaNet2):
        state_dict = _gdn2_to_ours(state_dict, layer)
    elif isinstance(layer, DeltaProduct):
        state_dict = _delta_product_to_ours(state_dict, layer)
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


def _gdn2_to_ours(sd: Dict[str, torch.Tensor], layer) -> Dict[str, torch.Tensor]:
    if not layer.fla_gate:
        raise ValueError("load_fla_state_dict: fla's GatedDeltaNet2 gates its output with sigmoid(W_g2 W_g1 x + bias); "
                         "build ours with `fla_gate`=True to load it")
    renames = {"f_proj.0.weight": "f_a_proj.weight", "f_proj.1.weight": "f_b_proj.weight", "g_proj.1.bias": "gate_bias"}
    out = {renames.get(k, k): v for k, v in sd.items() if k not in ("g_proj.0.weight", "g_proj.1.weight")}
    group = layer.num_v_heads // layer.n_heads
    if group > 1:  # per key head in fla, per value head here: value head j reads key head j // group
        K = layer.head_dim
        for name, per_head in (("A_log", 1), ("dt_bias", K), ("b_proj.weight", K), ("f_b_proj.weight", K)):
            t = out.get(name)
            if t is not None and t.shape[0] == layer.n_heads * per_head:
                heads = t.reshape((layer.n_heads, per_head) + tuple(t.shape[1:]))
                out[name] = heads.repeat_interleave(group, dim=0).reshape((-1,) + tuple(t.shape[1:]))
    if "g_proj.0.weight" in sd and "g_proj.1.weight" in sd:  # the low-rank gate as one matrix
        out["g_proj.weight"] = sd["g_proj.1.weight"] @ sd["g_proj.0.weight"]
    return out


def _delta_product_to_ours(sd: Dict[str, torch.Tensor], layer) -> Dict[str, torch.Tensor]:
    n_h = layer.num_householder
    if n_h > 1 and any(f"{c}.weight" in sd for c in _CONVS):
        raise ValueError(
            f"load_fla_state_dict: fla's GatedDeltaProduct convolves all {n_h} steps' keys and values; our "
            f"DeltaProduct convolves only the first step's, so a layer with short convolutions loads only for "
            f"num_householder = 1 (build both with use_short_conv=False)"
        )
    out = dict(sd)
    for name, rest, width in (("k_proj", "ks_proj", layer.key_width), ("v_proj", "vs_proj", layer.value_width)):
        w = sd.get(f"{name}.weight")
        if w is not None and n_h > 1 and w.shape[0] == n_h * width:  # step-major rows: step 1, then the others
            out[f"{name}.weight"], out[f"{rest}.weight"] = w[:width], w[width:]
    return out


def _rwkv7_to_ours(sd: Mapping[str, torch.Tensor], mix_rows) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    mix = [sd.get(f"x_{row}") for row in mix_rows]
    if any(m is not None for m in mix):
        missing = [f"x_{row}" for row, m in zip(mix_rows, mix) if m is None]
        if missing:
            raise ValueError(f"load_fla_state_dict: the fla RWKV7Attention state dict lacks {missing}")
        out["token_mix"] = torch.stack([m.reshape(-1) for m in mix])
    renames = {"k_k": "removal_key_scale", "k_a": "replacement_rate", "r_k": "bonus"}
    for key, value in sd.items():
        if key.startswith("x_") and key[2:] in mix_rows:
            continue
        if key in renames:
            out[renames[key]] = value
        elif ".lora.0." in key:
            out[key.replace(".lora.0.", ".down.")] = value
        elif ".lora.2." in key:
            out[key.replace(".lora.2.", ".up.")] = value
        else:
            out[key] = value
    return out


def load_fla_state_dict(layer: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load an fla ``DeltaNet``/``GatedDeltaNet``/``GatedDeltaNet2``/``GatedDeltaProduct``/``RWKV7Attention``
    state dict into ``layer`` (ours: DeltaNet, GatedDeltaNet, GatedDeltaNet2, DeltaProduct, RWKV7Attention),
    in place.

    Every tensor must find its place and every parameter of ``layer`` must be given;
    otherwise a ``ValueError`` lists the missing and unexpected names or the shapes that
    differ (build ``layer`` with the fla layer's sizes).
    """
    from .rwkv7 import RWKV7Attention

    if not isinstance(layer, (FastWeightMixer, RWKV7Attention)):
        raise TypeError(f"load_fla_state_dict: `layer` must be a DeltaNet, GatedDeltaNet, GatedDeltaNet2, DeltaProduct "
                        f"or RWKV7Attention, got {type(layer).__name__}")
    ours = fla_state_dict_to_ours(state_dict, layer)
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
