"""Convert between a ``fastweights train`` checkpoint and a transformers model folder.

One call each way (:func:`checkpoint_to_hf`, :func:`hf_to_checkpoint`) and one CLI
command (``fastweights hf export CKPT OUT`` / ``fastweights hf import HF_DIR OUT``).
Both folders hold safetensors weights and JSON only; both are written atomically
(a temporary folder beside the target, then a rename), and only into a new or empty
folder or one these converters wrote before (:mod:`.output_folder`: a checked marker
file; ``overwrite=True`` replaces any other folder, never the source or a folder
holding it). The transformers folder must hold every tensor the model needs, and no
other (:meth:`FastWeightsForCausalLM.from_pretrained`).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch

from ..io.checkpoint import load_model, resolve_checkpoint, save_checkpoint
from ..models import LM
from .modeling import FastWeightsConfig, FastWeightsForCausalLM, load_pretrained
from .output_folder import check_output_folder, write_output_folder

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


def checkpoint_to_hf(checkpoint: Union[str, os.PathLike], out_dir: Union[str, os.PathLike],
                     dtype: Optional[torch.dtype] = None, overwrite: bool = False) -> str:
    """A checkpoint (or run folder: its latest checkpoint) of ``fastweights train`` ->
    a transformers folder loadable by ``AutoModelForCausalLM.from_pretrained(out_dir)``.

    ``out_dir`` must be new, empty, or an earlier output of these converters, unless
    ``overwrite`` (:mod:`fastweights.hf.output_folder`); returns its absolute path."""
    sources = [checkpoint, resolve_checkpoint(checkpoint)]
    check_output_folder(out_dir, sources, "fastweights hf export", overwrite)  # before the work
    lm, _ = load_model(checkpoint, dtype=dtype)
    model = lm_to_hf(lm)
    return write_output_folder(out_dir, lambda tmp: model.save_pretrained(tmp, safe_serialization=True),
                               sources=sources, command="hf export", overwrite=overwrite)


def hf_to_checkpoint(hf_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike],
                     overwrite: bool = False) -> str:
    """A transformers folder of :class:`FastWeightsForCausalLM` -> a fastweights checkpoint
    folder (loadable by ``fastweights generate`` and :func:`fastweights.io.checkpoint.load_model`).

    Every tensor the config needs must be in ``hf_dir`` and no other (a ``ValueError``
    naming them otherwise); ``out_dir`` as in :func:`checkpoint_to_hf`."""
    check_output_folder(out_dir, [hf_dir], "fastweights hf import", overwrite)
    lm = hf_to_lm(load_pretrained(hf_dir))
    return write_output_folder(out_dir, lambda tmp: save_checkpoint(tmp, lm), sources=[hf_dir],
                               command="hf import", overwrite=overwrite)
