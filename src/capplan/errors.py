"""Every kind of error capplan raises, and its exit code, in one place.

The command line (`capplan.cli`) prints a CapplanError as one line, `error: ...`,
and exits with its `exit_code`:

- 1, bad input: SpecError (a spec), PlanError (a plan file), InputError (a batch or
  calibration file), StalePlansError (`compile --check`), and CapplanError itself;
- 2, bad usage: UsageError (except in `diff`, whose 2 means "the plans differ": a
  refusal there exits 1).

The runtime (the vLLM plugin) raises an EngineRefusal: the engine process stops with
its line (exit status 1) before any graph is captured. The contract check's
`runtime.hooking.IncompatibleVllm` is the one refusal defined beside its table.
"""

from __future__ import annotations


class CapplanError(Exception):
    """A user-facing failure: one line naming what is wrong, plus how to fix it."""

    exit_code = 1
    earlier: list[str] = []  # lines said before this one (each as `error: LINE`)

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        # Input can put newlines or terminal escapes into a message (a key named
        # "\n"): print them escaped so an error is always exactly one safe line.
        return printable(f"{self.message} ({self.hint})" if self.hint else self.message)


def printable(text: str) -> str:
    """`text` with every character that is not printable (line breaks, escapes) backslash-escaped."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class SpecError(CapplanError):
    """The spec YAML is unreadable or invalid."""


class PlanError(CapplanError):
    """A plan file is unreadable, invalid, or inconsistent with itself."""


class InputError(CapplanError):
    """A batch file or a calibration file is unreadable or invalid."""


class UsageError(CapplanError):
    """The command line asks for something impossible."""

    exit_code = 2


class StalePlansError(CapplanError):
    """`compile --check` found plans that do not hold what their specs compile to: one
    line per plan, each naming the command that regenerates it (the last is the message)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(lines[-1])
        self.earlier = lines[:-1]


class EngineRefusal(RuntimeError):
    """The runtime refuses an engine the plan cannot be in force in; the message is one
    line that starts with `capplan`, and the plugin stops the process with it."""

    exit_code = 1


class UnsupportedVllm(EngineRefusal):
    """The running vLLM is not a release capplan supports."""
