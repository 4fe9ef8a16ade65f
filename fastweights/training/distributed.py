"""Data-parallel plumbing: the process group, per-rank heartbeats, and collectives with a deadline.

Every collective has a deadline (``ddp_timeout``): a rank that stops answering (stopped,
swapped out, deadlocked) ends the job on every other rank with a message naming it, from
the per-step heartbeats the ranks leave in the process group's store.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

__all__ = ["DistributedTimeout", "Heartbeat", "all_reduce_", "collective", "dist_info", "maybe_init_distributed",
           "set_heartbeat", "current_heartbeat"]


def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def maybe_init_distributed(timeout: float = 300.0) -> bool:
    """Join the process group torchrun set up (WORLD_SIZE > 1); True if this call created it.
    ``timeout``: seconds any collective may wait before it fails."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        return True
    return False


class DistributedTimeout(RuntimeError):
    """A collective failed or timed out: a rank is silent or gone."""


class Heartbeat:
    """Per-rank liveness in the process group's store: ``beat(step)`` after every step.

    When a collective fails, :meth:`silent_ranks` says which ranks stopped beating
    (the oldest beats); rank 0 logs a heartbeat line every ``interval`` seconds.
    The store is the one ``init_process_group`` made; without it (one process,
    or a store that cannot be reached) the messages just say less.
    """

    KEY = "fastweights/heartbeat/{}"

    def __init__(self, rank: int, world: int, interval: float, log: Callable[[str], None]) -> None:
        self.rank, self.world, self.interval, self.log = rank, world, interval, log
        self.store = None
        if world > 1:
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except Exception:  # a private hook; the timeout still works without it
                self.store = None
        self.last_log = time.time()

    def beat(self, step: int) -> None:
        if self.store is None:
            return
        now = time.time()
        self.store.set(self.KEY.format(self.rank), f"{step} {now}")
        if self.rank == 0 and now - self.last_log >= self.interval:
            self.last_log = now
            beats = self.beats()
            slowest = min(beats, key=lambda r: beats[r]) if beats else None
            self.log(f"heartbeat: step {step}; {len(beats)} of {self.world} ranks reported"
                     + (f", the last one rank {slowest} at step {beats[slowest][0]}, {now - beats[slowest][1]:.1f} s ago"
                        if slowest is not None else ""))

    def beats(self):
        """``{rank: (step, unix time)}`` of the ranks that have beaten."""
        found = {}
        for r in range(self.world):
            key = self.KEY.format(r)
            try:
                if self.store.check([key]):
                    step, when = self.store.get(key).decode().split()
                    found[r] = (int(step), float(when))
            except Exception:  # the store itself may be gone with a dead rank
                break
        return found

    def failure(self, what: str, error: BaseException) -> DistributedTimeout:
        """The error to raise when a collective failed: which ranks went silent, and since when."""
        beats = self.beats() if self.store is not None else {}
        now = time.time()
        others = [r for r in range(self.world) if r != self.rank]
        mine = beats.get(self.rank, (None, now))[0]
        behind = [r for r in others if r not in beats or (mine is not None and beats[r][0] < mine)]
        if not behind and beats:
            behind = [min(others, key=lambda r: beats.get(r, (0, 0.0))[1])]
        if behind:
            described = ", ".join(
                f"rank {r} (silent for {now - beats[r][1]:.1f} s, last heartbeat at step {beats[r][0]})" if r in beats
                else f"rank {r} (no heartbeat)" for r in behind)
        else:
            described = "a rank that could not be identified (the store is unreachable)"
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        return DistributedTimeout(
            f"train: rank {self.rank} gave up on {what}: waiting for {described}; "
            f"the job stops on every rank (--ddp-timeout; {reason})"
        )


_HEARTBEAT: Optional[Heartbeat] = None  # the running loop's, for the collectives below


def set_heartbeat(heartbeat: Optional[Heartbeat]) -> None:
    """Make ``heartbeat`` the one the collectives name silent ranks from (``None``: none)."""
    global _HEARTBEAT
    _HEARTBEAT = heartbeat


def current_heartbeat() -> Optional[Heartbeat]:
    """The running loop's heartbeat, or ``None``."""
    return _HEARTBEAT


def collective(what: str, fn, *args) -> None:
    """Run one collective; a failure (timeout, a rank gone) becomes :class:`DistributedTimeout`."""
    try:
        fn(*args)
    except RuntimeError as e:
        if _HEARTBEAT is None or isinstance(e, DistributedTimeout):
            raise
        raise _HEARTBEAT.failure(what, e) from None


def all_reduce_(tensors: List[torch.Tensor]) -> None:
    """Sum tensors across processes in place, as one flat buffer."""
    if dist_info()[1] == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    collective("an all-reduce", dist.all_reduce, flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()
