"""Continuous batching for a fast-weight LM: many sessions in one preallocated pool of states.

Every fast-weight layer's decode state is a fixed ``[H, K, V]`` memory plus the short
convolution's last W − 1 inputs, whatever the context. :class:`SessionPool` preallocates
``slots`` of them per layer, once; sessions arrive (their prefill's cache is written into a
free slot), decode one token per step together with whichever other sessions are live, and
leave (the slot is freed, nothing is reallocated)::

    pool = SessionPool(model, slots=256)
    _, cache = model(prompt_ids)                     # [1, P] prefill (or fork_cache of a stored prefix)
    slot = pool.admit(cache)
    logits = pool.step(next_tokens, torch.tensor([slot, ...]))   # [N] tokens of N live sessions
    pool.release(slot)

:meth:`SessionPool.step` runs the LM's ordinary one-token forward on the N sessions' states:
it gathers them from their slots (one copy of N states per layer), steps, and writes the new
states back (another). A session's logits are those of the same session decoded alone, to
the batch's rounding (bitwise with the compiled CPU step, which is batch invariant). The
pool's memory is ``slots`` × the per-session state, constant in the context length:
:attr:`SessionPool.nbytes`.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from ..config import check_int
from ..layers.common import FastWeightState
from .lm import LM, LMCache

__all__ = ["SessionPool"]


class SessionPool:
    """``slots`` sessions' decode states for ``model`` (fast-weight mixers only), preallocated."""

    def __init__(self, model: LM, slots: int, dtype: Optional[torch.dtype] = None) -> None:
        check_int("SessionPool", "slots", slots)
        mixers = list(model.config.mixers)
        if "softmax" in mixers:
            raise ValueError(f"SessionPool: mixers {mixers} include softmax, whose KV cache grows with the context; "
                             f"a pool of fixed-size states needs fast-weight mixers only")
        self.model, self.slots, self.mixers = model, slots, mixers
        param = next(model.parameters())
        with torch.no_grad():  # one session's empty-prompt state gives every layer's shapes and dtypes
            _, probe = model(torch.zeros(1, 1, dtype=torch.long, device=param.device))
        self.memory: List[torch.Tensor] = []
        self.conv: List[Optional[torch.Tensor]] = []
        for s in probe.states:
            mem = s.memory
            self.memory.append(mem.new_zeros((slots,) + tuple(mem.shape[1:]), dtype=dtype or mem.dtype))
            self.conv.append(None if s.conv is None else s.conv.new_zeros((slots,) + tuple(s.conv.shape[1:])))
        self.lengths = torch.zeros(slots, dtype=torch.long)
        self.free = list(range(slots - 1, -1, -1))  # a stack: the lowest free slot is taken first
        self._live = torch.zeros(slots, dtype=torch.bool)

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (all slots, used or not): fixed at construction."""
        return sum(t.numel() * t.element_size() for t in self.memory + [c for c in self.conv if c is not None])

    @property
    def live(self) -> int:
        return self.slots - len(self.free)

    def admit(self, cache: LMCache) -> int:
        """Write a one-session ``cache`` (a prefill's, or :func:`~fastweights.models.prefix.fork_cache`'s)
        into a free slot; returns the slot."""
        if not isinstance(cache, LMCache) or cache.batch_size != 1 or cache.mixers != self.mixers:
            raise ValueError("SessionPool.admit: `cache` must be a one-session LMCache of this pool's model")
        if not self.free:
            raise ValueError(f"SessionPool.admit: all {self.slots} slots are taken; release() a session first")
        slot = self.free.pop()
        self._live[slot] = True
        with torch.no_grad():
            for i, s in enumerate(cache.states):
                self.memory[i][slot].copy_(s.memory[0])
                if self.conv[i] is not None:
                    self.conv[i][slot].copy_(s.conv[0])
        self.lengths[slot] = cache.length
        return slot

    def release(self, slot: int) -> None:
        """Free ``slot`` (its state is overwritten by the next session admitted there)."""
        check_int("SessionPool.release", "slot", slot, minimum=0)
        if slot >= self.slots or not bool(self._live[slot]):
            raise ValueError(f"SessionPool.release: `slot`={slot} is not a live session's slot")
        self._live[slot] = False
        self.free.append(slot)

    def cache(self, slots: torch.Tensor) -> LMCache:
        """The sessions at ``slots [N]`` as an N-row :class:`LMCache` (a copy of their states)."""
        return self._gathered(slots, reuse=False)

    def _gathered(self, slots: torch.Tensor, reuse: bool = True) -> LMCache:
        """:meth:`cache`; with ``reuse`` into buffers kept from one step to the next (valid until the next
        step: a fresh multi-MiB allocation per step costs its page faults)."""
        idx = slots.to(self.memory[0].device)
        n = len(idx)
        if not reuse or getattr(self, "_buffers", (None, 0))[1] != n:
            buffers = ([(m.new_empty((n,) + m.shape[1:]), None if c is None else c.new_empty((n,) + c.shape[1:]))
                        for m, c in zip(self.memory, self.conv)], n)
            if reuse:
                self._buffers = buffers
        else:
            buffers = self._buffers
        states = []
        for (m, c), (m_out, c_out) in zip(zip(self.memory, self.conv), buffers[0]):
            states.append(FastWeightState(torch.index_select(m, 0, idx, out=m_out),
                                          None if c is None else torch.index_select(c, 0, idx, out=c_out)))
        return LMCache(states, length=int(self.lengths[slots].max()), batch_size=n, mixers=list(self.mixers))

    def step(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each session at ``slots [N]`` (``tokens [N]``): logits ``[N, vocab]``, states
        advanced in place at their slots."""
        from ..ops.state_pool import check_state_indices

        check_state_indices("SessionPool.step", self.memory[0], slots, len(slots), pool_name="pool")
        if bool((slots < 0).any()) or not bool(self._live[slots.long()].all()):
            raise ValueError("SessionPool.step: `slots` must name live sessions")
        with torch.no_grad():
            logits, cache = self.model(tokens.view(-1, 1), self._gathered(slots))
            idx = slots.to(self.memory[0].device)
            for i, s in enumerate(cache.states):
                self.memory[i].index_copy_(0, idx, s.memory)
                if self.conv[i] is not None:
                    self.conv[i].index_copy_(0, idx, s.conv)
        self.lengths[slots] += 1
        return logits[:, -1]
