"""``python -m fastweights.ops.cpu``: build the compiled CPU kernels now (``make setup`` runs it)."""

import sys

from . import build, status

if __name__ == "__main__":
    build(verbose="-v" in sys.argv)
    print(status())
