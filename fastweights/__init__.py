"""fastweights: sequence memories that learn while they read.

``fastweights.ops`` holds the functional solvers (softmax attention, linear
attention, the delta rule and the gated delta rule) in recurrent, parallel and
chunk forms, all proven equal to a float64 recurrence in the test suite.
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)

from . import ops  # noqa: F401
from .allocator import tune_cpu_allocator  # noqa: F401  (not called on import; see its docstring)
