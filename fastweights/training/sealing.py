"""The sealing module's path before the checkpoint files had their own room (:mod:`fastweights.io`).

Importing ``fastweights.training.sealing`` warns once (a DeprecationWarning); the names are those of ``fastweights.io.sealing``.
"""

import warnings

warnings.warn("`fastweights.training.sealing` moved to `fastweights.io.sealing`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from ..io.sealing import *  # noqa: E402, F403
