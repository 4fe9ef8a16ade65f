"""Autotuning of the Triton kernels: every listed config, or one pinned config per kernel.

Each kernel module lists the ``(num_warps, num_stages)`` configs its launchers may
use (``benchmarks/triton_resources.py`` compiles every one for sm_90 and checks
that it fits) and one pinned config. ``FASTWEIGHTS_TRITON_AUTOTUNE=0``, set before
the kernels are first used, runs the pinned ones: autotuning compiles every
config of every kernel for each shape and dtype, which on a new device can take
longer than the run itself (``benchmarks/gpu_chunk_delta.py`` pins by default).
"""

from __future__ import annotations

import os

import triton

from .._backend import interpreting


def autotuning() -> bool:
    """False when ``FASTWEIGHTS_TRITON_AUTOTUNE=0``: every kernel runs its pinned config."""
    return os.environ.get("FASTWEIGHTS_TRITON_AUTOTUNE", "1").lower() not in ("0", "false", "off", "no")


def capped(configs, max_stages: int):
    """``configs`` with num_stages clamped to ``max_stages`` (duplicates dropped, order kept)."""
    out = []
    for w, s in configs:
        if (w, min(s, max_stages)) not in out:
            out.append((w, min(s, max_stages)))
    return out


def autotuned(kernel, configs, pinned, key, stage_cap=None, **options):
    """``kernel`` autotuned over ``configs`` on a GPU (only ``pinned`` when not :func:`autotuning`);
    the kernel as is under the interpreter, which cannot benchmark.

    ``stage_cap(named_args, kwargs) -> int``, when given, clamps every config's
    pipeline stages for the launch at hand (the stages that fit in shared memory
    depend on the block sizes and the dtype, which the configs cannot know).
    """
    if interpreting():
        return kernel
    chosen = configs if autotuning() else [pinned]
    if stage_cap is not None:
        def prune(configs_, named_args, **kwargs):
            cap = stage_cap(named_args, kwargs)
            kept = capped([(c.num_warps, c.num_stages) for c in configs_], cap)
            return [triton.Config({}, num_warps=w, num_stages=s) for w, s in kept]

        options["prune_configs_by"] = {"early_config_prune": prune}
    return triton.autotune(configs=[triton.Config({}, num_warps=w, num_stages=s) for w, s in chosen], key=key,
                           **options)(kernel)
