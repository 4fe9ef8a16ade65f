"""The benchmarks' path before they moved beside the package: they are ``benchmarks/`` at the top of
a checkout now, run with ``python -m benchmarks.run NAME``. This module was the chunk-speed benchmark.

Importing ``fastweights.bench`` warns once (a DeprecationWarning) and needs a checkout: the
benchmarks are not installed with the package.
"""

import warnings

warnings.warn("`fastweights.bench` moved to `benchmarks.chunk_speed` (the benchmarks are benchmarks/ beside the package: "
              "python -m benchmarks.run NAME); import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from benchmarks.chunk_speed import *  # noqa: E402, F403
