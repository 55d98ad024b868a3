"""What the docs tell users to pin exists: every capplan pin in the README, the docs, the
example workflow and the pre-commit hook is the documented placeholder for a release commit
(`COMMIT`, whose SHA docs/releasing.md says how to find) or a revision this repository has."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = "COMMIT"
PIN = re.compile(r"capplan\.git@([^\s\"'#]+)|^\s*#?\s*rev:\s*([^\s#]+)", re.MULTILINE)


def _pinned_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / ".pre-commit-hooks.yaml", *sorted((ROOT / "docs").glob("*.md"))]
    return files + sorted((ROOT / "examples" / "ci").glob("*.y*ml"))


def pins() -> list[tuple[str, str]]:
    found = []
    for path in _pinned_files():
        for match in PIN.finditer(path.read_text()):
            found.append((path.relative_to(ROOT).as_posix(), match.group(1) or match.group(2)))
    return found


def test_the_install_docs_and_examples_pin_capplan():
    where = {path for path, _ in pins()}
    assert {"README.md", "docs/releasing.md", ".pre-commit-hooks.yaml", "examples/ci/capture-plans.yml"} <= where


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_every_pin_resolves():
    for path, rev in pins():
        if rev == PLACEHOLDER:
            continue
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True
        )
        if found.returncode != 0 and _shallow():
            pytest.skip(f"a shallow clone: {path}'s pin {rev} may be older than its history")
        assert found.returncode == 0, f"{path} pins {rev}, which this repository does not have"


def _shallow() -> bool:
    said = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    return said.stdout.strip() == "true"


RECIPE = re.compile(r"git log --format='%H %s' -E --grep '([^']+)' origin/main")


def test_the_release_steps_say_how_to_find_the_pinned_commit():
    text = (ROOT / "docs" / "releasing.md").read_text()
    assert RECIPE.search(text) and "`COMMIT`" in text and "Release X.Y.Z" in text


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_documented_recipe_finds_releases_and_only_releases():
    """The recipe, run on this repository's history: every commit it finds is a release (its
    message `Release X.Y.Z`, its `__version__` X.Y.Z), and there is at least one."""
    found = RECIPE.search((ROOT / "docs" / "releasing.md").read_text())
    assert found
    log = subprocess.run(
        ["git", "log", "--format=%H %s", "-E", f"--grep={found.group(1)}", "HEAD"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    if not log and _shallow():
        pytest.skip("a shallow clone: the release commits are not in its history")
    assert log, "the recipe finds no release"
    for line in log:
        sha, subject = line.split(" ", 1)
        version = subject.removeprefix("Release ")
        init = subprocess.run(["git", "show", f"{sha}:src/capplan/__init__.py"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
        assert f'__version__ = "{version}"' in init, (sha, subject)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_the_readme_pins_a_release():
    """The README's install lines pin a release commit: its message `Release X.Y.Z`, its version X.Y.Z."""
    revs = set(re.findall(r"capplan\.git@([0-9a-zA-Z]+)", (ROOT / "README.md").read_text()))
    assert len(revs) == 1 and re.fullmatch(r"[0-9a-f]{40}", next(iter(revs))), revs
    rev = next(iter(revs))
    subject = subprocess.run(["git", "log", "-1", "--format=%s", rev], cwd=ROOT, capture_output=True, text=True)
    if subject.returncode != 0 and _shallow():
        pytest.skip("a shallow clone: the release commit is not in its history")
    version = subject.stdout.strip().removeprefix("Release ")
    assert re.fullmatch(r"[0-9]+\.[0-9]+\.[0-9]+", version), subject.stdout
    init = subprocess.run(["git", "show", f"{rev}:src/capplan/__init__.py"], cwd=ROOT, capture_output=True, text=True)
    assert f'__version__ = "{version}"' in init.stdout
