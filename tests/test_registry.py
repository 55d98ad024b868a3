"""The runtime's hook registry, without vLLM: the table is complete, the mechanism installs
only what the table selects, every problem is collected into one refusal, and no hook
reads a vLLM argument by position or writes into vLLM outside the registry.

The same registry against vLLM's real classes, per release: tests/conformance/test_runtime_cpu.py
(`removed_entry_untouched`, `hooks_unmarked`, `contract_problems`)."""

from __future__ import annotations

import ast
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from capplan.releases import MORE, RELEASES, A
from capplan.runtime import registry
from capplan.runtime.hooking import MARK, Call, Hook, Need, binder, install_one, signature_problem

RUNTIME = Path(__file__).resolve().parents[1] / "src" / "capplan" / "runtime"
HOOK_MODULES = sorted([*RUNTIME.glob("hooks/*.py"), *RUNTIME.glob("deferred/*.py"), RUNTIME / "hooking.py"])


def test_every_entry_has_its_signature_in_every_release_row_it_applies_to():
    for version, release in RELEASES.items():
        for hook in registry.entries(release):
            assert hook.target in release.signatures, (version, hook.name)
            want = hook.expected(release)
            named = want[:-1] if want and want[-1] == MORE else want
            assert set(hook.reads) <= set(named), (version, hook.name, hook.reads)
    targets = {h.target for h in registry.REGISTRY} | {registry.dp.GUARD.target}
    for version, release in RELEASES.items():
        applying = {h.target for h in registry.entries(release)} | {registry.dp.GUARD.target}
        assert applying <= set(release.signatures) <= targets, version  # no row keeps a signature no hook binds


def test_entry_names_are_unique_in_the_table():
    """One entry per hook: where releases differ, the entry reads the release's row (`Hook.on`)."""
    names = [h.name for h in registry.REGISTRY]
    assert len(names) == len(set(names))
    for release in RELEASES.values():
        assert all(isinstance(h.attributes, tuple) for h in registry.entries(release))


# -- the mechanism, on a stand-in module ---------------------------------------------------
def _fake_vllm(monkeypatch):
    module = types.ModuleType("fake_vllm_for_registry")

    class Manager:
        def dispatch(self, num_reqs, num_tokens, uniform=None):
            return ("vllm", num_reqs, num_tokens, uniform)

        @classmethod
        def make(cls, n):
            return ("made", n)

    def free(a, b, *, flag=False):
        return ("free", a, b, flag)

    module.Manager, module.free = Manager, free
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _row(module):
    name = module.__name__
    return replace(
        RELEASES["0.25.0"],
        version="9.9.9",
        rules=A,
        signatures={
            f"{name}:Manager.dispatch": ("self", "num_reqs", "num_tokens", "uniform"),
            f"{name}:Manager.make": ("n",),
            f"{name}:free": ("a", "b", MORE),
        },
    )


def _wrap(tag):
    def installer(ctx, hook, original):
        bind = binder(original)

        def replacement(*args, **kwargs):
            call = bind(args, kwargs)
            return (
                tag,
                call["num_reqs"] if "num_reqs" in call.bound.signature.parameters else None,
                original(*args, **kwargs),
            )

        return replacement

    return installer


def _table(module):
    name = module.__name__
    return (
        Hook("t.dispatch", f"{name}:Manager.dispatch", "test", _wrap("d"), reads=("num_reqs",)),
        Hook("t.make", f"{name}:Manager.make", "test", _wrap("m")),
        Hook("t.free", f"{name}:free", "test", _wrap("f")),
        Hook("t.relied", f"{name}:free", "relied on only"),
    )


@pytest.mark.parametrize("removed", ["t.dispatch", "t.make", "t.free"])
def test_removing_an_entry_removes_its_hook_and_only_it(monkeypatch, removed):
    module = _fake_vllm(monkeypatch)
    release = _row(module)
    originals = {
        "t.dispatch": module.Manager.dispatch,
        "t.make": module.Manager.__dict__["make"],
        "t.free": module.free,
    }
    table = tuple(h for h in _table(module) if h.name != removed)
    need = Need(release, None, {})  # type: ignore[arg-type]  # these entries read no plan
    hooks = registry.selected(need, table)
    assert registry.problems(hooks, release) == []
    for hook in hooks:
        if hook.install is not None:
            install_one(hook, None)  # type: ignore[arg-type]  # these installers read no hook context
    live = {"t.dispatch": module.Manager.dispatch, "t.make": module.Manager.__dict__["make"], "t.free": module.free}
    assert live[removed] is originals[removed]
    for name, fn in live.items():
        if name != removed:
            assert getattr(fn.__func__ if isinstance(fn, classmethod) else fn, MARK) == name
    assert isinstance(module.Manager.__dict__["make"], classmethod)  # a classmethod stays one
    if removed != "t.dispatch":  # positional and keyword calls bind alike
        m = module.Manager()
        assert m.dispatch(2, 8) == m.dispatch(num_tokens=8, num_reqs=2) == ("d", 2, ("vllm", 2, 8, None))


def test_every_problem_is_collected_before_anything_is_installed(monkeypatch):
    module = _fake_vllm(monkeypatch)
    name = module.__name__
    release = replace(
        _row(module),
        signatures={
            f"{name}:Manager.dispatch": ("self", "num_reqs", "tokens"),  # vLLM "renamed" num_tokens
            f"{name}:Manager.make": ("n",),
            f"{name}:free": ("a", "c", MORE),  # and b
            f"{name}:gone": ("x",),
        },
    )
    table = (*_table(module)[:3], Hook("t.gone", f"{name}:gone", "a function vLLM removed", _wrap("g")))
    found = registry.problems(list(table), release)
    assert [p.split(":")[0] for p in found] == ["t.dispatch", "t.free", "t.gone"]
    assert "expected ('self', 'num_reqs', 'tokens')" in found[0] and "and more" in found[1]
    assert "vLLM has no" in found[2]


def test_where_a_replacement_goes_is_checked_with_the_rest(monkeypatch):
    """An entry whose replacement goes into a module that imported the target by name (`at`):
    that module no longer having the name is a problem found before anything is installed."""
    module = _fake_vllm(monkeypatch)
    name = module.__name__
    moved = Hook("t.moved", f"{name}:free", "test", _wrap("f"), at=f"{name}:free_as_imported")
    found = registry.problems([*_table(module)[:2], moved], _row(module))
    assert len(found) == 1 and found[0].startswith(f"t.moved: vLLM has no {name}:free_as_imported, where")
    module.free_as_imported = module.free
    assert registry.problems([moved], _row(module)) == []


def test_an_install_failing_halfway_puts_back_what_it_had_installed(monkeypatch):
    """vLLM is hooked by every entry or by none: where the third installer fails, the two
    already in place are put back (the classmethod as a classmethod) and the error goes on."""
    from capplan.runtime.hooking import install_all

    module = _fake_vllm(monkeypatch)
    name = module.__name__
    originals = (module.Manager.__dict__["dispatch"], module.Manager.__dict__["make"], module.free)

    def broken(ctx, hook, original):
        raise RuntimeError("installer failed")

    table = [*_table(module)[:2], Hook("t.broken", f"{name}:free", "test", broken)]
    with pytest.raises(RuntimeError, match="installer failed"):
        install_all(table, None)
    assert (module.Manager.__dict__["dispatch"], module.Manager.__dict__["make"], module.free) == originals
    assert module.Manager().dispatch(2, 8) == ("vllm", 2, 8, None) and module.Manager.make(3) == ("made", 3)
    install_all(list(_table(module)), None)  # and installs whole when nothing fails
    assert getattr(module.free, MARK) == "t.free" and module.Manager().dispatch(2, 8)[0] == "d"


def test_a_hook_on_an_inherited_method_is_put_back_by_removing_it(monkeypatch):
    from capplan.runtime.hooking import install_all

    module = _fake_vllm(monkeypatch)

    class Child(module.Manager):
        pass

    module.Child = Child
    name = module.__name__
    hook = Hook("t.child", f"{name}:Child.dispatch", "test", _wrap("c"))

    def broken(ctx, hook, original):
        raise RuntimeError("installer failed")

    with pytest.raises(RuntimeError):
        install_all([hook, Hook("t.broken", f"{name}:free", "test", broken)], None)
    assert "dispatch" not in vars(Child) and Child().dispatch(1, 2) == ("vllm", 1, 2, None)


def test_a_parameter_a_hook_reads_must_be_in_the_signature(monkeypatch):
    module = _fake_vllm(monkeypatch)
    hook = Hook("t.reads", f"{module.__name__}:Manager.dispatch", "test", _wrap("d"), reads=("num_active_loras",))
    problem = signature_problem(hook, _row(module))
    assert problem is not None and "no parameter num_active_loras" in problem


def test_a_call_reads_defaults_and_writes_by_name():
    def vllm_fn(self, a, b=3, *, c=None):
        return (a, b, c)

    import inspect

    call = Call(inspect.signature(vllm_fn), ("s", 1), {})
    assert (call["a"], call["b"], call["c"]) == (1, 3, None)
    call["b"] = 7
    assert call.copy().run(vllm_fn) == (1, 7, None) and call.run(vllm_fn) == (1, 7, None)


# -- structure: by name only, and the registry alone patches vLLM --------------------------
def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def positional_reads(source: str) -> list[str]:
    """Where a function subscripts, slices or measures its own *args: reading a vLLM argument by position."""
    found = []
    for fn in _functions(ast.parse(source)):
        if fn.args.vararg is None:
            continue
        name = fn.args.vararg.arg
        for node in ast.walk(fn):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name:
                found.append(f"{fn.name}:{node.lineno}: {name}[...]")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "len" and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Name) and arg.id == name:
                    found.append(f"{fn.name}:{node.lineno}: len({name})")
    return found


def test_the_positional_read_detector_catches_one():
    bad = (
        "def execute_model(self, scheduler_output, *args, **kwargs):\n    return args[1] if len(args) > 1 else False\n"
    )
    assert len(positional_reads(bad)) == 2
    assert positional_reads("def f(*args, **kwargs):\n    call = bind(args, kwargs)\n    return call['x']\n") == []


@pytest.mark.parametrize("path", HOOK_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_hook_reads_a_vllm_argument_by_position(path):
    assert positional_reads(path.read_text()) == []


def writes_into_vllm(source: str) -> list[str]:
    """Assignments to an attribute of something imported from vLLM (a module or class)."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("vllm")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            imported |= {a.asname or a.name for a in node.names}
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        )
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


def test_the_write_detector_catches_one():
    assert writes_into_vllm("import vllm.v1.worker.gpu.cudagraph_utils as cg\ncg.graph_capture = f\n") == [
        "2: cg.graph_capture"
    ]


@pytest.mark.parametrize("path", sorted(RUNTIME.rglob("*.py")), ids=lambda p: str(p.relative_to(RUNTIME)))
def test_nothing_but_the_registry_writes_into_vllm(path):
    assert writes_into_vllm(path.read_text()) == []
