"""Models built from :mod:`fastweights.layers`: a small causal LM (``lm.py``)."""

from .lm import LM, LMCache, LMConfig
from .prefix import fork_cache, store_prefix

__all__ = ["LM", "LMConfig", "LMCache", "fork_cache", "store_prefix"]
