"""Install a capplan plan into vLLM's real MRV2 classes on CPU and check them.

Run in the oracle venv: PYTHONPATH=SRC/<version>:REPO/src:REPO python runtime_check.py OUT.json
Prints nothing on success; writes a JSON report the pytest side asserts on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "conformance" / "oracle"))

import vllm  # noqa: E402
import vllm.v1.worker.gpu.cudagraph_utils as cg  # noqa: E402
import vllm.v1.worker.gpu.model_runner as runner_mod  # noqa: E402
import vllm_oracle  # noqa: E402

from capplan.loading import spec_from_data  # noqa: E402
from capplan.planner import Batch, Dispatcher, compile_plan  # noqa: E402
from capplan.runtime.engine_check import PlanMismatch  # noqa: E402
from capplan.runtime.versions import detect_release  # noqa: E402

RELEASE = detect_release(vllm.__version__)
SPEC = {
    "target": {"vllm": RELEASE.version},
    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
    "speculative": {"num_speculative_tokens": 1},
}


def model_manager(spec_dict: dict):
    """vLLM's ModelCudaGraphManager for a spec, built as the oracle builds the base class."""
    original = cg.CudaGraphManager
    cg.CudaGraphManager = cg.ModelCudaGraphManager  # the oracle builds whatever this names
    try:
        vllm_oracle.CudaGraphManager = cg.ModelCudaGraphManager
        built = vllm_oracle.build_manager(spec_dict)
    finally:
        cg.CudaGraphManager = original
        vllm_oracle.CudaGraphManager = original
    return built.manager


def row(desc) -> list:
    return [
        desc.cg_mode.name,
        desc.num_tokens,
        desc.num_reqs,
        desc.uniform_token_count,
        getattr(desc, "max_query_len", None),
        desc.num_active_loras,
    ]


# Variant: sizes per LoRA case (capplan optimize's output), which vLLM alone cannot express.
CASE_SIZES = {
    **SPEC,
    "cudagraph": {
        "mode": "FULL_AND_PIECEWISE",
        "capture_sizes": [2, 4, 8, 12, 16, 24, 32],
        "lora_case_sizes": [{"case": 4, "sizes": [8, 32]}, {"case": 5, "sizes": [32]}],
    },
}


# The dummy-run example: 8192 tokens over 100 requests, max_model_len 128 (before vLLM 0.27: one
# request of 173).
DUMMY_SPEC = {
    "target": {"vllm": RELEASE.version},
    "scheduler": {"max_num_seqs": 100, "max_num_batched_tokens": 8192, "max_model_len": 128},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
}


def dummy_run_layout(num_tokens: int, max_num_reqs: int) -> dict:
    """Call vLLM's real GPUModelRunner._dummy_run (as now installed) on a stand-in runner and
    record the per-request token counts it hands to the LoRA dummy mapping and to execute_model."""
    import contextlib

    seen: dict = {}

    @contextlib.contextmanager
    def maybe_dummy_run_with_lora(lora_config, num_scheduled_tokens, *args, **kwargs):
        seen["lora"] = [int(n) for n in num_scheduled_tokens]
        yield

    def execute_model(scheduler_output, *args, **kwargs):
        seen["scheduler"] = list(scheduler_output.num_scheduled_tokens.values())
        seen["dummy_run"] = kwargs.get("dummy_run")

    fake = SimpleNamespace(
        eplb=SimpleNamespace(suppress=contextlib.nullcontext, step=lambda **kwargs: None),
        max_num_reqs=max_num_reqs,
        decode_query_len=1,
        max_num_tokens=num_tokens,
        speculator=None,
        kv_connector=SimpleNamespace(set_disabled=lambda disabled: None),
        is_first_pp_rank=True,
        is_last_pp_rank=False,
        is_encoder_only=False,  # read by 0.28 to 0.30
        lora_config=SimpleNamespace(max_loras=4),
        maybe_dummy_run_with_lora=maybe_dummy_run_with_lora,
        execute_model=execute_model,
    )
    runner_mod.GPUModelRunner._dummy_run(fake, num_tokens, skip_eplb=True)
    seen["instance_attributes_restored"] = (
        fake.execute_model is execute_model and fake.maybe_dummy_run_with_lora is maybe_dummy_run_with_lora
    )
    return seen


def _config_fields_exist() -> list[str]:
    """The fields capplan.settings reads off VllmConfig, looked up on vLLM's real config classes;
    returns the missing ones."""
    import dataclasses

    from vllm.config import (
        CompilationConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    def names(cls) -> set[str]:
        try:
            return {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
        except TypeError:
            return set(getattr(cls, "model_fields", {})) | set(dir(cls))

    wanted = {
        VllmConfig: [
            "scheduler_config",
            "compilation_config",
            "lora_config",
            "model_config",
            "speculative_config",
            "parallel_config",
        ],
        SchedulerConfig: ["max_num_seqs", "max_num_batched_tokens"],
        CompilationConfig: [
            "cudagraph_mode",
            "cudagraph_capture_sizes",
            "max_cudagraph_capture_size",
            "cudagraph_specialize_lora",
        ],
        LoRAConfig: ["max_loras", "specialize_active_lora"],
        ModelConfig: ["max_model_len", "is_moe"],
        SpeculativeConfig: ["num_speculative_tokens"],
        ParallelConfig: ["data_parallel_size"],
    }
    return [f"{cls.__name__}.{field}" for cls, fields in wanted.items() for field in fields if field not in names(cls)]


def runs(counts: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for n in counts:
        if out and out[-1][1] == n:
            out[-1][0] += 1
        else:
            out.append([1, n])
    return out


def main(out: Path, variant: str = "") -> None:
    global SPEC
    if variant == "case-sizes":
        SPEC = CASE_SIZES
    spec = spec_from_data(SPEC, "runtime")
    plan = compile_plan(spec)
    report: dict = {"vllm": vllm.__version__}
    # vLLM's own tables before capplan is installed, for comparison.
    vanilla = model_manager(spec.model_dump(mode="json"))
    report["vanilla_graphs"] = sum(len(v) for v in vanilla._capture_descs.values())
    report["planned_graphs"] = len(plan.graphs)
    # vLLM's own dummy run, before capplan is installed, against what the plan says vLLM does.
    dummy_plan = compile_plan(spec_from_data(DUMMY_SPEC, "dummy"))
    (profile,) = [r for r in dummy_plan.dummy_runs if r.run == "profile"]
    vanilla_dummy = dummy_run_layout(profile.tokens, 100)
    report["dummy_vllm_layout"] = runs(vanilla_dummy["scheduler"])
    report["dummy_vllm_layout_as_planned"] = (
        runs(vanilla_dummy["scheduler"]) == runs(vanilla_dummy["lora"]) == [list(r) for r in profile.vllm]
    )
    report["dummy_plan_layout"] = [list(r) for r in profile.plan]

    from capplan.runtime import registry
    from capplan.runtime.hooking import MARK, resolve

    # The registry, against vLLM's own functions (before capplan replaces them).
    report["contract_problems"] = registry.check_all(RELEASE)
    report["contract_entries"] = len(registry.entries(RELEASE))
    # Installed from the table less one entry (the compile-cache key's): that function is
    # vLLM's own afterwards, and every other entry that applies is in place, marked.
    removed = next(h for h in registry.REGISTRY if h.name == "config.compute_hash")
    untouched = resolve(removed.target)
    table = tuple(h for h in registry.REGISTRY if h is not removed)
    state = registry.install(plan, "runtime.plan.yaml", env={}, table=table)
    report["removed_entry_untouched"] = resolve(removed.target) is untouched
    need = registry.Need(RELEASE, plan, {})
    placed = {h.at or h.target for h in registry.selected(need, table) if h.install is not None}
    report["hooks_installed"] = len(placed)
    report["hooks_marked"] = sorted(p for p in placed if getattr(resolve(p), MARK, None) is not None)
    report["hooks_unmarked"] = sorted(placed - set(report["hooks_marked"]))
    # The same dummy run with the plan in force (the hook is per process: any plan with
    # dummy_remainder installs it; from 0.27 vLLM already spreads and nothing is hooked).
    hooked = dummy_run_layout(profile.tokens, 100)
    report["dummy_hooked_scheduler"] = runs(hooked["scheduler"])
    report["dummy_hooked_lora"] = runs(hooked["lora"])
    report["dummy_hooked_as_planned"] = (
        runs(hooked["scheduler"]) == runs(hooked["lora"]) == [list(r) for r in profile.plan]
    )
    report["dummy_attributes_restored"] = hooked["instance_attributes_restored"]
    manager = model_manager(spec.model_dump(mode="json"))
    captured = [
        row(d)
        for mode in ("PIECEWISE", "FULL")
        for d in manager._capture_descs.get(getattr(cg.CUDAGraphMode, mode), [])
    ]
    report["capture_list_equals_plan"] = captured == [
        [d.cg_mode, d.num_tokens, d.num_reqs, d.uniform_token_count, d.max_query_len, d.num_active_loras]
        for d in plan.descriptors
    ]
    dispatcher = Dispatcher(plan)
    mismatches = 0
    checked = 0
    expected_eager = 0
    counters = state.report
    for r in range(1, 17):
        for t in range(r, 80):
            for k in range(0, min(r, 4) + 1):
                for base in (False, True):
                    if base and k == r:
                        continue
                    q = -(-t // r)
                    u = q if t == q * r else None
                    ours = dispatcher.dispatch(Batch(r, t, q, k, base))
                    count = k + 1 if base and k > 0 else k
                    theirs = manager.dispatch(r, t, u, count)
                    expected_eager += ours.cg_mode == "NONE"
                    checked += 1
                    mismatches += list(ours[:6]) != row(theirs)
    report["dispatch_checked"] = checked
    report["identity"] = counters.identity  # read from vLLM's config when the manager was built
    report["dispatch_mismatches"] = mismatches
    # A batch the plan does not cover runs eager, and is counted.
    report["eager_expected"] = expected_eager
    report["eager_counted"] = counters.eager
    report["graph_hits_counted"] = sum(counters.hits.values())
    # One step through vLLM's step path counts once; a dispatch outside it after that (fast
    # prefill's padding of the logits batch, from 0.30.0) is no step and is not counted.
    before = counters.eager + sum(counters.hits.values())
    step_kwargs = {"num_active_loras": 1}
    if RELEASE.rules.max_query_len_in_descriptor:
        step_kwargs["max_query_len"] = 1
    runner_mod.dispatch_cg_and_sync_dp(manager, 4, 4, 1, 1, 0, **step_kwargs)
    report["step_counted"] = counters.eager + sum(counters.hits.values()) - before
    manager.dispatch(num_reqs=4, num_tokens=3, uniform_token_count=None, num_active_loras=0)
    report["dispatch_after_steps_counted"] = counters.eager + sum(counters.hits.values()) - before - 1

    # The runner's LoRA count: kernel slots under lora_slot.
    lora_state = SimpleNamespace(
        lora_requests={"a": 1, "b": 2}, get_activate_loras=lambda ids: {x for x in ids if x in ("a", "b")}
    )
    count = runner_mod.get_num_active_loras_for_dispatch(
        SimpleNamespace(max_loras=4), lora_state, ["a", "b", "c"], False
    )
    report["slots_for_2_adapters_plus_base"] = count

    # The capture hook warms the max_loras + 1 graph with a -1 (0) row.
    calls = []
    fake_runner = SimpleNamespace(_set_active_loras=lambda p, t, reqs: calls.append((p, t, reqs)))
    hook = runner_mod.create_lora_capture_hook(SimpleNamespace(max_loras=4), fake_runner)
    graph = next(g for g in plan.graphs if g.descriptor.num_active_loras == 5 and g.dummy.num_reqs >= 5)
    hook(5, graph.dummy.num_reqs, graph.descriptor.num_tokens)
    prompt, token, reqs = calls[-1]
    report["case5_prompt_ids"] = sorted(set(prompt))
    report["case5_tokens"] = len(token) == graph.descriptor.num_tokens
    report["case5_requests"] = sorted(r.lora_int_id for r in reqs)

    # The registry: the manager's private state, as the hooks rely on it.
    from capplan.runtime.engine_check import config_problem
    from capplan.runtime.hooking import IncompatibleVllm, check_attributes
    from capplan.runtime.hooks.manager import PROFILING_MARK

    def entry(name: str):
        return next(h for h in registry.entries(RELEASE) if h.name == name)

    try:
        check_attributes(entry("manager.init_candidates"), manager)
        report["manager_state_present"] = True
    except IncompatibleVllm as exc:
        report["manager_state_present"] = str(exc)
    # From 0.29 vLLM's memory profiling captures on a manager whose profiling mark is a list;
    # a manager built for serving has it None (the capture hook tells the two passes apart by it).
    try:
        check_attributes(entry("manager.capture"), manager)
        report["capture_state_present"] = True
    except IncompatibleVllm as exc:
        report["capture_state_present"] = str(exc)
    report["profiling_mark"] = repr(getattr(manager, PROFILING_MARK, "absent"))
    # The early check reads the config the manager was built from (the oracle's stands in
    # for VllmConfig; vLLM's real class is checked for the property the check reads).
    config = manager.vllm_config
    if getattr(config.model_config, "max_model_len", None) is None:
        config.model_config.max_model_len = SPEC["scheduler"]["max_model_len"]
    if getattr(config, "speculative_config", None) is None:
        config.speculative_config = SimpleNamespace(
            num_speculative_tokens=SPEC["speculative"]["num_speculative_tokens"]
        )
    report["config_fields_exist"] = _config_fields_exist()
    report["early_check_same_engine"] = config_problem(plan, "runtime.plan.yaml", config)
    from vllm.config import VllmConfig

    report["uses_v2_runner_attribute"] = isinstance(getattr(VllmConfig, "use_v2_model_runner", None), property)
    config.scheduler_config.max_num_seqs += 1
    report["early_check_other_engine"] = config_problem(plan, "runtime.plan.yaml", config)
    config.scheduler_config.max_num_seqs -= 1
    # Breakable CUDA graphs, read through the release's own vllm.envs.
    from capplan.runtime.engine_check import breakable_problem

    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    report["breakable_refusal"] = breakable_problem(plan, "runtime.plan.yaml", RELEASE)
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "0"
    report["breakable_off_refusal"] = breakable_problem(plan, "runtime.plan.yaml", RELEASE)
    # The same in each process that captures, off the manager vLLM builds with it on (an engine
    # built from a VllmConfig directly never passes the front-end check).
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    try:
        model_manager(spec_from_data(SPEC, "breakable").model_dump(mode="json"))
        report["breakable_manager_refusal"] = None
    except PlanMismatch as exc:
        report["breakable_manager_refusal"] = str(exc)
    del os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"]

    # A mismatched engine stops before capture.
    # (An engine config: capplan's lora_case_sizes means nothing to vLLM, and its
    # cases would not be max_loras 8's.)
    engine = {
        **SPEC,
        "lora": {**SPEC["lora"], "max_loras": 8},
        "cudagraph": {k: v for k, v in SPEC.get("cudagraph", {}).items() if k != "lora_case_sizes"},
    }
    other = spec_from_data(engine, "other").model_dump(mode="json")
    try:
        model_manager(other)
        report["mismatch_error"] = None
    except PlanMismatch as exc:
        report["mismatch_error"] = str(exc)

    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
