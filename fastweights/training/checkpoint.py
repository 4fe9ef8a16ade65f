"""The checkpoint module's path before the checkpoint files had their own room (:mod:`fastweights.io`).

Importing ``fastweights.training.checkpoint`` warns once (a DeprecationWarning); the names are those of ``fastweights.io.checkpoint``.
"""

import warnings

warnings.warn("`fastweights.training.checkpoint` moved to `fastweights.io.checkpoint`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from ..io.checkpoint import *  # noqa: E402, F403
from .train_state import tokenizer_of  # noqa: E402,F401  (it was here too)
