"""The kernels' sources compile for every CPU target the dispatcher can choose, not only this one.

The tests elsewhere run the kernels on the instruction-set paths *this* CPU reaches. The code
behind the others (AMX tiles through oneDNN's brgemm, the ``vdpbf16ps`` micro-kernel, the
AVX-512 forms of the loops, the build without MKL, Arm) sits behind ``#if`` branches that a
``-march=native`` build on an AVX2 CPU never compiles. Here the host compiler builds the same
sources with the flags of the real build (``fastweights/ops/cpu/__init__.py``), ``-march=native``
replaced by each target's:

===================  ==================================  ============================
target               what the CPU has                    highest path the build runs
===================  ==================================  ============================
sapphirerapids       AMX, AVX512-BF16 (Intel Xeon 4th+)  amx (chosen where the CPU reports amx_bf16)
cooperlake           AVX512-BF16, no AMX                 amx (the CPU's flags then choose avx512bf16)
skylake-avx512       AVX-512 without bf16                avx2
x86-64-v3            AVX2 + FMA                          avx2
x86-64, no MKL       SSE2, no BLAS                       portable
aarch64 (cross)      Arm, no MKL                         portable
===================  ==================================  ============================

The first tests check, at compile time, which path each build can run (``isa.h``'s
``kBuildMaxIsa``, through a ``static_assert``) and that the AMX source compiles for an AMX
target. The slow ones compile every source to an object for every target at ``-O3`` (code
generation included: an intrinsic outside its target, a failed inline): 60 compiles, about
21 minutes on 2 cores. Nothing compiled here runs; the Arm target needs ``aarch64-linux-gnu-g++`` (Debian's
``g++-aarch64-linux-gnu``) and skips without it.
"""

import functools
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from fastweights.ops import cpu as cpu_kernels

HERE = Path(cpu_kernels.__file__).resolve().parent
LEVELS = {"portable": 0, "avx2": 1, "avx512bf16": 2, "amx": 3}  # isa.h's enum Isa

#: name -> (compiler, target flags, MKL, the highest path isa.h gives such a build)
TARGETS = {
    "sapphirerapids": ("host", ("-march=sapphirerapids",), True, "amx"),
    "cooperlake": ("host", ("-march=cooperlake",), True, "amx"),
    "skylake-avx512": ("host", ("-march=skylake-avx512",), True, "avx2"),
    "x86-64-v3": ("host", ("-march=x86-64-v3",), True, "avx2"),
    "x86-64-no-mkl": ("host", ("-march=x86-64",), False, "portable"),
    "aarch64": ("aarch64-linux-gnu-g++", ("-march=armv8.6-a+bf16",), False, "portable"),
}


def _host_compiler():
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx) or shutil.which("g++")


@functools.cache
def _compiler_or_why(target):
    """(the compiler for ``target``, None) or (None, why not): probed once per target and process."""
    kind = TARGETS[target][0]
    found = _host_compiler() if kind == "host" else shutil.which(kind)
    if found is None:
        return None, f"no compiler for the {target} target ({'c++/g++' if kind == 'host' else kind} not on PATH)"
    if kind == "host":
        probe = subprocess.run([found, "-dumpmachine"], capture_output=True, text=True)
        if not probe.stdout.startswith(("x86_64", "amd64")):
            return None, f"the host compiler targets {probe.stdout.strip() or 'an unknown machine'}, not x86-64"
        accepts = subprocess.run([found, *TARGETS[target][1], "-E", "-x", "c++", "-"], input="", capture_output=True,
                                 text=True)
        if accepts.returncode != 0:
            return None, f"{found} does not know {' '.join(TARGETS[target][1])}: {accepts.stderr.strip()[:200]}"
    return found, None


def _compiler(target):
    found, why = _compiler_or_why(target)
    if found is None:
        pytest.skip(why)
    return found


def _flags(target):
    """The real build's flags (``_CFLAGS``, torch's own), ``-march=native`` swapped for the target's."""
    _, arch, mkl, _ = TARGETS[target]
    own = [f for f in cpu_kernels._CFLAGS if f not in cpu_kernels._NATIVE and f != "-DFASTWEIGHTS_MKL"]
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(HERE)]
    return ["-std=c++20", "-fPIC", *arch, *own, *(["-DFASTWEIGHTS_MKL"] if mkl else []),
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=fastweights_cpu_target_check",
            *(f"-I{p}" for p in includes)]


def _compile(target, source, *mode, input_text=None):
    cmd = [_compiler(target), *_flags(target), *mode]
    cmd += ["-x", "c++", "-"] if input_text is not None else [str(HERE / source)]
    done = subprocess.run(cmd, input=input_text, capture_output=True, text=True, cwd=HERE)
    errors = "\n".join(ln for ln in done.stderr.splitlines() if "error" in ln)[:3000]
    assert done.returncode == 0, f"{source} does not compile for {target} ({' '.join(TARGETS[target][1])}):\n{errors or done.stderr[-3000:]}"


def test_every_source_is_listed():
    """The build's source list is what the folder holds: a source left out of it would go untested here."""
    on_disk = {p.name for p in HERE.glob("*.cpp")}
    assert on_disk == set(cpu_kernels._SOURCES)
    assert {p.name for p in HERE.glob("*.h")} == set(cpu_kernels._HEADERS)


@pytest.mark.parametrize("target", list(TARGETS))
def test_the_build_runs_the_path_its_target_allows(target):
    """``kBuildMaxIsa`` for each target's build (the CPU's flags then pick at most that, at load)."""
    want = TARGETS[target][3]
    probe = f'#include "isa.h"\nstatic_assert(fastweights::cpu::kBuildMaxIsa == {LEVELS[want]}, "{want}");\n'
    _compile(target, "<level probe>", "-fsyntax-only", input_text=probe)


def test_a_wrong_level_is_caught():
    """The probe above can fail: the same check with a level the target's build does not have."""
    probe = '#include "isa.h"\nstatic_assert(fastweights::cpu::kBuildMaxIsa == 0, "portable");\n'
    with pytest.raises(AssertionError, match="does not compile for sapphirerapids"):
        _compile("sapphirerapids", "<level probe>", "-fsyntax-only", input_text=probe)


def test_the_amx_source_compiles_for_an_amx_target():
    """The bf16-products forward (oneDNN brgemm on AMX tiles, the vdpbf16ps micro-kernel) for
    Sapphire Rapids: its AMX and AVX-512 branches are the ones compiled."""
    _compile("sapphirerapids", "chunk_delta_bf16.cpp", "-fsyntax-only")


@pytest.mark.slow
@pytest.mark.parametrize("source", cpu_kernels._SOURCES)
@pytest.mark.parametrize("target", list(TARGETS))
def test_every_source_compiles_for_every_target(target, source, tmp_path):
    """Every source to an object at ``-O3`` (code generation included) for every target."""
    _compile(target, source, "-c", "-o", str(tmp_path / "out.o"))
