"""``tune_cpu_allocator`` keeps freed memory in the process: the chunk forward stops faulting pages in."""

import json
import os
import subprocess
import sys

import pytest

from fastweights.training.allocator import tune_cpu_allocator

CHILD = r"""
import json, resource, sys, torch
import fastweights
from fastweights.ops import chunk_delta_rule
torch.set_num_threads(1)
if sys.argv[1] == "tuned":
    assert fastweights.tune_cpu_allocator()
else:  # pin glibc's initial thresholds (128 KiB), which it would otherwise raise by itself at some point
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 128 * 1024) and libc.mallopt(-1, 128 * 1024)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2048, 4, 64, generator=g) for _ in range(3))
k = torch.nn.functional.normalize(k, dim=-1)
beta = torch.rand(1, 2048, 4, generator=g)
with torch.no_grad():
    for _ in range(3):
        chunk_delta_rule(q, k, v, beta)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        chunk_delta_rule(q, k, v, beta)
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5))
"""


def faults_per_call(mode: str) -> float:
    """Page faults per forward on the PyTorch path (the compiled CPU kernels, which allocate only
    their outputs per call, are turned off: the tuning is for the path that makes intermediates)."""
    env = dict(os.environ, FASTWEIGHTS_CPU_KERNELS="0")
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=300, check=True,
                         env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt: Linux only")
def test_tuned_allocator_stops_page_faults_in_the_chunk_forward():
    default, tuned = faults_per_call("initial"), faults_per_call("tuned")
    print(f"page faults per chunk_delta_rule forward (T=2048, H=4, K=V=64): glibc's initial thresholds "
          f"{default:.0f}, tuned {tuned:.0f}")
    assert default > 1000  # ~8,000 here: every large intermediate is faulted in afresh
    assert tuned < 400 and 10 * tuned < default  # 0-80 here


def test_tune_cpu_allocator_is_idempotent():
    first = tune_cpu_allocator()
    assert tune_cpu_allocator() is first
    assert first is (sys.platform.startswith("linux") and first)  # a bool, False off Linux
