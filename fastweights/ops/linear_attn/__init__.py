from .api import chunk_linear_attn, parallel_linear_attn, recurrent_linear_attn

__all__ = ["recurrent_linear_attn", "parallel_linear_attn", "chunk_linear_attn"]
