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

:meth:`SessionPool.step` runs the LM's one-token step on the N sessions where they lie
(:meth:`LM.step_slots <fastweights.models.lm.LM.step_slots>`): every layer passes its pool and
the slots to the op's pool form, which on the CPU is the compiled kernel updating each slot in
place, so no state is gathered into a batch or copied back (only the short convolution's
window, a few KiB per session, is). A session's logits are those of the same session decoded
alone, to the batch's rounding (the projections are batched matmuls; the state update itself
is the same kernel per row). The
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
        self._states = [FastWeightState(m, c) for m, c in zip(self.memory, self.conv)]  # the pools, per layer
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
        idx = slots.to(self.memory[0].device).long()
        states = [FastWeightState(m.index_select(0, idx), None if c is None else c.index_select(0, idx))
                  for m, c in zip(self.memory, self.conv)]
        return LMCache(states, length=int(self.lengths[slots].max()), batch_size=len(idx), mixers=list(self.mixers))

    def step(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token for each session at ``slots [N]`` (``tokens [N]``): logits ``[N, vocab]``, states
        advanced in place at their slots (:meth:`LM.step_slots <fastweights.models.lm.LM.step_slots>`)."""
        from ..ops.state_pool import check_state_indices

        check_state_indices("SessionPool.step", self.memory[0], slots, len(slots), pool_name="pool")
        if bool((slots < 0).any()) or not bool(self._live[slots.long()].all()):
            raise ValueError("SessionPool.step: `slots` must name live sessions")
        idx = slots.to(self.memory[0].device).long()
        with torch.no_grad():
            logits = self.model.step_slots(tokens, self._states, idx)
        self.lengths[slots] += 1
        return logits
