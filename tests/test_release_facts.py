"""Release facts are written once, in capplan/releases.py; the docs and help texts that name
a release for a rule say what that table says.

- docs/vllm-releases.md holds tables generated from the release table
  (`capplan.release_table`): the checked-in text must be exactly the generated one.
- The hand-written tables of docs/vllm-releases.md (which releases plan alike, the supported
  releases) name the releases, groups and torch pins the table gives.
- Each prose statement below that names the release a rule starts from (or the releases a
  flag holds on) must name what the table gives; and every "0.NN+" in the docs and in
  capplan's sources names a release where some rule or flag of the table starts.

A change to releases.py that the docs do not follow fails here; regenerate the tables with
`python -m capplan.release_table docs/vllm-releases.md` and fix the prose this test names.
"""

import re
from dataclasses import fields
from pathlib import Path

import pytest

from capplan.release_table import BEGIN, END, render, spans
from capplan.releases import ALIASES, GROUPS, RELEASES, Release, Rules

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = list(RELEASES)
RULES = [f.name for f in fields(Rules) if f.name != "group"]
ROW_FLAGS = [f.name for f in fields(Release) if f.type in ("bool", bool)]


def _text(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def _has(release: Release, flag: str) -> bool:
    return bool(getattr(release.rules, flag) if flag in RULES else getattr(release, flag))


def _with(flag: str) -> list[str]:
    return [v for v, r in RELEASES.items() if _has(r, flag)]


def _names(named: str, exact: str) -> bool:
    """Whether a release as prose names it ("0.28.0", or "0.28" for the first 0.28 release)
    is the exact release."""
    if named == exact:
        return True
    first_of_minor = next((v for v in VERSIONS if v.startswith(named + ".")), None)
    return named.count(".") == 1 and first_of_minor == exact


def _listed(named: str) -> list[str]:
    """The releases a prose list or range names: "0.25.0, 0.25.1 and 0.26.0", "0.25.0-0.26.0"."""
    named = named.strip()
    ends = re.fullmatch(r"(\S+?)\s*(?:-|to)\s*(\S+)", named)
    if ends:
        lo, hi = VERSIONS.index(ends.group(1)), VERSIONS.index(ends.group(2))
        return VERSIONS[lo : hi + 1]
    return [v.strip() for v in re.split(r",|\band\b", named) if v.strip()]


# -- the generated tables ------------------------------------------------------------------


def test_the_generated_release_tables_are_the_checked_in_ones():
    doc = (ROOT / "docs" / "vllm-releases.md").read_text()
    assert doc.count(BEGIN) == 1 and doc.count(END) == 1, "docs/vllm-releases.md: the generated block is missing"
    checked_in = doc[doc.index(BEGIN) : doc.index(END) + len(END)] + "\n"
    assert checked_in == render(), (
        "docs/vllm-releases.md is stale: run python -m capplan.release_table docs/vllm-releases.md"
    )


def test_the_generated_tables_name_each_group_rule_and_flag():
    text = render()
    for group in GROUPS:
        assert f"\n| {group.group} | {spans(v for v, r in RELEASES.items() if r.rules == group)} |" in text
    for name in RULES + ROW_FLAGS:
        assert f"\n| `{name}` | {spans(_with(name))} | " in text
    assert f"\n| `spreads_dummy_remainder` | {VERSIONS[3]} to {VERSIONS[-1]} | " in text  # 0.27.0 to 0.33.0


def test_spans_name_runs_of_consecutive_releases():
    assert spans(["0.25.0", "0.25.1", "0.26.0", "0.29.0"]) == "0.25.0 to 0.26.0, 0.29.0"
    assert spans(["0.32.0", "0.33.0"]) == "0.32.0, 0.33.0"
    assert spans([]) == "none"


# -- the hand-written tables of docs/vllm-releases.md --------------------------------------


def _rows(heading: str) -> list[list[str]]:
    doc = (ROOT / "docs" / "vllm-releases.md").read_text()
    section = doc.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]


def test_the_releases_that_plan_alike_are_the_groups():
    found: dict[str, list[str]] = {}
    for group, releases, *_ in _rows("Releases that plan alike")[1:]:
        found.setdefault(group.rstrip("'"), []).extend(_listed(releases))  # A' is A with one row flag
    assert found == {g.group: [v for v, r in RELEASES.items() if r.rules == g] for g in GROUPS}


def test_the_supported_release_table_names_each_release_group_plan_and_torch():
    rows = _rows("Supported vLLM releases")[1:]
    assert [row[0] for row in rows] == VERSIONS
    for version, group, runs, *_, torch, _notes in rows:
        release = RELEASES[version]
        assert group == release.group, version
        assert _listed(runs) == [v for v, r in RELEASES.items() if r.rules == release.rules], version
        assert torch == release.torch, version


# -- prose ---------------------------------------------------------------------------------

# (file, pattern, flag): the release the pattern captures is the first with the flag (a rule
# of `Rules` or a flag of a release's row). design.md's failure classes: tests/test_docs.py.
# fmt: off
FIRST = [
    ("docs/cli.md", r"spread it one token each over the last requests \((\S+)\+ behaviour\)", "spreads_dummy_remainder"),
    ("docs/cli.md", r"\| vLLM before (\S+) piles the token remainder", "spreads_dummy_remainder"),
    ("docs/cli.md", r"build them per mode \((\S+)\+ behaviour\)", "per_mode_ranges"),
    ("docs/cli.md", r"\| vLLM before (\S+) builds token ranges over the union", "per_mode_ranges"),
    ("docs/cli.md", r"`--has-prefill` marks a real prefill chunk \(vLLM (\S+)\+ keeps", "prefill_breaks_uniform"),
    ("docs/cli.md", r"From vLLM (\S+) `target.blackwell` raises the default capture ceiling", "blackwell_ceiling_1024"),
    ("docs/cli.md", r"cudagraph_mm_encoder \(MRV2 captures them from vLLM (\S+)\)", "encoder_graphs"),
    ("docs/cli.md", r"`EncoderCudaGraphManager` on every release from (\S+) ", "encoder_graphs"),
    ("docs/cli.md", r"; before (\S+) MRV2 captures", "encoder_graphs"),
    ("docs/design.md", r"From (\S+) vLLM estimates CUDA-graph memory", "profiling_capture"),
    ("docs/vllm-releases.md", r"encoder graphs from (\S+)\. CI runs", "encoder_graphs"),
    ("docs/vllm-releases.md", r"union up to \S+, per mode from (\S+)\.", "per_mode_ranges"),
    ("docs/vllm-releases.md", r"piled on the last request in \S+ and \S+, spread from (\S+)\.", "spreads_dummy_remainder"),
    ("src/capplan/cli_help.py", r"\(from vLLM (\S+): no decode graph\)", "prefill_breaks_uniform"),
    ("src/capplan/schemas/spec.py", r"From vLLM (\S+) the default capture ceiling", "blackwell_ceiling_1024"),
    ("src/capplan/schemas/plan.py", r"its CUDA graphs \(MRV2 from vLLM (\S+)\)", "encoder_graphs"),
    ("src/capplan/batches.py", r"a real prefill chunk is in the batch \(vLLM (\S+)\+ keeps", "prefill_breaks_uniform"),
    ("src/capplan/planner/dispatch.py", r"\(from (\S+) it keeps the batch out of decode graphs\)", "prefill_breaks_uniform"),
    ("src/capplan/planner/candidates.py", r"- before vLLM (\S+) \(`union`\)", "per_mode_ranges"),
    ("src/capplan/planner/candidates.py", r"- (\S+)\+ \(`per_mode`", "per_mode_ranges"),
    ("src/capplan/planner/encoder.py", r"EncoderCudaGraphManager, MRV2 from (\S+)\)", "encoder_graphs"),
    ("src/capplan/planner/encoder.py", r"Packing \(vLLM (\S+)\+, the release rule `encoder_packing_defers`", "encoder_packing_defers"),
    ("src/capplan/planner/dummy_layout.py", r"vLLM before (\S+) piles the remainder", "spreads_dummy_remainder"),
    ("src/capplan/planner/dummy_runs.py", r"vLLM before (\S+) puts the whole remainder", "spreads_dummy_remainder"),
]
# fmt: on


@pytest.mark.parametrize("path, pattern, flag", FIRST, ids=[f"{p.split('/')[-1]}:{f}" for p, _, f in FIRST])
def test_a_release_named_for_a_rule_is_the_first_with_it(path, pattern, flag):
    found = re.search(pattern, _text(path))
    assert found, f"{path}: no longer says {pattern!r}; update the statement here with the text"
    first = _with(flag)[0]
    assert _names(found.group(1), first), f"{path}: names {found.group(1)} for {flag}; the table: {first}"


def test_counts_and_ends_of_the_release_range():
    changes = "zero one two three four five six seven eight nine".split()[len(GROUPS) - 1]
    words = {11: "eleven", 12: "twelve", 13: "thirteen"}
    first, last = VERSIONS[0], VERSIONS[-1]
    for path in ("docs/design.md", "src/capplan/releases.py"):
        assert f"changed {changes} times between vLLM {first} and {last}" in _text(path), path
    releases_doc = _text("docs/vllm-releases.md")
    assert releases_doc.startswith(f"# MRV2 CUDA-graph planning across vLLM {first} to {last}")
    assert f"exactly these {words.get(len(RELEASES), len(RELEASES))} releases" in releases_doc
    assert f"the same in all {words.get(len(RELEASES), len(RELEASES))} releases" in releases_doc
    assert f"the supported vLLM releases ({first} to {last}," in _text("README.md")
    assert f"between {first} and {last}, read from each release's code" in _text("docs/cli.md")


def test_the_aliases_are_named_with_their_releases():
    for path in ("docs/vllm-releases.md", "docs/cli.md"):
        text = _text(path)
        for alias, covered in ALIASES.items():
            for named in re.findall(rf'`"{re.escape(alias)}"` \(([\d., ]+)\)', text):
                assert _listed(named) == list(covered), (path, alias, named)
    text = _text("docs/vllm-releases.md")
    assert all(f'`"{alias}"` ({", ".join(covered)})' in text for alias, covered in ALIASES.items())


def test_the_torch_pins_are_the_table_s():
    found = re.search(r"\*\*torch pinned by each release\*\*: (.*?)\. ", _text("docs/vllm-releases.md"))
    assert found
    named = {
        torch: _listed(releases)
        for torch, releases in re.findall(r"(\d+\.\d+\.\d+) for ([\d. to]+?)(?:,|$)", found.group(1))
    }
    pins: dict[str, list[str]] = {}
    for version, release in RELEASES.items():
        pins.setdefault(release.torch, []).append(version)
    assert named == pins


def test_the_readme_downloads_one_wheel_of_each_group():
    found = re.search(r"one vLLM wheel of each group of releases \(([\d., ]+);", _text("README.md"))
    assert found
    groups = [RELEASES[v].group for v in _listed(found.group(1))]
    assert groups == [g.group for g in GROUPS]


def _starts() -> set[str]:
    """Releases where some rule or row flag of the table turns on or off."""
    out = {VERSIONS[0]}
    for flag in RULES + ROW_FLAGS:
        for before, after in zip(VERSIONS, VERSIONS[1:]):
            if _has(RELEASES[before], flag) != _has(RELEASES[after], flag):
                out.add(after)
    return out


def _scanned() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    sources = [p for p in sorted((ROOT / "src" / "capplan").rglob("*.py")) if p.name != "releases.py"]
    return docs + sources


def test_every_release_named_with_a_plus_starts_a_rule():
    """A release written with a plus ("0.28+", "0.27.0+") says a behaviour starts there: some
    rule or flag of the table must."""
    starts = _starts()
    wrong = []
    for path in _scanned():
        for named in re.findall(r"\b(0\.\d\d(?:\.\d+)?)\+", path.read_text()):
            if not any(_names(named, s) for s in starts):
                wrong.append(f"{path.relative_to(ROOT)}: {named}+")
    assert wrong == [], f"no rule or flag of capplan/releases.py starts there: {wrong}"
