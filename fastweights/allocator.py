"""The allocator module's path before the package had rooms (now :mod:`fastweights.training.allocator`).

Importing ``fastweights.allocator`` warns once (a DeprecationWarning); the names are those of ``fastweights.training.allocator``.
"""

import warnings

warnings.warn("`fastweights.allocator` moved to `fastweights.training.allocator`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from .training.allocator import *  # noqa: E402, F403
