"""`capplan diff` (two plans, or two specs compiled in memory) and `git-diff`, the
driver git runs for plan files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from capplan.analysis.diff import PlanDiff
from capplan.analysis.review import Verdict
from capplan.commands import inputs
from capplan.errors import CapplanError, UsageError, printable
from capplan.schemas.plan import Plan

FORMATS = ("text", "markdown", "json")
VERDICT_EXIT = {"pass": 0, "warn": 3, "deny": 4}  # diff --policy's exit codes, for CI to gate on


def diff(
    old: Path,
    new: Path,
    fmt: str,
    specs: bool,
    calibration: Path | None,
    plot: Path | None,
    model_config: Path | None = None,
    policy: Path | None = None,
) -> tuple[PlanDiff, Verdict | None]:
    """The semantic diff of two plans (or specs); with `plot`, drawn there; with `policy`, the
    review's verdict on it. A refusal exits 1, since this command's exit 2 means "the plans
    differ" (and, with a policy, 3 and 4 mean warn and deny)."""
    from capplan.analysis.review import review
    from capplan.loading import load_policy

    try:
        rules = None if policy is None else load_policy(policy)
        result, a, b = _diff(old, new, fmt, specs, calibration, model_config)
        if plot is not None:
            from capplan.files import write_atomic
            from capplan.present.diff import headline
            from capplan.present.picture import diff_grids
            from capplan.present.plot import plot_plan

            grids, legend = diff_grids(a, b)
            caption = f"capplan diff {old.name} -> {new.name}: {headline(result)}"
            write_atomic(plot, plot_plan(plot, grids, caption, legend), inputs(old, new, calibration, model_config))
    except UsageError as exc:
        exc.exit_code = 1
        raise
    return result, None if rules is None else review(result, rules, b.fingerprint)


def _diff(
    old: Path, new: Path, fmt: str, specs: bool, calibration: Path | None, model_config: Path | None = None
) -> tuple[PlanDiff, Plan, Plan]:
    """Load both sides (plans, or specs compiled in memory) and compare them."""
    from capplan.analysis.diff import diff_plans
    from capplan.calibration.price import load_pricer

    if fmt not in FORMATS:
        raise UsageError(f"--format must be text, markdown or json (got {fmt!r})")
    pricer = load_pricer(calibration, new, model_config)
    a, b = _load(old, specs), _load(new, specs)
    if isinstance(a, CapplanError) or isinstance(b, CapplanError):
        raise _mixup(old, new, a, b, specs)
    return diff_plans(a, b, pricer, printable(str(old)), printable(str(new))), a, b


def _load(path: Path, specs: bool) -> Plan | CapplanError:
    from capplan.commands.compile import compile_spec
    from capplan.planfile.read import load_plan

    try:
        return compile_spec(path) if specs else load_plan(path)
    except CapplanError as exc:
        return exc


def _mixup(old: Path, new: Path, a: Plan | CapplanError, b: Plan | CapplanError, specs: bool) -> CapplanError:
    """The error to raise when a side did not load: the likely mix-ups (specs without
    --spec, plans with it, or one of each) said as such, else the side's own error."""
    from capplan.files import shown
    from capplan.loading import wrong_document

    def kind(side: Plan | CapplanError) -> str:
        if isinstance(side, CapplanError):
            return wrong_document(side) or "error"
        return "plan" if not specs else "spec"

    kinds = (kind(a), kind(b))
    o, n = shown(old), shown(new)
    if kinds == ("spec", "spec") and not specs:
        return UsageError(f"{o} is a spec, not a plan", f"compare specs with: capplan diff --spec {o} {n}")
    if kinds == ("plan", "plan") and specs:
        return UsageError(f"{o} is a plan, not a spec", f"compare plans without --spec: capplan diff {o} {n}")
    if sorted(kinds) == ["plan", "spec"]:
        spec_side = o if kinds[0] == "spec" else n
        plan_side = n if kinds[0] == "spec" else o
        return UsageError(
            f"{spec_side} is a spec and {plan_side} a plan; diff compares two plans, or two specs with --spec",
            f"compile the spec first (capplan compile {spec_side}) and compare the two plans",
        )
    return a if isinstance(a, CapplanError) else b  # type: ignore[return-value]


GIT_DIFF_USAGE = (
    "usage: capplan git-diff PATH OLD-FILE OLD-HEX OLD-MODE NEW-FILE NEW-HEX NEW-MODE (git runs this; see capplan "
    "git-setup)"
)


@dataclass(frozen=True)
class GitDiff:
    """What the driver prints: the semantic diff, or a line saying why not (and the raw diff)."""

    text: str


def git_diff(args: list[str]) -> GitDiff:
    """git's external diff driver: PATH OLD-FILE OLD-HEX OLD-MODE NEW-FILE NEW-HEX NEW-MODE [NEW-PATH]."""
    import difflib

    from capplan.analysis.diff import diff_plans
    from capplan.errors import InputError
    from capplan.files import read_text
    from capplan.planfile.read import load_plan
    from capplan.present.compile import summary
    from capplan.present.diff import render_text

    if len(args) < 7:
        raise UsageError(GIT_DIFF_USAGE)
    path, old_file, new_file = printable(args[0]), Path(args[1]), Path(args[4])
    new_path = printable(args[7]) if len(args) > 7 else path  # a rename: git appends the new name
    if str(old_file) == os.devnull or str(new_file) == os.devnull:
        which = "new" if str(old_file) == os.devnull else "deleted"
        side = new_file if which == "new" else old_file
        try:
            return GitDiff(f"capplan diff b/{new_path}: {which} plan: {summary(load_plan(side))}\n")
        except CapplanError as exc:
            return GitDiff(f"capplan diff b/{new_path}: {which} file, not a loadable plan ({exc.one_line()})\n")
    try:
        old, new = load_plan(old_file), load_plan(new_file)
    except CapplanError as exc:
        try:
            old_text = read_text(old_file, "plan file", InputError)
            new_text = read_text(new_file, "plan file", InputError)
        except CapplanError as unreadable:
            return GitDiff(f"capplan diff a/{path} b/{new_path}: not compared ({unreadable.one_line()})\n")
        head = f"capplan diff a/{path} b/{new_path}: not compared semantically ({exc.one_line()}); raw diff:\n"
        old_lines = [printable(line) + "\n" for line in old_text.splitlines()]
        new_lines = [printable(line) + "\n" for line in new_text.splitlines()]
        return GitDiff(head + "".join(difflib.unified_diff(old_lines, new_lines, f"a/{path}", f"b/{new_path}")))
    from capplan.calibration.price import load_pricer

    # git runs the driver from the top of the work tree: the calibration folder is found from the plan's path
    # (one that does not load prices nothing, said in the price's notes)
    pricer = load_pricer(None, Path(args[7] if len(args) > 7 else args[0]))
    result = diff_plans(old, new, pricer, f"a/{path}", f"b/{new_path}")
    return GitDiff(render_text(result))
