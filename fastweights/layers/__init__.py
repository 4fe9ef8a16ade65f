"""Token mixers as nn.Modules: thin shells of projections, convolution, norms and gates
around :mod:`fastweights.ops` (docs/design.md: layers never re-implement a recurrence).

Every mixer has one interface::

    y, state = layer(x, state=None, cu_seqlens=None, attention_mask=None)     x, y: [B, T, d_model]

Prefill (T tokens, no state or a state) runs the chunk form of the op; a call with
T = 1 and a state is one decoding step through the recurrent form. ``cu_seqlens``
packs N sequences into one row (B = 1); ``attention_mask [B, T]`` (0 = padding)
runs only the real tokens of each row, as packed sequences, so a pad never touches
a memory, a convolution or a KV cache, and each row gives what it gives alone.

=====================  ================================  =========================
layer                  op                                 state
=====================  ================================  =========================
``SoftmaxAttention``   ``softmax_attn``                   ``KVCache`` (grows; an
                                                          ``AttentionState`` with
                                                          the short convolution)
``LinearAttention``    ``chunk_/recurrent_linear_attn``   ``FastWeightState`` (fixed)
``DeltaNet``           ``chunk_/recurrent_delta_rule``    ``FastWeightState`` (fixed)
``GatedDeltaNet``      ``chunk_/recurrent_gated_...``     ``FastWeightState`` (fixed)
``KimiDeltaAttention`` ``chunk_kda`` / ``kda_step``       ``FastWeightState`` (fixed)
``GatedDeltaNet2``     ``chunk_gdn2`` / ``gdn2_step``     ``FastWeightState`` (fixed)
``DeltaProduct``       ``chunk_/recurrent_gated_delta_``  ``FastWeightState`` (fixed)
                       ``product``
``RWKV7Attention``     ``chunk_dplr_delta_rule`` /        ``FastWeightState`` (fixed;
                       ``dplr_step``                      ``conv``: the last token)
=====================  ================================  =========================
"""

from .base import FastWeightMixer
from .common import FastWeightState, GatedRMSNorm, RMSNorm, ShortConvolution, causal_conv1d
from .delta_product import DeltaProduct
from .deltanet import DeltaNet
from .fla_weights import load_fla_state_dict
from .gated_deltanet import GatedDeltaNet
from .gdn2 import GatedDeltaNet2
from .kda import KimiDeltaAttention
from .linear_attention import LinearAttention
from .rwkv7 import RWKV7Attention
from .softmax_attention import AttentionState, SoftmaxAttention

MIXERS = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "kda": KimiDeltaAttention,
    "gdn2": GatedDeltaNet2,
    "deltaproduct": DeltaProduct,
    "rwkv7": RWKV7Attention,
}

__all__ = [
    "SoftmaxAttention", "AttentionState", "LinearAttention", "DeltaNet", "GatedDeltaNet", "KimiDeltaAttention",
    "GatedDeltaNet2", "DeltaProduct", "RWKV7Attention", "FastWeightMixer",
    "FastWeightState", "ShortConvolution", "causal_conv1d", "RMSNorm", "GatedRMSNorm", "MIXERS", "load_fla_state_dict",
]
