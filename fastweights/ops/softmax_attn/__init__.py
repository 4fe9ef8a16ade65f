from .attention import KVCache, softmax_attn, softmax_attn_reference

__all__ = ["KVCache", "softmax_attn", "softmax_attn_reference"]
