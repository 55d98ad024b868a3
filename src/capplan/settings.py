"""The vLLM settings a plan pins, in one table (`SETTINGS`): one row per setting.

A row says how the plan gives the setting's value, how vLLM's final config holds it (and,
where the CUDA-graph manager resolves it itself, the manager), how vLLM's command line
spells it (a flag, its short alias, a switch's `--no-` form, a compilation-config or
speculative-config key), and the releases it applies to. Everything that compares a plan
with vLLM derives from this table:

- `capplan apply` (capplan.launcher): which flags of a command contradict the plan, which
  are added where the command leaves them out, how vLLM's own parser's answer is read;
- `capplan flags`: the flags a plan needs (the completion of an empty command);
- the in-engine checks (capplan.runtime.engine_check): the plan against vLLM's final
  config before the engine starts, against the graph manager in every process that captures.

Pinning one more setting is one more row. Pure: imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from capplan.releases import Release, release_of
from capplan.schemas.plan import Plan

# vLLM's two JSON configs on the command line (each also takes dotted keys: -cc.cudagraph_mode=FULL)
COMPILATION_FLAGS = ("--compilation-config", "-cc")
SPECULATIVE_FLAGS = ("--speculative-config", "-sc")

_ABSENT = object()


def _itself(value: Any) -> object:
    return value


@dataclass(frozen=True)
class Read:
    """How a setting is read off a vLLM object: an attribute path from it (`a.b`; an attribute
    ending in `?` may be absent, and then the value is `missing`; any other absent attribute is
    an AttributeError), then `convert` (applied to `missing` too)."""

    path: str
    convert: Callable[[Any], object] = _itself
    missing: object = None

    def of(self, obj: Any) -> object:
        for name in self.path.split("."):
            if name.endswith("?"):
                obj = getattr(obj, name[:-1], _ABSENT)
                if obj is _ABSENT:
                    return self.convert(self.missing)
            else:
                obj = getattr(obj, name)
        return self.convert(obj)


def _always(plan: Plan) -> bool:
    return True


def _never(plan: Plan) -> bool:
    return False


Kind = Literal["int", "bool", "int_list", "mode", "choice"]


@dataclass(frozen=True)
class Setting:
    """One vLLM setting a plan pins. Only `name` and `plan` are needed; every other field
    says where else the setting lives, and what differs from the plain case."""

    name: str
    """The setting as messages name it (the spec's field where it is one: `lora.max_loras`)."""
    plan: Callable[[Plan], object] | None
    """Its value in the plan (None: a flag the plan only checks, as `conflict` says)."""
    config: Read | None = None
    """How vLLM's final VllmConfig holds it (the front-end check, before the engine starts)."""
    manager: Read | None = None
    """How the CUDA-graph manager holds it, where the manager resolves it itself (the check in
    each process that captures reads the rest off the manager's `vllm_config`)."""
    flag: str | None = None
    """vLLM's command-line flag (a switch when `kind` is bool: `--no-FLAG` sets it false)."""
    aliases: tuple[str, ...] = ()
    """Short spellings of the flag (`-tp`)."""
    kind: Kind = "int"
    """What the flag and the JSON keys take; "int_list" flags take one or more integers, "choice"
    flags one of `choices`."""
    choices: tuple[str, ...] = ()
    """The values a "choice" flag takes (vLLM's parser refuses any other)."""
    human: bool = False
    """The flag takes vLLM's human-readable integers (1k = 1000, 1K = 1024)."""
    from_model: bool = False
    """`auto` or -1 on the flag leave the value to the model: not read from the command."""
    from_gpu: bool = False
    """vLLM's default depends on the GPU it starts on (its memory and name) and on how it is started
    (`vllm serve` or `LLM`): the plan cannot know it, so it is never added to an operator's command."""
    negatable: bool = False
    """Completed as `--no-FLAG` where the plan's value is false (other switches only when true)."""
    compilation: str | None = None
    """Its key in vLLM's compilation config (`-cc`)."""
    speculative: str | None = None
    """Its key in vLLM's speculative config (`-sc`); a speculative config is never added."""
    releases: Callable[[Release], bool] | None = None
    """The releases it applies to (the plan's `target.vllm`), where not all."""
    checked: Callable[[Plan], bool] = _always
    """Whether the engine checks it for this plan."""
    on_line: Callable[[Plan], bool] = _always
    """Whether the plan pins it on the command line: a command's other value is refused, and
    it is added where the command gives none."""
    resolved: bool = False
    """The engine's value is what vLLM resolved, not what was given: the in-engine check says so."""
    canon: Callable[[list[Any]], list[Any]] | None = None
    """A list value as compared (sizes: sorted, once each)."""
    unless: tuple[str, ...] = ()
    """Not added where the command gives one of these settings (vLLM derives it from them)."""
    conflict: Callable[[Plan, object, str], str | None] | None = None
    """On the command line, in place of comparing with the plan's value: (plan, the command's
    value, how the command set it) -> the contradiction, or None."""
    unpinned: Callable[[Plan, object, str], str | None] | None = None
    """On the command line, where the plan does not pin it: the same, checked after the rest."""
    if_absent: Callable[[Plan], str | None] | None = None
    """What the command must give itself where it does not give this setting (checked last)."""
    agrees: Callable[[Plan, object, object], bool] | None = None
    """In the engine: (plan, the plan's value, the engine's) -> true where unequal values agree."""
    unseen_if_none: bool = False
    """In a capturing process: None means the manager cannot see it (not checked there)."""
    only: str | None = None
    """A setting no spec field gives (the plan supports its one value): what to do about another
    value, which the command line's check and the in-engine checks refuse with it (such a row
    says `on_line=_never`: its one value is vLLM's default, never added)."""

    @property
    def derived_from(self) -> str | None:
        """What vLLM derives the setting from where a command leaves it out, if it derives it."""
        return "the model" if self.from_model else "the GPU it starts on" if self.from_gpu else None

    @property
    def label(self) -> str:
        """How the in-engine check names it."""
        return f"{self.name} (resolved)" if self.resolved else self.name

    @property
    def dest(self) -> str | None:
        """The EngineArgs field its flag sets: vLLM names each after its flag."""
        return None if self.flag is None else self.flag[2:].replace("-", "_")

    def value(self, plan: Plan) -> object:
        assert self.plan is not None, self.name
        return self.plan(plan)

    def applies(self, plan: Plan) -> bool:
        return self.releases is None or self.releases(release_of(plan.spec.target.vllm))

    def same(self, plan: Plan, have: object) -> bool:
        """Whether the engine's value is the plan's."""
        want = self.value(plan)
        return want == have or (self.agrees is not None and self.agrees(plan, want, have))


# -- what the rows need beyond a value -------------------------------------------------------


def _lora(plan: Plan) -> bool:
    return plan.spec.lora.enabled


def _rank_given(plan: Plan) -> bool:
    return plan.spec.lora.enabled and plan.spec.lora.max_lora_rank is not None


def _multimodal(plan: Plan) -> bool:
    return plan.spec.multimodal is not None


def _encoder(plan: Plan) -> bool:
    mm = plan.spec.multimodal
    return mm is not None and mm.encoder_cudagraphs


def _encoder_graphs(release: Release) -> bool:
    return release.rules.encoder_graphs  # before 0.28 MRV2 captures no encoder graphs, whatever the flag says


def _named(field: str) -> Callable[[Plan], bool]:
    def named(plan: Plan) -> bool:
        return getattr(plan.spec.parallel, field) is not None  # unset in the spec: not the plan's to pin

    return named


def _mode_name(mode: Any) -> object:
    return getattr(mode, "name", str(mode))


def _list(value: Any) -> object:
    return list(value or [])


def _sorted(value: Any) -> object:
    return sorted(value or [])


def _or_zero(value: Any) -> object:
    return value or 0


def _present(value: Any) -> object:
    return value is not None


def _minus_one(value: Any) -> object:
    return value - 1


def _unique_sorted(values: list[Any]) -> list[Any]:
    return sorted(set(values))


def _ceiling(plan: Plan, have: object, shown: str) -> str | None:
    # not a plan value of its own: the plan's largest graph, or the ceiling the plan's sizes were
    # derived from (vLLM derives the same sizes from it: the largest may fall below it, 992 of 1000)
    cg = plan.spec.cudagraph
    if have == plan.max_capture_size or (cg.capture_sizes is None and have == cg.max_capture_size):
        return None
    return f"{shown}: the plan's largest graph is {plan.max_capture_size} tokens"


PERFORMANCE_MODES = ("balanced", "interactivity", "throughput")  # vLLM's PerformanceMode (vllm/config/vllm.py)


def _performance_mode(plan: Plan) -> object:
    return plan.spec.cudagraph.performance_mode


def _not_balanced(plan: Plan) -> bool:
    # put on a line only where the plan's is not vLLM's default (`balanced` is what vLLM runs unasked)
    return plan.spec.cudagraph.performance_mode != "balanced"


def _performance(plan: Plan, have: object, shown: str) -> str | None:
    """A command's performance mode against a plan of vLLM's default one: another mode derives
    other default capture sizes (and, for throughput, larger scheduler defaults) than the plan's."""
    want = plan.spec.cudagraph.performance_mode
    if have == want:
        return None
    return f"{shown}: the plan was compiled for performance mode {want} (cudagraph.performance_mode)"


DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType (vllm/config/model.py)
DTYPE_NAMES = {"half": "float16", "float": "float32"}  # the two synonyms vLLM reads as these


def _model_dtype(plan: Plan) -> object:
    return plan.spec.model.dtype if plan.spec.model is not None else None


def _dtype(plan: Plan, have: object, shown: str) -> str | None:
    """A command's dtype against the spec's `model.dtype` (no graph depends on it; the prices do,
    and the spec must say what the deployment runs): `auto` is the model's own, not compared."""
    want = _model_dtype(plan)
    if want is None or have == "auto" or DTYPE_NAMES.get(str(have), have) == DTYPE_NAMES.get(str(want), want):
        return None
    return f"{shown}: the spec's model.dtype is {want}, which its prices are of"


def _eager(plan: Plan, have: object, shown: str) -> str | None:
    mode = plan.spec.cudagraph.mode.value
    return f"--enforce-eager runs no CUDA graph, the plan cudagraph.mode {mode}" if have and mode != "NONE" else None


def _draft(plan: Plan) -> str | None:
    k = plan.spec.speculative.num_speculative_tokens
    if not k:
        return None
    return (
        f"the plan needs {k} speculative token(s): add --speculative-config with your draft method and "
        f'"num_speculative_tokens": {k}'
    )


_PCP_FIX = (
    "capplan plans no prefill context parallelism (each rank's graph is then chosen by its share "
    "of the batch, which a plan does not model): run without --prefill-context-parallel-size"
)
_DBO_FIX = (
    "capplan plans no dual batch overlap (a micro-batched step replays graphs no plan holds, so "
    "it would run eager): run without --enable-dbo"
)
_ELASTIC_FIX = (
    "capplan plans no elastic expert parallelism (a rank added while serving would install its "
    "plan apart from the others): run without --enable-elastic-ep"
)


def _dense_rank(plan: Plan, want: object, have: object) -> bool:
    """A dense model's DP ranks are engines of their own: vLLM sets data_parallel_size 1 inside
    each (EngineCoreProc.run_engine_core), so there a dense plan's size reads 1; the process
    that starts them sees the launch's size."""
    parallel = plan.spec.parallel
    return parallel.data_parallel_size > 1 and parallel.moe is False and have == 1


def _max_loras(plan: Plan) -> object:
    return plan.spec.lora.max_loras if plan.spec.lora.enabled else None


def _specialize_active(plan: Plan) -> object:
    return plan.spec.lora.specialize_active if plan.spec.lora.enabled else False


def _tower_lora(plan: Plan) -> object:
    mm = plan.spec.multimodal
    return bool(mm and mm.tower_connector_lora)


def _encoder_cudagraphs(plan: Plan) -> object:
    mm = plan.spec.multimodal
    return bool(mm and mm.encoder_cudagraphs)


def _token_budgets(plan: Plan) -> object:
    mm = plan.spec.multimodal
    return sorted(mm.token_budgets or []) if mm is not None else []


def _budgets_given(plan: Plan) -> bool:
    mm = plan.spec.multimodal
    return mm is not None and mm.encoder_cudagraphs and bool(mm.token_budgets)


def _vision_items(plan: Plan) -> object:
    mm = plan.spec.multimodal
    return None if mm is None else mm.max_vision_items_per_batch


def _vision_items_given(plan: Plan) -> bool:
    mm = plan.spec.multimodal
    return mm is not None and mm.encoder_cudagraphs and bool(mm.max_vision_items_per_batch)


def _frames(plan: Plan) -> object:
    mm = plan.spec.multimodal
    return None if mm is None else mm.max_frames_per_batch


# -- the table -------------------------------------------------------------------------------
# Its order is the order of the in-engine check's messages and of the flags `complete` adds
# (flags, then switches, then the compilation config's keys, each in table order).

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "scheduler.max_num_seqs",
        lambda p: p.spec.scheduler.max_num_seqs,
        config=Read("scheduler_config.max_num_seqs"),
        flag="--max-num-seqs",
        from_gpu=True,
    ),
    Setting(
        "scheduler.max_num_batched_tokens",
        lambda p: p.spec.scheduler.max_num_batched_tokens,
        config=Read("scheduler_config.max_num_batched_tokens"),
        flag="--max-num-batched-tokens",
        human=True,
        from_gpu=True,
    ),
    Setting(
        "scheduler.max_model_len",
        lambda p: p.spec.scheduler.max_model_len,
        config=Read("model_config?.max_model_len?"),
        flag="--max-model-len",
        human=True,
        from_model=True,
        unseen_if_none=True,
    ),
    Setting(
        "cudagraph.mode",
        lambda p: p.spec.cudagraph.mode.value,
        config=Read("compilation_config.cudagraph_mode", _mode_name),
        manager=Read("cudagraph_mode", _mode_name),
        kind="mode",
        compilation="cudagraph_mode",
    ),
    Setting(
        "cudagraph.capture_sizes",
        lambda p: p.capture_sizes,
        config=Read("compilation_config.cudagraph_capture_sizes", _list),
        flag="--cudagraph-capture-sizes",
        kind="int_list",
        compilation="cudagraph_capture_sizes",
        resolved=True,
        canon=_unique_sorted,
        unless=("cudagraph.max_capture_size",),
    ),
    Setting(
        "cudagraph.performance_mode",
        _performance_mode,
        config=Read("performance_mode?", missing="balanced"),
        flag="--performance-mode",
        kind="choice",
        choices=PERFORMANCE_MODES,
        on_line=_not_balanced,  # vLLM's default is never added; a command's other mode is refused
        unpinned=_performance,
    ),
    Setting(
        "cudagraph.max_capture_size",
        lambda p: p.max_capture_size,
        config=Read("compilation_config.max_cudagraph_capture_size", _or_zero),
        flag="--max-cudagraph-capture-size",
        compilation="max_cudagraph_capture_size",
        resolved=True,
        on_line=_never,  # never added (vLLM derives it from the sizes); a command's own is checked
        conflict=_ceiling,
    ),
    Setting(
        "lora.enabled",
        lambda p: p.spec.lora.enabled,
        config=Read("lora_config?", _present),
        flag="--enable-lora",
        kind="bool",
    ),
    Setting(
        "lora.max_loras",
        _max_loras,
        config=Read("lora_config?.max_loras?"),
        flag="--max-loras",
        on_line=_lora,
    ),
    Setting(
        "lora.max_lora_rank",
        lambda p: p.spec.lora.max_lora_rank if p.spec.lora.enabled else None,
        config=Read("lora_config?.max_lora_rank?"),
        flag="--max-lora-rank",
        checked=_rank_given,
        on_line=_rank_given,
    ),
    Setting(
        "lora.specialize",
        lambda p: p.spec.lora.specialize,
        config=Read("compilation_config.cudagraph_specialize_lora", bool),
        kind="bool",
        compilation="cudagraph_specialize_lora",
        checked=_lora,  # irrelevant without LoRA
    ),
    Setting(
        "lora.specialize_active",
        _specialize_active,
        config=Read("lora_config?.specialize_active_lora?", bool),
        flag="--specialize-active-lora",
        kind="bool",
        negatable=True,
        on_line=_lora,
    ),
    Setting(
        "lora_capture_cases",
        lambda p: p.lora_capture_cases,
        manager=Read("lora_capture_cases", list),
        resolved=True,
    ),
    Setting(
        "speculative.num_speculative_tokens",
        lambda p: p.spec.speculative.num_speculative_tokens,
        config=Read("speculative_config?.num_speculative_tokens?", _or_zero),
        manager=Read("decode_query_len", _minus_one),
        speculative="num_speculative_tokens",
        if_absent=_draft,
    ),
    Setting(
        "parallel.data_parallel_size",
        lambda p: p.spec.parallel.data_parallel_size,
        config=Read("parallel_config.data_parallel_size"),
        flag="--data-parallel-size",
        aliases=("-dp",),
        agrees=_dense_rank,
    ),
    Setting(
        "parallel.moe",
        lambda p: p.spec.parallel.moe,
        config=Read("model_config?.is_moe?", bool),
        kind="bool",
        checked=lambda p: p.spec.parallel.data_parallel_size > 1,
    ),
    Setting(
        "parallel.tensor_parallel_size",
        lambda p: p.spec.parallel.tensor_parallel_size,
        config=Read("parallel_config.tensor_parallel_size?"),
        flag="--tensor-parallel-size",
        aliases=("-tp",),
        checked=_named("tensor_parallel_size"),
        on_line=_named("tensor_parallel_size"),
    ),
    Setting(
        "parallel.pipeline_parallel_size",
        lambda p: p.spec.parallel.pipeline_parallel_size,
        config=Read("parallel_config.pipeline_parallel_size?"),
        flag="--pipeline-parallel-size",
        aliases=("-pp",),
        checked=_named("pipeline_parallel_size"),
        on_line=_named("pipeline_parallel_size"),
    ),
    Setting(
        "parallel.prefill_context_parallel_size",
        lambda p: 1,  # no spec field: every rank dispatches the whole batch, as the plan models it
        config=Read("parallel_config.prefill_context_parallel_size?", missing=1),
        flag="--prefill-context-parallel-size",
        aliases=("-pcp",),
        on_line=_never,  # never added (1 is vLLM's default); a command's own is checked
        only=_PCP_FIX,
    ),
    Setting(
        "parallel.enable_dbo",
        lambda p: False,  # no spec field: a plan holds no micro-batch graphs
        config=Read("parallel_config.enable_dbo?", bool),
        flag="--enable-dbo",
        kind="bool",
        on_line=_never,  # never added (off is vLLM's default); a command's own is checked
        only=_DBO_FIX,
    ),
    Setting(
        "parallel.enable_elastic_ep",
        lambda p: False,  # no spec field: every rank installs the plan at start
        config=Read("parallel_config.enable_elastic_ep?", bool),
        flag="--enable-elastic-ep",
        kind="bool",
        on_line=_never,
        only=_ELASTIC_FIX,
    ),
    Setting(
        "multimodal.tower_connector_lora",
        _tower_lora,
        config=Read("lora_config?.enable_tower_connector_lora?", bool),
        flag="--enable-tower-connector-lora",
        kind="bool",
        on_line=_multimodal,
    ),
    Setting(
        "multimodal.encoder_cudagraphs",
        _encoder_cudagraphs,
        config=Read("compilation_config.cudagraph_mm_encoder?", bool),
        kind="bool",
        compilation="cudagraph_mm_encoder",
        releases=_encoder_graphs,
        on_line=_multimodal,
    ),
    Setting(
        "multimodal.token_budgets",
        _token_budgets,
        config=Read("compilation_config.encoder_cudagraph_token_budgets?", _sorted),
        kind="int_list",
        compilation="encoder_cudagraph_token_budgets",
        releases=_encoder_graphs,
        checked=_encoder,
        on_line=_budgets_given,
        canon=sorted,
    ),
    Setting(
        "multimodal.max_vision_items_per_batch",
        _vision_items,
        config=Read("compilation_config.encoder_cudagraph_max_vision_items_per_batch?", missing=0),
        compilation="encoder_cudagraph_max_vision_items_per_batch",
        releases=_encoder_graphs,
        checked=_encoder,
        on_line=_vision_items_given,
    ),
    Setting(
        "multimodal.max_frames_per_batch",
        _frames,
        config=Read("compilation_config.encoder_cudagraph_max_frames_per_batch?"),
        compilation="encoder_cudagraph_max_frames_per_batch",  # read (and typed) on the line, checked in the engine
        releases=_encoder_graphs,
        checked=_encoder,
        on_line=_never,
    ),
    Setting(
        "model.dtype",
        _model_dtype,
        flag="--dtype",
        kind="choice",
        choices=DTYPES,
        on_line=_never,  # never added (no graph depends on it); a command's other dtype is refused
        unpinned=_dtype,
    ),
    Setting("enforce_eager", None, flag="--enforce-eager", kind="bool", conflict=_eager),  # no graphs at all
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def engine_values(plan: Plan) -> dict[str, object]:
    """The settings the in-engine checks compare for this plan, with the plan's values."""
    return {
        s.name: s.value(plan)
        for s in SETTINGS
        if s.plan is not None and (s.config or s.manager) and s.applies(plan) and s.checked(plan)
    }


def line_values(plan: Plan) -> dict[str, object]:
    """The settings of vLLM's command line this plan pins, with the plan's values."""
    return {
        s.name: s.value(plan)
        for s in SETTINGS
        if s.plan is not None and (s.flag or s.compilation or s.speculative) and s.applies(plan) and s.on_line(plan)
    }


def read_config(cfg: Any) -> dict[str, object]:
    """Every setting vLLM's final VllmConfig holds, read off `cfg`."""
    return {s.name: s.config.of(cfg) for s in SETTINGS if s.config is not None}


def read_manager(manager: Any) -> dict[str, object]:
    """Every setting a CUDA-graph manager holds: its config's, with what it resolved itself."""
    return {
        **read_config(manager.vllm_config),
        **{s.name: s.manager.of(manager) for s in SETTINGS if s.manager is not None},
    }
