"""Where a spec's plan goes by default, and the command that regenerates it."""

from __future__ import annotations

import os
from pathlib import Path

from capplan.errors import printable


def relative(path: Path, base: Path) -> str:
    """`path` relative to the folder `base` (never absolute: the bare name when no
    relative path exists), escaped to one line."""
    try:
        rel = Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()
    except ValueError:
        rel = path.name
    return printable(rel)


def default_plan_path(spec_path: Path) -> Path:
    name = spec_path.name
    for suffix in (".yaml", ".yml"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return spec_path.with_name(name + ".plan.yaml")


def regenerate_command(spec_path: Path, plan_path: Path, base: Path) -> str:
    """The command that rewrites `plan_path` from `spec_path`, run from the folder `base`
    (`-o` only when the plan is not next to the spec under its default name)."""
    command = f"capplan compile {relative(spec_path, base)}"
    if plan_path.resolve() != default_plan_path(spec_path).resolve():
        command += f" -o {relative(plan_path, base)}"
    return command
