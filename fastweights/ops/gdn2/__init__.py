from .api import chunk_gdn2, fused_recurrent_gdn2, parallel_gdn2, recurrent_gdn2
from .recurrent import gdn2_step

__all__ = ["recurrent_gdn2", "parallel_gdn2", "chunk_gdn2", "fused_recurrent_gdn2", "gdn2_step"]
