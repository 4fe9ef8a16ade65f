"""Checkpoints: safetensors weights plus JSON, written atomically, loaded without executing code.

A checkpoint is a folder::

    ckpt-000200/
        config.json             the LMConfig (plain JSON)
        model.safetensors       the weights; its metadata repeats the config and the format
        train.json              (training only) run id, step, configs, loss history, optimizer hyperparameters,
                                and (fp16) the gradient scaler's state
        train_state.safetensors (training only) optimizer moments and RNG state
        manifest.json           the SHA-256 and size of every other file, written last

A run folder holds several of them and a ``latest`` file naming the newest.
Writing goes to ``ckpt-000200.tmp-<pid>/`` first and is then renamed into place
(``os.replace``), and ``latest`` is replaced the same way afterwards: a run killed
at any instant leaves either the old checkpoint or the new one, never half of one.
A write that fails (a full disk) removes its temp folder and raises
:class:`CheckpointWriteError` in one line; what was there before is untouched.
Every folder that is on its way out (a replaced or pruned checkpoint) is first
renamed to a ``*.tmp-*`` name, so a kill in the middle of deleting it never
leaves a half checkpoint under a checkpoint's name; :func:`clean_stray` removes
such leftovers when the next run takes the folder.

Loading reads only JSON and safetensors (no pickle, no ``torch.load``), checks every
file against the manifest's SHA-256 (a flipped bit in the weights is refused, not
trained on), checks that the weights match the config exactly, and checks
``train.json`` against its schema (:func:`check_train_state`); anything else raises
:class:`CheckpointError` (a ``ValueError``) in one line saying what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .config import atomic_write_text
from .models import LM, LMConfig

FORMAT = "fastweights-lm-1"
LATEST = "latest"
MANIFEST = "manifest.json"
CHECKPOINT_FILES = {"config.json", "model.safetensors", "train.json", "train_state.safetensors"}
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d+)$")
STRAY = re.compile(r"\.tmp-|\.tmp$")  # temp folders/files of writers that are gone

__all__ = [
    "CheckpointError", "CheckpointWriteError", "Checkpoint", "save_checkpoint", "load_checkpoint", "load_model",
    "resolve_checkpoint", "optimizer_to_flat", "optimizer_from_flat", "check_train_state",
    "load_training_checkpoint", "check_training_tensors", "FORMAT",
]


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only folder); nothing was replaced."""


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns (tensors on the CPU)."""

    path: str
    config: LMConfig
    weights: Dict[str, torch.Tensor]
    train: Optional[Dict[str, Any]] = None
    train_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)


def _weights_of(model: LM) -> Dict[str, torch.Tensor]:
    """The state dict without the tied output projection (safetensors refuses shared storage)."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """An optimizer's state dict as (tensors for safetensors, JSON-able rest)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, slots in sd["state"].items():
        for name, value in slots.items():
            key = f"optimizer.{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().cpu()
            else:
                scalars[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(tensors: Dict[str, torch.Tensor], info: Dict[str, Any]) -> Dict[str, Any]:
    """Inverse of :func:`optimizer_to_flat`: a state dict for ``optimizer.load_state_dict``."""
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(info.get("scalars", {}).items()):
        if not key.startswith("optimizer."):
            continue
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in info["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(
    path: "str | os.PathLike",
    model: LM,
    *,
    train: Optional[Dict[str, Any]] = None,
    train_tensors: Optional[Dict[str, torch.Tensor]] = None,
) -> str:
    """Write a checkpoint folder at ``path`` atomically; return its path.

    Args:
        path: the checkpoint folder to create (replaced if it exists).
        model: the :class:`~fastweights.models.LM` to save.
        train: JSON-able training state (step, configs, history...), saved as train.json.
        train_tensors: tensors of the training state (optimizer moments, RNG), saved
            as train_state.safetensors.
    """
    from safetensors.torch import save_file

    from safetensors import SafetensorError

    path = os.path.abspath(os.fspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.makedirs(tmp)
        config_text = model.config.to_json()
        dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        # "manifest": a checkpoint of this version has one, so a lost manifest.json is refused
        # on load instead of being taken for a checkpoint from before manifests
        save_file(_weights_of(model), os.path.join(tmp, "model.safetensors"),
                  metadata={"format": FORMAT, "config": config_text, "dtype": dtype, "manifest": MANIFEST})
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            f.write(config_text)
        if train is not None:
            with open(os.path.join(tmp, "train.json"), "w", encoding="utf-8") as f:
                json.dump(train, f, indent=1)
        if train_tensors:
            save_file({k: v.contiguous().cpu() for k, v in train_tensors.items()},
                      os.path.join(tmp, "train_state.safetensors"), metadata={"format": FORMAT})
        files = {name: _file_digest(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"format": FORMAT, "files": files}, f, indent=1)
        for name in os.listdir(tmp):  # make the bytes durable before the rename publishes them
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
    except (OSError, SafetensorError) as e:  # a full disk, a read-only folder: undo, then say so
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"could not write checkpoint {path}: {_reason(e)}") from None
    except BaseException:  # an interrupt mid-write: leave nothing half-written behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(path):
        old = f"{path}.tmp-old-{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _file_digest(file: str) -> Dict[str, Any]:
    """``{"sha256": hex, "bytes": size}`` of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"sha256": digest.hexdigest(), "bytes": os.path.getsize(file)}


def verify_manifest(path: str) -> None:
    """Check every file of a checkpoint against its ``manifest.json`` (SHA-256 and size), and
    that every checkpoint file in the folder is listed there.

    Checkpoints written before manifests existed have none and are only structurally checked;
    one whose weights say it was written with a manifest (metadata ``"manifest"``) and has
    none is refused: a lost manifest must not switch the checksums off.
    """
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_file):
        if _header_metadata(os.path.join(path, "model.safetensors")).get("manifest"):
            raise CheckpointError(f"{path}: {MANIFEST} is missing, but model.safetensors says the checkpoint was "
                                  f"written with one: the checkpoint is incomplete (its files cannot be verified)")
        return
    try:
        with open(manifest_file, encoding="utf-8") as f:
            files = json.load(f)["files"]
        entries = [(str(name), str(e["sha256"]), int(e["bytes"])) for name, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: {MANIFEST} is corrupt: {e}") from None
    unlisted = sorted(CHECKPOINT_FILES & set(os.listdir(path)) - {name for name, _, _ in entries})
    if unlisted:
        raise CheckpointError(f"{path}: checkpoint file {unlisted[0]} is not listed in {MANIFEST}: it cannot be verified")
    for name, sha256, size in entries:
        file = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(file):
            raise CheckpointError(f"{path}: checkpoint file {name} listed in {MANIFEST} is missing")
        found = _file_digest(file)
        if found["bytes"] != size or found["sha256"] != sha256:
            raise CheckpointError(
                f"{path}: checkpoint file {name} fails its SHA-256 check ({found['bytes']} bytes, sha256 "
                f"{found['sha256'][:16]}..., expected {size} bytes, {sha256[:16]}...): the file is corrupt"
            )


def _header_metadata(file: str) -> Dict[str, str]:
    """The metadata of a safetensors file's header (``{}`` when it cannot be read: the
    structural checks that follow say what is wrong with the file)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            return f.metadata() or {}
    except Exception:  # noqa: BLE001 -- missing, truncated or garbled: reported by _read_safetensors
        return {}


def mark_latest(run_dir: "str | os.PathLike", checkpoint: "str | os.PathLike") -> None:
    """Point ``run_dir/latest`` at ``checkpoint`` (atomically)."""
    atomic_write_text(os.path.join(os.fspath(run_dir), LATEST), os.path.basename(os.fspath(checkpoint)) + "\n")


def resolve_checkpoint(path: "str | os.PathLike") -> str:
    """A checkpoint folder, or a run folder (followed through its ``latest`` file)."""
    path = os.fspath(path)
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
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        found = run_checkpoints(path)
        if found:  # a run folder whose `latest` is gone (e.g. a kill right after its first checkpoint)
            names = [os.path.basename(folder) for _, folder in found]
            raise CheckpointError(
                f"{path!r} is a run folder without a `latest` file; it holds {', '.join(names[-3:])}"
                f"{' and older' if len(names) > 3 else ''}: pass one of them, e.g. {os.path.join(path, names[-1])!r} "
                f"(`fastweights train --resume` picks the newest that verifies)")
        raise CheckpointError(f"{path!r} holds neither model.safetensors nor a `latest` file: not a checkpoint or run folder")
    return path


def _read_safetensors(file: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    from safetensors import safe_open

    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint file {file!r} is missing")
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for truncated/garbled files
        raise CheckpointError(f"checkpoint file {file!r} is corrupt or not a safetensors file: {e}") from None
    return tensors, metadata


def load_checkpoint(path: "str | os.PathLike") -> Checkpoint:
    """Read and check a checkpoint (or a run folder's latest); no code is executed."""
    path = resolve_checkpoint(path)
    verify_manifest(path)
    weights, metadata = _read_safetensors(os.path.join(path, "model.safetensors"))
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: model.safetensors has format {metadata.get('format')!r}, expected {FORMAT!r}")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise CheckpointError(f"{path}: config.json is missing")
    try:  # fields newer than the checkpoint get the values it was trained with (LMConfig.fill_legacy)
        with open(config_file, encoding="utf-8") as f:
            config = LMConfig.from_dict(LMConfig.fill_legacy(json.load(f)), source=f"file {config_file}")
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: config.json is invalid: {e}") from None
    try:
        saved = LMConfig.fill_legacy(json.loads(metadata.get("config", "null")))
    except json.JSONDecodeError:
        saved = None
    if saved != config.to_dict():
        raise CheckpointError(
            f"{path}: config.json does not match the config the weights were saved with "
            f"({_diff(saved, config.to_dict())})"
        )
    train, train_tensors = None, {}
    if os.path.isfile(os.path.join(path, "train.json")):
        try:
            with open(os.path.join(path, "train.json"), encoding="utf-8") as f:
                train = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: train.json is corrupt: {e}") from None
        state_file = os.path.join(path, "train_state.safetensors")
        if os.path.exists(state_file):  # absent for a finished model saved without its optimizer
            train_tensors, _ = _read_safetensors(state_file)
    return Checkpoint(path, config, weights, train, train_tensors)


def load_training_checkpoint(path: "str | os.PathLike") -> Checkpoint:
    """:func:`load_checkpoint` for resuming: the training state must be there and pass
    :func:`check_train_state`."""
    ckpt = load_checkpoint(path)
    if ckpt.train is None or "rng.torch" not in ckpt.train_tensors:
        raise CheckpointError(f"{ckpt.path} holds a model but no training state (train.json, train_state.safetensors); it cannot be resumed")
    check_train_state(ckpt.train, ckpt.train_tensors, f"{ckpt.path}/train.json")
    return ckpt


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def check_train_state(train, tensors: Dict[str, torch.Tensor], where: str = "train.json") -> None:
    """Check ``train.json`` against its schema and against itself; one-line :class:`CheckpointError`.

    Schema: an object with ``step`` (int >= 0), ``history`` (one record per step,
    ``{"step": 1..step, "loss": number, ...}``), ``evals`` (a list of records with
    ``step`` <= step), ``train_config`` (an object), ``optimizer`` (an object) and,
    since run ids exist, ``run_id`` (a string); an fp16 run also has ``grad_scaler``
    (:data:`GRAD_SCALER_SCHEMA`, the state of ``torch.amp.GradScaler``). The step must be
    the one the history and the optimizer's own step counters reached (less the steps
    the history marks ``"skipped": true``, where an fp16 overflow skipped the optimizer):
    a ``step`` edited to 999 in a 20-step checkpoint is refused rather than resumed from
    the wrong place.
    """
    def fail(message: str):
        raise CheckpointError(f"{where}: {message}")

    if not isinstance(train, dict):
        fail(f"expected a JSON object, got {type(train).__name__} {json.dumps(train)[:40]}")
    for key, kind, check in (("step", "an int >= 0", lambda x: _is_int(x) and x >= 0),
                             ("history", "a list", lambda x: isinstance(x, list)),
                             ("evals", "a list", lambda x: isinstance(x, list)),
                             ("train_config", "an object", lambda x: isinstance(x, dict)),
                             ("optimizer", "an object", lambda x: isinstance(x, dict)),
                             ("run_id", "a string", lambda x: isinstance(x, str) and x)):
        if key not in train:
            if key != "run_id":  # checkpoints from before run ids have none
                fail(f"`{key}` is missing (expected {kind})")
            continue
        if not check(train[key]):
            fail(f"`{key}` must be {kind}, got {json.dumps(train[key])[:40]}")
    step, history = train["step"], train["history"]
    for i, record in enumerate(history):
        if not isinstance(record, dict) or record.get("step") != i + 1 or not _is_number(record.get("loss")) \
                or not isinstance(record.get("skipped", False), bool):
            fail(f"`history[{i}]` must be {{\"step\": {i + 1}, \"loss\": <number>, ...}}, got {json.dumps(record)[:60]}")
    if len(history) != step:
        fail(f"`step`={step} does not match the history, which ends at step {len(history)}")
    for i, record in enumerate(train.get("evals", [])):
        if not isinstance(record, dict) or not _is_int(record.get("step")) or not 0 < record["step"] <= step:
            fail(f"`evals[{i}]` must be an object with a `step` in 1..{step}, got {json.dumps(record)[:60]}")
    precision = train["train_config"].get("precision", "fp32")
    if "grad_scaler" in train or precision == "fp16":
        _check_grad_scaler(train.get("grad_scaler"), precision, fail)
    taken = step - sum(1 for record in history if record.get("skipped"))
    for key, value in tensors.items():  # AdamW counts the steps it took: they must agree
        if key.startswith("optimizer.") and key.endswith(".step") and value.numel() == 1 and float(value) != taken:
            skipped = f" less {step - taken} skipped" if taken != step else ""
            fail(f"`step`={step}{skipped} does not match the optimizer state ({key} = {float(value):g})")


# ``train.json``'s ``grad_scaler``: torch.amp.GradScaler.state_dict() of an enabled scaler.
GRAD_SCALER_SCHEMA = {
    "scale": ("a finite number > 0", lambda x: _is_number(x) and x > 0),
    "growth_factor": ("a finite number > 1", lambda x: _is_number(x) and x > 1),
    "backoff_factor": ("a number in (0, 1)", lambda x: _is_number(x) and 0 < x < 1),
    "growth_interval": ("an int > 0", lambda x: _is_int(x) and x > 0),
    "_growth_tracker": ("an int >= 0", lambda x: _is_int(x) and x >= 0),
}


def _check_grad_scaler(state, precision: str, fail) -> None:
    if state is None:
        fail(f"`grad_scaler` is missing: a `precision`={precision!r} run must save its gradient scaler "
             f"(resuming with a fresh scale would not continue the run exactly)")
    if not isinstance(state, dict):
        fail(f"`grad_scaler` must be an object, got {json.dumps(state)[:40]}")
    if precision != "fp16":
        fail(f"`grad_scaler` is only saved by fp16 runs; this run's `precision` is {precision!r}")
    for key, (kind, check) in GRAD_SCALER_SCHEMA.items():
        if key not in state:
            fail(f"`grad_scaler.{key}` is missing (expected {kind})")
        if not check(state[key]):
            fail(f"`grad_scaler.{key}` must be {kind}, got {json.dumps(state[key])[:40]}")
    if state["_growth_tracker"] >= state["growth_interval"]:
        fail(f"`grad_scaler._growth_tracker`={state['_growth_tracker']} must be below "
             f"`growth_interval`={state['growth_interval']}")


def check_training_tensors(ckpt: "Checkpoint", optimizer: torch.optim.Optimizer) -> None:
    """Check a checkpoint's tensors against the run they resume, before anything is loaded:
    finite weights; ``rng.torch`` shaped as torch's CPU generator state; every optimizer
    moment of an existing parameter index, with that parameter's shape and dtype, finite, and
    the same slots for every parameter that has any. (The manifest proves the files are as
    written; this catches what a buggy writer or an edit consistent with the manifest breaks,
    which would otherwise be a raw error deep in the optimizer, or a silent dtype change.)
    One-line :class:`CheckpointError`s naming the file and the tensor.
    """
    weights_file, state_file = f"{ckpt.path}/model.safetensors", f"{ckpt.path}/train_state.safetensors"
    for key, value in ckpt.weights.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{weights_file}: weight `{key}` holds {int((~torch.isfinite(value)).sum())} "
                                  f"non-finite value(s): training cannot continue from it")
    rng, expected = ckpt.train_tensors["rng.torch"], torch.get_rng_state()
    if rng.dtype != expected.dtype or rng.shape != expected.shape:
        raise CheckpointError(f"{state_file}: `rng.torch` must be torch's CPU generator state, a {expected.dtype} "
                              f"tensor of shape {list(expected.shape)}; got {rng.dtype} {list(rng.shape)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    slots: Dict[int, set] = {}
    for key, value in sorted(ckpt.train_tensors.items()):
        if not key.startswith("optimizer."):
            continue
        _, index, name = key.split(".", 2)
        if not index.isdigit() or int(index) >= len(params):
            raise CheckpointError(f"{state_file}: `{key}` names no parameter (the optimizer has {len(params)}, "
                                  f"indices 0..{len(params) - 1})")
        param = params[int(index)]
        if name == "step" and value.numel() != 1:
            raise CheckpointError(f"{state_file}: `{key}` must hold one number, got shape {list(value.shape)}")
        if name != "step" and (value.shape != param.shape or value.dtype != param.dtype):
            raise CheckpointError(f"{state_file}: `{key}` must have its parameter's shape {list(param.shape)} and dtype "
                                  f"{param.dtype}, got {list(value.shape)} {value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{state_file}: `{key}` holds {int((~torch.isfinite(value)).sum())} non-finite value(s)")
        slots.setdefault(int(index), set()).add(name)
    every = set().union(*slots.values()) if slots else set()
    for index, names in sorted(slots.items()):
        if names != every:
            raise CheckpointError(f"{state_file}: parameter {index} has optimizer state {sorted(names)} but others have "
                                  f"{sorted(every)}: `optimizer.{index}.{sorted(every - names)[0]}` is missing")


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


def _diff(a, b) -> str:
    if not isinstance(a, dict):
        return "the weights carry no config"
    keys = sorted(set(a) | set(b), key=str)
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))


def load_weights(model: LM, weights: Dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Copy ``weights`` into ``model``, refusing any missing, unexpected or misshapen tensor."""
    expected = {k: v for k, v in model.state_dict().items() if not (model.config.tie_embeddings and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [f"{k}: {list(weights[k].shape)} vs model {list(expected[k].shape)}"
              for k in sorted(set(expected) & set(weights)) if weights[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append("shape mismatches " + "; ".join(shapes[:5]))
        raise CheckpointError(f"{where}: the weights do not match the model config: " + ", ".join(parts))
    with torch.no_grad():
        for k, t in expected.items():
            t.copy_(weights[k])


def load_model(path: "str | os.PathLike", dtype: Optional[torch.dtype] = None) -> Tuple[LM, Checkpoint]:
    """Build the :class:`~fastweights.models.LM` of a checkpoint; returns ``(model, checkpoint)``.

    ``dtype`` defaults to the dtype the weights were saved in.
    """
    ckpt = load_checkpoint(path)
    model = LM(ckpt.config)
    if dtype is None:
        dtype = next(iter(ckpt.weights.values())).dtype if ckpt.weights else torch.float32
    model.to(dtype)
    load_weights(model, ckpt.weights, ckpt.path)
    model.eval()
    return model, ckpt
