"""The checkpoint module's path before the package had rooms (now :mod:`fastweights.io.checkpoint`).

Importing ``fastweights.checkpoint`` warns once (a DeprecationWarning); the names are those of ``fastweights.io.checkpoint``.
"""

import warnings

warnings.warn("`fastweights.checkpoint` moved to `fastweights.io.checkpoint`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from .io.checkpoint import *  # noqa: E402, F403
from .training.train_state import tokenizer_of  # noqa: E402,F401  (it was here too)
