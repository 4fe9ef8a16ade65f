"""Data-parallel plumbing: the process group, per-rank heartbeats, and collectives with a deadline.

Every collective has a deadline (``ddp_timeout``): a rank that stops answering (stopped,
swapped out, deadlocked) ends the job on every other rank with a message naming it, from
the per-step heartbeats the ranks leave in the process group's store and the pulse a
thread of each rank leaves there every second, also while the rank waits in a collective
(so a killed or stopped rank is told apart from the ranks that only wait for it).
"""

from __future__ import annotations

import datetime
import os
import threading
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

    When a collective fails, :meth:`failure` names the ranks whose pulse stopped
    (:meth:`start_pulse`: killed or stopped) and, failing that, the ranks behind in
    steps or with the oldest beats; rank 0 logs a heartbeat line every ``interval``
    seconds. The store is the one ``init_process_group`` made; without it (one process,
    or a store that cannot be reached) the messages just say less.
    """

    KEY = "fastweights/heartbeat/{}"
    ALIVE = "fastweights/alive/{}"  # a pulse every `pulse` s from a thread, even while the main one waits
    GAVE_UP = "fastweights/gaveup/{}"  # set by a rank whose collective failed: it exits for another's sake

    def __init__(self, rank: int, world: int, interval: float, log: Callable[[str], None], pulse: float = 1.0) -> None:
        self.rank, self.world, self.interval, self.log, self.pulse = rank, world, interval, log, pulse
        self.store = None
        if world > 1:
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except Exception:  # a private hook; the timeout still works without it
                self.store = None
        self.last_log = time.time()
        self._stop = threading.Event()

    def start_pulse(self) -> "Heartbeat":
        """Start a daemon thread that marks this process alive every ``pulse`` s, also while the main
        thread waits in a collective: a killed or stopped rank falls silent, a rank that only waits
        for it does not. Returns ``self``."""
        if self.store is not None:
            def pulse():
                while not self._stop.wait(self.pulse):
                    try:
                        self.store.set(self.ALIVE.format(self.rank), str(time.time()))
                    except Exception:  # the store went with a dead rank 0: nothing more to say
                        return

            self.store.set(self.ALIVE.format(self.rank), str(time.time()))
            threading.Thread(target=pulse, name="fastweights-pulse", daemon=True).start()
        return self

    def stop_pulse(self) -> None:
        self._stop.set()

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

    def _times(self, template: str):
        """``{rank: unix time}`` of the store entries ``template`` (a pulse, a give-up)."""
        found = {}
        for r in range(self.world):
            key = template.format(r)
            try:
                if self.store.check([key]):
                    found[r] = float(self.store.get(key).decode())
            except Exception:  # the store itself may be gone with a dead rank
                break
        return found

    def lost_ranks(self):
        """``(ranks, {rank: last pulse})``: the other ranks whose pulse stopped without their giving up
        on a collective (killed or stopped), not those that only gave up waiting for them. A rank that
        fails fast (a peer's connection reset) waits up to six pulses for a dead peer's to go stale."""
        try:
            self.store.set(self.GAVE_UP.format(self.rank), str(time.time()))
        except Exception:  # the store went with a dead rank 0
            return [], {}
        others = [r for r in range(self.world) if r != self.rank]
        deadline = time.time() + 6 * self.pulse
        while True:
            alive, gave_up, now = self._times(self.ALIVE), self._times(self.GAVE_UP), time.time()
            if not alive:  # no pulses (a store without them): the heartbeats alone must tell
                return [], alive
            lost = [r for r in others if r not in gave_up and (r not in alive or now - alive[r] > 5 * self.pulse)]
            if lost or now >= deadline:
                return lost, alive
            time.sleep(self.pulse / 2)

    def failure(self, what: str, error: BaseException) -> DistributedTimeout:
        """The error to raise when a collective failed: which ranks went silent, and since when."""
        lost, alive = self.lost_ranks() if self.store is not None else ([], {})
        beats = self.beats() if self.store is not None else {}
        now = time.time()
        others = [r for r in range(self.world) if r != self.rank]
        mine = beats.get(self.rank, (None, now))[0]
        behind = lost or [r for r in others if r not in beats or (mine is not None and beats[r][0] < mine)]
        if not behind and beats:
            behind = [min(others, key=lambda r: beats.get(r, (0, 0.0))[1])]
        if behind:
            described = ", ".join(
                f"rank {r} (silent for {now - beats[r][1]:.1f} s, last heartbeat at step {beats[r][0]}"
                + (f"; no sign of life for {now - alive[r]:.1f} s: killed or stopped)" if r in lost and r in alive else ")")
                if r in beats else f"rank {r} (no heartbeat)" for r in behind)
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


def collective(what: str, fn, *args, **kwargs):
    """Run one collective, or work that runs collectives (an FSDP forward or backward pass, a sharded
    checkpoint); a failure (timeout, a rank gone) becomes :class:`DistributedTimeout`. Returns ``fn``'s result."""
    try:
        return fn(*args, **kwargs)
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
