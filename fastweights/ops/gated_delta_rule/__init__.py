from .api import chunk_gated_delta_rule, parallel_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["recurrent_gated_delta_rule", "parallel_gated_delta_rule", "chunk_gated_delta_rule"]
