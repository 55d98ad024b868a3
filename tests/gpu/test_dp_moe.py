"""Data parallel on two GPUs: one plan, two ranks, different LoRA mixes (vLLM 0.25.0 MRV2).

A tiny random Mixtral (8 experts) with attention LoRA adapters, DP=2 with
expert parallelism, launched the way vLLM's offline data-parallel example
does (one process per rank, VLLM_DP_* variables; tests/gpu/dp_launch.py):
- reference: specialize_active_lora off, no plan (capplan's plugin is
  installed, so both ranks take part in the plan check saying "no plan");
- planned:   specialize_active_lora on, `capplan apply --runner mrv2 PLAN --
  python dp_launch.py ...`, CAPPLAN_DP_AUDIT=1: outputs must equal the
  reference on every request of both ranks, and the per-rank reports must
  show cross-rank padding with the ranks agreeing on every padded size;
- vanilla:   specialize_active_lora on, no plan: vLLM's own bug (a batch of
  k adapters plus base requests loses an adapter) shows under DP too;
- mismatch:  rank 1 gets a plan for max_loras 8: both ranks stop before any
  capture, rank 0 naming rank 1, and nothing hangs.
Needs two GPUs (device kind nvidia-h200-x2) and the MOE=1 bundle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("CAPPLAN_GPU_OUT", "/tmp/capplan-gpu"))
SPEC = """\
target: {{runner: mrv2, vllm: "{version}"}}
scheduler: {{max_num_seqs: 32, max_num_batched_tokens: 2048, max_model_len: 512}}
cudagraph: {{mode: FULL_AND_PIECEWISE}}
lora: {{enabled: true, max_loras: {max_loras}, specialize: true, specialize_active: true}}
parallel: {{data_parallel_size: 2, moe: true}}
"""


def _two_gpus() -> bool:
    try:
        import torch

        return torch.cuda.device_count() >= 2
    except ImportError:
        return False


pytestmark = pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs (device kind nvidia-h200-x2)")


def _save(name: str, data: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"gpu_dp_{name}.json").write_text(json.dumps(data, indent=2))


def _compile(work: Path, name: str, version: str, max_loras: int) -> Path:
    spec = work / f"{name}.yaml"
    spec.write_text(SPEC.format(version=version, max_loras=max_loras))
    plan = work / f"{name}.plan.yaml"
    subprocess.run([sys.executable, "-m", "capplan.cli", "compile", str(spec), "-o", str(plan)], check=True)
    return plan


def _launch(
    name: str, model: Path, work: Path, specialize: int, plan: Path | None = None, rank1_plan: Path | None = None
) -> dict:
    out = work / name
    env = {**os.environ, "CAPPLAN_DP_AUDIT": "1"}
    env.pop("CAPPLAN_PLAN", None)
    launch = [
        sys.executable,
        str(HERE / "dp_launch.py"),
        str(model),
        str(out),
        "--specialize-active",
        str(specialize),
        "--timeout",
        "240",
    ]
    if rank1_plan is not None:
        launch += ["--rank1-plan", str(rank1_plan)]
    if plan is not None:
        cmd = [
            sys.executable,
            "-m",
            "capplan.cli",
            "apply",
            "--runner",
            "mrv2",
            str(plan),
            "--report",
            str(out / "report.{rank}.json"),
            "--",
            *launch,
        ]
    else:
        cmd = launch
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    logs = [(out / f"rank{r}.log").read_text() if (out / f"rank{r}.log").exists() else "" for r in (0, 1)]
    data = {
        "cmd": " ".join(cmd),
        "returncode": proc.returncode,
        "launcher": (proc.stdout + proc.stderr)[-1500:],
        "log_tail": [
            [ln for ln in log.splitlines() if "capplan" in ln or "Graph capturing finished" in ln or "done:" in ln][
                -14:
            ]
            for log in logs
        ],
        "logs": logs,
        "ranks": [],
    }
    for r in (0, 1):
        result = out / f"rank{r}.json"
        report = out / f"report.{r}.json"
        data["ranks"].append(
            {
                "results": json.loads(result.read_text()) if result.exists() else None,
                "report": json.loads(report.read_text()) if report.exists() else None,
            }
        )
    return data


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import vllm

    sys.path.insert(0, str(HERE))
    from make_model import build_moe

    work = tmp_path_factory.mktemp("gpu-dp")
    model = work / "moe"
    build_moe(model)
    from capplan.runtime.versions import detect_release

    version = detect_release(vllm.__version__).version
    return work, model, version


@pytest.fixture(scope="module")
def runs(setup):
    work, model, version = setup
    plan = _compile(work, "dp", version, 4)
    runs = {
        "reference": _launch("reference", model, work, 0),
        "planned": _launch("planned", model, work, 1, plan),
        "vanilla": _launch("vanilla", model, work, 1),
    }
    _save(
        "runs",
        {
            name: {k: v for k, v in run.items() if k != "logs"}
            | {
                "ranks": [
                    {"report": r["report"], "startup_s": (r["results"] or {}).get("startup_s")} for r in run["ranks"]
                ]
            }
            for name, run in runs.items()
        },
    )
    return runs


def _outputs(run: dict) -> dict:
    out = {}
    for r, rank in enumerate(run["ranks"]):
        assert rank["results"] is not None, "\n".join(run["logs"][r].splitlines()[-40:])
        for row in rank["results"]["results"]:
            out[(r, row["round"], row["req"])] = row
    return out


def test_both_launches_finish(runs):
    for name, run in runs.items():
        assert run["returncode"] == 0, f"{name}: {run['launcher']}\n" + "\n".join(run["logs"][0].splitlines()[-30:])


def test_planned_outputs_equal_reference_on_both_ranks(runs):
    ref, planned = _outputs(runs["reference"]), _outputs(runs["planned"])
    assert ref.keys() == planned.keys() and len(ref) > 60
    differing = sorted(k for k in ref if ref[k]["tokens"] != planned[k]["tokens"])
    worst = max(
        abs(a - b)
        for k in ref
        for a, b in zip(ref[k]["logprobs"], planned[k]["logprobs"])
        if a is not None and b is not None
    )
    _save("compare", {"requests": len(ref), "differing": [list(k) for k in differing], "worst_logprob_diff": worst})
    assert differing == [], f"{len(differing)} requests differ: {differing[:8]}"


def test_upstream_bug_without_plan_under_dp(runs):
    """vLLM's own behaviour with specialize_active_lora (expected wrong): rank 0's
    k-adapters-plus-base batches lose an adapter. Shows the comparison can fail."""
    ref, vanilla = _outputs(runs["reference"]), _outputs(runs["vanilla"])
    differing = sorted(k for k in ref if ref[k]["tokens"] != vanilla[k]["tokens"])
    _save(
        "vanilla",
        {
            "differing": [list(k) for k in differing],
            "batches": sorted(
                {f"rank {k[0]}: {ref[k]['adapters']} adapters{' + base' if ref[k]['base'] else ''}" for k in differing}
            ),
        },
    )
    assert differing, "expected vLLM without the plan to drop an adapter in some batch"
    assert all(ref[k]["base"] for k in differing)


def test_reports_show_cross_rank_padding_and_agreement(runs):
    reports = [rank["report"] for rank in runs["planned"]["ranks"]]
    assert all(reports), "a rank wrote no report"
    for r, report in enumerate(reports):
        dp = report["dp"]
        assert dp["rank"] == r and dp["size"] == 2
        assert report["graphs_captured"] == report["graphs_planned"]
        assert dp["audited_steps"] > 0 and dp["token_disagreements"] == 0
        assert report["dispatch"]["graph_hits"] > 0
    assert sum(rep["dp"]["padded_to_other_rank"] for rep in reports) > 0
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"]


def test_mismatched_plan_on_one_rank_stops_both(setup):
    work, model, version = setup
    plan = _compile(work, "dp-ok", version, 4)
    wrong = _compile(work, "dp-wrong", version, 8)
    run = _launch("mismatch", model, work, 1, plan, rank1_plan=wrong)
    _save("mismatch", {k: v for k, v in run.items() if k not in ("logs", "ranks")})
    assert run["returncode"] not in (0, 124), run["launcher"]  # failed, and did not hang
    for log in run["logs"]:
        assert "Graph capturing finished" not in log
    for rank, log in enumerate(run["logs"]):
        assert f"capplan (rank {rank}): the engine's ranks loaded different plans" in log  # world rank = DP rank (TP 1)
        assert "Rank 1 also refused its own plan" in log and "lora.max_loras: plan 8, engine 4" in log
