"""Names that moved out of a module, still found under the old path with a DeprecationWarning.

The public op functions moved from the forms' modules (``recurrent.py``, ``parallel.py``,
``chunk.py``) to their family's ``api.py``, so that a call visits each module once on its way down
(docs/design.md, "The path of a call"). ``from fastweights.ops.delta_rule.chunk import
chunk_delta_rule`` keeps working: the old module's ``__getattr__`` (PEP 562) finds the name in the
new module when it is asked for, after both are loaded, and warns, as the old module paths of the
package do. Nothing is imported when the old module loads, so the forms' modules never import the
module that imports them.
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["moved_names"]


def moved_names(old_module: str, new_module: str, *names: str):
    """The ``__getattr__`` of ``old_module`` for ``names``, which now live in ``new_module``."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        warnings.warn(f"{old_module}.{name} moved to {new_module}.{name}; "
                      f"the old path will be removed", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(new_module), name)

    return __getattr__
