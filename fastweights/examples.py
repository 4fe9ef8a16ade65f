"""The worked examples' module path before the package had rooms (now :mod:`fastweights.studies.worked_examples`).

Importing ``fastweights.examples`` warns once (a DeprecationWarning); the names are those of ``fastweights.studies.worked_examples``.
"""

import warnings

warnings.warn("`fastweights.examples` moved to `fastweights.studies.worked_examples`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from .studies.worked_examples import *  # noqa: E402, F403
from .studies.worked_examples import __getattr__  # noqa: E402,F401  (its earlier function names, with their own warning)
