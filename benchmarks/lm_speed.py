"""Speed of the LM per mixer (DeltaNet, Gated DeltaNet, linear, softmax): training step and decoding step.

Usage (repository root)::

    python benchmarks/lm_speed.py            # train T = 256/2048/8192, decode after 256/4096/32768; 2 threads
    python benchmarks/lm_speed.py --quick    # a short run that checks that everything runs

Same as ``fastweights bench --lm``; ``fastweights/lm_bench.py`` documents what is
measured. Writes ``benchmarks/results/lm_speed.json``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fastweights.lm_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
