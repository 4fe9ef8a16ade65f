from .api import chunk_delta_rule, parallel_delta_rule, recurrent_delta_rule

__all__ = ["recurrent_delta_rule", "parallel_delta_rule", "chunk_delta_rule"]
