"""What the conformance tier compared in this run, counted where it is compared and printed at
the end of the run (tests/conftest.py, merged over the xdist workers), so a reviewer sees that a
change to the tests or to how they run did not shrink the proof:

    conformance planning: 33 specs x 6 releases = 198 compared; 8 fields: capture_sizes 198, ...

A test calls `compared(group, subject, release, {field: values})` once it has compared them:
the subject (a spec, a check script) against that release, each field with how many values
(descriptors, dispatch decisions, ...). Standard library only (the GPU suite loads conftest.py).
"""

from __future__ import annotations

from collections import Counter

_PAIRS: dict[str, set[tuple[str, str]]] = {}
_VALUES: dict[str, Counter[str]] = {}
_ANSWERS: Counter[str] = Counter()


def compared(group: str, subject: str, release: str, fields: dict[str, int]) -> None:
    _PAIRS.setdefault(group, set()).add((subject, release))
    _VALUES.setdefault(group, Counter()).update(fields)


def answered(cached: int, computed: int) -> None:
    """Answers the oracle scripts gave: read from the cache (verified) or computed by vLLM."""
    _ANSWERS.update({"cached": cached, "computed": computed})


def snapshot() -> dict:
    """This process's counts, as JSON data (what an xdist worker sends back)."""
    groups = {
        group: {"pairs": sorted(map(list, pairs)), "values": dict(_VALUES.get(group, {}))}
        for group, pairs in _PAIRS.items()
    }
    return {"groups": groups, "answers": dict(_ANSWERS)}


def merge(data: dict) -> None:
    """Add another process's `snapshot()`."""
    for group, found in data["groups"].items():
        _PAIRS.setdefault(group, set()).update((subject, release) for subject, release in found["pairs"])
        _VALUES.setdefault(group, Counter()).update(found["values"])
    _ANSWERS.update(data["answers"])


def summary() -> list[str]:
    """One line per group: subjects x releases, the pairs compared, each field's values."""
    lines = []
    for group in sorted(_PAIRS):
        pairs = _PAIRS[group]
        subjects = {s for s, _ in pairs}
        releases = {r for _, r in pairs}
        values = _VALUES[group]
        fields = ", ".join(f"{name} {values[name]:,}" for name in sorted(values))
        lines.append(
            f"conformance {group}: {len(subjects)} subjects x {len(releases)} releases = {len(pairs)} compared; "
            f"{len(values)} fields: {fields}"
        )
    if _ANSWERS:
        lines.append(
            f"conformance oracle answers: {_ANSWERS['cached']:,} read from the cache (each verified against its key), "
            f"{_ANSWERS['computed']:,} computed by vLLM"
        )
    return lines
