"""Whether the Triton kernels can run a chunk delta op, and the backend names.

The PyTorch chunk form (``delta_rule/chunk.py``, any device and dtype) and the
Triton kernels (``triton/``, CUDA, fp32/bf16/fp16) are peers: neither imports
the other. The public ops hand their spec and arguments to ``_dispatch.run``,
whose ``choose_backend`` asks :func:`select_backend` about Triton and runs one of
them. This module imports neither, so the Triton package imports its limits from
here without a circle. The Triton package is looked up, not imported, until it is
chosen (importing it costs every user time, and Triton decides at kernel-definition
time whether ``@triton.jit`` compiles for the GPU or runs on numpy, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from ._chunk import LONG_CHUNK

__all__ = [
    "HAS_TRITON", "BACKENDS", "MAX_HEAD_DIM", "CHUNK_SIZE", "TRITON_DTYPES", "interpreting", "select_backend",
    "backward_can_follow", "inference_op", "InferenceOp",
]

HAS_TRITON = importlib.util.find_spec("triton") is not None
#: The backend choices of every op: ``auto``, ``torch`` (the PyTorch code, every device),
#: ``cpu`` (the compiled CPU kernels, ``fastweights/ops/cpu/``), ``triton`` (CUDA kernels).
BACKENDS = ("auto", "torch", "cpu", "triton")
MAX_HEAD_DIM = 256  # K and V the kernels accept (64 and 128 are the fast sizes)
CHUNK_SIZE = LONG_CHUNK  # the kernels' chunk length: the long default chunk (``_chunk.LONG_CHUNK``), not a second 64
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def select_backend(op: str, backend: str, q: torch.Tensor, v: Optional[torch.Tensor] = None, *,
                   chunk_size: int = CHUNK_SIZE, feature_map=None) -> str:
    """``"triton"`` when the Triton kernels run one call of a chunk op, else ``"torch"`` (the
    dispatcher then picks the PyTorch code or the compiled CPU kernels).

    ``auto`` takes Triton for CUDA tensors in fp32/bf16/fp16 with K, V <= 256 and
    chunk size 64 when Triton is installed, and PyTorch otherwise (CPU tensors,
    fp64, other sizes). ``triton`` insists, and says why when it cannot. K is the
    state's key size, after any ``feature_map``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown `backend` {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    if backend in ("torch", "cpu") or not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] == 0:
        return "torch"  # malformed inputs get the shared checks' errors; T = 0 needs no kernel
    from .feature_maps import get_feature_map

    key_dim = get_feature_map(feature_map, op).output_dim(q.shape[-1])
    value_dim = v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() > 0 else key_dim
    if backend == "auto":
        ok = (
            HAS_TRITON and q.is_cuda and q.dtype in TRITON_DTYPES and chunk_size == CHUNK_SIZE
            and key_dim <= MAX_HEAD_DIM and value_dim <= MAX_HEAD_DIM
        )
        return "triton" if ok else "torch"
    if not HAS_TRITON:
        raise ImportError(f"{op}: backend='triton' needs the triton package: pip install 'fastweights[triton]'")
    if not q.is_cuda and not interpreting():
        raise ValueError(
            f"{op}: backend='triton' needs CUDA tensors, got `q` on {q.device}; use backend='torch' (or "
            f"'auto'), or set TRITON_INTERPRET=1 before importing triton to run the kernels on the CPU"
        )
    if q.dtype not in TRITON_DTYPES:
        raise TypeError(f"{op}: backend='triton' supports float32, bfloat16 and float16 inputs, got `q` of dtype {q.dtype}")
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"{op}: backend='triton' supports `chunk_size`={CHUNK_SIZE} only, got {chunk_size}")
    for name, dim in (("key (q, k)", key_dim), ("value (v)", value_dim)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{op}: backend='triton' supports head sizes up to {MAX_HEAD_DIM}, got {name} size {dim}; "
                f"use backend='torch'"
            )
    return "triton"


def backward_can_follow(*inputs) -> bool:
    """Whether a backward may follow this forward: grad mode on and an input requires grad.

    Decided by the caller of ``autograd.Function.apply``: inside ``forward`` grad
    mode is always off, and ``ctx.needs_input_grad`` stays True under
    ``torch.no_grad()`` / ``torch.inference_mode()`` when the inputs require grad,
    so it cannot tell inference from training. ``None`` inputs are skipped.
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)


class InferenceOp:
    """A forward that no backward follows, registered as the ``torch.library`` custom op ``name``
    (``register_fake`` as on the op): ``torch.compile`` and ``torch.export`` see the op, while eager
    code calls the implementation itself, without the custom op's Python dispatch (its autograd and
    view-tracking layers: 0.05 ms a call warm, 0.2-0.3 ms after a long call has evicted them from
    the caches, measured on the delta rule's op at B 1, H 8, T 2048). Both run the same code."""

    def __init__(self, name: str, fn):
        self.fn = fn
        self.op = torch.library.custom_op(name, mutates_args=())(fn)
        self.__doc__ = fn.__doc__

    def __call__(self, *args):
        return self.op(*args) if torch.compiler.is_compiling() else self.fn(*args)

    def register_fake(self, fake):
        return self.op.register_fake(fake)


def inference_op(name: str):
    """Decorator form of :class:`InferenceOp`."""
    return lambda fn: InferenceOp(name, fn)
