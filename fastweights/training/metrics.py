"""The run folder's ``metrics.jsonl``: one JSON record a line (training steps and evaluations)."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from ..config import atomic_write_text
from .run_folder import RunFolderError

__all__ = ["metrics_path", "write_metrics", "rewrite_metrics"]


def metrics_path(out_dir: str) -> str:
    return os.path.join(out_dir, "metrics.jsonl")


def write_metrics(out_dir: Optional[str], record: Dict[str, Any]) -> None:
    if out_dir is not None:
        try:
            with open(metrics_path(out_dir), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:  # a full disk: one line, not a traceback
            raise RunFolderError(f"train: could not append to {metrics_path(out_dir)}: {e.strerror or e}") from None

def rewrite_metrics(out_dir: str, history, evals) -> None:
    records = sorted(history + evals, key=lambda r: (r["step"], "eval_loss" in r))
    try:
        atomic_write_text(metrics_path(out_dir), "".join(json.dumps(r) + "\n" for r in records))
    except OSError as e:  # a full disk: one line; the old metrics file is untouched
        raise RunFolderError(f"train: could not rewrite {metrics_path(out_dir)}: {e.strerror or e}") from None
