"""Work waiting for a module's import (capplan.runtime.imports): it runs right after the module's
code, before any importer binds a name from it; what it raises fails that import; a module that is
imported already gets it at once; the module's loader still answers for its source."""

from __future__ import annotations

import inspect
import sys
import textwrap

import pytest

from capplan.runtime import imports


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh module `waited_<n>` on sys.path, with a function `f`, and another that imports `f` by
    name; none imported yet."""
    names = []

    def make(tag: str) -> str:
        name = f"waited_{tag}"
        (tmp_path / f"{name}.py").write_text("def f():\n    return 'vllm'\n")
        (tmp_path / f"{name}_user.py").write_text(f"from {name} import f as bound\n")
        names.append(name)
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for name in names:
        for mod in (name, f"{name}_user"):
            sys.modules.pop(mod, None)
        imports._WAITING.pop(name, None)


def test_work_runs_after_the_module_and_before_a_name_is_bound_from_it(package):
    name = package("bound")

    def hook() -> None:
        module = sys.modules[name]
        module.f = lambda: "hooked"

    imports.when_imported(name, hook)
    assert name in imports.waiting() and name not in sys.modules
    user = __import__(f"{name}_user")  # imports the module by name: gets the hooked function
    assert user.bound() == "hooked"
    assert name not in imports.waiting()
    assert "return 'vllm'" in inspect.getsource(sys.modules[name])  # the loader's source, through the wrapper


def test_what_the_work_raises_fails_the_import(package):
    name = package("refused")

    def refuse() -> None:
        raise RuntimeError("capplan: refused")

    imports.when_imported(name, refuse)
    with pytest.raises(RuntimeError, match="capplan: refused"):
        __import__(name)
    assert name not in sys.modules


def test_an_imported_module_gets_the_work_at_once(package):
    name = package("now")
    __import__(name)
    ran = []
    imports.when_imported(name, lambda: ran.append(1))
    assert ran == [1] and name not in imports.waiting()


def test_work_waits_in_order_and_runs_once(package):
    name = package("order")
    ran: list[str] = []
    imports.when_imported(name, lambda: ran.append("first"))
    imports.when_imported(name, lambda: ran.append("second"))
    __import__(name)
    sys.modules.pop(name)
    __import__(name)  # imported again: nothing waits any more
    assert ran == ["first", "second"]


def test_a_module_nothing_waits_for_is_not_touched(package):
    name = package("untouched")
    other = package("other")
    imports.when_imported(other, lambda: None)
    module = __import__(name)
    assert type(module.__loader__).__name__ != "_Then"
    assert textwrap.dedent(inspect.getsource(module.f)).startswith("def f")
