from .chunk import chunk_dplr_delta_rule
from .fla_aliases import chunk_rwkv7, fused_recurrent_dplr_delta_rule, fused_recurrent_rwkv7
from .parallel import parallel_dplr_delta_rule
from .recurrent import dplr_step, recurrent_dplr_delta_rule

__all__ = ["recurrent_dplr_delta_rule", "parallel_dplr_delta_rule", "chunk_dplr_delta_rule", "dplr_step",
           "fused_recurrent_dplr_delta_rule", "chunk_rwkv7", "fused_recurrent_rwkv7"]
