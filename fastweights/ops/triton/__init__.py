"""Optional Triton kernels for the chunk delta rules and the one-token decode step.

Install with ``pip install fastweights[triton]``. Nothing here imports Triton's
kernels until they are first used, because Triton decides when a kernel module is
imported whether ``@triton.jit`` compiles for the GPU or runs on numpy
(``TRITON_INTERPRET=1``, how the tests run them on the CPU).

=============================  ===============================================
file                           what
=============================  ===============================================
``_chunk_kernels.py``          the five kernels (WY, state, state adjoint, 2 × grads)
``chunk.py``                   launchers, the ``autograd.Function``, the front end
``decode.py``                  the fused one-token step (``fastweights.ops.delta_rule_step`` on CUDA)
=============================  ===============================================

The public ops ``chunk_delta_rule`` / ``chunk_gated_delta_rule`` take
``backend="auto" | "torch" | "triton"``; ``ops/_backend.py`` decides, for both
peers, and imports this package's kernels only when it picks them.
"""

from __future__ import annotations

# The backend choice and the kernels' limits live in ``ops/_backend.py`` (which imports nothing
# of this package); re-exported here for users who import them from this package.
from .._backend import (
    BACKENDS, CHUNK_SIZE, HAS_TRITON, MAX_HEAD_DIM, TRITON_DTYPES, interpreting, select_backend,
)

__all__ = ["HAS_TRITON", "BACKENDS", "CHUNK_SIZE", "MAX_HEAD_DIM", "TRITON_DTYPES", "select_backend", "interpreting"]

