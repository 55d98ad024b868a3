"""The README and the docs it points to say what the code does: the README is a short
guide, its set-up commands are the two that work, every `console` block's commands run
and print what is shown, every plan excerpt is in the plan it names, and every link and
path resolves. (The command synopsis in docs/cli.md: tests/test_everyday.py.)"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = [README, ROOT / "docs" / "cli.md", ROOT / "docs" / "benchmarks.md"]
DOCS = [*GUIDES, ROOT / "docs" / "vllm-releases.md", ROOT / "docs" / "releasing.md", ROOT / "CHANGELOG.md"]


def blocks(path: Path, info: str) -> list[str]:
    """The fenced code blocks of `path` whose info string is `info`."""
    return re.findall(rf"^```{info}\n(.*?)^```$", path.read_text(), re.S | re.M)


def test_the_readme_is_a_short_guide():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    first_screen = "\n".join(lines[:20])
    (setup,) = re.findall(r"^```bash\n(.*?)^```$", first_screen, re.S | re.M)
    commands = setup.strip().splitlines()
    assert len(commands) == 2, commands
    plan, tests = commands
    assert plan.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && ")
    assert ".venv/bin/capplan compile configs/" in plan and ".venv/bin/capplan show " in plan
    assert tests.startswith("bash .ci/run ")
    for needed in ("python3.11", "unzip", "1.6 GB", "minutes"):
        assert needed in first_screen + "\n".join(lines[:30]), needed


def test_the_first_setup_command_plans_and_shows(tmp_path):
    """Its capplan part, with this checkout's capplan (the venv and install steps are what
    .ci/run and .ci/package do)."""
    setup = README.read_text().split("```bash\n", 1)[1].splitlines()[0]
    steps = setup.split(" && ")[2:]
    for step in steps:
        args = shlex.split(step.replace("/tmp/", f"{tmp_path}/"))
        assert args[0] == ".venv/bin/capplan"
        out = subprocess.run([sys.executable, "-m", "capplan", *args[1:]], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{tmp_path}/qwen3.plan.yaml\n")  # show names the plan it shows


def _console(path: Path) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for every `$ ` line of the `console` blocks."""
    steps: list[tuple[str, list[str]]] = []
    for block in blocks(path, "console"):
        for line in block.splitlines():
            if line.startswith("$ "):
                steps.append((line[2:], []))
            else:
                steps[-1][1].append(line)
    return steps


def _matches(expected: list[str], actual: list[str]) -> bool:
    """`expected` in order, each line whole; `...` stands for any number of lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and actual[0] == expected[0] and _matches(expected[1:], actual[1:])


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_console_blocks_run_and_print_what_is_shown(path, tmp_path):
    steps = _console(path)
    if path == README:
        assert len(steps) >= 6
    work = tmp_path / "checkout"  # the commands write only here
    for folder in ("configs", "examples"):
        shutil.copytree(ROOT / folder, work / folder)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    for command, expected in steps:
        args = shlex.split(command.replace("/tmp/", f"{scratch}/"))
        assert args[0] == "capplan", command
        out = subprocess.run(
            [sys.executable, "-m", "capplan", *args[1:]], cwd=work, capture_output=True, text=True, timeout=300
        )
        assert out.returncode in ((0, 2) if args[1] == "diff" else (0,)), (command, out.stderr)
        actual = (out.stdout + out.stderr).replace(f"{scratch}/", "/tmp/").splitlines()
        assert _matches(expected, actual), f"{command}: prints\n" + "\n".join(actual[:40])


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_plan_excerpts_are_in_their_plans(path):
    text = path.read_text()
    for name, block in re.findall(r"<!-- excerpt of (\S+) -->\n```yaml\n(.*?)^```$", text, re.S | re.M):
        plan = (ROOT / name).read_text().splitlines()
        wanted = block.splitlines()
        assert _matches(["...", *wanted, "..."], plan), f"{path.name}: the excerpt of {name} is not in it"
    assert text.count("<!-- excerpt of ") == len(re.findall(r"<!-- excerpt of \S+ -->\n```yaml\n", text))


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_links_and_paths_resolve(path):
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{path.name}: link {target} leads nowhere"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", resolved.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{path.name}: {target}: no such heading"
    # Paths in backticks are from the repository root.
    for candidate in re.findall(r"`((?:src|tests|docs|examples|configs|bench|\.ci)/[\w./-]*)`", text):
        if "*" in candidate or candidate.endswith((".jsonl", ".svg", ".png")) and "examples/traces/" not in candidate:
            continue
        assert (ROOT / candidate).exists(), f"{path.name}: `{candidate}` does not exist"


def test_benchmark_commands_name_real_modules():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    modules = set(re.findall(r"`python -m (bench(?:\.\w+)?)", text))
    assert modules >= {"bench", "bench.traffic", "bench.capture_hook", "bench.diff_stability"}
    for module in modules:
        path = ROOT / Path(*module.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), module


def test_the_release_table_moved_whole():
    """The support table lives in docs/vllm-releases.md, linked from the README."""
    releases = (ROOT / "docs" / "vllm-releases.md").read_text()
    assert "## Supported vLLM releases" in releases
    from capplan.releases import RELEASES

    rows = [line for line in releases.splitlines() if line.startswith("| 0.")]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == list(RELEASES)  # one row per supported release
    assert [row.split(" | ")[1] for row in rows] == [r.group for r in RELEASES.values()]
    assert "docs/vllm-releases.md#supported-vllm-releases" in README.read_text()


# Release facts the design document states in prose, each tied to the rule of the table
# (capplan.releases) it describes: the release it names must be the first with that rule.
RELEASE_FACTS = {
    r"MRV2 on 0.25 runs the encoder eager; from (\S+) it may": "encoder_graphs",
    r"requests \(what (\S+)\+ does\) on every dummy path": "spreads_dummy_remainder",
    r"mode \((\S+)\+ behaviour\); `verify` lists every eager token range": "per_mode_ranges",
    r"Encoder graphs that skip tower/connector LoRA.\*\* From vLLM (\S+), MRV2": "encoder_graphs",
}


@pytest.mark.parametrize("pattern, rule", RELEASE_FACTS.items(), ids=RELEASE_FACTS.values())
def test_release_facts_in_the_design_document_match_the_table(pattern, rule):
    import re

    from capplan.releases import RELEASES

    text = " ".join((ROOT / "docs" / "design.md").read_text().split())
    found = re.search(pattern, text)
    assert found, pattern
    first = next(v for v, r in RELEASES.items() if getattr(r.rules, rule))
    assert found.group(1).rstrip(",") == first, (rule, found.group(1), first)
