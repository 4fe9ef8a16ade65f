"""Training speed of the delta rule's chunk path: recurrent vs textbook chunk vs fast chunk.

Usage (repository root)::

    python benchmarks/chunk_speed.py                  # T = 512, 2048, 8192; 2 threads; JSON to benchmarks/results/
    python benchmarks/chunk_speed.py --long           # also 1,000,000 tokens streamed in pieces
    python benchmarks/chunk_speed.py --device cuda    # the same code on CUDA tensors

Same as ``fastweights bench``; ``fastweights/bench.py`` documents what is measured
(FLOP count, memory measure, baselines).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastweights.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
