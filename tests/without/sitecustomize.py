"""Makes the packages named in $KDTREE_WITHOUT (comma-separated top-level names) look
uninstalled to this interpreter and its children: put this directory first on PYTHONPATH.

Every import finder answers None for them, so `import name` raises ModuleNotFoundError
("No module named ...") and `importlib.util.find_spec(name)` is None, as where the
package is absent. tests/test_optional_dependencies.py runs test modules under it.
"""

from __future__ import annotations

import os
import sys

HIDDEN = frozenset(filter(None, os.environ.get("KDTREE_WITHOUT", "").split(",")))


class _Without:
    """A meta-path finder that answers None for the hidden packages and defers to `finder` otherwise."""

    def __init__(self, finder: object) -> None:
        self.finder = finder

    def find_spec(self, name: str, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name: str):
        return getattr(self.finder, name)


if HIDDEN:
    sys.meta_path[:] = [_Without(finder) for finder in sys.meta_path]
