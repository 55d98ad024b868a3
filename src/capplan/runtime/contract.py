"""capplan's contract with vLLM: everything the runtime hooks or relies on, in one table.

Each entry names a vLLM function (module:qualname), the releases it is hooked on
(`applies`, a test of the release's row in capplan.releases; every release when
unset), the parameters it must have (a prefix when `prefix` is set; the
release row's signature for the hooks whose parameters changed between
releases), the private attributes capplan reads or writes on its
instances (checked on the live object before the first write, since they
are set in __init__ and a class does not carry them), and why: the failure
class the hook prevents (docs/design.md). If vLLM renamed any of them, the
hook would write a new attribute and vLLM would keep its own: the plan
would quietly not be in force. So every entry is checked before it is used,
and any drift refuses the engine at start with the entry's name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from capplan.errors import EngineRefusal
from capplan.releases import Release


class IncompatibleVllm(EngineRefusal):
    """vLLM is not a version, or not shaped the way, capplan's hooks expect."""


def _every(release: Release) -> bool:
    return True


def _piles_remainder(release: Release) -> bool:
    return not release.rules.spreads_dummy_remainder


def _has_encoder_graphs(release: Release) -> bool:
    return release.rules.encoder_graphs


def _profiles_graphs(release: Release) -> bool:
    return release.profiling_capture


def _captures_once(release: Release) -> bool:
    return not release.profiling_capture


def _defers(release: Release) -> bool:
    return release.deferred_capture


@dataclass(frozen=True)
class Hook:
    target: str  # "module:Class.method" or "module:function"
    params: tuple[str, ...] | Callable[[Release], tuple[str, ...]]  # fixed, or the release row's
    why: str
    attributes: tuple[str, ...] = ()  # private state on the instance the hook touches
    prefix: bool = False  # params only has to be a prefix (vLLM added optional ones)
    applies: Callable[[Release], bool] = _every

    def expected(self, release: Release) -> tuple[str, ...]:
        return self.params(release) if callable(self.params) else self.params


MANAGER = "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager"
RUNNER = "vllm.v1.worker.gpu.model_runner"
MANAGER_STATE = (
    "_capture_descs",
    "_candidates",
    "_lora_dispatch_map",
    "_max_lora_case",
    "_graphs_captured",
    "vllm_config",
    "cudagraph_mode",
    "lora_capture_cases",
    "decode_query_len",
)
PROFILING_MARK = "_capture_mem_samples"  # a list while vLLM's memory profiling captures, None otherwise
RECORDED_STATE = ("lora_config", "dp_rank", "dp_size", "decode_query_len", "parallel_config")
DUMMY_BATCH_FIELDS = (
    "num_scheduled_tokens",
    "query_start_loc_np",
    "query_start_loc",
    "logits_indices",
    "seq_lens_cpu_upper_bound",
)

CONTRACT: tuple[Hook, ...] = (
    Hook(
        f"{MANAGER}._init_candidates",
        ("self",),
        "install the plan's capture list, candidate table and LoRA map; refuse a plan that does not match "
        "the engine (classes 3, 6, 8)",
        MANAGER_STATE,
    ),
    Hook(
        f"{MANAGER}.dispatch",
        lambda release: release.dispatch,
        "dispatch every step through the plan's table (classes 6, 8)",
        ("_graphs_captured",),
    ),
    Hook(
        f"{MANAGER}.capture",
        ("self",),
        "time capture and count graphs for the report",
        prefix=True,
        applies=_captures_once,
    ),
    Hook(
        f"{MANAGER}.capture",
        ("self",),
        "time capture and count graphs for the report; tell vLLM's memory-profiling capture (graphs it "
        "discards) from the real one",
        (PROFILING_MARK,),
        prefix=True,
        applies=_profiles_graphs,
    ),
    Hook(
        f"{RUNNER}:get_num_active_loras_for_dispatch",
        ("lora_config", "lora_state", "req_ids", "dummy_run"),
        "count kernel slots, not adapters, under lora_slot (class 6)",
        ("lora_requests",),
    ),
    Hook(
        f"{RUNNER}:create_lora_capture_hook",
        ("lora_config", "runner"),
        "warm each LoRA graph with the plan's dummy adapter ids, -1 row included (classes 1, 2, 3, 6)",
        ("_set_active_loras",),
    ),
    Hook(
        "vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy",
        ("num_reqs", "num_tokens", "input_buffers"),
        "spread the dummy token remainder under dummy_remainder (class 5)",
        DUMMY_BATCH_FIELDS,
        applies=_piles_remainder,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner._dummy_run",
        ("self", "num_tokens", "args", "skip_attn", "uniform_decode", "skip_eplb", "is_profile", "kwargs"),
        "spread the remainder in profile, warm-up and DP idle dummy runs (class 5)",
        applies=_piles_remainder,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner.maybe_dummy_run_with_lora",
        ("self", "lora_config", "num_scheduled_tokens", "num_sampled_tokens", "remove_lora", "num_active_loras"),
        "the dummy LoRA mapping _dummy_run builds (class 5)",
        prefix=True,
        applies=_piles_remainder,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner.execute_model",
        ("self", "scheduler_output", "intermediate_tensors", "dummy_run"),
        "the dummy scheduler output _dummy_run builds (class 5); each real step's batch for the trace recorder; "
        "deferred capture as a step starts",
        RECORDED_STATE,
        prefix=True,
    ),
    Hook(
        "vllm.config:VllmConfig.compute_hash",
        lambda release: release.compute_hash,
        "put the plan fingerprint into vLLM's compile-cache key (class 9)",
    ),
    Hook(
        "vllm.v1.worker.gpu.dp_utils:dispatch_cg_and_sync_dp",
        ("cudagraph_manager", "num_reqs", "num_tokens", "uniform_token_count", "dp_size", "dp_rank"),
        "count what each step runs after DP sync (class 7)",
        prefix=True,
    ),
    Hook(
        "vllm.v1.worker.gpu.dp_utils:sync_cudagraph_and_dp_padding",
        (
            "cudagraph_manager",
            "desired_batch_desc",
            "num_tokens",
            "num_reqs",
            "uniform_token_count",
            "dp_size",
            "dp_rank",
        ),
        "record the DP-agreed size per rank (class 7)",
        prefix=True,
    ),
    Hook(
        "vllm.v1.worker.encoder_cudagraph:EncoderCudaGraphManager.capture",
        ("self", "graph_pool"),
        "check the encoder budgets against the plan; under encoder_lora_eager capture none (class 11)",
        ("token_budgets", "max_batch_size", "max_frames_per_batch", "graph_pool"),
        applies=_has_encoder_graphs,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner.sample_tokens",
        ("self", "grammar_output"),
        "deferred capture between steps only: execute_model sets execute_model_state, sample_tokens clears it",
        ("execute_model_state", "parallel_config"),
        applies=_defers,
    ),
    Hook(
        "vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output",
        ("self",),
        "deferred capture: the async output thread never waits on the GPU while a graph is captured",
        applies=_defers,
    ),
    Hook(
        "vllm.v1.worker.gpu.async_utils:AsyncPoolingOutput.get_output",
        ("self",),
        "deferred capture: the async output thread never waits on the GPU while a graph is captured",
        applies=_defers,
    ),
    Hook(
        "vllm.utils.gpu_sync_debug:gpu_sync_allowed",
        ("first_only",),
        "deferred capture synchronizes the device between steps: allowed under VLLM_GPU_SYNC_CHECK",
        applies=_defers,
    ),
    Hook(
        "vllm.v1.worker.gpu.block_table:BlockTables.get_dummy_block_tables",
        ("self", "num_reqs"),
        "deferred capture: the dummy rows are zeroed first (the null block, as at start-up), so a warm-up "
        "never reads or updates a live request's blocks or state",
        ("input_block_tables",),
        applies=_defers,
    ),
    Hook(
        "vllm.lora.model_manager:LoRAModelManager._set_adapter_mapping",
        ("self", "mapping"),
        "deferred capture: warm a LoRA graph with the plan's dummy mapping, no adapter loaded or evicted "
        "(classes 1, 3, 6)",
        ("lora_index_to_id", "_last_mapping"),
        applies=_defers,
    ),
    Hook(
        "vllm.v1.engine.core:EngineCoreProc._process_input_queue",
        ("self",),
        "deferred capture while the engine core is idle, in every worker through collective_rpc",
        (
            "input_queue",
            "aborts_queue",
            "has_work",
            "is_running",
            "is_sleeping",
            "collective_rpc",
            "_handle_client_request",
            "_notify_idle_state_callbacks",
        ),
        applies=_defers,
    ),
    Hook(
        "vllm.v1.worker.gpu.cudagraph_utils:graph_capture",
        ("device",),
        "deferred capture: every capture on one stream, so later captures reuse the graph pool's segments "
        "(the body capplan runs instead: the TP and PP groups' graph_capture on that stream)",
        prefix=True,
        applies=_defers,
    ),
    Hook(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        ("self",),
        "check plan against the final engine config before anything starts (class 10)",
        prefix=True,
    ),
    Hook(
        "vllm.v1.worker.gpu_worker:Worker.init_device",
        ("self",),
        "refuse an engine vLLM put on its V1 model runner, where no hook applies (class 10)",
        ("use_v2_model_runner", "model_runner"),
    ),
)


def resolve(target: str):
    """The live vLLM object a contract entry names."""
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def entries(release: Release) -> list[Hook]:
    """The contract entries hooked on this release."""
    return [h for h in CONTRACT if h.applies(release)]


def entry(target: str, release: Release) -> Hook:
    (found,) = [h for h in entries(release) if h.target == target]
    return found


def check_signature(hook: Hook, release: Release, fn=None) -> None:
    """IncompatibleVllm unless the live function has the parameters the entry expects on this release."""
    fn = resolve(hook.target) if fn is None else fn
    got = tuple(inspect.signature(fn).parameters)
    want = hook.expected(release)
    ok = got[: len(want)] == want if hook.prefix else got == want
    if not ok:
        raise IncompatibleVllm(
            f"capplan: vLLM's {hook.target} has parameters {got}, expected {want}; "
            "this vLLM is not supported (see capplan's runtime contract)"
        )


def check_attributes(hook: Hook, obj: object) -> None:
    """IncompatibleVllm unless the live object carries every private attribute the entry relies on."""
    missing = [name for name in hook.attributes if not hasattr(obj, name)]
    if missing:
        raise IncompatibleVllm(
            f"capplan: vLLM's {type(obj).__name__} has no {', '.join(missing)} "
            f"(relied on by the hook of {hook.target}); this vLLM is not supported: "
            "the plan could not be in force"
        )


def check_all(release: Release) -> list[str]:
    """Every signature of the contract on this release, checked against the live vLLM;
    the problems found (empty: all hold)."""
    problems = []
    for hook in entries(release):
        try:
            check_signature(hook, release)
        except (IncompatibleVllm, ImportError, AttributeError) as exc:
            problems.append(f"{hook.target}: {exc}")
    return problems
