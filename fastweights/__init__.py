"""fastweights: sequence memories that learn while they read.

``fastweights.ops`` holds the functional solvers (softmax attention, linear
attention, the delta rule and the gated delta rule) in recurrent, parallel and
chunk forms, all proven equal to a float64 recurrence in the test suite.
The rooms: ``ops`` → ``layers`` → ``models``; ``training``, ``tasks``, ``hf``,
``io`` (the checkpoint files), ``studies``, ``lab``; ``cli`` with ``commands``; ``config`` (the shared
dataclass and flag system). The benchmarks are ``benchmarks/`` beside the package (not installed).
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)

from . import ops

# Module paths from before the package had rooms (``fastweights.train``, ``fastweights.checkpoint``, ...)
# are small modules of their own that warn and forward to the new path; nothing is installed on import.


def __getattr__(name):
    # ``fastweights.tune_cpu_allocator`` without importing the training room on ``import fastweights``
    if name == "tune_cpu_allocator":
        from .training.allocator import tune_cpu_allocator

        return tune_cpu_allocator
    raise AttributeError(f"module 'fastweights' has no attribute {name!r}")


__all__ = ["ops", "tune_cpu_allocator", "__version__"]
