"""Every malformed spec and plan in tests/data/bad/ fails closed through the real CLI.

Each file starts with `# expect: <fragment>`. Specs run through `capplan
compile`, plans through `capplan show`, as subprocesses: exit code 1, the
fragment in a one-line error, no traceback, and no file created or changed.
"""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

BAD = Path(__file__).parent / "data" / "bad"
FILES = sorted(p for p in BAD.iterdir() if p.suffix == ".yaml")


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_corpus_is_large():
    assert len(FILES) >= 60
    assert sum(p.name.startswith("plan-") for p in FILES) >= 20


def test_bad_plans_are_what_their_generator_writes():
    """The plan corpus derives from a plan compiled now: a plan format change shows up here."""
    import importlib.util

    loader = importlib.util.spec_from_file_location("make_bad_plans", BAD / "make_bad_plans.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    for name, (text, expect) in module.CASES.items():
        path = BAD / f"plan-{name}.plan.yaml"
        assert path.read_text() == f"# expect: {expect}\n{text}", f"stale: {path.name} (run {BAD / 'make_bad_plans.py'})"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_bad_input_fails_closed(path, tmp_path):
    expect = path.read_bytes().split(b"\n", 1)[0].decode().removeprefix("# expect: ")
    work = tmp_path / "work"
    work.mkdir()
    target = work / path.name
    target.write_bytes(path.read_bytes())
    if path.name.startswith("plan-"):
        args = ["show", target.name]
    else:
        (work / (target.stem + ".plan.yaml")).write_text("old plan\n")  # must survive untouched
        args = ["compile", target.name]
    before = snapshot(work)
    proc = subprocess.run([sys.executable, "-m", "capplan.cli", *args], cwd=work,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expect in lines[0]
    assert lines[0].startswith(f"error: {target.name}"), "the error names the file"
    assert snapshot(work) == before
