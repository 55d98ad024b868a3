"""capplan's contract with vLLM: everything the runtime hooks or relies on, in one table.

Each entry names a vLLM function (module:qualname), the planning semantics it
is hooked under ("0.25", "0.33"), the parameters it must have (a prefix when
`prefix` is set), the private attributes capplan reads or writes on its
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
from dataclasses import dataclass


class IncompatibleVllm(RuntimeError):
    """vLLM is not a version, or not shaped the way, capplan's hooks expect."""


@dataclass(frozen=True)
class Hook:
    target: str  # "module:Class.method" or "module:function"
    semantics: tuple[str, ...]
    params: tuple[str, ...]
    why: str
    attributes: tuple[str, ...] = ()  # private state on the instance the hook touches
    prefix: bool = False  # params only has to be a prefix (vLLM added optional ones)


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
RECORDED_STATE = ("lora_config", "dp_rank", "dp_size", "decode_query_len")
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
        ("0.25", "0.33"),
        ("self",),
        "install the plan's capture list, candidate table and LoRA map; refuse a plan that does not match "
        "the engine (classes 3, 6, 8)",
        MANAGER_STATE,
    ),
    Hook(
        f"{MANAGER}.dispatch",
        ("0.25",),
        ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"),
        "dispatch every step through the plan's table (classes 6, 8)",
        ("_graphs_captured",),
    ),
    Hook(
        f"{MANAGER}.dispatch",
        ("0.33",),
        ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras", "max_query_len", "num_ubatches"),
        "dispatch every step through the plan's table (classes 6, 8)",
        ("_graphs_captured",),
    ),
    Hook(
        f"{MANAGER}.capture", ("0.25", "0.33"), ("self",), "time capture and count graphs for the report", prefix=True
    ),
    Hook(
        f"{RUNNER}:get_num_active_loras_for_dispatch",
        ("0.25", "0.33"),
        ("lora_config", "lora_state", "req_ids", "dummy_run"),
        "count kernel slots, not adapters, under lora_slot (class 6)",
        ("lora_requests",),
    ),
    Hook(
        f"{RUNNER}:create_lora_capture_hook",
        ("0.25", "0.33"),
        ("lora_config", "runner"),
        "warm each LoRA graph with the plan's dummy adapter ids, -1 row included (classes 1, 2, 3, 6)",
        ("_set_active_loras",),
    ),
    Hook(
        "vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy",
        ("0.25",),
        ("num_reqs", "num_tokens", "input_buffers"),
        "spread the dummy token remainder under dummy_remainder (class 5)",
        DUMMY_BATCH_FIELDS,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner._dummy_run",
        ("0.25",),
        ("self", "num_tokens", "args", "skip_attn", "uniform_decode", "skip_eplb", "is_profile", "kwargs"),
        "spread the remainder in profile, warm-up and DP idle dummy runs (class 5)",
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner.maybe_dummy_run_with_lora",
        ("0.25",),
        ("self", "lora_config", "num_scheduled_tokens", "num_sampled_tokens", "remove_lora", "num_active_loras"),
        "the dummy LoRA mapping _dummy_run builds (class 5)",
        prefix=True,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner.execute_model",
        ("0.25",),
        ("self", "scheduler_output", "intermediate_tensors", "dummy_run", "skip_attn_for_dummy_run", "is_profile"),
        "the dummy scheduler output _dummy_run builds (class 5); each real step's batch for the trace recorder",
        RECORDED_STATE,
    ),
    Hook(
        f"{RUNNER}:GPUModelRunner.execute_model",
        ("0.33",),
        ("self", "scheduler_output", "intermediate_tensors", "dummy_run"),
        "each real step's batch for the trace recorder",
        RECORDED_STATE,
        prefix=True,
    ),
    Hook(
        "vllm.config:VllmConfig.compute_hash",
        ("0.25",),
        ("self",),
        "put the plan fingerprint into vLLM's compile-cache key (class 9)",
    ),
    Hook(
        "vllm.config:VllmConfig.compute_hash",
        ("0.33",),
        ("self", "include_version"),
        "put the plan fingerprint into vLLM's compile-cache key (class 9)",
    ),
    Hook(
        "vllm.v1.worker.gpu.dp_utils:dispatch_cg_and_sync_dp",
        ("0.25", "0.33"),
        ("cudagraph_manager", "num_reqs", "num_tokens", "uniform_token_count", "dp_size", "dp_rank"),
        "count what each step runs after DP sync (class 7)",
        prefix=True,
    ),
    Hook(
        "vllm.v1.worker.gpu.dp_utils:sync_cudagraph_and_dp_padding",
        ("0.25", "0.33"),
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
        ("0.33",),
        ("self", "graph_pool"),
        "check the encoder budgets against the plan; under encoder_lora_eager capture none (class 11)",
        ("token_budgets", "max_batch_size", "max_frames_per_batch", "graph_pool"),
    ),
    Hook(
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        ("0.25", "0.33"),
        ("self",),
        "check plan against the final engine config before anything starts (class 10)",
        prefix=True,
    ),
    Hook(
        "vllm.v1.worker.gpu_worker:Worker.init_device",
        ("0.25", "0.33"),
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


def entries(target: str, semantics: str) -> list[Hook]:
    return [h for h in CONTRACT if h.target == target and semantics in h.semantics]


def entry(target: str, semantics: str) -> Hook:
    (found,) = entries(target, semantics)
    return found


def check_signature(hook: Hook, fn=None) -> None:
    """IncompatibleVllm unless the live function has the parameters the entry expects."""
    fn = resolve(hook.target) if fn is None else fn
    got = tuple(inspect.signature(fn).parameters)
    ok = got[: len(hook.params)] == hook.params if hook.prefix else got == hook.params
    if not ok:
        raise IncompatibleVllm(
            f"capplan: vLLM's {hook.target} has parameters {got}, expected {hook.params}; "
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


def check_all(semantics: str) -> list[str]:
    """Every signature of the contract for these semantics, checked against the live vLLM;
    the problems found (empty: all hold)."""
    problems = []
    for hook in CONTRACT:
        if semantics not in hook.semantics:
            continue
        try:
            check_signature(hook)
        except (IncompatibleVllm, ImportError, AttributeError) as exc:
            problems.append(f"{hook.target}: {exc}")
    return problems
