"""`capplan apply --runner mrv2 PLAN --smoke DIR`: a short offline check on a GPU.

Builds the engine the plan describes twice, each in its own process: once
eager (no graphs, no plan) and once with CUDA graphs and the plan in force;
generates the same LoRA batches (k adapters, with and without base-model
requests) greedily on both and compares tokens and logprobs.

DIR holds the base model in `DIR/base` and LoRA adapters in sibling folders
with an `adapter_config.json` (the layout tests/gpu/make_model.py writes).
Extra `LLM(...)` keywords (attention_backend, gpu_memory_utilization, ...)
come from the JSON object in CAPPLAN_SMOKE_LLM_ARGS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from capplan.errors import CapplanError, printable
from capplan.schemas.plan import Plan

REQS_PER_BATCH = 8
MAX_TOKENS = 8

T = TypeVar("T")


def engine_kwargs(plan: Plan) -> dict[str, Any]:
    """LLM(...) keywords that make the engine match the plan's fingerprint."""
    spec = plan.spec
    if spec.speculative.num_speculative_tokens or spec.parallel.data_parallel_size > 1:
        raise CapplanError(
            "--smoke drives single-rank engines without speculative decoding",
            "smoke-test a copy of the spec with those set to 0 and 1",
        )
    kwargs: dict[str, Any] = dict(
        max_num_seqs=spec.scheduler.max_num_seqs,
        max_num_batched_tokens=spec.scheduler.max_num_batched_tokens,
        max_model_len=spec.scheduler.max_model_len,
        compilation_config={
            "cudagraph_mode": spec.cudagraph.mode.value,
            "cudagraph_capture_sizes": plan.capture_sizes,
            "cudagraph_specialize_lora": spec.lora.specialize,
        },
    )
    if spec.lora.enabled:
        kwargs.update(
            enable_lora=True, max_loras=spec.lora.max_loras, specialize_active_lora=spec.lora.specialize_active
        )
    return kwargs


LLM_ARGS_ENV = "CAPPLAN_SMOKE_LLM_ARGS"


def env_llm_args() -> dict[str, Any]:
    """CAPPLAN_SMOKE_LLM_ARGS: a JSON object of `LLM(...)` keyword arguments (unset: none),
    bounded like capplan's other JSON readers; CapplanError naming the variable otherwise."""
    from capplan.files import json_value

    raw = os.environ.get(LLM_ARGS_ENV, "")
    if not raw.strip():
        return {}
    if len(raw) > 64 * 1024:
        raise CapplanError(f"{LLM_ARGS_ENV}: {len(raw)} characters (at most 65536)", "pass only LLM keyword arguments")
    try:
        data = json_value(raw)
    except ValueError as exc:
        raise CapplanError(
            f"{LLM_ARGS_ENV}: not JSON ({printable(str(exc))[:80]})",
            'give a JSON object of LLM keyword arguments, e.g. {"max_model_len": 512}',
        ) from None
    if not isinstance(data, dict):
        raise CapplanError(f"{LLM_ARGS_ENV}: must be a JSON object of LLM keyword arguments")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = data.get(name, 1)
        if type(size) is not int or not 1 <= size <= 1024:
            raise CapplanError(f"{LLM_ARGS_ENV}: {name} must be an integer from 1 to 1024")
    return data


def adapters_in(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.iterdir() if (p / "adapter_config.json").exists())


def batches(max_loras: int, num_adapters: int) -> list[tuple[int, bool]]:
    top = min(max_loras, num_adapters)
    return [(k, base) for k in range(1, top + 1) for base in (True, False)] + [(0, True)]


def assign_adapters(adapters: list[T], k: int, base: bool, num_reqs: int) -> list[T | None]:
    """Per request: one of the first k adapters in turn, or None (base model) for
    every other request when `base`; so the batch holds exactly k distinct adapters
    (num_reqs >= 2k) plus the no-adapter slot when `base` is on."""
    loras: list[T | None] = []
    used = 0
    for j in range(num_reqs):
        if k == 0 or (base and j % 2 == 1):
            loras.append(None)
        else:
            loras.append(adapters[used % k])
            used += 1
    return loras


def _worker(model_dir: Path, out: Path, plan_path: Path, eager: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from capplan.planfile import load_plan

    plan = load_plan(plan_path)
    kwargs = engine_kwargs(plan)
    if eager:
        kwargs.pop("compilation_config")
    kwargs.update(env_llm_args())
    llm = LLM(model=str(model_dir / "base"), skip_tokenizer_init=True, seed=0, enforce_eager=eager, **kwargs)
    vocab = json.loads((model_dir / "base" / "config.json").read_text()).get("vocab_size", 1000)
    adapter_dirs = adapters_in(model_dir)
    adapters = [LoRARequest(p.name, i, str(p)) for i, p in enumerate(adapter_dirs, 1)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1, detokenize=False)
    results = []
    max_loras = plan.spec.lora.max_loras if plan.spec.lora.enabled else 0
    for b, (k, base) in enumerate(batches(max_loras, len(adapters))):
        prompts = [
            {"prompt_token_ids": [(31 * b + 17 * j + t) % (vocab - 10) + 5 for t in range(4 + j)]}
            for j in range(REQS_PER_BATCH)
        ]
        loras = assign_adapters(adapters, k, base, REQS_PER_BATCH)
        for j, o in enumerate(llm.generate(prompts, params, lora_request=loras, use_tqdm=False)):
            c = o.outputs[0]
            results.append(
                {
                    "batch": b,
                    "adapters": k,
                    "base": base,
                    "req": j,
                    "tokens": list(c.token_ids),
                    "logprobs": [max(lp.values(), key=lambda x: x.logprob).logprob for lp in (c.logprobs or [])],
                }
            )
    from capplan.files import write_atomic

    write_atomic(out, json.dumps(results), handle_signals=False)


def run_smoke(plan_path: Path, model_dir: Path, tolerance: float = 0.1) -> tuple[bool, str]:
    """Run the eager and the planned engine; return (passed, report text)."""
    from capplan.planfile import load_plan

    plan = load_plan(plan_path)
    engine_kwargs(plan)  # fail early on what smoke cannot drive
    env_llm_args()
    if not (model_dir / "base").is_dir():
        raise CapplanError(f"{model_dir}: expected the base model in {model_dir / 'base'}")
    if plan.spec.lora.enabled and not adapters_in(model_dir):
        raise CapplanError(f"{model_dir}: no LoRA adapters (folders with adapter_config.json)")
    runs = {}
    with tempfile.TemporaryDirectory(prefix="capplan-smoke-") as tmp:
        for name, eager in (("eager", True), ("planned", False)):
            out = Path(tmp) / f"{name}.json"
            env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_CACHE_ROOT": str(Path(tmp) / f"cache-{name}")}
            env.pop("CAPPLAN_PLAN", None)
            if not eager:
                env["CAPPLAN_PLAN"] = str(plan_path.resolve())
            print(f"capplan smoke: starting the {name} engine", file=sys.stderr, flush=True)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "capplan.offline.smoke",
                    str(model_dir),
                    str(out),
                    str(plan_path),
                    "--eager" if eager else "--graphs",
                ],
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
                raise CapplanError(f"smoke: the {name} engine failed:\n{tail}")
            runs[name] = {(r["batch"], r["req"]): r for r in json.loads(out.read_text())}
    lines, failures, ties = [], 0, 0
    for key, ref in sorted(runs["eager"].items()):
        got = runs["planned"][key]
        # Compare up to and including the first differing token: graphs and
        # eager may pick different tokens on a near-tie (top-1 logprobs within
        # tolerance there); a skipped adapter shifts logprobs well before that.
        split = next((i for i, (a, b) in enumerate(zip(ref["tokens"], got["tokens"])) if a != b), None)
        upto = len(ref["logprobs"]) if split is None else split + 1
        worst = max((abs(a - b) for a, b in zip(ref["logprobs"][:upto], got["logprobs"][:upto])), default=0.0)
        if worst > tolerance:
            failures += 1
            lines.append(
                f"  batch {key[0]} ({ref['adapters']} adapters{' + base' if ref['base'] else ''}) "
                f"request {key[1]}: max |logprob diff| {worst:.3f}"
                + ("" if split is None else f", tokens differ from position {split}")
            )
        elif split is not None:
            ties += 1
    total = len(runs["eager"])
    verdict = (
        f"capplan smoke: {total - failures}/{total} requests match eager (tolerance {tolerance}"
        + (f"; {ties} diverged at a near-tie" if ties else "")
        + ")"
    )
    return failures == 0, "\n".join([verdict, *lines])


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] == "--eager")
