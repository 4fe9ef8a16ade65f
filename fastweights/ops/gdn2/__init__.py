from .chunk import chunk_gdn2
from .parallel import parallel_gdn2
from .recurrent import fused_recurrent_gdn2, gdn2_step, recurrent_gdn2

__all__ = ["recurrent_gdn2", "parallel_gdn2", "chunk_gdn2", "fused_recurrent_gdn2", "gdn2_step"]
