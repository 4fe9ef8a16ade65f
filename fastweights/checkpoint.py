"""Checkpoints: safetensors weights plus JSON, written atomically, loaded without executing code.

A checkpoint is a folder::

    ckpt-000200/
        config.json             the LMConfig (plain JSON)
        model.safetensors       the weights; its metadata repeats the config and the format
        train.json              (training only) step, configs, loss history, optimizer hyperparameters
        train_state.safetensors (training only) optimizer moments and RNG state

A run folder holds several of them and a ``latest`` file naming the newest.
Writing goes to ``ckpt-000200.tmp-<pid>/`` first and is then renamed into place
(``os.replace``), and ``latest`` is replaced the same way afterwards: a run killed
at any instant leaves either the old checkpoint or the new one, never half of one.

Loading reads only JSON and safetensors (no pickle, no ``torch.load``), and checks
that the weights match the config exactly; anything else raises
:class:`CheckpointError` (a ``ValueError``) saying what is wrong.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch

from .config import atomic_write_text
from .models import LM, LMConfig

FORMAT = "fastweights-lm-1"
LATEST = "latest"

__all__ = [
    "CheckpointError", "Checkpoint", "save_checkpoint", "load_checkpoint", "load_model",
    "resolve_checkpoint", "optimizer_to_flat", "optimizer_from_flat", "FORMAT",
]


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


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

    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    config_text = model.config.to_json()
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    save_file(_weights_of(model), os.path.join(tmp, "model.safetensors"),
              metadata={"format": FORMAT, "config": config_text, "dtype": dtype})
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        f.write(config_text)
    if train is not None:
        with open(os.path.join(tmp, "train.json"), "w", encoding="utf-8") as f:
            json.dump(train, f, indent=1)
    if train_tensors:
        save_file({k: v.contiguous().cpu() for k, v in train_tensors.items()},
                  os.path.join(tmp, "train_state.safetensors"), metadata={"format": FORMAT})
    for name in os.listdir(tmp):  # make the bytes durable before the rename publishes them
        with open(os.path.join(tmp, name), "rb") as f:
            os.fsync(f.fileno())
    if os.path.isdir(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


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
        if not name or not os.path.isdir(target):
            raise CheckpointError(f"{latest} names {name!r}, which is not a checkpoint folder in {path!r}")
        return target
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
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
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: train.json is corrupt: {e}") from None
        state_file = os.path.join(path, "train_state.safetensors")
        if os.path.exists(state_file):  # absent for a finished model saved without its optimizer
            train_tensors, _ = _read_safetensors(state_file)
    return Checkpoint(path, config, weights, train, train_tensors)


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
