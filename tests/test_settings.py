"""One table of the settings a plan pins (capplan.settings) drives every comparison of a plan
with vLLM: `capplan apply` refuses a command whose value of any row contradicts the plan
(read by capplan's reader or by vLLM's parser), completes a command with every row the plan
pins, `capplan flags` prints them, and the in-engine checks refuse a config or a graph manager
differing in any row. Each test walks the table: a new row is covered without a new test."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capplan.errors import CapplanError
from capplan.launcher.cmdline import off_forms, read_command, short
from capplan.launcher.engine_args import complete, contradictions, flags_for, prepare
from capplan.loading import spec_from_data
from capplan.planner import compile_plan
from capplan.releases import runs_on
from capplan.runtime.engine_check import config_problem, engine_problem
from capplan.settings import (
    BY_NAME,
    COMPILATION_FLAGS,
    SETTINGS,
    SPECULATIVE_FLAGS,
    Setting,
    engine_values,
    line_values,
)

# A plan that pins every row: LoRA, data/tensor/pipeline parallel sizes, speculative decoding,
# encoder graphs (vLLM 0.33).
SPEC = {
    "target": {"vllm": "0.33"},
    "lora": {"enabled": True, "max_loras": 2, "specialize_active": True, "max_lora_rank": 16},
    "parallel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 2, "moe": True},
    "speculative": {"num_speculative_tokens": 1},
    "multimodal": {
        "tower_connector_lora": True,
        "encoder_cudagraphs": True,
        "token_budgets": [64, 128],
        "max_vision_items_per_batch": 8,
        "max_frames_per_batch": 4,
    },
}
PLAN = compile_plan(spec_from_data(SPEC, "all"))
SERVE = ["vllm", "serve", "M"]
DRAFT = {"method": "ngram", "num_speculative_tokens": PLAN.spec.speculative.num_speculative_tokens}
ON_LINE = [s for s in SETTINGS if s.flag or s.compilation or s.speculative]


def _other(value: Any) -> Any:
    """A value of the same type that differs."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return sorted({*value, max(value, default=0) + 1})
    if isinstance(value, str):
        return "PIECEWISE" if value != "PIECEWISE" else "FULL"
    if isinstance(value, SimpleNamespace) and hasattr(value, "name"):
        return SimpleNamespace(name=_other(value.name))
    if value is None:
        return 1
    return None  # a config object: absent


def _spelled(s: Setting, value: Any) -> tuple[list[str], str]:
    """(the arguments that give `value` for the setting, how a refusal names them)."""
    if s.flag is not None and s.kind in ("int", "choice"):
        return [s.flag, str(value)], f"{s.flag} {value}"
    if s.flag is not None and s.kind == "bool":
        flag = s.flag if value else _off_form(s.flag)
        return [flag], flag
    if s.flag is not None and s.kind == "int_list":
        return [s.flag, *map(str, value)], s.flag
    if s.compilation is not None:
        return [COMPILATION_FLAGS[0], json.dumps({s.compilation: value})], f"{COMPILATION_FLAGS[0]} {s.compilation}"
    assert s.speculative is not None
    return [
        SPECULATIVE_FLAGS[0],
        json.dumps({**DRAFT, s.speculative: value}),
    ], f"{SPECULATIVE_FLAGS[0]} {s.speculative}"


def _off_form(flag: str) -> str:
    """The switch's off form that every release PLAN targets takes (vLLM's option tables), else
    the latest release's (which capplan's own reader then refuses: not all of them take it)."""
    releases = runs_on(PLAN.spec.target.vllm)
    forms = off_forms(flag, releases)
    common = [f for f, by in forms.items() if by == set(releases)]
    return common[0] if common else next(f for f, by in forms.items() if releases[-1] in by)


def _contradicting(s: Setting) -> Any:
    if s.kind == "choice":
        return next(c for c in s.choices if c != s.value(PLAN))
    return True if s.plan is None else _other(s.value(PLAN))  # a flag the plan only checks: given


def _draft_args(s: Setting) -> list[str]:
    return [] if s.speculative else [SPECULATIVE_FLAGS[1], json.dumps(DRAFT)]  # what the plan needs given


@pytest.mark.parametrize("setting", ON_LINE, ids=[s.name for s in ON_LINE])
def test_apply_refuses_each_setting_alone_naming_its_flag(setting):
    value = _contradicting(setting)
    pinned = setting.name in line_values(PLAN) or setting.conflict is not None or setting.only is not None
    pinned = pinned or (setting.unpinned is not None and setting.unpinned(PLAN, value, "x") is not None)
    args, named = _spelled(setting, value)
    argv = [*SERVE, *_draft_args(setting), *args]
    if not pinned:  # read (and typed) on the line, compared by the engine only
        assert contradictions(PLAN, read_command(argv)) == []
        return
    with pytest.raises(CapplanError) as refused:
        prepare(PLAN, "p.plan.yaml", argv)  # vLLM is not installed here: capplan's own reader
    if refused.value.message.startswith(f"{named}: capplan's own reader"):  # an off form not every release takes
        assert "not every vLLM release the line is read for takes it" in refused.value.message
        return
    assert refused.value.message.startswith("the command contradicts p.plan.yaml: ")
    (problem,) = refused.value.message.split(": ", 1)[1].split("; ")
    assert named in problem, problem


@pytest.mark.parametrize("setting", ON_LINE, ids=[s.name for s in ON_LINE])
def test_apply_refuses_each_setting_as_vllms_parser_resolves_it(setting):
    if setting.name not in line_values(PLAN) and setting.conflict is None and setting.only is None:
        return
    value = _contradicting(setting)
    resolution: dict[str, Any] = {
        "values": {},
        "level_mode": None,
        "compilation": {},
        "speculative": DRAFT,
        "given": ["speculative_config"],
        "from_config": [],
        "json_keys": {},
    }
    if setting.dest is not None:
        resolution["values"][setting.dest] = value
        resolution["given"].append(setting.dest)
        named = str(setting.flag)  # then its value as vLLM read it: "--max-loras 3"
    elif setting.compilation is not None:
        resolution["compilation"][setting.compilation] = value
        resolution["given"].append("compilation_config")
        resolution["json_keys"] = {"compilation_config": [[setting.compilation]]}
        named = f"{COMPILATION_FLAGS[0]} {setting.compilation} {short(value)}"
    else:
        resolution["speculative"] = {setting.speculative: value}
        named = f"{SPECULATIVE_FLAGS[0]} {setting.speculative} {value}"
    argv = [*SERVE, *_spelled(setting, value)[0]]
    with pytest.raises(CapplanError) as refused:
        prepare(PLAN, "p.plan.yaml", argv, resolution=resolution)
    (problem,) = refused.value.message.split(": ", 1)[1].split("; ")
    assert problem.startswith(named), problem


def test_a_command_is_completed_with_every_setting_the_plan_pins_and_flags_prints_them():
    want = line_values(PLAN)
    full, added = complete(PLAN, read_command([*SERVE, SPECULATIVE_FLAGS[1], json.dumps(DRAFT)]))
    assert added and full[: len(SERVE)] == SERVE
    again = read_command(full)
    for name, value in want.items():
        # each pinned row, read back as the plan's; what vLLM derives (from the model, the GPU) left to it
        assert again.values.get(name) == (None if BY_NAME[name].derived_from else value), name
    assert contradictions(PLAN, again) == [] and complete(PLAN, again)[1] == []
    printed = read_command([*SERVE, *flags_for(PLAN)])  # `capplan flags`: all but the draft, which is the user's
    for name, value in want.items():
        assert printed.values.get(name) == (None if BY_NAME[name].speculative else value), name
    assert contradictions(PLAN, printed) == [s.if_absent(PLAN) for s in SETTINGS if s.if_absent]


@settings(max_examples=60, deadline=None)
@given(
    setting=st.sampled_from([s for s in ON_LINE if s.flag and s.kind == "int" and s.name in line_values(PLAN)]),
    number=st.integers(0, 10**6),
)
def test_an_integer_flag_contradicts_exactly_when_it_differs(setting, number):
    argv = [*SERVE, SPECULATIVE_FLAGS[1], json.dumps(DRAFT), setting.flag, str(number)]
    problems = contradictions(PLAN, read_command(argv))
    assert (problems != []) == (number != line_values(PLAN)[setting.name]), problems


@settings(max_examples=60, deadline=None)
@given(
    setting=st.sampled_from([s for s in ON_LINE if s.only is not None and s.kind == "int"]),
    spelled=st.sampled_from(["flag", "alias", "equals"]),
    number=st.integers(0, 10**6),
)
def test_a_setting_no_spec_gives_contradicts_exactly_when_it_is_not_vllms_default(setting, spelled, number):
    """A row no spec field gives (the plan supports one value): any other value, however spelled,
    is refused with the row's own fix; its one value passes and is never added."""
    flag = setting.aliases[0] if spelled == "alias" and setting.aliases else setting.flag
    args = [f"{flag}={number}"] if spelled == "equals" else [flag, str(number)]
    problems = contradictions(PLAN, read_command([*SERVE, SPECULATIVE_FLAGS[1], json.dumps(DRAFT), *args]))
    assert (problems != []) == (number != setting.value(PLAN)), problems
    assert all(setting.only in p for p in problems)
    assert setting.name not in line_values(PLAN)


@pytest.mark.parametrize(
    "setting", [s for s in ON_LINE if s.only is not None and s.kind == "bool"], ids=lambda s: s.name
)
def test_a_switch_no_spec_gives_is_refused_on_and_passes_off(setting):
    """A switch no spec field gives (the plan supports it off): on, it is refused with the row's
    own fix; with `=true` as vLLM's parser refuses it (a switch takes no value); off (in the form
    each release's parser takes) passes, and it is never added."""
    draft = [SPECULATIVE_FLAGS[1], json.dumps(DRAFT)]
    problems = contradictions(PLAN, read_command([*SERVE, *draft, setting.flag]))
    assert len(problems) == 1 and setting.only in problems[0], problems
    with pytest.raises(CapplanError, match="takes no value: vLLM refuses the command"):
        read_command([*SERVE, *draft, f"{setting.flag}=true"])
    for release in ("0.29.0", "0.33.0"):  # each release's own off form (--no-X, then --disable-X)
        for off in off_forms(setting.flag, (release,)):
            assert contradictions(PLAN, read_command([*SERVE, *draft, off], (release,))) == []
    assert setting.name not in line_values(PLAN)


# -- the in-engine checks -----------------------------------------------------------------------


def _config(plan) -> SimpleNamespace:
    """A final VllmConfig as vLLM builds it for `plan`, written out by hand."""
    spec, mm = plan.spec, plan.spec.multimodal
    return SimpleNamespace(
        performance_mode=spec.cudagraph.performance_mode,
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(name=spec.cudagraph.mode.value),
            cudagraph_capture_sizes=list(plan.capture_sizes),
            max_cudagraph_capture_size=plan.max_capture_size,
            cudagraph_specialize_lora=spec.lora.specialize,
            cudagraph_mm_encoder=mm.encoder_cudagraphs,
            encoder_cudagraph_token_budgets=list(mm.token_budgets),
            encoder_cudagraph_max_vision_items_per_batch=mm.max_vision_items_per_batch,
            encoder_cudagraph_max_frames_per_batch=mm.max_frames_per_batch,
        ),
        scheduler_config=SimpleNamespace(
            max_num_seqs=spec.scheduler.max_num_seqs, max_num_batched_tokens=spec.scheduler.max_num_batched_tokens
        ),
        model_config=SimpleNamespace(max_model_len=spec.scheduler.max_model_len, is_moe=True),
        lora_config=SimpleNamespace(
            max_loras=spec.lora.max_loras,
            specialize_active_lora=True,
            enable_tower_connector_lora=True,
            max_lora_rank=spec.lora.max_lora_rank,
        ),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec.speculative.num_speculative_tokens),
        parallel_config=SimpleNamespace(
            data_parallel_size=2,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=1,
            enable_dbo=False,
            enable_elastic_ep=False,
        ),
    )


def _manager(plan) -> SimpleNamespace:
    return SimpleNamespace(
        vllm_config=_config(plan),
        cudagraph_mode=SimpleNamespace(name=plan.spec.cudagraph.mode.value),
        decode_query_len=1 + plan.spec.speculative.num_speculative_tokens,
        lora_capture_cases=list(plan.lora_capture_cases),
    )


def _change(obj: Any, path: str) -> None:
    """Change the attribute at `path` (capplan.settings.Read's form) to a value that differs."""
    *parents, last = (name.rstrip("?") for name in path.split("."))
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, last, _other(getattr(obj, last)))


CHECKED = [s for s in SETTINGS if s.name in engine_values(PLAN)]


def _names_the_difference(setting: Setting, problem: str | None) -> bool:
    """The refusal names the setting, and says what to do: a setting no spec field gives (`only`),
    its own fix and not the spec's."""
    if problem is None:
        return False
    if setting.only is None:
        return f"{setting.label}: plan " in problem and problem.endswith("regenerate: capplan compile SPEC")
    return f"{setting.label}: engine " in problem and setting.only in problem and "capplan compile" not in problem


def test_the_plan_fits_the_engine_built_for_it():
    assert set(engine_values(PLAN)) == {s.name for s in SETTINGS if s.config or s.manager}  # every row checked
    assert config_problem(PLAN, "p", _config(PLAN)) is None
    assert engine_problem(PLAN, "p", _manager(PLAN)) is None


@pytest.mark.parametrize("setting", [s for s in CHECKED if s.config], ids=lambda s: s.name)
def test_the_front_end_check_refuses_a_config_differing_in_each_setting(setting):
    cfg = _config(PLAN)
    _change(cfg, setting.config.path)
    problem = config_problem(PLAN, "p.plan.yaml", cfg)
    assert _names_the_difference(setting, problem), problem
    assert problem.startswith("capplan: p.plan.yaml does not match this engine (")


@pytest.mark.parametrize("setting", CHECKED, ids=lambda s: s.name)
def test_the_engine_check_refuses_a_manager_differing_in_each_setting(setting):
    manager = _manager(PLAN)
    if setting.manager is not None:
        _change(manager, setting.manager.path)
    else:
        _change(manager.vllm_config, setting.config.path)
    problem = engine_problem(PLAN, "p.plan.yaml", manager)
    assert _names_the_difference(setting, problem), problem
    assert "Nothing was captured" in problem


def test_rows_releases_and_plans_decide_what_is_compared():
    old = compile_plan(
        spec_from_data({**SPEC, "target": {"vllm": "0.25"}, "multimodal": {"tower_connector_lora": True}}, "o")
    )
    encoder = {s.name for s in SETTINGS if s.releases is not None}
    assert encoder and not encoder & set(engine_values(old)) and not encoder & set(line_values(old))
    bare = compile_plan(spec_from_data({}, "b"))
    assert "parallel.tensor_parallel_size" not in engine_values(bare)  # not named by the spec: not pinned
    assert "lora.max_loras" not in line_values(bare) and engine_values(bare)["lora.max_loras"] is None


def test_the_table_is_one_spelling_per_setting():
    names = [s.name for s in SETTINGS]
    spellings = [x for s in SETTINGS for x in (s.flag, *s.aliases, s.compilation, s.speculative) if x]
    assert len(set(names)) == len(names) and len(set(spellings)) == len(spellings)
    for s in SETTINGS:
        assert s.plan is not None or s.conflict is not None, s.name  # a value, or a check of its own
        assert not (s.aliases and not s.flag) and not (s.negatable and s.kind != "bool"), s.name


def test_the_launcher_and_the_table_import_no_vllm_torch_or_runtime():
    code = (
        "import sys, capplan.settings, capplan.launcher.engine_args, capplan.launcher.launch\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch') or m.startswith('capplan.runtime')]\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
