"""The LM benchmark's module path before the package had rooms (now ``fastweights.bench.lm_speed``).

Importing ``fastweights.lm_bench`` warns once (a DeprecationWarning); the names are those of ``fastweights.bench.lm_speed``.
"""

import warnings

warnings.warn("`fastweights.lm_bench` moved to `fastweights.bench.lm_speed`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from .bench.lm_speed import *  # noqa: E402,F401,F403
