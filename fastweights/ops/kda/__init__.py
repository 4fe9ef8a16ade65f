from ..step import kda_step
from .api import chunk_kda, fused_recurrent_kda, parallel_kda, recurrent_kda
from .fla import kda_gate

__all__ = ["recurrent_kda", "parallel_kda", "chunk_kda", "fused_recurrent_kda", "kda_step", "kda_gate"]
