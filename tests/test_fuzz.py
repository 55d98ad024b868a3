"""Fuzzing: mutated specs, plans and random YAML never escape as anything but a
capplan error (which the CLI turns into one line and exit 1)."""

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capplan.analysis.verify import verify_plan
from capplan.errors import CapplanError, PlanError
from capplan.files import read_yaml
from capplan.loading import load_spec, spec_from_data
from capplan.planfile import load_plan, plan_file_data, render_plan
from capplan.planner import compile_plan

VALID = {
    "target": {"runner": "mrv2", "vllm": "0.25", "blackwell": False},
    "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 256},
    "cudagraph": {
        "mode": "FULL_AND_PIECEWISE",
        "capture_sizes": None,
        "max_capture_size": None,
        "performance_mode": "balanced",
    },
    "lora": {"enabled": True, "max_loras": 3, "specialize": True, "specialize_active": True},
    "speculative": {"num_speculative_tokens": 1},
    "parallel": {"data_parallel_size": 2, "moe": True},
    "fixes": ["lora_slot", "dummy_remainder", "mixed_ranges"],
}
WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.lists(st.integers(-5, 5), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mutated_specs(draw):
    data = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(data)))
        action = draw(st.sampled_from(["drop", "retype", "extreme", "extra", "field"]))
        if action == "drop":
            data.pop(section, None)
        elif action == "retype":
            data[section] = draw(WEIRD)
        elif action == "extra":
            data[draw(st.text(min_size=1, max_size=8))] = draw(WEIRD)
        elif isinstance(data.get(section), dict) and data[section]:
            key = draw(st.sampled_from(sorted(data[section])))
            if action == "extreme":
                data[section][key] = draw(st.sampled_from([0, -1, 2**31, 2**63, 10**12, 1.5, "", None]))
            else:
                data[section][key] = draw(WEIRD)
    return data


@SETTINGS
@given(mutated_specs())
def test_mutated_specs_fail_closed(data):
    try:
        spec = spec_from_data(data, "fuzz")
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return
    plan = compile_plan(spec)  # whatever validates must compile
    assert plan.spec == spec


@SETTINGS
@given(st.text(max_size=300))
def test_random_yaml_specs_fail_closed(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "x.yaml"
    path.write_text(text)
    try:
        load_spec(path)
    except CapplanError as exc:
        assert "\n" not in exc.one_line()


PLAN_TEXT = render_plan(compile_plan(spec_from_data(VALID, "fuzz")), "capplan compile fuzz.yaml")
PLAN_LINES = PLAN_TEXT.splitlines()


@SETTINGS
@given(st.data())
def test_mutated_plans_fail_closed(tmp_path_factory, data):
    lines = list(PLAN_LINES)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        action = data.draw(st.sampled_from(["drop", "duplicate", "digit", "truncate", "swap"]))
        if action == "drop":
            lines.pop(i)
        elif action == "duplicate":
            lines.insert(i, lines[i])
        elif action == "digit":
            digits = [k for k, c in enumerate(lines[i]) if c.isdigit()]
            if digits:
                k = data.draw(st.sampled_from(digits))
                lines[i] = lines[i][:k] + data.draw(st.sampled_from("0123456789-x ")) + lines[i][k + 1 :]
        elif action == "truncate":
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))]
        else:
            j = data.draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
    path = tmp_path_factory.mktemp("fuzz") / "x.plan.yaml"
    path.write_text("\n".join(lines) + "\n")
    try:
        plan = load_plan(path)
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return
    # Only a file that holds exactly what its spec compiles to loads: an edit of a comment, a
    # reordering of top-level keys, or an edit of the embedded spec that compiles to this very
    # content (data_parallel_size 2 -> 3: the same graphs and DP policy) is the plan of that spec.
    assert verify_plan(plan).ok
    assert read_yaml(path, "plan", PlanError) == plan_file_data(plan)


TIERED = {
    **{k: v for k, v in VALID.items() if k not in ("speculative", "parallel")},
    "tiers": {"ready": ["FULL:8x8@4", "PIECEWISE:16@1"], "every_steps": 2},
}
TIERED_PLAN = compile_plan(spec_from_data(TIERED, "fuzz"))
ADDRESS_LIKE = st.from_regex(
    r"(PIECEWISE|FULL|NONE|ENCODER|full):[0-9]{1,9}(x[0-9]{1,4})?@-?[0-9]{1,6}", fullmatch=True
)


@SETTINGS
@given(
    ready=st.one_of(
        WEIRD,
        ADDRESS_LIKE,
        st.sampled_from(["full_decode", "FULL_DECODE", "all", ""]),
        st.lists(st.one_of(ADDRESS_LIKE, WEIRD), max_size=6),
    ),
    every=st.one_of(WEIRD, st.integers(-3, 2**40)),
    extra=st.booleans(),
)
def test_generated_tiers_sections_fail_closed(ready, every, extra):
    """A spec's tiers section, generated: a spec whose plan verifies, or one error line."""
    tiers = {"ready": ready, "every_steps": every}
    if extra:
        tiers["later"] = True
    try:
        spec = spec_from_data({**TIERED, "tiers": tiers}, "fuzz")
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return
    plan = compile_plan(spec)
    assert plan.tiers is not None and verify_plan(plan).ok


TIERED_LINES = render_plan(TIERED_PLAN, "capplan compile fuzz.yaml").splitlines()
DEFERRED_LINES = [i for i, line in enumerate(TIERED_LINES) if "deferred: " in line and "{graph:" in line]


@SETTINGS
@given(st.data())
def test_edited_deferred_entries_fail_closed(tmp_path_factory, data):
    """The plan file's deferred marks, edited (dropped, retargeted, added to a ready graph):
    refused in one line, never loaded as another plan."""
    lines = list(TIERED_LINES)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.sampled_from(DEFERRED_LINES))
        action = data.draw(st.sampled_from(["drop", "retarget", "ready_graph"]))
        if ", deferred: " not in lines[i]:
            continue  # dropped by an earlier edit: nothing left to edit on this line
        if action == "drop":
            lines[i] = lines[i].split(", deferred: ")[0] + "}"
        elif action == "retarget":
            lines[i] = lines[i].split(", deferred: ")[0] + f", deferred: {data.draw(ADDRESS_LIKE)}}}"
        else:
            j = data.draw(st.integers(0, len(lines) - 1))
            if "{graph:" in lines[j] and "deferred" not in lines[j]:
                lines[j] = lines[j][:-1] + ", deferred: " + lines[i].split(", deferred: ")[1]
    path = tmp_path_factory.mktemp("fuzz") / "x.plan.yaml"
    path.write_text("\n".join(lines) + "\n")
    try:
        plan = load_plan(path)
    except CapplanError as exc:
        assert "\n" not in exc.one_line()
        return
    assert plan == TIERED_PLAN  # an edit that changed nothing
