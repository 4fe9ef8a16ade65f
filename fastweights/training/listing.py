"""The listing module's path before the checkpoint files had their own room (:mod:`fastweights.io`).

Importing ``fastweights.training.listing`` warns once (a DeprecationWarning); the names are those of ``fastweights.io.listing``.
"""

import warnings

warnings.warn("`fastweights.training.listing` moved to `fastweights.io.listing`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from ..io.listing import *  # noqa: E402, F403
