from .chunk import chunk_gated_delta_rule
from .parallel import parallel_gated_delta_rule
from .recurrent import recurrent_gated_delta_rule

__all__ = ["recurrent_gated_delta_rule", "parallel_gated_delta_rule", "chunk_gated_delta_rule"]
