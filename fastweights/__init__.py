"""fastweights: sequence memories that learn while they read.

``fastweights.ops`` holds the functional solvers (softmax attention, linear
attention, the delta rule and the gated delta rule) in recurrent, parallel and
chunk forms, all proven equal to a float64 recurrence in the test suite.
The rooms: ``ops`` → ``layers`` → ``models``; ``training``, ``tasks``, ``hf``,
``studies``, ``lab``, ``bench``; ``cli`` with ``commands``; ``config`` (the shared
dataclass and flag system).
"""

__version__ = "0.1.0"  # the one place the version is written (pyproject reads it)

import importlib as _importlib
import importlib.abc as _importlib_abc
import importlib.util as _importlib_util
import sys as _sys
import warnings as _warnings

from . import ops

#: Module paths from before the package had rooms, and where each one lives now. Importing an
#: old path still works (it is the new module, under the old name too) and warns once.
MOVED_MODULES = {
    "fastweights.train": "fastweights.training",
    "fastweights.checkpoint": "fastweights.training",
    "fastweights.run_folder": "fastweights.training",
    "fastweights.allocator": "fastweights.training.allocator",
    "fastweights.examples": "fastweights.studies.worked_examples",
    "fastweights.lm_bench": "fastweights.bench.lm_speed",
}


class _MovedModuleFinder(_importlib_abc.MetaPathFinder, _importlib_abc.Loader):
    """Finds the old dotted names of :data:`MOVED_MODULES`; loading one imports the new module
    (lazily: nothing moves until an old name is imported) and warns with a DeprecationWarning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return _importlib_util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        _warnings.warn(f"`{spec.name}` moved to `{new}`; import it from there (the old path will be removed)",
                       DeprecationWarning, stacklevel=2)
        return _importlib.import_module(new)

    def exec_module(self, module):
        """Nothing to run: :meth:`create_module` returned the new module, already executed."""


# First in line: it answers only the old names, and a finder of an older editable install
# would otherwise map them to files that are gone.
if not any(isinstance(f, _MovedModuleFinder) for f in _sys.meta_path):
    _sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name):
    # ``fastweights.tune_cpu_allocator`` without importing the training room on ``import fastweights``
    if name == "tune_cpu_allocator":
        from .training.allocator import tune_cpu_allocator

        return tune_cpu_allocator
    raise AttributeError(f"module 'fastweights' has no attribute {name!r}")


__all__ = ["ops", "tune_cpu_allocator", "MOVED_MODULES", "__version__"]
