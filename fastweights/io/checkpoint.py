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
leaves a half checkpoint under a checkpoint's name; :func:`~fastweights.io.listing.clean_stray` removes
such leftovers when the next run takes the folder.

Loading reads only JSON and safetensors (no pickle, no ``torch.load``), checks every
file against the manifest's SHA-256 (a flipped bit in the weights is refused, not
trained on) and checks that the weights match the config exactly (the training room checks
``train.json`` against its schema when it resumes:
:func:`fastweights.training.train_state.check_train_state`); anything else raises
:class:`CheckpointError` (a ``ValueError``) in one line saying what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from ..models import LM, LMConfig
from .dcp_checkpoint import is_dcp_file, is_sharded_checkpoint, load_full_weights
from .errors import CheckpointError, CheckpointWriteError
from .listing import is_model_file, resolve_checkpoint
from .sealing import MANIFEST, check_own_file, file_digest, publish, read_manifest, reason, write_manifest

FORMAT = "fastweights-lm-1"
CHECKPOINT_FILES = {"config.json", "model.safetensors", "train.json", "train_state.safetensors"}

__all__ = [
    "CheckpointError", "CheckpointWriteError", "Checkpoint", "save_checkpoint", "load_checkpoint", "load_model",
    "load_weights", "verify_manifest", "FORMAT", "save_model_file", "load_model_file", "export_model",
    "tensors_sha256", "check_export_target", "checkpoint_folder_of",
]


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns (tensors on the CPU)."""

    path: str
    config: LMConfig
    weights: Dict[str, torch.Tensor]
    train: Optional[Dict[str, Any]] = None
    train_tensors: Dict[str, torch.Tensor] = field(default_factory=dict)
    sharded: bool = False  # written by an FSDP run through DCP: the tensors stay in the shards (``weights`` is empty)


def _weights_of(model: LM) -> Dict[str, torch.Tensor]:
    """The state dict without the tied output projection (safetensors refuses shared storage)."""
    sd = model.state_dict()
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


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
        write_manifest(tmp, FORMAT)
    except (OSError, SafetensorError) as e:  # a full disk, a read-only folder: undo, then say so
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"could not write checkpoint {path}: {_reason(e)}") from None
    except BaseException:  # an interrupt mid-write: leave nothing half-written behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, path)
    return path


_reason, _file_digest = reason, file_digest  # the names this module's callers know


def verify_manifest(path: str) -> None:
    """Check every file of a checkpoint against its ``manifest.json`` (SHA-256 and size), and
    that every checkpoint file in the folder is listed there.

    Checkpoints written before manifests existed have none and are only structurally checked;
    one whose weights say it was written with a manifest (metadata ``"manifest"``) and has
    none is refused: a lost manifest must not switch the checksums off.
    """
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.lexists(manifest_file):
        if is_sharded_checkpoint(path):  # sharded checkpoints always had manifests
            raise CheckpointError(f"{path}: {MANIFEST} is missing: the sharded checkpoint is incomplete (its files cannot be verified)")
        if _header_metadata(os.path.join(path, "model.safetensors")).get("manifest"):
            raise CheckpointError(f"{path}: {MANIFEST} is missing, but model.safetensors says the checkpoint was "
                                  f"written with one: the checkpoint is incomplete (its files cannot be verified)")
        return
    entries = read_manifest(path)
    unlisted = sorted({n for n in os.listdir(path) if n in CHECKPOINT_FILES or is_dcp_file(n)} - {name for name, _, _ in entries})
    if unlisted:
        raise CheckpointError(f"{path}: checkpoint file {unlisted[0]} is not listed in {MANIFEST}: it cannot be verified")
    for name, sha256, size in entries:
        file = check_own_file(path, name)  # a plain name, a regular file: no symlink, FIFO or outside path
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
    except Exception:  # missing, truncated or garbled: reported by _read_safetensors
        return {}


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
    """Read and check a checkpoint (or a run folder's latest, or a single-file model); no code is executed.

    A sharded checkpoint (an FSDP run's) is verified and its JSON read; its tensors stay in the
    shards (``weights`` is empty, ``sharded`` is true): :func:`load_model` reassembles them."""
    path = resolve_checkpoint(path)
    if is_model_file(path):
        config, weights, train = load_model_file(path)
        return Checkpoint(path, config, weights, train)
    verify_manifest(path)
    sharded = is_sharded_checkpoint(path)
    weights, metadata = ({}, {}) if sharded else _read_safetensors(os.path.join(path, "model.safetensors"))
    if not sharded and metadata.get("format") != FORMAT:
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
    if not sharded and saved != config.to_dict():
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
    if sharded and not isinstance(train, dict):
        raise CheckpointError(f"{path}: train.json is missing: a sharded checkpoint cannot be read without it")
    return Checkpoint(path, config, weights, train, train_tensors, sharded=sharded)


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
    if ckpt.sharded:  # reassembled from every rank's shards, in this process
        saved = {"float32": torch.float32, "float64": torch.float64}.get(ckpt.train.get("train_config", {}).get("dtype"))
        model.to(saved or torch.float32)
        load_full_weights(ckpt.path, model)
        model.to(dtype or next(model.parameters()).dtype).eval()
        return model, ckpt
    if dtype is None:
        dtype = next(iter(ckpt.weights.values())).dtype if ckpt.weights else torch.float32
    model.to(dtype)
    load_weights(model, ckpt.weights, ckpt.path)
    model.eval()
    return model, ckpt

# -- one file: ``fastweights export`` ------------------------------------------------------------------
#
# A single-file model is a safetensors file whose metadata holds what a checkpoint's model.safetensors
# holds (the format, the LMConfig as JSON, the dtype) plus "tensors_sha256", the SHA-256 of every
# tensor's name, dtype, shape and bytes in name order, which every load checks (a checkpoint folder
# has its manifest instead), and "train": the run's id, step, tokenizer and training config (no
# optimizer state: the file is for using the model, not for resuming its training).

DIGEST_KEY = "tensors_sha256"
TRAIN_KEY = "train"
RUN_FIELDS = ("run_id", "step", "tokenizer", "train_config")


def tensors_sha256(tensors: Dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_model_file(model: LM, path: "str | os.PathLike", train: Optional[Dict[str, Any]] = None,
                    replace: bool = True) -> str:
    """Write ``model`` as one safetensors file at ``path`` (a temp file, fsync, rename); returns the path.
    ``train``: what the loaders need of the run (``tokenizer``, ``train_config``, ``step``, ``run_id``).
    ``replace=False``: a file that exists at ``path`` when the temp file is published is kept (a hard
    link publishes it, which fails on an existing name) and a ``ValueError`` names ``--out``."""
    from safetensors.torch import save_file

    from safetensors import SafetensorError

    path = os.path.abspath(os.fspath(path))
    weights = _weights_of(model)
    metadata = {"format": FORMAT, "config": model.config.to_json(),
                "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), DIGEST_KEY: tensors_sha256(weights)}
    if train:
        metadata[TRAIN_KEY] = json.dumps(train)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(weights, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        _publish_file(tmp, path, replace)
    except BaseException as e:  # a full disk or an interrupt: no temp file left behind
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, (OSError, SafetensorError)):
            raise CheckpointWriteError(f"could not write {path}: {reason(e)}") from None
        raise
    return path


def _publish_file(tmp: str, path: str, replace: bool) -> None:
    """Rename ``tmp`` to ``path``; without ``replace``, never over an existing file."""
    if replace:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)  # atomic, and fails if the name exists (a file that appeared meanwhile)
    except FileExistsError:
        raise ValueError(f"export: `--out` {path!r} already exists; pass --overwrite to replace it, "
                         f"or choose another path") from None
    except OSError:  # a filesystem without hard links: check, then rename
        if os.path.lexists(path):
            raise ValueError(f"export: `--out` {path!r} already exists; pass --overwrite to replace it") from None
        os.replace(tmp, path)
        return
    os.remove(tmp)


def load_model_file(path: "str | os.PathLike") -> Tuple[LMConfig, Dict[str, torch.Tensor], Optional[Dict[str, Any]]]:
    """``(config, weights, train)`` of a single-file model, its digest checked (``train``: the run's
    tokenizer and training config, or ``None``); one-line :class:`CheckpointError` otherwise."""
    path = os.fspath(path)
    weights, metadata = _read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    if DIGEST_KEY not in metadata:
        raise CheckpointError(f"{path}: no `{DIGEST_KEY}` in its metadata, so it cannot be verified; a checkpoint's "
                              f"model.safetensors is checked by its folder's manifest: pass the checkpoint folder")
    found = tensors_sha256(weights)
    if found != metadata[DIGEST_KEY]:
        raise CheckpointError(f"{path}: the tensors fail their SHA-256 check (sha256 {found[:16]}..., expected "
                              f"{metadata[DIGEST_KEY][:16]}...): the file is corrupt")
    try:
        config = LMConfig.from_dict(LMConfig.fill_legacy(json.loads(metadata["config"])), source=f"file {path}")
        train = json.loads(metadata[TRAIN_KEY]) if TRAIN_KEY in metadata else None
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: its metadata is invalid: {e}") from None
    if train is not None and not isinstance(train, dict):
        raise CheckpointError(f"{path}: the `{TRAIN_KEY}` entry of its metadata must be a JSON object")
    return config, weights, train


def _is_checkpoint_manifest(file: str) -> bool:
    """Whether ``file`` is a checkpoint's manifest: one of this library's formats, or unreadable
    (a damaged checkpoint is still one); another project's ``manifest.json`` is not."""
    from .dcp_checkpoint import FORMAT_DCP

    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return True
    return not isinstance(data, dict) or data.get("format") in (FORMAT, FORMAT_DCP) or "files" in data


def checkpoint_folder_of(path: "str | os.PathLike") -> Optional[str]:
    """The checkpoint folder (a folder holding a checkpoint's ``manifest.json``) that ``path`` lies in,
    itself or any folder above it, symlinks resolved; ``None`` when there is none."""
    folder = os.path.dirname(os.path.realpath(os.fspath(path)))
    while True:
        manifest = os.path.join(folder, MANIFEST)
        if os.path.isfile(manifest) and _is_checkpoint_manifest(manifest):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def check_export_target(out: "str | os.PathLike", overwrite: bool = False) -> str:
    """Refuse an ``export`` target that would lose data (a ``ValueError`` naming ``--out``); returns it.

    A file inside a checkpoint folder is refused always: replacing one of its files would make the
    checkpoint fail its manifest's SHA-256 check, so it could neither resume nor be loaded. Any other
    existing file is replaced only with ``overwrite``; a folder or other non-file never is."""
    out = os.fspath(out)
    if not out.endswith(".safetensors"):
        raise ValueError(f"export: `--out` must name a .safetensors file, got {out!r}")
    inside = checkpoint_folder_of(out)
    if inside is not None:
        raise ValueError(f"export: `--out` {out!r} lies inside the checkpoint folder {inside!r} (it has a {MANIFEST}); "
                         f"writing there would break the checkpoint. Choose a path outside any checkpoint folder")
    if os.path.lexists(out):
        if not os.path.isfile(out) or os.path.islink(out):
            raise ValueError(f"export: `--out` {out!r} exists and is not a plain file; refusing to replace it")
        if not overwrite:
            raise ValueError(f"export: `--out` {out!r} already exists; pass --overwrite to replace it, or choose another path")
    return out


def export_model(source: "str | os.PathLike", out: "str | os.PathLike", dtype: Optional[torch.dtype] = None,
                 overwrite: bool = False) -> str:
    """Write the model of ``source`` (a run folder, a checkpoint folder, one process's or sharded, or a
    single-file model) as one file at ``out``; returns its path. ``dtype``: the weights' (default: as saved).

    ``out`` is checked by :func:`check_export_target` before anything is read and again before the
    write; without ``overwrite`` the file is published by a hard link, so even a file that appeared
    in between is not replaced."""
    check_export_target(out, overwrite)
    model, ckpt = load_model(source, dtype=dtype)
    check_export_target(out, overwrite)
    return save_model_file(model, out, {k: ckpt.train[k] for k in RUN_FIELDS if k in (ckpt.train or {})},
                           replace=overwrite)
