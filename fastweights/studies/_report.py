"""What every study shares: seeds, tables, JSON/CSV files and matplotlib figures.

A study returns a plain ``dict`` (JSON-ready) and writes, under its output folder,
``<study>.json``, ``<study>.csv`` (its main table) and PNG plots. Figures are drawn
with matplotlib's Agg backend, so no display is needed; matplotlib is the ``plots``
extra and is imported only when a figure is drawn.

Nothing computed is lost when something goes wrong late: :func:`save_result` writes
the JSON and CSV before it draws any plot (a missing matplotlib skips the plots with
one line), and :class:`CellCache` saves each finished cell of a sweep to
``<study>.partial.json`` at once, so Ctrl-C or a kill leaves the finished cells on
disk and ``--resume`` continues from them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..config import add_declared_arguments, atomic_write_text, check_int, config_from_declared

BRANCHES = ("dev1", "dev2", "heldout")


def study_command(cls: type, order: Tuple[str, ...] = ()) -> Tuple[Callable, Callable]:
    """``(add_arguments, config_from_args)``: the command line of a study whose config dataclass
    ``cls`` declares its flags (:func:`fastweights.config.flag`) and has a ``full`` preset.

    ``add_arguments(parser)`` adds the declared flags, those named in ``order`` first (a study
    keeps its established help); ``config_from_args(args)`` builds ``cls.full`` with ``--full``
    (else ``cls``) from ``--root-seed`` and the flags given.
    """

    def add_arguments(parser) -> None:
        add_declared_arguments(parser, cls, order=order)

    def config_from_args(args):
        return config_from_declared(args, cls, cls.full if args.full else None, root_seed=args.root_seed)

    return add_arguments, config_from_args


def branch_seed_sequence(root_seed: int, branch: str, *key: int) -> np.random.SeedSequence:
    """The seed sequence of ``branch`` (``dev1``, ``dev2`` or ``heldout``) under ``root_seed``.

    The three branches are the children ``spawn_key=(0,)``, ``(1,)``, ``(2,)`` of one
    root ``SeedSequence`` (what ``SeedSequence(root_seed).spawn(3)`` returns), so
    they are disjoint by construction; ``key`` extends the spawn key further (for
    example with a cell's width and load), so every cell of every branch draws from
    its own stream, and adding a cell never shifts another cell's numbers.
    """
    check_int("", "root_seed", root_seed, minimum=0, what="a non-negative int")
    if branch not in BRANCHES:
        raise ValueError(f"`branch` must be one of {', '.join(BRANCHES)}, got {branch!r}")
    return np.random.SeedSequence(int(root_seed), spawn_key=(BRANCHES.index(branch),) + tuple(int(k) for k in key))


def keyed_seed(root_seed: int, *key: int) -> int:
    """A 63-bit seed for the stream ``key`` under ``root_seed`` (``SeedSequence`` spawn keys).

    Studies without development branches (retrieval, MQAR) key their runs by
    their settings, so every run is deterministic and independent of the others.
    """
    check_int("", "root_seed", root_seed, minimum=0, what="a non-negative int")
    state = np.random.SeedSequence(int(root_seed), spawn_key=tuple(int(k) for k in key)).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def torch_generator(seed_sequence: np.random.SeedSequence):
    """A ``torch.Generator`` seeded from a ``SeedSequence`` (64 bits of its state)."""
    state = seed_sequence.generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@contextlib.contextmanager
def torch_threads(threads: Optional[int]):
    """Run the block with ``torch.set_num_threads(threads)`` (``None``: leave it), then restore.

    The studies' tensors are small: on a shared machine one thread is both the
    fastest and the least noisy setting (above PyTorch's parallel grain size a
    busy second core stalls every op), so the studies default to one.
    """
    before = torch.get_num_threads()
    if threads is not None:
        check_int("", "threads", threads, what="a positive int or None")
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def mean_se(values: Sequence[float]) -> Dict[str, float]:
    """Mean and standard error (sample std / √n) of ``values``; ``se`` is 0 for n = 1."""
    x = np.asarray(values, dtype=np.float64)
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0
    return {"mean": float(x.mean()), "se": se}


def format_table(rows: List[Dict], columns: Sequence[str], floatfmt: str = ".3f", title: Optional[str] = None) -> str:
    """A plain-text table of ``rows`` (dicts) with the given ``columns``."""

    def cell(v):
        if isinstance(v, float):
            return "nan" if math.isnan(v) else format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    lines = [] if title is None else [title]
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(b[i].rjust(w) for i, w in enumerate(widths)) for b in body)
    return "\n".join(lines)


def write_json(path: Path, result: Dict) -> None:
    atomic_write_text(path, json.dumps(result, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def write_csv(path: Path, rows: Iterable[Dict], columns: Sequence[str]) -> None:
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(r)
    atomic_write_text(path, buf.getvalue())


def save_result(result: Dict, out_dir, name: str, rows: Iterable[Dict], columns: Sequence[str],
                plot: Optional[Callable[[Dict, Path], List[str]]] = None,
                log: Callable[[str], None] = print) -> None:
    """Write a study's ``<name>.csv`` (its main table) and ``<name>.json``, then its plots,
    under ``out_dir``, listing every file in ``result["files"]``; nothing without ``out_dir``.

    The numbers are on disk before any figure is drawn: a missing matplotlib skips the
    plots with one line, and an interrupt while plotting leaves the JSON and CSV whole.
    ``<name>.json`` is written again with the plots' files once they exist.
    """
    if out_dir is None:
        return
    out = Path(out_dir)
    write_csv(out / f"{name}.csv", rows, columns)
    result["files"] += [str(out / f"{name}.csv"), str(out / f"{name}.json")]
    write_json(out / f"{name}.json", result)
    if plot is None:
        return
    try:
        figures = plot(result, out)
    except ImportError as e:  # matplotlib is an extra: the numbers are what matter
        log(f"{name}: plots skipped ({e}); {name}.json and {name}.csv are written")
        return
    result["files"] += figures
    write_json(out / f"{name}.json", result)


def finish_study(result: Dict, started: float, cache: "CellCache", out_dir, name: str, rows: Iterable[Dict],
                 columns: Sequence[str], plot: Optional[Callable[[Dict, Path], List[str]]] = None) -> Dict:
    """A study's last step, in this order: its runtime (seconds since ``started``, a
    ``time.perf_counter()`` value) into ``result["runtime_s"]``, its files written
    (:func:`save_result`), and only then its partial cells dropped (:meth:`CellCache.finish`).
    Returns ``result``."""
    result["runtime_s"] = round(time.perf_counter() - started, 3)
    save_result(result, out_dir, name, rows, columns, plot)
    cache.finish()
    return result


class CellCache:
    """Per-cell results of a sweep, saved as they finish, so that a crash or Ctrl-C loses at most one cell.

    ``cache.get(key, compute)`` returns cell ``key``'s value (``key``: a tuple of JSON
    scalars): the stored one, or ``compute()``, which is then written at once to
    ``<out_dir>/<name>.partial.json`` (atomically). Values are kept in their JSON form
    (tuples become lists, NumPy values Python ones), and returned in that form whether
    fresh or resumed, so a resumed study computes exactly what an uninterrupted one does;
    ``decode`` turns the JSON form back into what the study uses (say, arrays).

    ``resume=True`` reuses a partial file made with the same ``config`` and refuses one
    made with another. :meth:`finish` removes the file once the study's own files are
    written. Without ``out_dir`` this only computes.
    """

    def __init__(self, out_dir, name: str, config: Dict[str, Any], resume: bool = False,
                 log: Callable[[str], None] = print) -> None:
        self.path = None if out_dir is None else Path(out_dir) / f"{name}.partial.json"
        self.config = _json_form(config)
        self.cells: Dict[str, Any] = {}
        if self.path is None or not resume:
            return
        if not self.path.exists():
            log(f"{name}: no partial results to resume in {self.path}; starting from the first cell")
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            stored_config, cells = data["config"], dict(data["cells"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path} is not a partial result file ({e}); remove it or run without --resume") from None
        if stored_config != self.config:
            changed = sorted(k for k in set(stored_config) | set(self.config) if stored_config.get(k) != self.config.get(k))
            raise ValueError(f"{self.path} holds cells computed with another config (differs in {', '.join(changed)}); "
                             f"run with the same options, or without --resume to start over")
        self.cells = cells
        log(f"{name}: resuming {len(cells)} finished cell(s) from {self.path}")

    def __contains__(self, key: Tuple[Hashable, ...]) -> bool:
        """Whether cell ``key`` is stored (finished, or resumed)."""
        return json.dumps(list(key)) in self.cells

    def get(self, key: Tuple[Hashable, ...], compute: Callable[[], Any], decode: Callable[[Any], Any] = lambda v: v):
        name = json.dumps(list(key))
        if name not in self.cells:
            self.cells[name] = _json_form(compute())
            if self.path is not None:
                write_json(self.path, {"config": self.config, "cells": self.cells})
        return decode(self.cells[name])

    def finish(self) -> None:
        """Drop the partial file: the study's final files hold everything now."""
        if self.path is not None and self.path.exists():
            self.path.unlink()


def _json_form(value):
    return json.loads(json.dumps(value, default=_json_default))


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the studies' plots need matplotlib: pip install 'fastweights[plots]'") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 100) -> str:
    """Save ``fig`` as PNG at ``path`` (folders created), close it, return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    pyplot().close(fig)
    return str(path)
