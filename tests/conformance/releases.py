"""Which of capplan's supported vLLM releases (capplan.releases) a conformance run checks:
CI the oldest, the newest and one between; the matrix every one."""

from __future__ import annotations

import os

from capplan.releases import SUPPORTED_RELEASES as SEMANTICS

CI_RELEASES = ("0.25.0", "0.32.0", "0.33.0")


def releases() -> tuple[str, ...]:
    """The releases this run checks: CAPPLAN_ORACLE_RELEASES (comma or space separated), else CI's."""
    chosen = os.environ.get("CAPPLAN_ORACLE_RELEASES")
    if not chosen:
        return CI_RELEASES
    found = tuple(r for r in chosen.replace(",", " ").split() if r)
    unknown = [r for r in found if r not in SEMANTICS]
    if unknown:
        raise ValueError(f"CAPPLAN_ORACLE_RELEASES names {unknown}, not in {sorted(SEMANTICS)}")
    return found
