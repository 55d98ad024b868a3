"""Which of capplan's supported vLLM releases (capplan.releases) a conformance run checks:
CI one release of each group of rules; the matrix every one."""

from __future__ import annotations

import os

from capplan.releases import RELEASES

CI_RELEASES = ("0.25.0", "0.27.0", "0.28.0", "0.29.0", "0.31.0", "0.33.0")


def releases() -> tuple[str, ...]:
    """The releases this run checks: CAPPLAN_ORACLE_RELEASES (comma or space separated), else CI's."""
    chosen = os.environ.get("CAPPLAN_ORACLE_RELEASES")
    if not chosen:
        return CI_RELEASES
    found = tuple(r for r in chosen.replace(",", " ").split() if r)
    unknown = [r for r in found if r not in RELEASES]
    if unknown:
        raise ValueError(f"CAPPLAN_ORACLE_RELEASES names {unknown}, not in {sorted(RELEASES)}")
    return found


def ends() -> tuple[str, ...]:
    """The oldest and the newest of `releases()`: for a multi-process check, each process importing
    vLLM (tens of seconds on two cores), whose subject differs by no release rule. The matrix,
    one release per run, checks each."""
    chosen = releases()
    return tuple(dict.fromkeys((chosen[0], chosen[-1])))


if __name__ == "__main__":  # .ci/run prepares the oracle for exactly these
    print(" ".join(releases()))
