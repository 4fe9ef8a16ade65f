"""Stopping a run cleanly: SIGINT / SIGTERM finish the current step and save a checkpoint, then the
process exits with 128 + the signal's number (130, 143); a second signal exits at once."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

__all__ = ["StopSignals", "TrainingInterrupted"]


class TrainingInterrupted(Exception):
    """Training stopped on SIGINT/SIGTERM after saving; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        saved = f"checkpoint {checkpoint} saved; continue with --resume" if checkpoint else "nothing saved (no --out)"
        super().__init__(f"train: stopped by {signal.Signals(signum).name} after step {step}; {saved}")


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the current step; a second one exits now.

    ``requested`` is the first signal's number (or ``None``). The second signal calls
    ``on_force`` (the trainer releases its lock) and ends the process with 128 + its
    number, without unwinding; an interrupted checkpoint write leaves only a ``*.tmp-*``
    folder, which the next run removes. Handlers can only be installed from the main
    thread; elsewhere this does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_force: Callable[[], None] = lambda: None) -> None:
        self.requested: Optional[int] = None
        self.on_force = on_force
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = signum
            sys.stderr.write(f"train: {name} received: finishing this step and saving a checkpoint "
                             f"(send it again to stop at once)\n")
            sys.stderr.flush()
            return
        sys.stderr.write(f"train: second {name}: stopping at once, without saving\n")
        sys.stderr.flush()
        try:
            self.on_force()
        finally:
            os._exit(128 + signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
