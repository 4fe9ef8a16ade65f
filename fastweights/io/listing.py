"""The checkpoints of a run folder: their names, the ``latest`` pointer, listing by step, and
removal that no kill can leave half done."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

from ..config import atomic_write_text
from .errors import CheckpointError

LATEST = "latest"
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")
STRAY = re.compile(r"\.tmp-|\.tmp$")  # temp folders/files of writers that are gone

__all__ = ["LATEST", "checkpoint_step", "clean_stray", "is_model_file", "mark_latest", "remove_folder", "resolve_checkpoint",
           "run_checkpoints", "run_id_of"]


def mark_latest(run_dir: "str | os.PathLike", checkpoint: "str | os.PathLike") -> None:
    """Point ``run_dir/latest`` at ``checkpoint`` (atomically)."""
    atomic_write_text(os.path.join(os.fspath(run_dir), LATEST), os.path.basename(os.fspath(checkpoint)) + "\n")


def is_model_file(path: "str | os.PathLike") -> bool:
    """Whether ``path`` is a single-file model (``fastweights export``'s ``.safetensors`` file), not a folder."""
    return os.path.isfile(os.fspath(path)) and os.fspath(path).endswith(".safetensors")


def resolve_checkpoint(path: "str | os.PathLike") -> str:
    """A checkpoint folder (one process's or sharded), a run folder (followed through its ``latest``
    file), or a single-file model."""
    from .dcp_checkpoint import is_sharded_checkpoint

    path = os.fspath(path)
    if is_model_file(path):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist (expected a checkpoint or run folder)")
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            name = f.read().strip()
        target = os.path.join(path, name)
        if not name or name in (".", "..") or os.path.basename(name) != name or not os.path.isdir(target):
            raise CheckpointError(f"{latest} names {name!r}, which is not a checkpoint folder in {path!r}")
        return target
    if not os.path.isfile(os.path.join(path, "model.safetensors")) and not is_sharded_checkpoint(path):
        found = run_checkpoints(path)
        if found:  # a run folder whose `latest` is gone (e.g. a kill right after its first checkpoint)
            names = [os.path.basename(folder) for _, folder in found]
            raise CheckpointError(
                f"{path!r} is a run folder without a `latest` file; it holds {', '.join(names[-3:])}"
                f"{' and older' if len(names) > 3 else ''}: pass one of them, e.g. {os.path.join(path, names[-1])!r} "
                f"(`fastweights train --resume` picks the newest that verifies)")
        raise CheckpointError(f"{path!r} holds neither model.safetensors nor a `latest` file: not a checkpoint or run folder")
    return path


def checkpoint_step(name: str) -> Optional[int]:
    """The step of a checkpoint folder name ``ckpt-<step>``; ``None`` for any other name."""
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def run_id_of(path: str) -> Optional[str]:
    """The run id in a checkpoint's train.json (``None`` if it has none or cannot be read)."""
    try:
        with open(os.path.join(path, "train.json"), encoding="utf-8") as f:
            run_id = json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def run_checkpoints(run_dir: str, run_id: Optional[str] = None) -> List[Tuple[int, str]]:
    """``(step, folder)`` of the checkpoints in ``run_dir`` sorted by step (not by name:
    ``ckpt-1000000`` comes after ``ckpt-999999``); only run ``run_id``'s if given."""
    found = []
    for name in os.listdir(run_dir):
        step = checkpoint_step(name)
        folder = os.path.join(run_dir, name)
        if step is not None and os.path.isdir(folder) and (run_id is None or run_id_of(folder) == run_id):
            found.append((step, folder))
    return sorted(found)


def remove_folder(folder: str) -> None:
    """Delete a folder so that no kill leaves half of it under its name: rename it to a
    ``*.tmp-*`` name first (atomic), then delete that (:func:`clean_stray` finishes the job
    if this process dies in between)."""
    doomed = f"{folder}.tmp-del-{os.getpid()}"
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_stray(run_dir: str) -> List[str]:
    """Remove the temp folders and files (``*.tmp-*``) that killed writers left in ``run_dir``;
    call it only while holding the run folder's lock. Returns their names."""
    removed = []
    for name in sorted(os.listdir(run_dir)):
        if STRAY.search(name):
            target = os.path.join(run_dir, name)
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            else:
                try:
                    os.remove(target)
                except OSError:
                    pass
            removed.append(name)
    return removed
