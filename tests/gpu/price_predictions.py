"""What capplan prices each job of the held-out round at, written before that round runs (CPU only).

    python tests/gpu/price_predictions.py OUT.json

For the shapes no calibration holds (`NEW`: Qwen2.5-7B and Llama-3.2-3B), the shape model's price of
plans A and B (probe_bench.py's plans, vLLM 0.33.0, an H100); for every shape of the round, the
interval a changed plan's price from the deployment's own probe will carry (the band of the plan
pairs measured so far, `price.error_band`). After the round, each measured figure is judged against
what this file says, not against a model refitted on the new starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from probe_bench import PLANS, SPEC  # noqa: E402

NEW = ("qwen2.5-7b", "llama-3.2-3b")
GPU = "NVIDIA H100 80GB HBM3"


def main() -> None:
    from capplan.calibration.price import error_band, fit_shape_model, project_calibrations, project_pair_errors
    from capplan.calibration.shape import shape_from_config
    from capplan.planfile import load_plan

    out = Path(sys.argv[1])
    cals = project_calibrations()
    model = fit_shape_model(cals)
    assert model is not None
    pairs = project_pair_errors()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    result: dict = {
        "capplan_commit": commit,
        "what": "prices written before the held-out round ran (CPU only: no vLLM, torch or GPU was used)",
        "command": f"python tests/gpu/price_predictions.py {out.name}",
        "priced_for": {"gpu": GPU, "vllm": "0.33.0", "plans": "probe_bench.py's plans A and B"},
        "calibrations": [c.name for c in cals],
        "pair_band": {
            what: {
                "pairs": [{"calibration": e.calibration, "error": e.error} for e in errs],
                "band": error_band([e.error for e in errs]),
            }  # fmt: skip
            for what, errs in (("seconds", pairs.seconds), ("gib", pairs.gib))
        },
        "shape_model": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        plans = {}
        for name, values in PLANS.items():
            spec, plan = Path(tmp) / f"plan{name}.yaml", Path(tmp) / f"plan{name}.plan.yaml"
            spec.write_text(
                SPEC.format(release="0.33.0", **values).replace("runner: mrv2,", f'runner: mrv2, gpu: "{GPU}",')
            )
            subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)], check=True,
                           capture_output=True)  # fmt: skip
            plans[name] = load_plan(plan)
        for shape_name in NEW:
            shape = shape_from_config(HERE / "configs" / f"{shape_name}.json")
            for name, plan in plans.items():
                p = model.predict(plan, shape, GPU)
                assert p.seconds is not None and p.gib is not None
                result["shape_model"][f"{shape_name}/{name}"] = {
                    "graphs": p.graphs,
                    "seconds": [p.seconds.value, p.seconds.lo, p.seconds.hi],
                    "gib": [p.gib.value, p.gib.lo, p.gib.hi],
                    "text": p.text(),
                    "notes": list(p.notes),
                }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["pair_band"], indent=1))
    for k, v in result["shape_model"].items():
        print(k, v["text"])


if __name__ == "__main__":
    main()
