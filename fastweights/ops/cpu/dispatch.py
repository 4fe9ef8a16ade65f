"""Which instruction-set path the compiled CPU kernels take, decided once and reported.

Four paths, lowest first (``fastweights/ops/cpu/isa.h`` has the C++ side):

========== ==================================================================================
portable   no hand-written intrinsics and no MKL: fp32/fp64 products by a register-blocked
           loop the compiler vectorises (what ARM and macOS builds run)
avx2       products by MKL's ``sgemm_`` / ``dgemm_``; bf16 products widened to fp32 first
avx512bf16 bf16 products by the ``vdpbf16ps`` micro-kernel (``gemm_bf16.h``)
amx        bf16 products by oneDNN's brgemm on AMX tiles (``at::native::cpublas::brgemm``)
========== ==================================================================================

The path is the lowest of three: what the CPU reports (``/proc/cpuinfo`` flags, else
``torch.backends.cpu.get_cpu_capability()``), what the build can run (MKL present, the compiler
targeting AVX512-BF16, torch exporting a bf16 brgemm), and ``FASTWEIGHTS_CPU_ISA`` when set,
which forces a *lower* path (so every path this machine can run is tested on it); asking for a
higher one is ignored with a warning. Nothing here imports or builds the kernels.
"""

from __future__ import annotations

import functools
import os
import platform
import warnings
from typing import Mapping, NamedTuple, Optional

import torch

__all__ = ["LEVELS", "ENV", "Choice", "cpu_flags", "cpu_level", "bf16_dot_unit", "requested", "choose", "kernel_paths"]

LEVELS = ("portable", "avx2", "avx512bf16", "amx")
ENV = "FASTWEIGHTS_CPU_ISA"

#: flags that stand for what torch's own dispatcher found, where /proc/cpuinfo cannot be read
_CAPABILITY_FLAGS = {
    "AVX512": frozenset({"avx2", "fma", "avx512f", "avx512bw"}),
    "AVX2": frozenset({"avx2", "fma"}),
}


class Choice(NamedTuple):
    """The path taken (an index into :data:`LEVELS`) and why, one reason per line."""

    level: int
    reasons: tuple

    @property
    def name(self) -> str:
        return LEVELS[self.level]


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """The CPU's feature flags: the first ``flags`` line of ``/proc/cpuinfo`` (Linux on x86), or
    its first ``Features`` line (Linux on Arm), else what ``torch.backends.cpu.get_cpu_capability()``
    implies (it does not tell AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return _CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), frozenset())


def _darwin_feature(name: str) -> bool:
    """A ``hw.optional.*`` sysctl of macOS read as a flag (False where it cannot be read)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        value, size = ctypes.c_int(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_int))
        ok = libc.sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0
        return ok and value.value == 1
    except (OSError, AttributeError):
        return False


def bf16_dot_unit(flags: Optional[frozenset] = None, machine: Optional[str] = None,
                  system: Optional[str] = None) -> bool:
    """Whether the CPU itself multiplies bf16 (not what any build or variable allows): on x86-64
    AVX512-BF16 (AMX comes with it), on Arm FEAT_BF16 (``bf16`` among Linux's ``Features``, or
    macOS's ``hw.optional.arm.FEAT_BF16``: the BFDOT/BFMMLA instructions, on which torch's
    Linux Arm builds run bf16 matmuls through oneDNN where the CPU has them); False on any other
    CPU."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return cpu_level(flags, machine)[0] >= 2
    if machine in ("aarch64", "arm64"):
        if (system or platform.system()) == "Darwin" and flags is None:
            return _darwin_feature("hw.optional.arm.FEAT_BF16")
        return "bf16" in (cpu_flags() if flags is None else frozenset(flags))
    return False


def cpu_level(flags: Optional[frozenset] = None, machine: Optional[str] = None) -> tuple:
    """``(level, why)``: the highest path the CPU itself supports."""
    flags = cpu_flags() if flags is None else frozenset(flags)
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return 0, f"the CPU is {machine}, not x86-64"
    if {"amx_bf16", "amx_tile", "avx512_bf16"} <= flags:
        return 3, "the CPU reports amx_bf16 and amx_tile"
    if {"avx512_bf16", "avx512bw", "avx512f"} <= flags:
        return 2, "the CPU reports avx512_bf16, no amx_bf16"
    if {"avx2", "fma"} <= flags:
        return 1, "the CPU reports avx2 and fma, no avx512_bf16"
    return 0, "the CPU reports neither avx2 nor fma"


def requested(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """The level ``FASTWEIGHTS_CPU_ISA`` asks for, or None when unset or empty."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return None
    name = raw.lower().replace("-", "").replace("_", "")
    if name not in LEVELS:
        raise ValueError(f"{ENV} must be one of {', '.join(LEVELS)} (or unset), got {raw!r}")
    return LEVELS.index(name)


def _build_limit(build_max: int, has_mkl: bool, has_brgemm: bool) -> str:
    if not has_mkl:
        return "this build has no MKL (torch was built without it, or the CPU is not x86-64)"
    if build_max < 2:
        return "the compiler did not target AVX512-BF16"
    if not has_brgemm:
        return "this torch exports no bf16 brgemm"
    return "this build stops there"


def choose(build_max: int, has_mkl: bool = True, has_brgemm: bool = True, *, flags: Optional[frozenset] = None,
           machine: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
           check_cpu: bool = True) -> Choice:
    """The path to take: the lowest of the CPU's (unless ``check_cpu`` is False, which lets a
    test run the AMX code on a CPU without AMX: oneDNN then runs it with the vector units), the
    build's (``build_max``) and ``FASTWEIGHTS_CPU_ISA``'s."""
    if not isinstance(build_max, int) or not 0 <= build_max < len(LEVELS):
        raise ValueError(f"choose: `build_max` must be an int in [0, {len(LEVELS) - 1}], got {build_max!r}")
    cpu, why = cpu_level(flags, machine) if check_cpu else (len(LEVELS) - 1, "the CPU's flags not consulted")
    level, reasons = min(cpu, build_max), [why]
    if build_max < cpu:
        reasons.append(f"{_build_limit(build_max, has_mkl, has_brgemm)}: up to {LEVELS[build_max]}")
    want = requested(environ)
    if want is not None:
        if want > level:
            msg = f"{ENV}={LEVELS[want]} asks for more than this CPU and build run ({LEVELS[level]}); ignored"
            warnings.warn("fastweights: " + msg, RuntimeWarning, stacklevel=3)
            reasons.append(msg)
        else:
            level = want
            reasons.append(f"forced by {ENV}={LEVELS[want]}")
    return Choice(level, tuple(reasons))


def kernel_paths(level: int, flags: Optional[frozenset] = None, native: bool = True) -> dict:
    """What each compiled kernel runs at ``level``: ``{kernel: path}``. ``native``: the build
    targets this CPU (``-march=native`` / ``-mcpu=native``)."""
    flags = cpu_flags() if flags is None else flags
    fp_products = "MKL sgemm_/dgemm_, one call per tile" if level >= 1 else "register-blocked loop (portable, no BLAS)"
    # the hand-written vector forms of the kernels' own loops (above the portable level, in a native build)
    vector = ("AVX-512" if "avx512f" in flags else "AVX2" if {"avx2", "fma"} <= flags else None) if level >= 1 and native else None
    inverse = {"AVX-512": "AVX-512 registers", "AVX2": "AVX2 registers (chunks up to 64)"}.get(vector, "loop the compiler vectorises")
    exps = f"an {vector} polynomial" if vector else "the C library's exp"
    transpose = f"{vector} register tiles" if vector else "a scalar loop"
    bf16 = {
        3: "oneDNN brgemm on AMX tiles (B packed VNNI-2)",
        2: "vdpbf16ps micro-kernel (AVX512-BF16)",
        1: "operands widened to fp32, then MKL sgemm_",
        0: "operands widened to fp32, then the portable register-blocked loop",
    }[level]
    if level < 2:  # no bf16 unit: the ops send bf16_products() inputs to the fp32 kernel (cpu.bf16_unit)
        bf16 += " when called directly; the ops under bf16_products() take the fp32 kernel on the bf16 rows instead"
    loops = "loops the compiler vectorises for this CPU" + (" (-march=native)" if native else " (portable build)")
    # plain bf16 q, k, v: the gather's widening and the output's rounding to bf16 (torch's rounding)
    lanes = {"AVX-512": "16", "AVX2": "8"}.get(vector)
    conversions = f"{vector}, {lanes} lanes" if vector else "scalar loops"
    return {
        "plain bf16 inputs (inference: delta, gated, KDA, linear attention)": (
            f"the fp32 kernels on the rows widened as they are gathered, o rounded to bf16 once as it is "
            f"written; conversions: {conversions}"),
        "chunk_delta_fwd / chunk_delta_bwd (fp32, fp64)": f"products: {fp_products}; triangular inverse: {inverse}",
        "chunk_delta_fwd_bf16 (bf16 products)": f"products: {bf16}; solve and state fp32",
        "chunk_kda_fwd / chunk_kda_bwd (KDA, GDN-2; fp32, fp64)": (
            f"products: {fp_products}; exponentials: {exps}; triangular inverse: {inverse}; "
            f"per-channel decay factors: {loops}"),
        "chunk_kda_fwd_bf16 (KDA, bf16 products)": (
            f"products: {bf16}; decayed rows, solve and state fp32 ({loops})"),
        "chunk_linear_attn_fwd / _bwd (fp32, fp64)": (
            f"products: {fp_products}; key transpose: {transpose}; decays and masks: {loops}"),
        "delta_step (decode)": loops,
        "kda_step (decode)": loops,
        "short_conv_fwd / _bwd": loops,
        "l2norm_fwd / _bwd": loops,
    }
