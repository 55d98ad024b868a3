"""`capplan calibrate SPEC --model DIR -o CAL.yaml`: measure the cost model on a GPU, through vLLM.

Three engines are built from the spec, each in its own process with a plan
in force (capplan's runtime report gives capture seconds and graph memory):

- the spec's own plan: capture cost of the full plan, and the time of a
  decode step replaying each measured size, per LoRA case;
- a small plan (the smallest capture size only): capture cost of a few
  graphs, and the time of an eager decode step at each measured size (every
  size above the smallest runs eager there), per LoRA case;
- a middle plan (every fourth capture size, LoRA off): capture cost only; with
  the other two it separates the cost of a plain graph, of a LoRA graph and
  the one-off cost of the first LoRA graph.

A decode step's time is measured as vLLM runs it: N requests decode together
(`LLM.generate`, greedy, ignore_eos), once for 2 tokens and once for 2 + S;
the difference over S is one step of N tokens (prefill and per-call overhead
cancel). Each LoRA case is driven by a batch that the plan's dispatcher puts
in that case (k adapters, with or without base requests). The result is a
calibration file `show`, `diff`, `simulate` and `optimize` read with
`--calibration`.

DIR holds the base model in DIR/base and LoRA adapters in sibling folders
(as for `capplan apply --smoke`); extra `LLM(...)` keywords come from the
JSON object in CAPPLAN_SMOKE_LLM_ARGS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from capplan.errors import CapplanError
from capplan.schemas.plan import Plan
from capplan.schemas.spec import Spec

DECODE_STEPS = 16  # S: decode steps measured per point
REPEATS = 2  # each timing is the best of this many


def decode_sizes(plan: Plan) -> list[int]:
    """Batch sizes measured: powers of two and the plan's largest decode size, up to max_num_seqs."""
    seqs = plan.spec.scheduler.max_num_seqs
    top = min(seqs, max(plan.capture_sizes) if plan.capture_sizes else seqs)
    sizes = {1 << i for i in range(top.bit_length()) if (1 << i) <= top} | {top}
    return sorted(sizes)


def case_batches(plan: Plan, num_adapters: int, num_reqs: int) -> dict[int, tuple[int, bool]]:
    """For each LoRA case the plan's dispatcher can reach with num_reqs requests: (adapters, base)."""
    from capplan.planner.dispatch import Batch, Dispatcher

    d = Dispatcher(plan)
    found: dict[int, tuple[int, bool]] = {}
    top = min(plan.spec.lora.max_loras, num_adapters) if plan.spec.lora.enabled else 0
    for k in range(0, top + 1):
        for base in (False, True):
            if (k == 0 and base) or k + base > num_reqs:
                continue
            case = d.lora_case(d.lora_count(Batch(num_reqs, num_reqs, 1, k, base)))
            found.setdefault(case, (k, base))
    return found


def _with_sizes(spec: Spec, sizes: list[int]) -> Spec:
    data = spec.model_dump(mode="json")
    data["cudagraph"].update(capture_sizes=sizes, max_capture_size=None, lora_case_sizes=None)
    return Spec.model_validate(data)


def engines(spec: Spec) -> list[tuple[str, Spec, str | None]]:
    """(label, spec, what to measure) for each engine calibrate builds."""
    from capplan.planner.capture_sizes import resolve_capture_sizes

    sizes, top = resolve_capture_sizes(spec)
    if top == 0:
        raise CapplanError("cudagraph.mode is NONE: there are no graphs to calibrate", "set a cudagraph mode")
    middle = _with_sizes(spec, sorted(set(sizes[::-1][::4])))
    if spec.lora.enabled:  # without LoRA: separates the cost of a plain graph from a LoRA graph's
        middle = middle.model_copy(update={"lora": middle.lora.model_copy(update={"enabled": False})})
    return [
        ("own plan", spec, "graph"),
        ("smallest size only", _with_sizes(spec, sizes[:1]), "eager"),
        ("every fourth size" + (", LoRA off" if spec.lora.enabled else ""), middle, None),
    ]


def _child(plan_path: Path, model_dir: Path, measure: str, out: Path, sizes_of: Path) -> None:
    """In an engine process (CAPPLAN_PLAN set): build the engine, time decode steps, write JSON."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    from capplan.offline.smoke import adapters_in, engine_kwargs, env_llm_args
    from capplan.planfile import load_plan

    plan = load_plan(plan_path)
    kwargs = engine_kwargs(plan)
    kwargs.update(env_llm_args())
    llm = LLM(model=str(model_dir / "base"), skip_tokenizer_init=True, seed=0, **kwargs)
    # The plugin writes its report to CAPPLAN_REPORT as soon as capture ends, in the process
    # that captured: with vLLM's default multiprocessing that is the engine core, another
    # process, so the report reaches this one through the file (the plugin is not imported here).
    report: dict[str, Any] | None = None
    report_path = Path(os.environ["CAPPLAN_REPORT"])
    if report_path.exists():
        report = json.loads(report_path.read_text())
    rows: list[dict[str, Any]] = []
    if measure:
        adapters = [LoRARequest(p.name, i, str(p)) for i, p in enumerate(adapters_in(model_dir), 1)]
        sizes = decode_sizes(load_plan(sizes_of))  # the sizes of the spec's own plan
        for n in sizes if measure == "graph" else [n for n in sizes if n > max(plan.capture_sizes)]:
            for case, (k, base) in sorted(case_batches(plan, len(adapters), n).items()):
                loras = [None if (k == 0 or (base and j >= k)) else adapters[j % k] for j in range(n)]
                prompts = [{"prompt_token_ids": [5 + (7 * j + t) % 500 for t in range(8)]} for j in range(n)]

                ms = 1000 * (_timed(llm, prompts, loras, 2 + DECODE_STEPS) - _timed(llm, prompts, loras, 2))
                ms /= DECODE_STEPS
                rows.append({"mode": measure, "case": case, "tokens": n, "ms": round(max(ms, 0.001), 4)})
                print(f"capplan calibrate: {measure} {n} tokens, case {case}: {ms:.3f} ms", file=sys.stderr, flush=True)
    from capplan.files import write_atomic

    write_atomic(out, json.dumps({"report": report, "steps": rows}), handle_signals=False)


def _timed(llm: Any, prompts: list[dict[str, list[int]]], loras: list[Any], tokens: int) -> float:
    """Best wall time of generating `tokens` tokens for every prompt together."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(spec: Spec, spec_name: str, model_dir: Path, name: str | None = None) -> tuple[str, dict[str, Any]]:
    """Run the three engines; return (calibration YAML text, summary)."""
    import importlib.util

    import yaml

    from capplan.files import write_atomic
    from capplan.install_hints import pip_install
    from capplan.offline.smoke import adapters_in, engine_kwargs, env_llm_args
    from capplan.planfile import plan_file_data, render_plan
    from capplan.planner.compiler import compile_plan

    if importlib.util.find_spec("vllm") is None:
        raise CapplanError(
            "calibrate measures through vLLM, which is not installed here",
            f"{pip_install('vllm')} on a GPU machine",
        )
    engine_kwargs(compile_plan(spec))  # refuse what the engines cannot drive, before starting any
    env_llm_args()
    if not (model_dir / "base").is_dir():
        raise CapplanError(f"{model_dir}: expected the base model in {model_dir / 'base'}")
    if spec.lora.enabled and not adapters_in(model_dir):
        raise CapplanError(f"{model_dir}: no LoRA adapters (folders with adapter_config.json)")
    runs, steps, versions = [], [], {}
    with tempfile.TemporaryDirectory(prefix="capplan-calibrate-") as tmp:
        for i, (label, engine_spec, measure) in enumerate(engines(spec)):
            plan = compile_plan(engine_spec)
            plan_path = Path(tmp) / f"engine{i}.plan.yaml"
            write_atomic(plan_path, render_plan(plan, plan_path.name, "capplan calibrate", plan_file_data(plan)))
            out = Path(tmp) / f"engine{i}.json"
            env = {
                **os.environ,
                "VLLM_USE_V2_MODEL_RUNNER": "1",
                "CAPPLAN_PLAN": str(plan_path),
                "CAPPLAN_REPORT": str(Path(tmp) / f"engine{i}.report.json"),
            }
            env.pop("CAPPLAN_TRACE", None)
            print(
                f"capplan calibrate: engine {i + 1}/3 ({label}: {len(plan.graphs)} graphs"
                + (f", timing {measure} decode steps" if measure else "")
                + ")",
                file=sys.stderr,
                flush=True,
            )
            code, tail = _run_engine(
                [
                    sys.executable,
                    "-m",
                    "capplan.offline.calibrate",
                    str(plan_path),
                    str(model_dir),
                    measure or "",
                    str(out),
                    str(Path(tmp) / "engine0.plan.yaml"),
                ],
                env,
            )
            if code != 0 or not out.exists():
                raise CapplanError(
                    f"calibrate: the engine for '{label}' failed (exit {code}); its last lines: "
                    + " | ".join(line.strip() for line in tail if line.strip())
                )
            result = json.loads(out.read_text())
            report = result["report"]
            if not report or report["graph_memory_gib"] is None:
                raise CapplanError(f"calibrate: the engine for '{label}' captured no graphs under the plan")
            lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
            runs.append(
                {
                    "label": f"{label}, {len(plan.graphs)} graphs",
                    "no_lora_graphs": len(plan.graphs) - lora,
                    "lora_graphs": lora,
                    "max_tokens": max(g.descriptor.num_tokens for g in plan.graphs),
                    "capture_seconds": report["capture_seconds"],
                    "graph_memory_gib": report["graph_memory_gib"],
                }
            )
            steps.extend(result["steps"])
    versions = _versions()
    gpu = versions.get("gpu", "GPU").replace("NVIDIA ", "").replace(" ", "-").lower()
    name = name or f"{gpu}-vllm{versions.get('vllm', '')}-{model_dir.name}"
    llm_args = env_llm_args()
    identity: dict[str, Any] = {"model": model_identity(model_dir / "base")}
    identity.update({k: versions[k] for k in ("gpu", "vllm", "torch") if versions.get(k)})
    identity["tensor_parallel_size"] = llm_args.get("tensor_parallel_size", 1)
    identity["pipeline_parallel_size"] = llm_args.get("pipeline_parallel_size", 1)
    header = (
        f"# Calibration written by capplan calibrate {spec_name} --model {model_dir.name}\n"
        f"# vLLM {versions.get('vllm')} Model Runner V2, torch {versions.get('torch')}, {versions.get('gpu')}.\n"
        "# runs: capture seconds and graph memory of three plans (capplan's runtime report).\n"
        f"# step_times: one decode step, N requests of one token each, best of {REPEATS}, "
        f"{DECODE_STEPS} steps per point;\n"
        "#   graph = replaying the N-token graph of that LoRA case, eager = no graph.\n"
    )
    data = {"name": name, "identity": identity, "runs": runs, "step_times": steps}
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)
    return text, data


def model_identity(base: Path) -> dict[str, Any]:
    """What a calibration records of its model: from the Hugging Face config.json and the
    safetensors headers (the parameter count), read without torch."""
    out: dict[str, Any] = {"name": base.parent.name if base.name == "base" else base.name}
    try:
        config = json.loads((base / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        out["architecture"] = archs[0]
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    for key, field in (("hidden_size", "hidden_size"), ("num_hidden_layers", "num_layers")):
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[field] = value
    dtype = config.get("torch_dtype") or config.get("dtype")
    if isinstance(dtype, str) and dtype:
        out["dtype"] = dtype
    total = 0
    for path in sorted(base.glob("*.safetensors")):
        try:
            with open(path, "rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                if not 0 < size <= 100 * 2**20:
                    continue
                header = json.loads(handle.read(size))
        except (OSError, ValueError):
            continue
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list):
                count = 1
                for dim in entry["shape"]:
                    count *= int(dim)
                total += count
    if total:
        out["parameters"] = total
    return out


def _run_engine(command: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run one engine process, passing capplan's own lines through as progress; (exit code,
    the last lines of its stderr)."""
    from collections import deque

    tail: deque[str] = deque(maxlen=8)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        tail.append(line.rstrip())
        if line.startswith("capplan"):
            print(line.rstrip(), file=sys.stderr, flush=True)
    return proc.wait(), list(tail)


def _versions() -> dict[str, str]:
    """vLLM, torch and GPU names, asked of the Python that runs the engines."""
    probe = (
        "import json, torch, importlib.metadata as m\n"
        "print(json.dumps({'vllm': m.version('vllm'), 'torch': torch.__version__, "
        "'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}))"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
        versions: dict[str, str] = json.loads(proc.stdout)  # the probe prints one object of strings
        return versions
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


if __name__ == "__main__":
    _child(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5]))
