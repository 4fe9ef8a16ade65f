import os

# Triton decides when it is first imported whether kernels compile for a GPU or run on
# numpy (TRITON_INTERPRET=1). Without an NVIDIA driver the interpreter is the only way
# to run them, so decide before any test (or torch) can import triton.
if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/proc/driver/nvidia/version"):
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same RNG state, so failures reproduce."""
    torch.manual_seed(0)
    yield
