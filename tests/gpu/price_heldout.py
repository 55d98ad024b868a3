"""The held-out round judged against what was written before it ran (CPU only).

    python tests/gpu/price_heldout.py RESULTS_DIR

RESULTS_DIR holds the round's kept files (probe_bench.py, round `heldout`) and `predictions.json`
(price_predictions.py, written and committed before the round). For each shape: its calibration
from the round's reports alone; the changed plan's price from the deployment's own probe against
its start (the pair band of predictions.json, the pairs measured before); for the shapes no
calibration held, the shape model's price (predictions.json) against the probe and the start.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUND = {  # shape: the round's reports of it, in probe_bench.py's names
    "llama-3.1-8b": ("probe.calibration.report.json", "startB.report.json", "startA.report.json"),
    "qwen2.5-7b": ("probe.calibration.report.json", "startB.report.json"),
    "llama-3.2-3b": ("probe.calibration.report.json", "startB.report.json"),
    "qwen2.5-14b": ("probe.calibration.report.json", "startB.report.json"),
}


@dataclass(frozen=True)
class Judged:
    shape: str
    what: str  # "seconds" or "gib"
    plan: str  # the plan priced (A or B)
    basis: str  # "pair" (the deployment's own probe or start of the other plan) or "shape model"
    predicted: float
    lo: float | None
    hi: float | None
    measured: float

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1

    @property
    def inside(self) -> bool | None:
        return None if self.lo is None or self.hi is None else self.lo <= self.measured <= self.hi


def calibrations(results: Path) -> dict[str, object]:
    """Each shape's calibration from the round's reports that came back (the probe of A first)."""
    from capplan.calibration.shape import shape_from_config
    from capplan.calibration.starts import Given, calibration_from_starts
    from capplan.planfile import load_plan

    plans = [load_plan(results / f"plan{p}.plan.yaml") for p in "AB"]
    out = {}
    for shape, names in ROUND.items():
        reports = [results / f"{shape}-{n}" for n in names if (results / f"{shape}-{n}").exists()]
        if len(reports) < 2 or not reports[0].name.endswith("probe.calibration.report.json"):
            continue
        given = Given(shape=shape_from_config(HERE / "configs" / f"{shape}.json"))
        out[shape] = calibration_from_starts(reports, plans, given, f"{shape}-heldout")
    return out


def judge(results: Path) -> list[Judged]:
    from capplan.calibration.price import (
        _keys_of,
        _plan_of,
        _plans_of,
        capture_seconds,
        memory_split,
        project_calibrations,
        scaled_memory,
    )

    pred = json.loads((results / "predictions.json").read_text())
    before = [c for c in project_calibrations() if c.name in pred["calibrations"]]
    split = memory_split(before)  # the split as it stood before the round
    band = {w: pred["pair_band"][w]["band"] for w in ("seconds", "gib")}
    out: list[Judged] = []
    for shape, cal in calibrations(results).items():
        ident = cal.identity  # type: ignore[attr-defined]
        by_plan = _plans_of(cal)  # type: ignore[arg-type]
        probe = next(s for s in cal.starts if s.captures)  # type: ignore[attr-defined]
        name = {fp: "A" if fp == probe.fingerprint else "B" for fp in {*by_plan, probe.fingerprint}}
        for fp, mine in by_plan.items():
            others = [s for s in cal.starts if s.fingerprint != fp]  # type: ignore[attr-defined]
            if not others:
                continue
            keys = _keys_of(mine[0])
            found = capture_seconds(_plan_of(keys), others)
            truth_s = statistics.median(s.capture_seconds for s in mine)
            if found is not None:
                lo, hi = band["seconds"]
                out.append(Judged(shape, "seconds", name[fp], "pair", found[0], found[0] / (1 + hi),
                                  found[0] / (1 + lo), truth_s))  # fmt: skip
            plan_memory = [s for f, ss in by_plan.items() if f != fp for s in ss]  # memory: a plan's readings
            if not plan_memory:
                continue
            guess, _ = scaled_memory(keys, plan_memory, ident.shape, split)
            lo, hi = band["gib"]
            truth_m = statistics.median(s.graph_memory_gib for s in mine)
            out.append(Judged(shape, "gib", name[fp], "pair", guess, guess / (1 + hi), guess / (1 + lo), truth_m))
        for plan in "AB":
            model = pred["shape_model"].get(f"{shape}/{plan}")
            measured = [s for fp, ss in by_plan.items() if name.get(fp) == plan for s in ss]
            if model is None or not measured:
                continue
            for what, field in (("seconds", "capture_seconds"), ("gib", "graph_memory_gib")):
                value, lo, hi = model[what]
                truth = statistics.median(getattr(s, field) for s in measured)
                out.append(Judged(shape, what, plan, "shape model", value, lo, hi, truth))
    return out


def main() -> None:
    results = Path(sys.argv[1])
    for j in judge(results):
        where = "no interval" if j.inside is None else ("inside" if j.inside else "OUTSIDE")
        unit = "s" if j.what == "seconds" else "GiB"
        print(f"{j.shape:13} {j.what:7} plan {j.plan} {j.basis:11} predicted {j.predicted:.4f} "
              f"[{j.lo:.4f}..{j.hi:.4f}] measured {j.measured:.4f} {unit}: {100 * j.error:+.1f}% {where}")  # fmt: skip


if __name__ == "__main__":
    main()
