"""Compiled CPU kernels (C++, built once on first use and cached): the fast path on the CPU.

``chunk_delta.cpp`` runs the (gated) delta rule's chunk forward one (sequence, head) per
task, each product one BLAS call on a whole tile; the PyTorch path in
``fastweights/ops/delta_rule/chunk.py`` is the same algebra and stays the fallback.

The extension is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja are
needed; ``make setup`` builds it ahead of time, ``python -m fastweights.ops.cpu`` too) from the
sources next to this file, which the wheel and the sdist ship, into
``$FASTWEIGHTS_CACHE/cpu_kernels/<key>`` (default ``~/.cache/fastweights``); ``kernel_cache.py``
keeps that cache (the key, verified entries, the build lock and its bounded wait, README.md here
says how). Nothing here runs at ``import fastweights``: the first CPU chunk call builds (about
50 s on 2 cores) or loads it. If the build fails, the wait for another process's build ends, or
``FASTWEIGHTS_CPU_KERNELS=0`` is set, the PyTorch path runs; a failed build says so once in a
one-line warning and never raises.

Which instruction-set path each kernel takes (AMX, AVX512-BF16, AVX2, portable) is decided once
when the kernels load (``fastweights/ops/cpu/dispatch.py``; ``FASTWEIGHTS_CPU_ISA`` forces a lower
one) and reported by :func:`status`, :func:`kernel_report` and ``python -m fastweights.ops.cpu``.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import kernel_cache

__all__ = ["available", "kernels", "kernels_for", "enabled", "set_enabled", "build", "status", "isa",
           "set_isa", "kernel_report", "kernels_for_bf16", "unit_last_stride"]

#: One file per kernel family, and module.cpp, the one module definition that registers them all.
_SOURCES = ("module.cpp", "chunk_delta.cpp", "chunk_delta_bf16.cpp", "gemm_bf16_check.cpp", "decode_step.cpp",
            "short_conv.cpp", "l2norm.cpp", "chunk_linear_attn.cpp", "chunk_kda.cpp",
            "chunk_kda_bf16.cpp")
_HEADERS = ("chunk_common.h", "chunk_bf16.h", "chunk_rows.h", "gemm_bf16.h", "gemm.h", "isa.h", "vec.h")  # included by the sources: part of the build key
_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_module = None
_error: Optional[str] = None
_tried = False
_enabled_override: Optional[bool] = None
_isa_choice = None  # isa.Choice, once the kernels are loaded
_compiler_line: Optional[str] = None


def _cpu_signature() -> str:
    """The CPU model and ISA flags (the build uses ``-march=native``)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines)


_MACHINE = platform.machine().lower()
#: The build targets this CPU: ``-march=native`` on x86-64, ``-mcpu=native`` on ARM, nothing else.
_NATIVE = {"x86_64": ("-march=native",), "amd64": ("-march=native",), "aarch64": ("-mcpu=native",),
           "arm64": ("-mcpu=native",)}.get(_MACHINE, ())
#: MKL's BLAS symbols (``sgemm_``, ``MKL_Set_Num_Threads_Local``) are used only where torch has MKL
#: on x86-64; elsewhere the kernels build without them (the portable products, isa.h).
_MKL = _MACHINE in ("x86_64", "amd64") and torch.backends.mkl.is_available()

#: Compiler and linker flags (part of the build's key). ``-fopenmp``: ``at::parallel_for`` is
#: inline OpenMP in torch's headers; compiled without it, the heads run one after another.
_CFLAGS = ("-O3", *_NATIVE, "-fno-math-errno", "-fopenmp") + (("-DFASTWEIGHTS_MKL",) if _MKL else ())
_LDFLAGS = ("-fopenmp",)


def _build_key() -> str:
    """What changes the built library, and nothing else: the sources' bytes (not their folder, so
    every checkout shares one build), the flags, torch's and Python's versions, the CPU and the
    compiler. ninja is not in it: it only schedules the compiler."""
    return kernel_cache.build_key(_HERE, _SOURCES + _HEADERS, " ".join(_CFLAGS + _LDFLAGS), torch.__version__,
                                  sys.version, platform.machine(), _cpu_signature(), _compiler())


def _compiler() -> str:
    global _compiler_line
    if _compiler_line is None:  # one subprocess per process, not per call
        _compiler_line = kernel_cache.compiler_version()
    return _compiler_line


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


def _compile_into(folder: Path, name: str, verbose: bool) -> Path:
    """torch's JIT builder in a private folder (its ninja file names this checkout's paths, so it
    is never shared); returns the built library, which the cache then verifies and publishes."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    print(f"fastweights: compiling the CPU kernels once (about 50 s on 2 cores) into {folder.parent}", file=sys.stderr, flush=True)
    load(name=name, sources=[str(_HERE / s) for s in _SOURCES], extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
         build_directory=str(folder), verbose=verbose)
    return folder / (name + ".so")


def build(verbose: bool = False):
    """Load the verified cached build of the kernels, or compile it (waiting for another process's
    build at most ``$FASTWEIGHTS_KERNEL_WAIT`` seconds, default 300); returns the module or None,
    never raises (a SIGINT while waiting ends the wait, then acts as usual)."""
    global _module, _error, _tried
    from .dispatch import requested

    requested()  # a misspelt FASTWEIGHTS_CPU_ISA is the caller's error: ValueError, not a silent fallback
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            folder = cache_dir()
            name = "fastweights_cpu_" + folder.name
            _module = kernel_cache.load_or_build(
                folder, name, lambda private: _compile_into(private, name, verbose),
                describe={"torch": torch.__version__, "python": sys.version.split()[0], "compiler": _compiler(),
                          "flags": " ".join(_CFLAGS + _LDFLAGS), "sources": list(_SOURCES + _HEADERS)})
            _apply_isa(_module)
        except BaseException as exc:  # a missing compiler, ninja or header, a wait given up: fall back, say so once
            _module = None
            _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            if not isinstance(exc, Exception):  # KeyboardInterrupt while waiting: no warning, the interrupt goes on
                raise
            warnings.warn(
                f"fastweights: the compiled CPU kernels are unavailable ({_error}); using the PyTorch path",
                RuntimeWarning, stacklevel=3,
            )
        return _module


def _apply_isa(mod, name: Optional[str] = None, check_cpu: bool = True) -> None:
    """Decide the ISA path (dispatch.py) for the loaded module and set it in the kernels."""
    global _isa_choice
    from . import dispatch as _isa

    env = None if name is None else {_isa.ENV: name}
    choice = _isa.choose(int(mod.build_max_isa), bool(mod.build_has_mkl), bool(mod.build_has_brgemm),
                         environ=env, check_cpu=check_cpu)
    mod.set_isa(choice.level)
    _isa_choice = choice


def isa() -> Optional[str]:
    """The ISA path the compiled kernels take (``"amx"``, ``"avx512bf16"``, ``"avx2"`` or
    ``"portable"``; builds them on the first call), or None when they are off or unavailable."""
    return None if kernels() is None else _isa_choice.name


def set_isa(name: Optional[str] = None, *, check_cpu: bool = True) -> Optional[str]:
    """Take another ISA path from now on, in this process: ``name`` as ``FASTWEIGHTS_CPU_ISA``
    reads it (a lower path than the CPU's; a higher one is ignored with a warning), or None to
    decide again from the environment. ``check_cpu=False`` lets tests run the AMX code on a CPU
    without AMX (oneDNN runs the same brgemm on its vector units). Returns the path taken, or
    None when the kernels are off or unavailable."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"set_isa: `name` must be a str or None, got {type(name).__name__}")
    mod = kernels()
    if mod is None:
        return None
    with _lock:
        _apply_isa(mod, name, check_cpu)
    return _isa_choice.name


def kernel_report() -> dict:
    """``{kernel: path}`` for every compiled kernel at the current ISA path (empty when the
    kernels are off or unavailable)."""
    if kernels() is None:
        return {}
    from . import dispatch as _isa

    return _isa.kernel_paths(_isa_choice.level, native=bool(_NATIVE))


def kernels():
    """The compiled module when enabled and built (building it on the first call), else None."""
    if not enabled():
        return None
    if _tried:
        return _module
    return build()


@torch.compiler.assume_constant_result
def _available_when_traced() -> bool:
    """:func:`available`, run by ``torch.compile`` while it traces (not traced itself, not in the
    graph): the first trace may build the kernels; the graph keeps the answer."""
    return kernels() is not None


def unit_last_stride(*tensors: Optional[torch.Tensor]):
    """The tensors with stride 1 in their last dim, as the kernels require of the rows they read
    (None stays None); one tensor in, one out.

    ``t.contiguous()`` is not enough: PyTorch calls a tensor contiguous whatever the strides of its
    size-1 dims, so a ``[1, 1, 1, 1]`` cotangent expanded from ``o.sum()`` (every stride 0), or any
    tensor whose last dim is 1, would reach a kernel with a last stride other than 1.
    """
    out = tuple(t if t is None or t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)
                for t in tensors)
    return out[0] if len(out) == 1 else out


def kernels_for(*tensors: Optional[torch.Tensor], dtypes=(torch.float32, torch.float64)):
    """The kernels (:mod:`fastweights.ops.cpu.library`: one function per kernel, the extension's
    names and signatures) when they may serve these tensors (``None`` entries skipped): all on
    the CPU, all of one dtype among ``dtypes``, and the kernels enabled and built. Otherwise
    None, and the caller runs its PyTorch code.

    Under ``torch.compile`` the answer is decided while tracing and the kernels are called as
    the custom ops ``torch.ops.fastweights.*``, so a compiled graph runs the same kernels as eager
    (``torch._dynamo.reset()`` re-decides after :func:`set_enabled`)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    dtype = present[0].dtype
    if dtype not in dtypes or any(t.device.type != "cpu" or t.dtype != dtype for t in present):
        return None
    return _kernels_now()


def _kernels_now():
    """:mod:`fastweights.ops.cpu.library` when the kernels are enabled and built (decided while
    tracing under ``torch.compile``), else None."""
    if torch.compiler.is_compiling():
        return library if _available_when_traced() else None
    return library if kernels() is not None else None


def kernels_for_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *others: Optional[torch.Tensor],
                     operands: bool = False):
    """The kernels (as :func:`kernels_for`) for bf16 rows that a kernel reads as bf16: q, k, v bf16
    CPU tensors (``operands``: only v need be bf16 yet, the caller rounds q and k to bf16 product
    operands), beside fp32 CPU ``others`` (None skipped: β, the decays, the initial state; there
    may be none, as for linear attention without decay or initial state). Otherwise None."""
    rows = (v,) if operands else (q, k, v)
    if any(t.dtype != torch.bfloat16 for t in rows) or any(t.device.type != "cpu" for t in (q, k, v)):
        return None
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in others):
        return None
    return _kernels_now()


@torch.compiler.assume_constant_result
def bf16_unit() -> bool:
    """Whether bf16 products pay on this CPU: the compiled kernels' ISA path multiplies bf16 in
    hardware (``amx``, ``avx512bf16``), or, before the kernels are loaded or without them, the CPU
    has a bf16 unit (:func:`dispatch.bf16_dot_unit`: AVX512-BF16 on x86-64, within what
    ``FASTWEIGHTS_CPU_ISA`` allows; FEAT_BF16 on Arm, where torch's own bf16 matmul uses it; no
    other CPU).

    Where they do not pay (``avx2``, ``portable``) a bf16 product is an fp32 product of operands
    rounded to bf16 and widened again: the bf16 kernels ran 0.85-0.93x the fp32 forward on the same
    bf16 inputs on an AVX2-only AMD EPYC, and torch's bf16 matmul 1.0-1.3 GFLOP/s against 86 in fp32
    (the PyTorch chunk path under the mode: 5-6x slower). There the chunk ops take
    :func:`fastweights.ops.bf16_products` as leave, not as an order (as
    ``torch.set_float32_matmul_precision("medium")`` is on such a CPU): bf16 q, k, v are computed as
    plain bf16 inputs are (the fp32 kernel widens them as it gathers them). The bf16 kernels, called
    directly, still widen their operands on those paths (tested there)."""
    from . import dispatch as _isa

    if enabled() and _tried and _module is not None:
        return _isa_choice.level >= 2
    want = _isa.requested() if platform.machine().lower() in ("x86_64", "amd64") else None
    return _isa.bf16_dot_unit() and (want is None or want >= 2)


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
    return f"compiled CPU kernels ({cache_dir()}), ISA path {_isa_choice.name} ({'; '.join(_isa_choice.reasons)})"


from . import library  # noqa: E402  (the custom ops; registering them builds nothing)
