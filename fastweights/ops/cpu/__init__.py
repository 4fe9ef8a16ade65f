"""Compiled CPU kernels (C++, built once on first use and cached): the fast path on the CPU.

``chunk_delta.cpp`` runs the (gated) delta rule's chunk forward one (sequence, head) per
task, each product one BLAS call on a whole tile; the PyTorch path in
``fastweights/ops/delta_rule/chunk.py`` is the same algebra and stays the fallback.

The extension is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are
needed; ``make setup`` builds it ahead of time, ``python -m fastweights.ops.cpu`` too) into
``$FASTWEIGHTS_CACHE`` (default ``~/.cache/fastweights``), in a folder named by a hash of the
sources, the torch version and the CPU, so a changed source or machine builds anew and
never loads a stale library. Nothing here runs at ``import fastweights``: the first CPU
chunk call builds (about 50 s on 2 cores) or loads it. If the build fails, or
``FASTWEIGHTS_CPU_KERNELS=0`` is set, the PyTorch path runs; a failed build says so once
in a one-line warning and never raises.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

__all__ = ["available", "kernels", "kernels_for", "enabled", "set_enabled", "build", "status"]

_SOURCES = ("chunk_delta.cpp", "gemm_bf16_check.cpp", "decode_step.cpp", "short_conv.cpp", "l2norm.cpp",
            "chunk_linear_attn.cpp", "chunk_kda.cpp")
_HEADERS = ("gemm_bf16.h", "chunk_common.h")  # included by the sources: part of the build key
_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_module = None
_error: Optional[str] = None
_tried = False
_enabled_override: Optional[bool] = None


def _cpu_signature() -> str:
    """The CPU model and ISA flags (the build uses ``-march=native``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines)


#: Compiler and linker flags (part of the build's key). ``-fopenmp``: ``at::parallel_for`` is
#: inline OpenMP in torch's headers; compiled without it, the heads run one after another.
_CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def _build_key() -> str:
    h = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        h.update((_HERE / name).read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the compiled kernels are kept: ``$FASTWEIGHTS_CACHE/cpu_kernels/<key>``."""
    root = os.environ.get("FASTWEIGHTS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fastweights")
    return Path(root) / "cpu_kernels" / _build_key()


def enabled() -> bool:
    """Whether CPU chunk calls may use the compiled kernels (``FASTWEIGHTS_CPU_KERNELS=0`` or
    :func:`set_enabled(False) <set_enabled>` turns them off; the PyTorch path then runs)."""
    if _enabled_override is not None:
        return _enabled_override
    return os.environ.get("FASTWEIGHTS_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def set_enabled(flag: Optional[bool]) -> None:
    """Turn the compiled kernels on or off for this process (``None``: back to the environment's choice)."""
    global _enabled_override
    _enabled_override = None if flag is None else bool(flag)


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip package's binary is not there unless its
    environment is activated (``make`` calls ``.venv/bin/python`` directly)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build(verbose: bool = False):
    """Compile (or load the cached build of) the kernels; returns the module or None, never raises."""
    global _module, _error, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            folder = cache_dir()
            folder.mkdir(parents=True, exist_ok=True)
            if not any(folder.glob("*.so")):
                print("fastweights: compiling the CPU kernels once (about 50 s on 2 cores) into " + str(folder), file=sys.stderr)
            _module = load(
                name="fastweights_cpu_" + folder.name,
                sources=[str(_HERE / s) for s in _SOURCES],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(folder),
                verbose=verbose,
            )
        except Exception as exc:  # a missing compiler, ninja or header: fall back, say so once
            _module = None
            _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            warnings.warn(
                f"fastweights: the compiled CPU kernels are unavailable ({_error}); using the PyTorch path",
                RuntimeWarning, stacklevel=3,
            )
        return _module


def kernels():
    """The compiled module when enabled and built (building it on the first call), else None."""
    if not enabled():
        return None
    if _tried:
        return _module
    return build()


def kernels_for(*tensors: Optional[torch.Tensor], dtypes=(torch.float32, torch.float64)):
    """The compiled module when it may serve these tensors (``None`` entries skipped): all on the
    CPU, all of one dtype among ``dtypes``, not being traced by ``torch.compile``, and the kernels
    enabled and built. Otherwise None, and the caller runs its PyTorch code."""
    present = [t for t in tensors if t is not None]
    if not present or torch.compiler.is_compiling():
        return None
    dtype = present[0].dtype
    if dtype not in dtypes or any(t.device.type != "cpu" or t.dtype != dtype for t in present):
        return None
    return kernels()


def available() -> bool:
    """Whether the compiled CPU kernels are enabled and built (builds them on the first call)."""
    return kernels() is not None


def status() -> str:
    """One line: which CPU path chunk calls take, and why."""
    if not enabled():
        return "PyTorch path (compiled CPU kernels turned off)"
    mod = kernels()
    if mod is None:
        return f"PyTorch path (compiled CPU kernels unavailable: {_error})"
    return f"compiled CPU kernels ({cache_dir()})"
