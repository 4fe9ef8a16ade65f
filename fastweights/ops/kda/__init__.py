from ..step import kda_step
from .chunk import chunk_kda
from .fla import kda_gate
from .parallel import parallel_kda
from .recurrent import fused_recurrent_kda, recurrent_kda

__all__ = ["recurrent_kda", "parallel_kda", "chunk_kda", "fused_recurrent_kda", "kda_step", "kda_gate"]
