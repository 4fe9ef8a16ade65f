from .api import chunk_dplr_delta_rule, parallel_dplr_delta_rule, recurrent_dplr_delta_rule
from .fla_aliases import chunk_rwkv7, fused_recurrent_dplr_delta_rule, fused_recurrent_rwkv7
from .recurrent import dplr_step

__all__ = ["recurrent_dplr_delta_rule", "parallel_dplr_delta_rule", "chunk_dplr_delta_rule", "dplr_step",
           "fused_recurrent_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_rwkv7"]
