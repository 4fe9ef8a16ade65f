"""GPU benchmark of the chunk delta rules: Triton kernels vs PyTorch, SDPA and fla.

Usage (on a CUDA machine, repository root; no network needed)::

    python -m benchmarks.run gpu_chunk_delta --json out/gpu_bench.json --append-md BENCHMARKS.md

With fla's wheels carried along (``BENCHMARKS.md``
says how), prefix the command with
``pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site``.

What it does, in one run so that the ratios are comparable:

1. measures the device's ceilings: device-to-device copy (GB/s, bytes read +
   written) and a bf16 8192³ matmul (TFLOP/s);
2. checks correctness on the GPU (``--check``, on by default): the Triton path
   in bf16, fp16 and fp32 against the float64 recurrence, with the rule of docs/design.md
   (error at most 2× -- 3× for gradients -- that of the recurrent form run in
   the same precision; fp32 within 1e-4);
3. times forward and forward+backward (``triton.testing.do_bench``, median ms)
   of the delta rule and the gated delta rule: fastweights Triton, fastweights
   PyTorch (``backend="torch"``, fp32 compute), fla when importable, and SDPA
   (causal, flash) as the attention baseline; H=16, K=V=128, bf16, 32k tokens
   per batch, T = 2048 (``--seqlens 2048,4096,8192,16384`` for more);
4. times the one-token decode step at B=64, H=16, K=V=128: the fused Triton
   step against the batched PyTorch step;
5. prints a table, writes JSON (``--json``) and appends a dated markdown section
   with device and versions to BENCHMARKS.md (``--append-md``).

Achieved rates: TFLOP/s counts the chunk form's matmuls (forward: K Kᵀ, W, U,
Q Kᵀ, P U' = 2C²(3K + 2V) per chunk, plus W h, Q h, K̄ᵀ U' = 6CKV; backward
counted as 2× forward) and SDPA's causal attention (2·B·H·T²·D forward, 2.5×
that backward). GB/s is the minimum traffic (inputs read, outputs written,
once) over the time, to compare with the copy ceiling.

The Triton kernels run one pinned config each (``ops/triton/_tuning.py``) unless
``--autotune`` is given: full autotuning compiles every config of every kernel
for every shape and dtype and can take longer than the whole run. Timing rows
still to come after ``--budget-s`` seconds (default 270) are skipped and say so,
so that a run ends within about five minutes.

``--dry-run`` runs every part on the CPU on tiny shapes with Triton's
interpreter (fp32), so the script is exercised without a GPU (the test suite
does this); its numbers mean nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from fastweights.config import flag


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run gpu_chunk_delta``."""

    dry_run: bool = field(default=False, metadata=flag(action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1"))
    json: Optional[str] = field(default=None, metadata=flag(help="write the results here"))
    append_md: Optional[str] = field(default=None, metadata=flag(help="append a dated markdown section to this file"))
    seqlens: str = field(default="2048", metadata=flag(help="T values, comma list (32k tokens per batch)"))
    autotune: bool = field(default=False, metadata=flag(
        action="store_true", help="autotune every kernel over all its configs (compiles each; minutes) instead of the pinned ones"))
    budget_s: float = field(default=270.0, metadata=flag(
        type=float, help="skip the timing rows still to come once this many seconds have passed"))
    tokens: int = field(default=32768, metadata=flag(type=int, help="tokens per batch (B = tokens / T)"))
    heads: int = field(default=16, metadata=flag(type=int, help="default 16"))
    head_dim: int = field(default=128, metadata=flag(type=int, help="K = V"))
    no_check: bool = field(default=False, metadata=flag(action="store_true", help="skip the correctness check"))
    no_torch: bool = field(default=False, metadata=flag(action="store_true", help="skip the (slow) PyTorch path"))
    rules: str = field(default="delta,gated", metadata=flag(help="comma list of delta, gated"))


def main(config: Config) -> int:
    if config.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined
    if not config.autotune:  # one config per kernel (ops/triton/_tuning.py): the run fits in minutes
        os.environ["FASTWEIGHTS_TRITON_AUTOTUNE"] = "0"
    from . import _gpu_chunk_delta

    return _gpu_chunk_delta.run(config)
