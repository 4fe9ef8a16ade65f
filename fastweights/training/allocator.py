"""Keep freed CPU memory in the process: a large, measured speed-up of the CPU paths.

glibc's ``malloc`` serves large blocks with ``mmap`` and gives freed memory back to
the kernel (``munmap``, heap trimming). A chunk-form forward allocates and frees
megabyte-sized intermediates; when they go back to the kernel, the next call
faults every page in again (zero-filled, 4 KiB at a time). On the 2-core
development machine, ``chunk_delta_rule`` at B=1, T=2048, H=4, K=V=64 in fp32
(2 threads) took 8.3–9.2 ms per forward in a fresh process with the defaults
(≈3,000 page faults per call) and 5.3–5.9 ms with :func:`tune_cpu_allocator`
(≈10 faults per call); forward+backward 18.6–19.5 ms vs 17.4–17.5 ms.

glibc raises its thresholds by itself once a process has freed a few large
blocks, so long-running jobs with big tensors often reach the fast state anyway;
this makes it immediate and deterministic. The cost: freed memory stays with the
process (resident size stays near its peak) instead of going back to the system.

Nothing here runs on ``import fastweights``: a library should not change process-wide
settings behind its user's back. The ``fastweights`` command calls it (train,
bench, demo, studies); call it yourself in your own training script, or get the
same effect with ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` in the
environment, or by preloading jemalloc/tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

#: Blocks up to this size come from the heap, not fresh mmaps (glibc's own dynamic ceiling).
MMAP_THRESHOLD = 32 * 2**20
#: Free memory at the top of the heap kept instead of trimmed.
TRIM_THRESHOLD = 1024 * 2**20

_state = {"tuned": None}


def tune_cpu_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring); idempotent.

    Returns True when the settings were applied (Linux with glibc), False elsewhere
    (macOS, Windows, musl), where it does nothing.
    """
    if _state["tuned"] is not None:
        return _state["tuned"]
    ok = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            mallopt(_M_TOP_PAD, 64 * 2**20)
        except (OSError, AttributeError):
            ok = False
    _state["tuned"] = ok
    return ok
