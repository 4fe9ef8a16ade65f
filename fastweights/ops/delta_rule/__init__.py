from .chunk import chunk_delta_rule
from .parallel import parallel_delta_rule
from .recurrent import recurrent_delta_rule

__all__ = ["recurrent_delta_rule", "parallel_delta_rule", "chunk_delta_rule"]
