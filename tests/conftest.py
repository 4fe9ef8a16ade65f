import os
import sys

# The tests live in one folder per room (tests/ops, tests/layers, ...); every one of them
# imports the shared helpers as `from helpers import ...`, so this folder goes on the path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Triton decides when it is first imported whether kernels compile for a GPU or run on
# numpy (TRITON_INTERPRET=1). Without an NVIDIA driver the interpreter is the only way
# to run them, so decide before any test (or torch) can import triton.
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/proc/driver/nvidia/version"):
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same RNG state, so failures reproduce."""
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tests on tiny tensors.

    With matrices this small a second thread only adds synchronization, and on a
    shared, busy machine it stalls every op; the caller's setting is restored.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def kernels():
    """The compiled CPU kernels' module; skips where no C++ compiler exists (the PyTorch path
    runs there, and its own tests cover it) and fails if a compiler exists but the build does not."""
    from fastweights.ops import cpu as cpu_kernels
    from helpers import HAS_COMPILER

    if not HAS_COMPILER:
        pytest.skip("no C++ compiler: the PyTorch path runs")
    assert cpu_kernels.available(), cpu_kernels.status()
    return cpu_kernels.kernels()


@pytest.fixture
def bf16_kernels(monkeypatch):
    """The ops under ``bf16_products()`` take the bf16 kernels on every ISA path, also where the
    path has no bf16 unit (``avx2``, ``portable``), where the chunk ops otherwise drop the mode
    (``fastweights.ops.cpu.bf16_unit``): so the bf16 kernels' widened-operand code is tested there."""
    from fastweights.ops import cpu as cpu_kernels

    monkeypatch.setattr(cpu_kernels, "bf16_unit", lambda: True)
    yield


@pytest.fixture
def kernels_on():
    """Skips where the compiled CPU kernels are unavailable; restores their default switch after."""
    from fastweights.ops import cpu as cpu_kernels

    if cpu_kernels.kernels() is None:
        pytest.skip(f"compiled CPU kernels unavailable: {cpu_kernels.status()}")
    yield
    cpu_kernels.set_enabled(None)
