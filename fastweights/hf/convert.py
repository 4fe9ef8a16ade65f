"""Convert between a ``fastweights train`` checkpoint and a transformers model folder.

One call each way (:func:`checkpoint_to_hf`, :func:`hf_to_checkpoint`) and one CLI
command (``fastweights hf export CKPT OUT`` / ``fastweights hf import HF_DIR OUT``).
Both folders hold safetensors weights and JSON only; both are written atomically
(a temporary folder beside the target, then a rename).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional, Union

import torch

from ..training.checkpoint import load_model, save_checkpoint
from ..models import LM
from .modeling import FastWeightsConfig, FastWeightsForCausalLM

__all__ = ["lm_to_hf", "hf_to_lm", "checkpoint_to_hf", "hf_to_checkpoint"]


def lm_to_hf(lm: LM, **config_kwargs) -> FastWeightsForCausalLM:
    """The transformers model of an :class:`LM` (a copy of its weights, same dtype)."""
    if not isinstance(lm, LM):
        raise TypeError(f"lm_to_hf: `lm` must be a fastweights LM, got {type(lm).__name__}")
    model = FastWeightsForCausalLM(FastWeightsConfig.from_lm_config(lm.config, **config_kwargs))
    dtype = next(lm.parameters()).dtype
    model.to(dtype)
    model.model.load_state_dict(lm.state_dict())
    return model.eval() if not lm.training else model


def hf_to_lm(model: FastWeightsForCausalLM) -> LM:
    """The :class:`LM` inside a transformers model (a copy, independent of ``model``)."""
    if not isinstance(model, FastWeightsForCausalLM):
        raise TypeError(f"hf_to_lm: `model` must be a FastWeightsForCausalLM, got {type(model).__name__}")
    lm = LM(model.config.to_lm_config()).to(next(model.parameters()).dtype)
    lm.load_state_dict(model.model.state_dict())
    return lm.eval()


def _atomic_save_pretrained(model: FastWeightsForCausalLM, out_dir: str) -> str:
    out_dir = os.path.abspath(os.fspath(out_dir))
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    old = f"{out_dir}.old-{os.getpid()}"
    if os.path.exists(out_dir):
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def checkpoint_to_hf(checkpoint: Union[str, os.PathLike], out_dir: Union[str, os.PathLike],
                     dtype: Optional[torch.dtype] = None) -> str:
    """A checkpoint (or run folder: its latest checkpoint) of ``fastweights train`` ->
    a transformers folder loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)``."""
    lm, _ = load_model(checkpoint, dtype=dtype)
    return _atomic_save_pretrained(lm_to_hf(lm), out_dir)


def hf_to_checkpoint(hf_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike]) -> str:
    """A transformers folder of :class:`FastWeightsForCausalLM` -> a fastweights checkpoint
    folder (loadable by ``fastweights generate`` and :func:`fastweights.training.checkpoint.load_model`)."""
    model = FastWeightsForCausalLM.from_pretrained(os.fspath(hf_dir))
    return save_checkpoint(out_dir, hf_to_lm(model))
