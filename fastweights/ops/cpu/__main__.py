"""``python -m fastweights.ops.cpu``: build the compiled CPU kernels now (``make setup`` runs it)
and print which path each kernel takes, and why."""

import sys

from . import build, kernel_report, status

if __name__ == "__main__":
    build(verbose="-v" in sys.argv)
    print(status())
    for kernel, path in kernel_report().items():
        print(f"  {kernel}: {path}")
