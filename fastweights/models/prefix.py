"""Prefix reuse: prefill a shared prompt once, then start every session from its cache.

A fast-weight layer's cache is a fixed ``[H, K, V]`` state (plus W − 1 convolution inputs)
per sequence, so a system prompt read once can seed any number of sessions at the cost of
a copy of that state::

    _, prefix = model(system_ids)                # [1, P]: the prompt, read once
    stored = store_prefix(prefix)                 # a committed, independent copy (fp32 states)
    cache = fork_cache(stored, n=8)               # 8 sessions, each continuing after the prompt
    logits, cache = model(user_ids, cache)        # [8, T]: their own turns

Exactness. Continuing from a forked cache is continuing from the prefix's cache: the same
states, the same kernels, so the logits are bitwise those of ``model(user_ids, prefix)``
(row by row). Against prefilling the whole text ``[system | user]`` in one call, the chunk
forms split the text at a different place (the prompt's end instead of a chunk boundary),
which regroups the same sums: equal to ≤ 1e-12 in float64 (``tests/models/test_prefix.py``),
and to the op's usual rounding in fp32.

Low-precision storage (``store_prefix(cache, dtype=torch.bfloat16)``). A server may keep
cached prefixes in bf16 to halve their memory. The contract: the fast-weight memories are
rounded to bf16 once, when stored (round to nearest even, relative error ≤ 2⁻⁹ per entry),
and widened back to fp32 exactly when forked; everything after that runs in fp32 as usual.
So a session forked from a bf16-stored prefix equals, bitwise, a session continuing from
``state.to(bfloat16).to(float32)``; it is *not* the cold fp32 path, and the difference is
that one rounding of the state carried forward (a random tiny gated-DeltaNet LM, 40-token
prompt: 1.8e-4 of the largest logit; the test bounds it by 1e-2). vLLM documents the same difference for its bf16 cached
states. Convolution windows and softmax KV caches are kept in the model's dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..config import check_int
from ..layers.common import FastWeightState
from ..layers.softmax_attention import AttentionState
from ..ops import KVCache
from .lm import LMCache

__all__ = ["fork_cache", "store_prefix"]

_LOW = (torch.bfloat16, torch.float16)


def _map_state(state, fn, memory_fn=None):
    """A layer's state with ``fn`` applied to every tensor (``memory_fn`` to a fast-weight memory)."""
    if isinstance(state, FastWeightState):
        return FastWeightState((memory_fn or fn)(state.memory), None if state.conv is None else fn(state.conv))
    if isinstance(state, AttentionState):
        return AttentionState(_map_state(state.kv, fn), fn(state.conv))
    if isinstance(state, KVCache):
        return KVCache(fn(state.keys), fn(state.values), fn(state.lengths))
    raise TypeError(f"fork_cache: unexpected layer state {type(state).__name__}")


def _check_cache(fn: str, cache) -> None:
    if not isinstance(cache, LMCache):
        raise TypeError(f"{fn}: `cache` must be an LMCache (as the LM returns it), got {type(cache).__name__}")
    if cache.window:
        raise ValueError(f"{fn}: `cache` has an open verify window of {cache.window_tokens} token(s); commit() it first "
                         f"(a stored prefix is a fixed point, not a draft)")


def store_prefix(cache: LMCache, dtype: Optional[torch.dtype] = None) -> LMCache:
    """An independent, committed copy of ``cache`` to keep as a prefix (module docstring).

    ``dtype`` (None, ``torch.bfloat16`` or ``torch.float16``) rounds the fast-weight memories for
    storage; :func:`fork_cache` widens them back to fp32. The KV caches of softmax layers and the
    convolution windows keep their dtype. ``cache`` itself is left as it is.
    """
    _check_cache("store_prefix", cache)
    if dtype is not None and dtype not in _LOW:
        raise ValueError(f"store_prefix: `dtype` must be None, torch.bfloat16 or torch.float16, got {dtype}")
    memory = (lambda t: t.clone()) if dtype is None else (lambda t: t.to(dtype))
    states = [_map_state(s, lambda t: t.clone(), memory) for s in cache.states]
    return dataclasses.replace(cache, states=states, window=[], recording=False)


def fork_cache(prefix: LMCache, n: int = 1, state_dtype: torch.dtype = torch.float32) -> LMCache:
    """A cache of ``n`` sessions, each continuing from ``prefix`` (one sequence, or already ``n``).

    Every tensor is a new copy (the sessions and the prefix never share memory), so the
    prefix can be forked again later. Memories stored in bf16/fp16 (:func:`store_prefix`)
    come back in ``state_dtype`` (fp32; pass torch.float64 for a float64 model).
    """
    _check_cache("fork_cache", prefix)
    check_int("fork_cache", "n", n)
    if prefix.batch_size not in (1, n):
        raise ValueError(f"fork_cache: `prefix` holds {prefix.batch_size} sequences; expected 1 (a prefix to "
                         f"repeat) or `n`={n}")
    reps = n // prefix.batch_size

    def copy(t):
        return t.repeat((reps,) + (1,) * (t.dim() - 1)) if reps > 1 else t.clone()

    def memory(t):
        return copy(t.to(state_dtype) if t.dtype in _LOW else t)

    states = [_map_state(s, copy, memory) for s in prefix.states]
    return dataclasses.replace(prefix, states=states, batch_size=n, window=[], recording=False)
