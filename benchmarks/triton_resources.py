"""Shared memory, registers and spills of every Triton kernel × config, compiled for sm_90 on the CPU.

Usage (repository root; no GPU needed, Triton installed)::

    python -m benchmarks.run triton_resources --json docs/results/triton_resources.json
    python -m benchmarks.run triton_resources --quick          # one cheap kernel, seconds

For every kernel of ``fastweights/ops/triton`` × every autotune configuration
the launchers can pick × input dtype (bf16, fp32) × K = V ∈ {64, 128, 256} ×
{plain, gated}, it builds the kernel's signature as the launcher would call it,
compiles it ahead of time for ``GPUTarget("cuda", 90, 32)`` (Hopper) with
``triton.compile(ASTSource(...))``, and reads

- ``shared``: dynamic shared memory per block (``metadata.shared``), which must
  be at most 232,448 bytes on sm_90 or the launch raises OutOfResources;
- ``regs``, ``spill_store``, ``spill_load``: from Triton's bundled ``ptxas -v``
  on the generated PTX (bytes per thread).

It prints a table, writes JSON (``--json``) and exits with status 1 when a
config does not fit the shared memory, or (``--max-spill B``) spills more than
B bytes per thread at K = V = 128 bf16.

Compiling one config takes 20-200 s on one core, so results are cached on disk
(``--cache``, default ``docs/results/.triton_resources_cache/``, git-ignored),
keyed by the kernel's source hash (Triton's ``cache_key``, which covers the
kernel and every ``@triton.jit`` helper it calls), the signature, the
constexprs, the config and the Triton version. Compiles run one after another
(the machine is shared; run it in the background).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from fastweights.config import atomic_write_text, flag

ROOT = Path(__file__).resolve().parents[1]  # the repository (results are written under it)

SM90_SHARED_LIMIT = 232_448  # bytes of dynamic shared memory per block on sm_90
DEFAULT_CACHE = ROOT / "docs" / "results" / ".triton_resources_cache"
TORCH_TO_TRITON = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


@dataclass
class Case:
    """One compile: a kernel, its argument types, constexprs and launch config."""

    kernel: str
    fn: object
    dtype: str
    dim: int
    gated: bool
    signature: Dict[str, str]
    constexprs: Dict[str, object]
    num_warps: int
    num_stages: int
    result: Dict[str, object] = field(default_factory=dict)

    @property
    def config(self) -> str:
        return f"w{self.num_warps}s{self.num_stages}"

    def key(self) -> str:
        import triton

        payload = json.dumps(
            [self.fn.cache_key, self.kernel, sorted(self.signature.items()),
             sorted((k, str(v)) for k, v in self.constexprs.items()), self.num_warps, self.num_stages,
             triton.__version__],
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _signature(fn, types: Dict[str, str], constexprs: Dict[str, object]) -> Dict[str, str]:
    """Every parameter of ``fn`` in order: its type from ``types``, or ``constexpr``."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:
            raise KeyError(f"no type given for argument {name!r} of {fn.__name__}")
    return sig


def build_cases(dtypes, dims, gated_modes, kernels: Optional[List[str]] = None) -> List[Case]:
    """Every (kernel, config, dtype, K = V, gated) the launchers can produce, from the launchers' own tables."""
    from fastweights.ops.triton import chunk as launch

    cases = []
    for spec in launch.kernel_specs(dtypes, dims, gated_modes):
        name, fn, dtype, dim, gated, types, constexprs, configs = spec
        if kernels and name not in kernels:
            continue
        types = {k: (TORCH_TO_TRITON[dtype] if v == "*in" else v) for k, v in types.items()}
        sig = _signature(fn, types, constexprs)
        for warps, stages in configs:
            cases.append(Case(name, fn, dtype, dim, gated, sig, constexprs, warps, stages))
    return cases


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas(ptx: str, arch: str) -> Dict[str, int]:
    """Registers and spill bytes per thread from the bundled ``ptxas -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {text[-2000:]}")
    regs = _PTXAS_REGS.search(text)
    spill = _PTXAS_SPILL.search(text)
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "spill_store": int(spill.group(1)) if spill else 0,
        "spill_load": int(spill.group(2)) if spill else 0,
    }


def compile_case(case: Case, cache: Path) -> Dict[str, object]:
    path = cache / f"{case.key()}.json"
    if path.exists():
        return dict(json.loads(path.read_text()), cached=True)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(case.fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in case.signature.items() if t.startswith("*")}  # torch allocations are 16-byte aligned
    src = ASTSource(case.fn, case.signature, case.constexprs, attrs)
    t0 = time.perf_counter()
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": case.num_warps, "num_stages": case.num_stages})
        result = {"shared": int(compiled.metadata.shared), **_ptxas(compiled.asm["ptx"], "sm_90a")}
    except Exception as exc:  # a config that does not compile is a finding, not a crash
        result = {"shared": -1, "regs": -1, "spill_store": -1, "spill_load": -1, "error": repr(exc)[:500]}
    result["compile_s"] = round(time.perf_counter() - t0, 1)
    if "error" in result:  # not cached: the next run tries again
        return dict(result, cached=False)
    atomic_write_text(path, json.dumps(result))
    return dict(result, cached=False)


def _row(c: Case) -> str:
    r = c.result
    fits = "yes" if 0 <= r["shared"] <= SM90_SHARED_LIMIT else "NO"
    return (f"{c.kernel:<14} {'gated' if c.gated else 'plain':<5} {c.dtype:<4} {c.dim:>3} {c.config:<6} "
            f"{r['shared']:>8} {fits:>4} {r['regs']:>4} {r['spill_store']:>6} {r['spill_load']:>6} "
            f"{r['compile_s']:>7}{' (cached)' if r.get('cached') else ''}")


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run triton_resources``."""

    dtypes: str = field(default="bf16,fp32", metadata=flag(help="comma list of bf16, fp16, fp32"))
    dims: str = field(default="64,128,256", metadata=flag(help="comma list of K = V"))
    gated: str = field(default="plain,gated", metadata=flag(help="comma list of plain, gated"))
    kernels: str = field(default="", metadata=flag(help="comma list of kernel names (default: all)"))
    quick: bool = field(default=False, metadata=flag(action="store_true", help="one cheap case (the decode step, fp32, K=V=64)"))
    max_spill: Optional[int] = field(default=None, metadata=flag(
        type=int, help="also fail when a kernel spills more than this many bytes/thread at K=V=128 bf16"))
    cache: Path = field(default=DEFAULT_CACHE, metadata=flag(type=Path, help="the compile cache (default docs/results/.triton_resources_cache/)"))
    json: Optional[Path] = field(default=None, metadata=flag(type=Path, help="where to write the rows (default: print only)"))
    list: bool = field(default=False, metadata=flag(action="store_true", help="list the cases and exit"))


def main(args: Config) -> int:
    # before Triton is first imported (the launchers import it): compile for the GPU, never interpret
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default at run time (silences its warning)
    if args.quick:
        args.dtypes, args.dims, args.gated, args.kernels = "fp32", "64", "plain", "decode_step"
    cases = build_cases(args.dtypes.split(","), [int(d) for d in args.dims.split(",")],
                        [m == "gated" for m in args.gated.split(",")],
                        [k for k in args.kernels.split(",") if k])
    if args.list:
        for c in cases:
            print(c.kernel, c.dtype, c.dim, "gated" if c.gated else "plain", c.config)
        return 0
    print(f"{len(cases)} compiles for sm_90 (cache {args.cache})", flush=True)
    print(f"{'kernel':<14} {'rule':<5} {'dt':<4} {'K=V':>3} {'config':<6} {'shared':>8} {'fits':>4} "
          f"{'regs':>4} {'spillS':>6} {'spillL':>6} {'compile_s':>7}", flush=True)
    bad = []
    for c in cases:
        c.result = compile_case(c, args.cache)
        print(_row(c), flush=True)
        r = c.result
        if "error" in r:
            bad.append(f"{c.kernel} {c.dtype} K=V={c.dim} {c.config}: compile error {r['error']}")
        elif r["shared"] > SM90_SHARED_LIMIT:
            bad.append(f"{c.kernel} {c.dtype} K=V={c.dim} {c.config}: {r['shared']} B shared > {SM90_SHARED_LIMIT}")
        if (args.max_spill is not None and c.dtype == "bf16" and c.dim == 128
                and max(r["spill_store"], r["spill_load"]) > args.max_spill):
            bad.append(f"{c.kernel} {'gated' if c.gated else 'plain'} bf16 K=V=128 {c.config}: spills "
                       f"{max(r['spill_store'], r['spill_load'])} B/thread > {args.max_spill}")
    if args.json:
        import triton

        rows = [dict(kernel=c.kernel, rule="gated" if c.gated else "plain", dtype=c.dtype, K=c.dim, V=c.dim,
                     num_warps=c.num_warps, num_stages=c.num_stages, constexprs={k: str(v) for k, v in c.constexprs.items()},
                     **{k: v for k, v in c.result.items() if k != "cached"}) for c in cases]
        atomic_write_text(args.json, json.dumps(dict(target="cuda sm_90", shared_limit=SM90_SHARED_LIMIT,
                                                     triton=triton.__version__, rows=rows, failures=bad), indent=1))
    for line in bad:
        print("DOES NOT FIT:", line)
    print(f"{len(cases) - len(bad)}/{len(cases)} fit", flush=True)
    return 1 if bad else 0

