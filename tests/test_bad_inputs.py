"""Every malformed file in tests/data/bad/ fails closed through the CLI.

Each file starts with `# expect: <fragment>`. Specs (`spec-*.yaml`) run
through `capplan compile`, plans (`plan-*.plan.yaml`) through `capplan show`,
traces (`trace-*.jsonl`) through `capplan simulate`, query files
(`queries-*.jsonl`) through `capplan dispatch --queries` and calibrations
(`calibration-*.yaml`) through `capplan show --calibration`, the last three
against the plan of `base.yaml`. Each must exit 1 with one line starting with
`error: <the file>` and holding the fragment, no traceback, and leave the
folder exactly as it was. The commands run in-process; a few run as real
processes too.
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.cli import app

BAD = Path(__file__).parent / "data" / "bad"
KINDS = ("spec-", "plan-", "trace-", "queries-", "calibration-")
FILES = sorted(p for p in BAD.iterdir() if p.name.startswith(KINDS))
runner = CliRunner()


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_corpus_is_large():
    assert len(FILES) >= 110
    for kind, least in (("spec-", 60), ("plan-", 25), ("trace-", 15), ("queries-", 5)):
        assert sum(p.name.startswith(kind) for p in FILES) >= least, kind


def test_bad_plans_are_what_their_generator_writes():
    """The plan corpus derives from a plan compiled now: a plan format change shows up here."""
    import importlib.util

    loader = importlib.util.spec_from_file_location("make_bad_plans", BAD / "make_bad_plans.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    for name, (text, expect) in module.CASES.items():
        path = BAD / f"plan-{name}.plan.yaml"
        assert path.read_text() == f"# expect: {expect}\n{text}", (
            f"stale: {path.name} (run {BAD / 'make_bad_plans.py'})"
        )


def _case(path: Path, work: Path) -> tuple[list[str], str]:
    """Copy the bad file into `work`; the command that must refuse it, and the fragment."""
    expect = path.read_bytes().split(b"\n", 1)[0].decode().removeprefix("# expect: ")
    target = work / path.name
    target.write_bytes(path.read_bytes())
    if path.name.startswith("spec-"):
        (work / (target.stem + ".plan.yaml")).write_text("old plan\n")  # must survive untouched
        return ["compile", target.name], expect
    if path.name.startswith("plan-"):
        return ["show", target.name], expect
    (work / "base.yaml").write_text((BAD / "base.yaml").read_text())
    made = runner.invoke(app, ["compile", str(work / "base.yaml")])
    assert made.exit_code == 0, made.output
    if path.name.startswith("trace-"):
        return ["simulate", "base.plan.yaml", target.name], expect
    if path.name.startswith("calibration-"):
        return ["show", "base.plan.yaml", "--calibration", target.name], expect
    return ["dispatch", "base.plan.yaml", "--queries", target.name], expect


def _check(code: int, stdout: str, stderr: str, name: str, expect: str) -> None:
    assert code == 1, stderr
    assert "Traceback" not in stderr + stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert expect in lines[0], lines[0]
    assert lines[0].startswith(f"error: {name}"), "the error names the file"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_bad_input_fails_closed(path, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args, expect = _case(path, work)
    before = snapshot(work)
    result = runner.invoke(app, args)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    _check(result.exit_code, result.stdout, result.stderr, path.name, expect)
    assert snapshot(work) == before


@pytest.mark.parametrize("name", ["spec-octal.yaml", "plan-graph-dropped.plan.yaml", "trace-mixed-formats.jsonl"])
def test_bad_input_fails_closed_as_a_process(name, tmp_path):
    """The same through `python -m capplan`: exit status and stderr as a shell sees them."""
    work = tmp_path / "work"
    work.mkdir()
    args, expect = _case(BAD / name, work)
    before = snapshot(work)
    proc = subprocess.run(
        [sys.executable, "-m", "capplan", *args], cwd=work, capture_output=True, text=True, timeout=60
    )
    _check(proc.returncode, proc.stdout, proc.stderr, name, expect)
    assert snapshot(work) == before
