"""The LM benchmark's module path before the package had rooms (now ``benchmarks/lm_speed.py`` of a
checkout, run with ``python -m benchmarks.run lm_speed``).

Importing ``fastweights.lm_bench`` warns once (a DeprecationWarning) and needs a checkout: the
benchmarks are not installed with the package.
"""

import warnings

warnings.warn("`fastweights.lm_bench` moved to `benchmarks.lm_speed`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from benchmarks.lm_speed import *  # noqa: E402, F403
