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

from capplan.calibration.price import _plans_of

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
    from capplan.calibration.price import plan_pair_errors, project_calibrations

    pred = json.loads((results / "predictions.json").read_text())
    before = [c for c in project_calibrations() if c.name in pred["calibrations"]]
    band = {w: pred["pair_band"][w]["band"] for w in ("seconds", "gib")}
    out: list[Judged] = []
    for shape, cal in calibrations(results).items():
        probe = next(s for s in cal.starts if s.captures)  # type: ignore[attr-defined]
        plan_a = probe.fingerprint[7:19]
        # each plan priced from the other plan's figures; the memory split the one from before the round
        pairs = plan_pair_errors([cal], split_from=before)  # type: ignore[list-item]
        for what, errs in (("seconds", pairs.seconds), ("gib", pairs.gib)):
            lo, hi = band[what]
            for e in errs:
                plan = "A" if e.changed == plan_a else "B"
                out.append(Judged(shape, what, plan, "pair", e.predicted, e.predicted / (1 + hi),
                                  e.predicted / (1 + lo), e.measured))  # fmt: skip
        by_plan = {"A" if fp[7:19] == plan_a else "B": ss for fp, ss in _plans_of(cal).items()}  # type: ignore[arg-type]
        for plan, measured in sorted(by_plan.items()):
            model = pred["shape_model"].get(f"{shape}/{plan}")
            if model is None:
                continue
            for what, field in (("seconds", "capture_seconds"), ("gib", "graph_memory_gib")):
                value, lo, hi = model[what]
                truth = statistics.median(getattr(s, field) for s in measured)
                out.append(Judged(shape, what, plan, "shape model", value, lo, hi, truth))
    return out


def main() -> None:
    results = Path(sys.argv[1])
    if not (results / "planA.plan.yaml").exists():
        raise SystemExit(f"{results}: no round here (probe_bench.py's planA.plan.yaml and reports)")
    judged = judge(results)
    for j in judged:
        where = "no interval" if j.inside is None else ("inside" if j.inside else "OUTSIDE")
        unit = "s" if j.what == "seconds" else "GiB"
        print(f"{j.shape:13} {j.what:7} plan {j.plan} {j.basis:11} predicted {j.predicted:.4f} "
              f"[{j.lo:.4f}..{j.hi:.4f}] measured {j.measured:.4f} {unit}: {100 * j.error:+.1f}% {where}")  # fmt: skip
    for line in not_measured(results, judged):
        print(line)


def not_measured(results: Path, judged: list[Judged]) -> list[str]:
    """What the round was to measure and did not: each shape of the round with no probe and start
    back, and each shape-model price written beforehand with no measurement of its plan."""
    pred = json.loads((results / "predictions.json").read_text())
    seen = {j.shape for j in judged}
    out = [f"{shape:13} not measured: no probe and start of it came back" for shape in ROUND if shape not in seen]
    priced = {(j.shape, j.plan) for j in judged if j.basis == "shape model"}
    for key in pred["shape_model"]:
        shape, plan = key.split("/")
        if shape in seen and (shape, plan) not in priced:
            out.append(f"{shape:13} plan {plan} shape model: not measured")
    return out


if __name__ == "__main__":
    main()
