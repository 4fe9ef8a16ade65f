"""A training run owns its ``--out`` folder: the lock, the run id, resuming, pruning.

What can go wrong in a run folder, and what this module does about it:

- **Two trainers on one folder** (their metrics interleave, one prunes the other's
  checkpoints): :class:`RunLock` holds an exclusive ``flock`` on ``out/lock`` for the
  life of the run. The file names the holder (pid, host, start time); the kernel
  drops the lock when the holder dies, so a lock left by a killed run is taken over
  (and reported as stale, by its pid) rather than blocking the folder forever.
  The file is removed on a clean exit.
- **A new run in a used folder** (it used to prune its own checkpoints in favour of
  the old run's, which sort later by name): :func:`claim_run_folder` refuses a
  folder that holds another run unless ``resume`` (continue it) or ``overwrite``
  (delete it first) says what to do. Every checkpoint carries its run's id, and
  :func:`prune_checkpoints` removes only the current run's older checkpoints, by
  step number, never by name and never the one ``latest`` names.
- **A kill while a checkpoint is deleted or written**: deletions rename the folder
  to a ``*.tmp-*`` name first; writes go to ``*.tmp-*`` folders; whatever a killed
  run left under such names is removed when the next run takes the lock.
- **SIGINT / SIGTERM** (Ctrl-C, a scheduler's preemption): :class:`StopSignals`
  lets the current step finish; the trainer saves a checkpoint and exits with
  128 + the signal's number (130, 143). A second signal exits at once.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Callable, Optional

from ..io.checkpoint import Checkpoint
from ..io.errors import CheckpointError
from ..io.listing import (
    LATEST, clean_stray, mark_latest, remove_folder, resolve_checkpoint, run_checkpoints, run_id_of,
)
from .errors import RunFolderError
from .train_state import load_training_checkpoint

LOCK = "lock"
METRICS = "metrics.jsonl"

__all__ = [
    "RunFolderError", "RunLock", "claim_run_folder", "prune_checkpoints", "new_run_id", "load_resume_checkpoint",
    "describe_latest",
]


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def _start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot, from /proc): with the pid it names one
    process, even after the pid is reused. ``None`` where /proc is not available."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process a lock file names is still running (same host only)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return holder.get("start") is None or _start_time(pid) in (None, holder.get("start"))


class RunLock:
    """An exclusive lock on a run folder (``run_dir/lock``); see the module docstring."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK)
        self._fd: Optional[int] = None

    def _holder(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                holder = json.load(f)
            return holder if isinstance(holder, dict) else {}
        except (OSError, ValueError):
            return {}

    def acquire(self, log: Callable[[str], None] = print) -> None:
        """Take the lock or raise :class:`RunFolderError` naming the trainer that holds it."""
        import fcntl

        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:  # a full disk, a read-only parent: one line, not a traceback
            raise RunFolderError(f"train: cannot create the run folder {self.run_dir}: {e.strerror or e}") from None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunFolderError(f"train: cannot create the lock file {self.path}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = self._holder()
                who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}"
                raise RunFolderError(
                    f"train: {self.run_dir} is in use by another trainer ({who}); wait for it to end or use another --out"
                ) from None
            try:  # the file we locked may have been unlinked by its previous holder meanwhile
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = self._holder()
        if previous.get("pid") is not None and previous.get("pid") != os.getpid():
            state = "still running but not holding it" if _alive(previous) else "no longer running"
            log(f"train: took over the stale lock of pid {previous.get('pid')} on {previous.get('host')} ({state})")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._fd = fd  # held from here on: release() removes the file, whatever happens next
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError as e:
            self.release()
            raise RunFolderError(f"train: cannot write the lock file {self.path}: {e.strerror or e}") from None

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent; safe in a signal handler)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.remove(self.path)  # while still locked, so no one else's lock file is removed
        except OSError:
            pass
        finally:  # whatever happens, the lock goes with the descriptor
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim_run_folder(run_dir: str, *, resume: bool, overwrite: bool, log: Callable[[str], None] = print) -> None:
    """Make ``run_dir`` ready for this run; call it holding the lock.

    Removes what killed runs left (``*.tmp-*``). A fresh run refuses a folder that holds
    checkpoints or metrics of another run unless ``overwrite``, which deletes them. A
    resumed run removes its own checkpoints newer than ``latest`` (written by a run
    killed before it could mark them; they are recomputed exactly). A resumed run whose
    folder has checkpoints but no ``latest`` (a run killed between renaming its first
    checkpoint into place and marking it) resumes from the newest checkpoint that loads
    and verifies, saying so; those that do not are named with the reason.
    """
    if resume and overwrite:
        raise RunFolderError("train: --resume continues the run in --out and --overwrite replaces it; pass one of them")
    stray = clean_stray(run_dir)
    if stray:
        log(f"train: removed {len(stray)} temp file(s) that an interrupted run left in {run_dir}: {', '.join(stray[:4])}"
            + (" ..." if len(stray) > 4 else ""))
    checkpoints = run_checkpoints(run_dir)
    has_latest = os.path.exists(os.path.join(run_dir, LATEST))
    if resume:
        if not has_latest and checkpoints:
            mark_latest(run_dir, _newest_valid(checkpoints, log).path)
        latest = resolve_checkpoint(run_dir)
        run_id = run_id_of(latest)
        step = next((s for s, folder in checkpoints if os.path.samefile(folder, latest)), None)
        for s, folder in checkpoints:
            if step is not None and s > step and run_id is not None and run_id_of(folder) == run_id:
                remove_folder(folder)
        return
    if not (checkpoints or has_latest or os.path.exists(os.path.join(run_dir, METRICS))):
        return
    if not overwrite:
        ids = sorted({run_id_of(folder) or "without id" for _, folder in checkpoints})
        what = (f"{len(checkpoints)} checkpoint(s) of run {', '.join(ids)} (up to {os.path.basename(checkpoints[-1][1])})"
                if checkpoints else "the files of another run")
        raise RunFolderError(
            f"train: {run_dir} already holds {what}; pass --resume to continue that run or --overwrite to replace it"
        )
    for _, folder in checkpoints:
        remove_folder(folder)
    for name in (LATEST, METRICS):
        if os.path.exists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))
    log(f"train: --overwrite: removed the previous run's {len(checkpoints)} checkpoint(s) from {run_dir}")


def load_resume_checkpoint(run_dir: str, log: Callable[[str], None] = lambda _: None) -> Checkpoint:
    """The checkpoint a ``--resume`` of ``run_dir`` continues from, loaded and verified
    (:func:`load_training_checkpoint`): the one ``latest`` names or, when the folder has
    checkpoints but no ``latest``, the newest that verifies (as :func:`claim_run_folder`
    chooses it; that one also writes ``latest``)."""
    if os.path.isdir(run_dir) and not os.path.exists(os.path.join(run_dir, LATEST)):
        checkpoints = run_checkpoints(run_dir)
        if checkpoints:
            return _newest_valid(checkpoints, log)
    return load_training_checkpoint(resolve_checkpoint(run_dir))


def _newest_valid(checkpoints, log: Callable[[str], None]) -> Checkpoint:
    """The newest of ``(step, folder)`` that passes :func:`load_training_checkpoint`, loaded;
    each newer one that does not is logged with its reason. Raises if none does."""
    reasons = []
    for _, folder in reversed(checkpoints):
        try:
            ckpt = load_training_checkpoint(folder)
        except CheckpointError as e:
            reasons.append(str(e))
            log(f"train: --resume: skipping {os.path.basename(folder)}: {e}")
            continue
        log(f"train: --resume: {os.path.dirname(folder)} has no `latest` file (a run killed before it marked its "
            f"checkpoint); resuming from {os.path.basename(folder)}, the newest checkpoint that verifies")
        return ckpt
    raise RunFolderError(f"train: --resume: no checkpoint in {os.path.dirname(checkpoints[0][1])} can be resumed "
                         f"({'; '.join(reasons)[:300]})")


def prune_checkpoints(run_dir: str, run_id: str, keep: int, latest: str) -> None:
    """Delete run ``run_id``'s checkpoints but its ``keep`` newest (by step) and ``latest``."""
    mine = run_checkpoints(run_dir, run_id)
    for _, folder in mine[:-keep] if keep else mine:
        if os.path.abspath(folder) != os.path.abspath(latest):
            remove_folder(folder)


def describe_latest(run_dir: str) -> str:
    """``"ckpt-000010 (latest) is intact"``, or that there is none yet: for error messages."""
    try:
        return f"the previous checkpoint {os.path.basename(resolve_checkpoint(run_dir))} (latest) is intact"
    except CheckpointError:
        return "no earlier checkpoint exists"
