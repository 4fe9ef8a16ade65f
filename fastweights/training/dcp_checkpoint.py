"""The sharded checkpoints' module path before the checkpoint files had their own room (:mod:`fastweights.io`).

Importing ``fastweights.training.dcp_checkpoint`` warns once (a DeprecationWarning); the names are those of ``fastweights.io.dcp_checkpoint``.
"""

import warnings

warnings.warn("`fastweights.training.dcp_checkpoint` moved to `fastweights.io.dcp_checkpoint`; import it from there (the old path will be removed)",
              DeprecationWarning, stacklevel=2)

from ..io.dcp_checkpoint import *  # noqa: E402, F403
