"""The run-folder module's path before the package had rooms (now :mod:`fastweights.training.run_folder`).

Importing ``fastweights.run_folder`` warns once (a DeprecationWarning); the names are those of ``fastweights.training.run_folder``.
"""

import warnings

warnings.warn("`fastweights.run_folder` moved to `fastweights.training.run_folder`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from .training.run_folder import *  # noqa: E402, F403
from .training.signals import StopSignals  # noqa: E402,F401  (it was here too)
