"""The training module's path before the package had rooms (now :mod:`fastweights.training`).

Importing ``fastweights.train`` warns once (a DeprecationWarning); the names are those of ``fastweights.training``.
"""

import warnings

warnings.warn("`fastweights.train` moved to `fastweights.training`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from .training import *  # noqa: E402, F403
from .tasks import RecallData, TextData, make_task, step_generator  # noqa: E402,F401  (it had the data sources too)
