"""`capplan git-setup`: make `git diff` show plans as `capplan diff` does, all or nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capplan.errors import CapplanError, UsageError, printable

GIT_ATTRIBUTE = "*.plan.yaml diff=capplan"


@dataclass(frozen=True)
class GitSetup:
    """What was set: the attributes file (`added`: the line was new there) and the driver command."""

    attributes: Path
    added: bool
    value: str


# The driver git runs (through its shell, from the top of the worktree, with the 7 diff
# arguments after ours): this capplan's python while it exists, else a capplan on PATH, else
# one line that says how to repair it. A venv rebuilt in place keeps working.
_DRIVER = (
    'py=$1; shift; if [ -x "$py" ]; then exec "$py" -m capplan git-diff -- "$@"; fi; '
    'if command -v capplan >/dev/null 2>&1; then exec capplan git-diff -- "$@"; fi; '
    "echo \"capplan: the git diff driver's python $py is gone and no capplan is on PATH; run "
    'capplan git-setup again from the environment that has capplan" >&2; exit 1'
)


def this_capplan(root: Path) -> str:
    """The driver command for this capplan: its python by a path relative to the repository
    when the python lies inside it (a rebuilt or moved clone keeps working), else by its
    absolute path, falling back to `capplan` on PATH (another GUI, CI)."""
    import shlex

    python = os.path.abspath(sys.executable)  # not resolved: a venv's python is a link into the base
    for top in {str(root), os.path.realpath(root)}:
        if python.startswith(top.rstrip(os.sep) + os.sep):
            python = "./" + os.path.relpath(python, top)
            break
    return f"sh -c {shlex.quote(_DRIVER)} capplan {shlex.quote(python)}"


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise CapplanError("git: command not found", "install git") from None


def git_setup(command: str | None = None) -> GitSetup:
    """Add GIT_ATTRIBUTE to the repository's .gitattributes and set `diff.capplan.command`
    in this clone's config; when git would not then use both, undo both and refuse."""
    from capplan.files import read_text, write_atomic

    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise CapplanError(
            f"git rev-parse --show-toplevel: {top.stderr.strip() or 'failed'}",
            "run capplan git-setup inside a git repository",
        )
    root = Path(top.stdout.removesuffix("\n"))  # the path as git has it: a name may end in a space
    attributes = root / ".gitattributes"
    current = ""
    if os.path.lexists(attributes):
        if os.path.islink(attributes):
            raise CapplanError(f"{printable(str(attributes))}: is a symbolic link", "make it a regular file")
        current = read_text(attributes, ".gitattributes file", CapplanError, 1 << 20)
    if command is not None and ("\n" in command or not command.strip()):
        raise UsageError("--command must be one line naming how to run capplan")
    # `--`: a plan named -h.plan.yaml is a path, not an option
    value = f"{command} git-diff --" if command is not None else this_capplan(root)
    before = _git("config", "--local", "--get", "diff.capplan.command")
    had = before.stdout.removesuffix("\n") if before.returncode == 0 else None
    setting = _git("config", "--local", "diff.capplan.command", value)
    if setting.returncode != 0:
        reason = setting.stderr.strip().splitlines()[0] if setting.stderr.strip() else "failed"
        hint = "nothing was changed"
        if "lock" in reason:
            hint += "; another git process holds the config lock (remove .git/config.lock if none runs)"
        raise CapplanError(f"git config diff.capplan.command: {reason}", hint)

    def undo_config() -> None:
        if had is None:
            _git("config", "--local", "--unset", "diff.capplan.command")
        else:
            _git("config", "--local", "diff.capplan.command", had)

    added = GIT_ATTRIBUTE not in current.splitlines()
    if added:
        try:
            write_atomic(
                attributes, current + ("" if not current or current.endswith("\n") else "\n") + GIT_ATTRIBUTE + "\n"
            )
        except CapplanError:
            undo_config()
            raise
    _check_effective(root, value, attributes, current, added, undo_config)
    return GitSetup(attributes, added, value)


def _check_effective(
    root: Path, value: str, attributes: Path, current: str, added: bool, undo_config: Callable[[], None]
) -> None:
    """Refuse, undoing both changes, when git would not run `value` for every plan.

    A later line, a folder's own .gitattributes or .git/info/attributes can set another
    diff for plans, and a worktree's config another command: ask git what it will use,
    for a new plan at the top and for every plan it tracks."""
    from capplan.files import write_atomic

    tracked = _git("-C", str(root), "ls-files", "-z", "--", "*.plan.yaml").stdout.split("\0")
    paths = ["capplan-probe.plan.yaml", *[p for p in tracked if p][:5000]]
    probe = subprocess.run(
        ["git", "-C", str(root), "check-attr", "-z", "diff", "--stdin"],
        input="\0".join(paths) + "\0", capture_output=True, text=True,
    )  # fmt: skip
    fields = probe.stdout.split("\0") if probe.returncode == 0 else []
    found = list(zip(fields[0::3], fields[2::3])) or [("capplan-probe.plan.yaml", "unknown")]
    where, says = next(((p, v) for p, v in found if v != "capplan"), ("", "capplan"))
    effective = _git("-C", str(root), "config", "--get", "diff.capplan.command").stdout.removesuffix("\n")
    if says == "capplan" and effective != value:
        undo_config()
        if added:
            if current:
                write_atomic(attributes, current)
            else:
                attributes.unlink()
        raise CapplanError(
            f"git would run `{printable(effective or 'nothing')}` for plans: diff.capplan.command is set where this "
            "clone's config does not reach it (a worktree's config, GIT_CONFIG_* in the environment); nothing was "
            "changed",
            "git config --show-origin --get diff.capplan.command shows where; unset it there",
        )
    if says != "capplan":
        if added:
            if current:
                write_atomic(attributes, current)
            else:
                attributes.unlink()
        undo_config()
        raise CapplanError(
            f"git would diff {printable(where)} with `diff: {printable(says)}`: another attributes line overrides "
            f"`{GIT_ATTRIBUTE}`; nothing was changed",
            f"remove or move that line (git check-attr diff -- {printable(where)} shows what git uses)",
        )
