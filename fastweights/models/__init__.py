"""Models built from :mod:`fastweights.layers`: a small causal LM (``lm.py``)."""

from .lm import LM, LMCache, LMConfig

__all__ = ["LM", "LMConfig", "LMCache"]
