"""The vLLM releases capplan supports, from one table of rules (`target.vllm` in a spec).

Model Runner V2's CUDA-graph planning changed five times between vLLM 0.25.0
and 0.33.0. Each change is one flag of `Rules`, read from each release's own
code (docs/vllm-releases.md) and proven by the conformance matrix (`python -m
tests.conformance.matrix`: planning on CPU against each release's code with
`fixes: []`, the runtime's contract and hooks against its classes, DP sync).
A group is the set of releases that share every rule. Each release is one row
of `RELEASES`: its group, the torch it pins, and the signatures of the vLLM
functions capplan hooks that changed between releases.

Everything in capplan that differs between releases reads a flag of the
release's rules or a field of its row; nothing compares release strings.
Adding a release is one row here plus a matrix run (docs/design.md).

A spec names an exact release (`target.vllm: "0.28.0"`), or one of two
aliases kept for the specs and plans written before exact releases were
accepted: "0.25" and "0.33". An alias plans with the rules of its newest
release and runs on every release it covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Rules:
    """How one group of releases plans. Each flag is one change in MRV2's planning code."""

    group: str
    spreads_dummy_remainder: bool = False
    """Dummy batches spread the token remainder one token each over the last requests
    (`make_dummy`, `_dummy_run`, the LoRA capture hook); before, the last request took it all."""
    prefill_breaks_uniform: bool = False
    """A batch with a prefilling request gets no uniform-decode token count (so no decode graph);
    before, any batch whose requests all had the same query length did."""
    max_query_len_in_descriptor: bool = False
    """BatchExecutionDescriptor has `max_query_len`, and dispatch takes it (None with a prefill)."""
    blackwell_ceiling_1024: bool = False
    """The default capture ceiling is 1024 tokens on data-center Blackwell (SM10x), not 512."""
    encoder_graphs: bool = False
    """MRV2 captures multimodal encoder graphs (`cudagraph_mm_encoder`)."""
    per_mode_ranges: bool = False
    """Token ranges are built per mode (FULL candidates, then PIECEWISE); before, over the union
    of every mode's sizes, each range offering only the graphs of its upper size."""
    speculative_decode_sizes: bool = False
    """With speculative decoding, decode sizes n * (1 + num_speculative_tokens) join the default sizes."""
    max_num_seqs_size: bool = False
    """Without speculative decoding, max_num_seqs joins the default sizes (when within the ceiling)."""
    encoder_packing_defers: bool = False
    """Encoder packing starts a new batch for an item that alone needs at least the current
    batch's budget, when their budgets apart are below the budget they would need together."""


A = Rules("A")
B = replace(A, group="B", spreads_dummy_remainder=True)
C = replace(
    B,
    group="C",
    prefill_breaks_uniform=True,
    max_query_len_in_descriptor=True,
    blackwell_ceiling_1024=True,
    encoder_graphs=True,
)
D = replace(C, group="D", per_mode_ranges=True, speculative_decode_sizes=True)
E = replace(D, group="E", max_num_seqs_size=True)
F = replace(E, group="F", encoder_packing_defers=True)
GROUPS = (A, B, C, D, E, F)

# The vLLM functions the runtime hooks or calls, and the parameters it binds by name on each
# release (runtime/registry.py: each hook's entry names one of these targets; the release's
# row holds the signature). A signature ending in "..." only has to be a prefix of the live
# one: vLLM may add parameters after it, which capplan neither reads nor passes.
MANAGER = "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager"
RUNNER = "vllm.v1.worker.gpu.model_runner"
MORE = "..."
CUDART = "vllm.distributed.device_communicators.cuda_wrapper:CudaRTLibrary"
SIGNATURES_A: dict[str, tuple[str, ...]] = {
    f"{MANAGER}._init_candidates": ("self",),
    f"{MANAGER}.dispatch": ("self", "num_reqs", "num_tokens", "uniform_token_count", "num_active_loras"),
    f"{MANAGER}.capture": (
        "self",
        "model",
        "model_state",
        "input_buffers",
        "intermediate_tensors",
        "block_tables",
        "attn_groups",
        "kv_cache_config",
        "has_lora",
        "use_aux_hidden_state_outputs",
        "lora_capture_hook",
        "progress_bar_desc",
    ),  # fmt: skip
    f"{RUNNER}:get_num_active_loras_for_dispatch": ("lora_config", "lora_state", "req_ids", "dummy_run"),
    f"{RUNNER}:create_lora_capture_hook": ("lora_config", "runner"),
    "vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy": ("num_reqs", "num_tokens", "input_buffers"),
    f"{RUNNER}:GPUModelRunner._dummy_run": (
        "self",
        "num_tokens",
        "args",
        "skip_attn",
        "uniform_decode",
        "skip_eplb",
        "is_profile",
        "kwargs",
    ),  # fmt: skip
    f"{RUNNER}:GPUModelRunner.maybe_dummy_run_with_lora": (
        "self",
        "lora_config",
        "num_scheduled_tokens",
        "num_sampled_tokens",
        "remove_lora",
        "num_active_loras",
        MORE,
    ),  # fmt: skip
    f"{RUNNER}:GPUModelRunner.execute_model": ("self", "scheduler_output", "intermediate_tensors", "dummy_run", MORE),
    f"{RUNNER}:GPUModelRunner.sample_tokens": ("self", "grammar_output"),
    f"{RUNNER}:GPUModelRunner.capture_model": ("self", MORE),
    "vllm.config:VllmConfig.compute_hash": ("self",),
    "vllm.v1.worker.gpu.dp_utils:dispatch_cg_and_sync_dp": (
        "cudagraph_manager",
        "num_reqs",
        "num_tokens",
        "uniform_token_count",
        "dp_size",
        "dp_rank",
        MORE,
    ),  # fmt: skip
    "vllm.v1.worker.gpu.dp_utils:sync_cudagraph_and_dp_padding": (
        "cudagraph_manager",
        "desired_batch_desc",
        "num_tokens",
        "num_reqs",
        "uniform_token_count",
        "dp_size",
        "dp_rank",
        MORE,
    ),  # fmt: skip
    "vllm.v1.worker.encoder_cudagraph:EncoderCudaGraphManager.capture": ("self", "graph_pool"),
    "vllm.v1.worker.gpu.async_utils:AsyncOutput.get_output": ("self",),
    "vllm.v1.worker.gpu.async_utils:AsyncPoolingOutput.get_output": ("self",),
    "vllm.utils.gpu_sync_debug:gpu_sync_allowed": ("first_only",),
    f"{CUDART}.cudaMalloc": ("self", "size"),
    f"{CUDART}.cudaFree": ("self", "devPtr"),
    "vllm.v1.worker.gpu.block_table:BlockTables.get_dummy_block_tables": ("self", "num_reqs"),
    "vllm.distributed.parallel_state:get_tp_group": (),
    "vllm.distributed.parallel_state:get_pp_group": (),
    "vllm.lora.model_manager:LoRAModelManager._set_adapter_mapping": ("self", "mapping"),
    "vllm.v1.engine.core:EngineCoreProc._process_input_queue": ("self",),
    "vllm.v1.worker.gpu.cudagraph_utils:graph_capture": ("device", MORE),
    "vllm.engine.arg_utils:EngineArgs.create_engine_config": ("self", MORE),
    "vllm.utils.argparse_utils:FlexibleArgumentParser.parse_args": ("self", "args", "namespace"),
    "vllm.v1.worker.gpu_worker:Worker.init_device": ("self",),
}
# What changed, release by release: dispatch and the DP step took max_query_len (0.28.0),
# dispatch num_ubatches (0.30.0); capture took pcp_manager before has_lora, and the runner's memory profiling
# of CUDA graphs came (0.29.0); compute_hash took
# include_version (0.30.0).
_DP_STEP = "vllm.v1.worker.gpu.dp_utils:dispatch_cg_and_sync_dp"
SIGNATURES_C = {
    **SIGNATURES_A,
    f"{MANAGER}.dispatch": (*SIGNATURES_A[f"{MANAGER}.dispatch"], "max_query_len"),
    _DP_STEP: (*SIGNATURES_A[_DP_STEP][:-1], "max_query_len", MORE),
}
_CAPTURE = SIGNATURES_A[f"{MANAGER}.capture"]
SIGNATURES_D = {
    **SIGNATURES_C,
    f"{MANAGER}.capture": (*_CAPTURE[:8], "pcp_manager", *_CAPTURE[8:]),
    f"{RUNNER}:GPUModelRunner.profile_cudagraph_memory": ("self",),
}
SIGNATURES_D2 = {
    **SIGNATURES_D,
    f"{MANAGER}.dispatch": (*SIGNATURES_C[f"{MANAGER}.dispatch"], "num_ubatches"),
    "vllm.config:VllmConfig.compute_hash": ("self", "include_version"),
}


@dataclass(frozen=True)
class Release:
    """One supported vLLM release: its group's rules, its torch pin and its hooked signatures."""

    version: str
    rules: Rules
    torch: str
    signatures: dict[str, tuple[str, ...]] = field(compare=False, repr=False)
    """Each hooked vLLM function's parameters on this release (ending in MORE: a prefix)."""
    breakable_pads_requests: bool = False
    """Under VLLM_USE_BREAKABLE_CUDAGRAPH=1 (set by the user, or by vLLM itself for a few
    architectures) mixed PIECEWISE graphs pad requests too: graphs no rule here plans, so
    the runtime refuses the setting on this release."""
    profiling_capture: bool = False
    """vLLM's memory profiling captures the plan's graphs once before the real capture, on a
    throwaway manager and pool (a sample of the FULL graphs, every PIECEWISE one), to estimate
    CUDA-graph memory; the manager's `_capture_mem_samples` is a list while it does. The real
    capture then reuses memory that pass left allocated, so its own reading undercounts what a
    capture run first takes. The pass is `GPUModelRunner.profile_cudagraph_memory`, called by the
    worker's `determine_available_memory` unless the KV cache's size is given: `apply
    --calibration` answers it from starts whose capture ran first, and the pass is skipped.
    Before, MRV2's `profile_cudagraph_memory` returns 0: no estimate, nothing to skip."""

    @property
    def group(self) -> str:
        return self.rules.group

    @property
    def dispatch_ubatches(self) -> bool:
        """vLLM's dispatch takes `num_ubatches` (micro-batching; a descriptor for more than one
        micro-batch runs eager), as this release's signature of it says."""
        return "num_ubatches" in self.signatures[f"{MANAGER}.dispatch"]


RELEASES: dict[str, Release] = {
    r.version: r
    for r in (
        Release("0.25.0", A, "2.11.0", SIGNATURES_A),
        Release("0.25.1", A, "2.11.0", SIGNATURES_A),
        Release("0.26.0", A, "2.11.0", SIGNATURES_A, breakable_pads_requests=True),
        Release("0.27.0", B, "2.13.0", SIGNATURES_A),
        Release("0.27.1", B, "2.13.0", SIGNATURES_A),
        Release("0.28.0", C, "2.13.0", SIGNATURES_C),
        Release("0.29.0", D, "2.13.0", SIGNATURES_D, profiling_capture=True),
        Release("0.30.0", D, "2.13.0", SIGNATURES_D2, profiling_capture=True),
        Release("0.31.0", E, "2.13.0", SIGNATURES_D2, profiling_capture=True),
        Release("0.32.0", F, "2.13.0", SIGNATURES_D2, profiling_capture=True),
        Release("0.33.0", F, "2.14.0", SIGNATURES_D2, profiling_capture=True),
    )
}

# Aliases for specs and plans written before exact releases: the releases each covers. An
# alias plans with its newest release's rules; its releases differ in no rule the plan
# depends on (0.31.0 packs encoder batches without deferring, which the plan does not fix).
ALIASES: dict[str, tuple[str, ...]] = {
    "0.25": ("0.25.0", "0.25.1", "0.26.0"),
    "0.33": ("0.31.0", "0.32.0", "0.33.0"),
}
TARGETS = (*RELEASES, *ALIASES)
"""Every value `target.vllm` accepts."""
# How a plan's text names an alias target, as plans compiled from an alias always have.
_ALIAS_LABELS = {"0.25": "0.25", "0.33": "0.31+"}


def label(target: str) -> str:
    """A `target.vllm` value as a plan's text names it: the release, or an alias's label."""
    return _ALIAS_LABELS.get(target, target)


def release_of(target: str) -> Release:
    """The release whose rules a `target.vllm` value plans with (an alias: its newest)."""
    return RELEASES[ALIASES[target][-1]] if target in ALIASES else RELEASES[target]


def rules_of(target: str) -> Rules:
    return release_of(target).rules


def runs_on(target: str) -> tuple[str, ...]:
    """The releases a plan for this `target.vllm` runs on: an alias's releases, or every
    release of the named release's group."""
    if target in ALIASES:
        return ALIASES[target]
    group = RELEASES[target].rules
    return tuple(v for v, r in RELEASES.items() if r.rules == group)


def installed_release(version: str) -> Release | None:
    """The supported release a `vllm.__version__` string names (a local build suffix such as
    +cu130 ignored), or None."""
    return RELEASES.get(version.split("+", 1)[0])


SUPPORTED = "vLLM " + ", ".join(RELEASES)


def release_problem(target: str, version: str) -> tuple[str, str] | None:
    """(why, fix) when a plan compiled for `target.vllm: target` cannot run on vLLM `version`; None
    when it can."""
    release = installed_release(version)
    if release is None:
        return f"vLLM {version} is not supported by capplan", f"install one of {SUPPORTED}"
    if release.version in runs_on(target):
        return None
    return (
        f"the plan was compiled for vLLM {target} (runs on {', '.join(runs_on(target))}), "
        f"not for vLLM {version}, which plans differently",
        f'recompile it with target.vllm: "{release.version}"',
    )
