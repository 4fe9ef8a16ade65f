"""Optional Triton kernels for the chunk delta rules and the one-token decode step.

Install with ``pip install fastweights[triton]``. Nothing here imports Triton's
kernels until they are first used, because Triton decides when a kernel module is
imported whether ``@triton.jit`` compiles for the GPU or runs on numpy
(``TRITON_INTERPRET=1``, how the tests run them on the CPU).

=============================  ===============================================
file                           what
=============================  ===============================================
``_chunk_kernels.py``          the four kernels (WY, state, state adjoint, grads)
``chunk.py``                   launchers, the ``autograd.Function``, the front end
``decode.py``                  the fused one-token step and its PyTorch twin
=============================  ===============================================

The public ops ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` take
``backend="auto" | "torch" | "triton"``; :func:`select_backend` decides.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

# The optional extra. Looked up, not imported: importing triton costs every user of
# fastweights time, and the kernels import it themselves on first use.
HAS_TRITON = importlib.util.find_spec("triton") is not None

BACKENDS = ("auto", "torch", "triton")
MAX_HEAD_DIM = 256  # K and V the kernels accept (64 and 128 are the fast sizes)
CHUNK_SIZE = 64  # the kernels' chunk length
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["HAS_TRITON", "BACKENDS", "MAX_HEAD_DIM", "select_backend", "interpreting", "chunk_op_triton",
           "delta_rule_step"]


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def select_backend(op: str, backend: str, q: torch.Tensor, v: Optional[torch.Tensor] = None, *,
                   chunk_size: int = CHUNK_SIZE, feature_map=None) -> str:
    """``"torch"`` or ``"triton"`` for one call of a chunk op.

    ``auto`` takes Triton for CUDA tensors in fp32/bf16/fp16 with K, V <= 256 and
    chunk size 64 when Triton imports, and PyTorch otherwise (CPU tensors, fp64,
    other sizes). ``triton`` insists, and says why when it cannot. K is the
    state's key size, after any ``feature_map``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown `backend` {backend!r}; expected one of {', '.join(map(repr, BACKENDS))}")
    if backend == "torch" or not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] == 0:
        return "torch"  # malformed inputs get the shared checks' errors; T = 0 needs no kernel
    from ..feature_maps import get_feature_map

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


def chunk_op_triton(op: str, q, k, v, **kwargs):
    """The Triton path of the chunk delta ops; imports the kernels on first use (see ``chunk.py``)."""
    from .chunk import chunk_op_triton as run

    return run(op, q, k, v, **kwargs)


def delta_rule_step(*args, **kwargs):
    """One decode step of the (gated) delta rule; see :func:`fastweights.ops.triton.decode.delta_rule_step`."""
    from .decode import delta_rule_step as step

    return step(*args, **kwargs)
