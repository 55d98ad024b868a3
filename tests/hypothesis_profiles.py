"""The property tests' example counts, in one place: tests/conftest.py loads the profile that
HYPOTHESIS_PROFILE names.

- ci (the default, what `.ci/run` runs): each test's own count (its `@settings(max_examples=...)`),
  Hypothesis's 100 where it gives none.
- deep (a deliberate long run, `HYPOTHESIS_PROFILE=deep .venv/bin/python -m pytest tests`): ten
  times each test's count, 1000 where it gives none.

A test's own `@settings(max_examples=...)` outranks any profile in Hypothesis, so the deep
profile is applied to the collected tests: `scale` multiplies the count each one carries
(Hypothesis keeps a test's settings on its function, `_hypothesis_internal_use_settings`, and
reads them when the test runs).
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import settings

PROFILES = ("ci", "deep")
DEEP_FACTOR = 10

settings.register_profile("ci", settings.get_profile("default"))
settings.register_profile("deep", settings.get_profile("default"))  # its counts: `scale`, at collection


def load(name: str | None) -> str:
    """Load the profile `name` (None or empty: ci); the name loaded. ValueError names the choices."""
    name = name or "ci"
    if name not in PROFILES:
        raise ValueError(f"HYPOTHESIS_PROFILE={name}: no such profile; use one of {', '.join(PROFILES)}")
    settings.load_profile(name)
    return name


def scale(tests: Iterable[object], factor: int) -> int:
    """Multiply the example count of each Hypothesis test among `tests` (each function once, however
    many parametrized items share it) by `factor`; how many were scaled."""
    seen: set[int] = set()
    for test in tests:
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is None or not getattr(test, "is_hypothesis_test", False) or id(test) in seen:
            continue
        seen.add(id(test))
        test._hypothesis_internal_use_settings = settings(own, max_examples=own.max_examples * factor)
    return len(seen)
