from .chunk import chunk_linear_attn
from .parallel import parallel_linear_attn
from .recurrent import recurrent_linear_attn

__all__ = ["recurrent_linear_attn", "parallel_linear_attn", "chunk_linear_attn"]
