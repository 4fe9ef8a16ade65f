"""Functional memory solvers: ``(q, k, v, beta, g, state) -> (o, state)``.

Layout and argument names follow flash-linear-attention (docs/design.md, "Op
conventions"): ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, ``beta, g [B, T, H]``,
state ``[N, H, K, V]`` in fp32 (fp64 for fp64 inputs), ``cu_seqlens [N + 1]``.

=========================  ==============================  ========================
rule                       forms                           state
=========================  ==============================  ========================
softmax attention          ``softmax_attn``                 :class:`KVCache` (grows)
linear attention (sum)     ``recurrent_/parallel_/chunk_``  ``[N, H, D, V(+1)]``
                           ``linear_attn``
delta rule                 ``recurrent_/parallel_/chunk_``  ``[N, H, K, V]``
                           ``delta_rule``
gated delta rule           ``recurrent_/parallel_/chunk_``  ``[N, H, K, V]``
                           ``gated_delta_rule``
per-channel gated delta    ``recurrent_/parallel_/chunk_``  ``[N, H, K, V]``
rule (Kimi Delta Attn.)    ``kda``
erase/write-gated delta    ``recurrent_/parallel_/chunk_``  ``[N, H, K, V]``
rule (Gated DeltaNet-2)    ``gdn2``
n_h Householder steps per  ``recurrent_/parallel_/chunk_``  ``[N, H, K, V]``
token ((Gated) DeltaProd.)  ``gated_delta_product``
diagonal-plus-low-rank     ``recurrent_/parallel_/chunk_``  ``[N, H, K, V]``
delta rule (RWKV-7)        ``dplr_delta_rule``
=========================  ==============================  ========================

Every form of a rule takes the same arguments and returns the same thing (only the
``chunk_*`` form has ``chunk_size``, ``backend`` and its other options); the
``recurrent_*`` form is the reference that the others are tested against.

One token at a time (decoding): ``delta_rule_step``, ``gated_delta_rule_step`` and
``linear_attn_step`` (``ops/step.py``), the recurrent forms' own step; on CUDA the delta
steps run a fused Triton kernel.

fla drop-in: the delta and gated ops also take fla's options (``use_qk_l2norm_in_kernel``,
``use_beta_sigmoid_in_kernel``, ``use_gate_in_kernel`` with ``A_log``/``dt_bias``, grouped
value heads, ...), and fla's names are aliases with fla's signatures:
``fused_recurrent_delta_rule`` and ``fused_recurrent_gated_delta_rule`` (the recurrent
forms), ``fused_recurrent_linear_attn`` (recurrent) and ``fused_chunk_linear_attn``
(chunk); ``chunk_kda`` and ``fused_recurrent_kda`` (Kimi Delta Attention, ``ops/kda/fla.py``);
``chunk_gdn2`` and ``fused_recurrent_gdn2`` (Gated DeltaNet-2, ``ops/gdn2/fla.py``);
``chunk_gated_delta_product`` (``ops/delta_product``); ``fused_recurrent_dplr_delta_rule``,
``chunk_rwkv7`` and ``fused_recurrent_rwkv7`` (``ops/dplr/fla_aliases.py``).
``ops/_fla_compat.py`` lists every fla argument we accept, ignore or refuse, and where fla's
defaults differ from ours (docs/fla_compat.md: the gated and KDA ops, argument by argument).
"""

from ._checks import check_cu_seqlens, checked_cu_seqlens_cpu, compute_dtype, finite_checks, value_checks
from ._checks import check_op_inputs as check_inputs
from ._chunk import check_chunk_option, default_chunk_size, resolve_chunk_size
from ._frontend import packed_positions
from ._fla_aliases import (
    fused_chunk_linear_attn, fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule, fused_recurrent_linear_attn,
)
from .delta_rule import chunk_delta_rule, parallel_delta_rule, recurrent_delta_rule
from .feature_maps import DPFP, EluPlusOne, FavorPlus, FeatureMap, Identity, ReLU, Taylor, get_feature_map, normalize_qk
from .gated_delta_rule import chunk_gated_delta_rule, parallel_gated_delta_rule, recurrent_gated_delta_rule
from .kda import chunk_kda, fused_recurrent_kda, kda_gate, kda_step, parallel_kda, recurrent_kda
from .gdn2 import chunk_gdn2, fused_recurrent_gdn2, gdn2_step, parallel_gdn2, recurrent_gdn2
from .dplr import (
    chunk_dplr_delta_rule, chunk_rwkv7, dplr_step, fused_recurrent_dplr_delta_rule, fused_recurrent_rwkv7,
    parallel_dplr_delta_rule, recurrent_dplr_delta_rule,
)
from .delta_product import (
    chunk_gated_delta_product, gated_delta_product_step, parallel_gated_delta_product, recurrent_gated_delta_product,
)
from .linear_attn import chunk_linear_attn, parallel_linear_attn, recurrent_linear_attn
from .precision import bf16_products, bf16_products_enabled, set_bf16_products
from .softmax_attn import KVCache, softmax_attn, softmax_attn_reference
from .step import delta_rule_step, gated_delta_rule_step, linear_attn_step

__all__ = [
    "softmax_attn", "softmax_attn_reference", "KVCache",
    "recurrent_linear_attn", "parallel_linear_attn", "chunk_linear_attn",
    "recurrent_delta_rule", "parallel_delta_rule", "chunk_delta_rule",
    "recurrent_gated_delta_rule", "parallel_gated_delta_rule", "chunk_gated_delta_rule",
    "recurrent_kda", "parallel_kda", "chunk_kda", "kda_step", "kda_gate",
    "recurrent_gdn2", "parallel_gdn2", "chunk_gdn2", "gdn2_step",
    "recurrent_gated_delta_product", "parallel_gated_delta_product", "chunk_gated_delta_product",
    "gated_delta_product_step",
    "recurrent_dplr_delta_rule", "parallel_dplr_delta_rule", "chunk_dplr_delta_rule", "dplr_step",
    "FeatureMap", "Identity", "EluPlusOne", "ReLU", "DPFP", "FavorPlus", "Taylor",
    "get_feature_map", "normalize_qk", "finite_checks", "value_checks", "check_inputs",
    "bf16_products", "bf16_products_enabled", "set_bf16_products",
    # one token (update + read), for decoding: the recurrent forms' step
    "delta_rule_step", "gated_delta_rule_step", "linear_attn_step",
    # what layers and models built on the ops share with them
    "compute_dtype", "default_chunk_size", "resolve_chunk_size", "check_chunk_option", "check_cu_seqlens", "checked_cu_seqlens_cpu", "packed_positions",
    # flash-linear-attention's names, with fla's signatures (ops/_fla_aliases.py)
    "fused_recurrent_delta_rule", "fused_recurrent_gated_delta_rule", "fused_recurrent_linear_attn",
    "fused_chunk_linear_attn", "fused_recurrent_kda", "fused_recurrent_gdn2",
    "fused_recurrent_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_rwkv7",
]
