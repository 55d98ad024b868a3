"""Work that waits for a vLLM module to be imported in this process.

vLLM loads its general plugins in every process, the API server's among them, which never
imports the model runner, the worker or the LoRA layers. Hooking those where they are not
imported would import them there: hundreds of modules and about 2 s before vLLM's first log
line at 8B on an H100 (`tests/gpu/results/startup/0.33.0-h100/pairs/`). So the hooks of a
module that is not imported yet wait for its import: `when_imported` runs them right after the
module's code has run, before the import returns to whoever asked for it (no `from M import f`
can bind the unhooked `f`). A process forked from this one (vLLM's engine core under the
default multiprocessing) inherits what is still waiting, and runs it at its own import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, cast

__all__ = ["module_of", "waiting", "when_imported"]

_WAITING: dict[str, list[Callable[[], None]]] = {}


def module_of(path: str) -> str:
    """The module of a "module:qualname" path."""
    return path.partition(":")[0]


def when_imported(module: str, then: Callable[[], None]) -> None:
    """Run `then` now if `module` is imported in this process, else right after its import; what
    `then` raises fails that import (the module stays unimported) and goes to its importer."""
    if module in sys.modules:
        then()
        return
    _WAITING.setdefault(module, []).append(then)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def waiting() -> list[str]:
    """The modules whose import some work still waits for."""
    return sorted(_WAITING)


class _AfterImport:
    """A finder that finds nothing itself: for a module some work waits for, it asks the finders
    after it and wraps the loader of what they found."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname not in _WAITING:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = cast("Loader", _Then(spec.loader, fullname))  # the loader's, and then some
        return spec


class _Then:
    """The module's own loader, then the work waiting for it. Everything else (source, file name,
    resources) is the loader's."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for then in _WAITING.pop(self._name, []):
            then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
