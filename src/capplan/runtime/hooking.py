"""How capplan hooks vLLM: one entry per hook, checked before any is installed.

A `Hook` names the vLLM function it wraps or relies on (`target`), the releases and
plans it applies to, the private attributes it touches on vLLM's objects, and its
installer. The parameters it binds on each release are in that release's row
(`capplan.releases.Release.signatures`), never here. `registry.install` selects the
entries, checks every one against the live vLLM (collecting every problem into one
refusal), then installs them in table order; nothing else patches vLLM.

Hooks read vLLM's arguments by name: a replacement takes `*args, **kwargs` and binds them
through the live function's signature (`Call`), so a parameter vLLM moves between
releases is still the one the hook means.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from dataclasses import replace as replace_fields
from typing import Any

from capplan.errors import EngineRefusal
from capplan.releases import MORE, Release
from capplan.schemas.plan import Plan

MARK = "__capplan_hook__"  # set on every replacement: the name of the entry that installed it


class IncompatibleVllm(EngineRefusal):
    """vLLM is not a version, or not shaped the way, capplan's hooks expect."""


class PlanNotInForce(EngineRefusal):
    """The engine would run without the plan (another model runner, another capture list): refused."""


@dataclass(frozen=True)
class Need:
    """What decides whether a hook applies in this process: the release, the plan, the environment."""

    release: Release
    plan: Plan
    env: Mapping[str, str]


Installer = Callable[[Any, "Hook", Any], Any]
"""(the process's context, a `context.HookContext`; the entry; the function now in place) -> its
replacement. The context is typed where each installer takes it: this module sits below it."""


def every_release(release: Release) -> bool:
    return True


def every_plan(need: Need) -> bool:
    return True


@dataclass(frozen=True)
class Hook:
    name: str
    target: str  # "module:Class.method" or "module:function": the vLLM function whose signature is checked
    why: str  # the failure class the hook prevents (docs/design.md)
    install: Installer | None = None  # None: relied on (called or read), not replaced
    at: str | None = None  # where the replacement goes when not at `target` (a module that imported it by name)
    # Private state on the live objects the hook touches: fixed, or read from the release's row
    # where releases differ (`on` resolves it for one release).
    attributes: tuple[str, ...] | Callable[[Release], tuple[str, ...]] = ()
    reads: tuple[str, ...] = ()  # the parameters the hook reads or passes by name
    releases: Callable[[Release], bool] = every_release
    when: Callable[[Need], bool] = every_plan

    def on(self, release: Release) -> Hook:
        """This entry as it applies on `release`: its attributes resolved to that release's."""
        if callable(self.attributes):
            return replace_fields(self, attributes=self.attributes(release))
        return self

    def expected(self, release: Release) -> tuple[str, ...]:
        """The parameters this release's row gives the target (MORE last: a prefix)."""
        return release.signatures[self.target]


def resolve(path: str) -> Any:
    """The live vLLM object a "module:qualname" names."""
    module_name, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(path: str) -> tuple[Any, str]:
    module_name, _, qualname = path.partition(":")
    owner, _, name = qualname.rpartition(".")
    return (resolve(f"{module_name}:{owner}") if owner else importlib.import_module(module_name)), name


def signature_problem(hook: Hook, release: Release, fn: Any = None) -> str | None:
    """Why the live function does not have the parameters this release's row expects, or None."""
    try:
        fn = resolve(hook.target) if fn is None else fn
    except (ImportError, AttributeError) as exc:
        return f"vLLM has no {hook.target} ({type(exc).__name__}: {exc})"
    got = tuple(inspect.signature(fn).parameters)
    want = hook.expected(release)
    prefix = bool(want) and want[-1] == MORE
    named = want[:-1] if prefix else want
    if (got[: len(named)] if prefix else got) != named:
        return f"vLLM's {hook.target} has parameters {got}, expected {named}{' and more' if prefix else ''}"
    unknown = [p for p in hook.reads if p not in got]
    if unknown:
        return f"vLLM's {hook.target} has no parameter {', '.join(unknown)} (read by capplan's {hook.name} hook)"
    return None


def check_attributes(hook: Hook, obj: object) -> None:
    """IncompatibleVllm unless the live object carries every private attribute the entry relies on."""
    assert not callable(hook.attributes), f"{hook.name}: resolve the entry for a release first (Hook.on)"
    missing = [name for name in hook.attributes if not hasattr(obj, name)]
    if missing:
        raise IncompatibleVllm(
            f"capplan: vLLM's {type(obj).__name__} has no {', '.join(missing)} "
            f"(relied on by the hook of {hook.target}); this vLLM is not supported: "
            "the plan could not be in force"
        )


def at_problem(hook: Hook) -> str | None:
    """Why the place the entry's replacement goes (`at`, a module that imported the target by
    name) is not there, or None."""
    if hook.at is None:
        return None
    try:
        resolve(hook.at)
    except (ImportError, AttributeError) as exc:
        return f"vLLM has no {hook.at}, where capplan's {hook.name} hook goes ({type(exc).__name__}: {exc})"
    return None


def install_one(hook: Hook, ctx: Any) -> Callable[[], None]:
    """Put the entry's replacement in place of the function now there; what puts it back."""
    installer = hook.install
    assert installer is not None
    return replace(hook.at or hook.target, lambda current: installer(ctx, hook, current), hook.name)


def install_all(hooks: list[Hook], ctx: Any) -> None:
    """Install every entry that replaces a function, in order; where one fails, put back the
    ones already in place before the error goes on: vLLM is hooked by all of them or by none."""
    undo: list[Callable[[], None]] = []
    try:
        for hook in hooks:
            if hook.install is not None:
                undo.append(install_one(hook, ctx))
    except BaseException:
        for put_back in reversed(undo):
            put_back()
        raise


def replace(path: str, make: Callable[[Any], Any], name: str) -> Callable[[], None]:
    """Set `make(the function now at path)` at path, marked with the hook's name (a
    classmethod stays one). The only place capplan writes a function into vLLM. Returns
    what puts the function that was there back."""
    owner, attr = _owner(path)
    current = inspect.getattr_static(owner, attr)
    wrapped = isinstance(current, classmethod)
    replacement = make(current.__func__ if wrapped else getattr(owner, attr))
    setattr(replacement, MARK, name)
    had_own = attr in vars(owner)  # not inherited: put back as it was, else removed again

    def put_back() -> None:
        if had_own:
            setattr(owner, attr, current)
        else:
            delattr(owner, attr)

    setattr(owner, attr, classmethod(replacement) if wrapped else replacement)
    return put_back


class Call:
    """One call of a hooked vLLM function, its arguments bound by name through the signature."""

    __slots__ = ("bound",)

    def __init__(self, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.bound = signature.bind(*args, **kwargs)

    def __getitem__(self, name: str) -> Any:
        """The argument `name` as vLLM's function sees it (its default when not passed)."""
        arguments = self.bound.arguments
        if name in arguments:
            return arguments[name]
        default = self.bound.signature.parameters[name].default
        return None if default is inspect.Parameter.empty else default

    def copy(self) -> Call:
        return Call(self.bound.signature, self.bound.args, dict(self.bound.kwargs))

    def __setitem__(self, name: str, value: Any) -> None:
        self.bound.arguments[name] = value

    def run(self, fn: Callable[..., Any]) -> Any:
        """`fn` called with these arguments, as given (with any replaced)."""
        return fn(*self.bound.args, **self.bound.kwargs)


def binder(fn: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], Call]:
    """A function binding a call's (args, kwargs) by name through `fn`'s signature."""
    signature = inspect.signature(fn)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        return Call(signature, args, kwargs)

    return bind
