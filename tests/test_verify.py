"""verify proves compiled plans sound and rejects each failure class with its reason."""

import pytest
from hypothesis import given, settings
from typer.testing import CliRunner

from capplan.analysis.verify import AboveLargestGraph, verify_plan
from capplan.cli import app
from capplan.planfile import render_plan
from capplan.planner import compile_plan
from capplan.present.verify import eager_text, violation_line, violation_message
from capplan.schemas.plan import Plan
from tests.conftest import make_spec
from tests.test_properties import specs

SPEC = dict(
    scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 1024},
    lora={"enabled": True, "max_loras": 4, "specialize_active": True},
    speculative={"num_speculative_tokens": 1},
    parallel={"data_parallel_size": 2, "moe": True},
)


def kinds(plan: Plan, consistency: bool = False) -> set[str]:
    return {v.kind for v in verify_plan(plan, consistency=consistency).violations}


def mutate(plan: Plan, edit) -> Plan:
    data = plan.model_dump(mode="json")
    edit(data)
    return Plan.model_validate(data)


def drop_graph(data, predicate):
    """Remove graphs matching `predicate`, renumbering ids and dispatch candidates."""
    keep = [g for g in data["graphs"] if not predicate(g["descriptor"])]
    new_id = {g["id"]: i for i, g in enumerate(keep)}
    for i, g in enumerate(keep):
        g["id"] = i
    data["graphs"] = keep
    for row in data["dispatch"]:
        row["candidates"] = [new_id[c] for c in row["candidates"] if c in new_id]
    data["dispatch"] = [r for r in data["dispatch"] if r["candidates"]]


@pytest.fixture(scope="module")
def plan():
    return compile_plan(make_spec(**SPEC))


def test_compiled_plan_verifies(plan):
    report = verify_plan(plan)
    assert report.ok, [violation_line(v) for v in report.violations]
    assert report.eager_regions == [AboveLargestGraph(65, 1024)]
    assert eager_text(report.eager_regions[0]) == "all batches of 65..1024 tokens run eager (above the largest graph)"


def test_exact_vllm_plans_show_their_failure_classes():
    assert kinds(compile_plan(make_spec(**SPEC, fixes=[]))) == {"lora_grid"}
    assert kinds(compile_plan(make_spec(**SPEC, target={"vllm": "0.25"}, fixes=[]))) == {"lora_grid", "dummy_length"}
    # decode_query_len 3 puts FULL-only sizes between the PIECEWISE ones on 0.25.
    spec3 = {**SPEC, "speculative": {"num_speculative_tokens": 2}}
    assert kinds(compile_plan(make_spec(**spec3, target={"vllm": "0.25"}, fixes=["lora_slot"]))) == {
        "coverage",
        "dummy_length",
    }


def test_dropped_graph_is_a_coverage_hole(plan):
    mutated = mutate(
        plan,
        lambda d: drop_graph(
            d, lambda desc: desc["cg_mode"] == "PIECEWISE" and desc["num_tokens"] == 8 and desc["num_active_loras"] == 0
        ),
    )
    report = verify_plan(mutated, consistency=False)
    # The eager case-0 rank also breaks DP agreement, and the plan's DP claim.
    assert [v.kind for v in report.violations] == ["coverage", "consistency", "dp"]
    assert (
        "LoRA case 0: mixed batches, 4 token count(s) (5..8) run eager although a captured PIECEWISE"
        in violation_message(report.violations[0])
    )


def test_shrunk_lora_case_skips_an_adapter(plan):
    def shrink(data):
        data["lora_dispatch_map"]["5"] = 4

    # (the reachability of cases under DP is judged with the mutated map too)
    assert "lora_grid" in kinds(mutate(plan, shrink))


def test_all_no_lora_dummy_records_no_kernels(plan):
    def blank(data):
        for g in data["graphs"]:
            if g["descriptor"]["num_active_loras"] == 2:
                g["dummy"]["lora_ids"], g["dummy"]["kernel_grid"] = [-1], 0

    assert kinds(mutate(plan, blank)) == {"lora_kernels"}


def test_wrong_warmup_count_is_caught(plan):
    def fewer(data):
        for g in data["graphs"]:
            if g["descriptor"]["num_active_loras"] == 4 and g["dummy"]["num_reqs"] >= 4:
                g["dummy"]["lora_ids"], g["dummy"]["kernel_grid"] = [1, 2], 2

    assert "lora_case" in kinds(mutate(plan, fewer))


def test_dummy_adapter_ids_outside_the_slots_are_caught(plan):
    def stray(data):
        g = next(g for g in data["graphs"] if g["descriptor"]["num_active_loras"] == 2)
        g["dummy"]["lora_ids"] = [1, 99]

    assert "lora_ids" in kinds(mutate(plan, stray))


def test_piled_dummy_remainder_is_caught(plan):
    def pile(data):
        g = next(g for g in data["graphs"] if g["descriptor"]["num_tokens"] == 40 and g["dummy"]["num_reqs"] == 16)
        assert g["dummy"]["tokens"] == [[8, 2], [8, 3]]
        g["dummy"]["tokens"], g["dummy"]["max_query_len"] = [[15, 2], [1, 10]], 10

    assert kinds(mutate(plan, pile)) == {"dummy_length"}


def test_dummy_over_max_model_len_is_caught():
    plan = compile_plan(
        make_spec(
            scheduler={"max_num_seqs": 2, "max_num_batched_tokens": 512, "max_model_len": 100},
            cudagraph={"capture_sizes": [8, 256]},
        )
    )
    report = verify_plan(plan)
    assert {v.kind for v in report.violations} == {"dummy_length"}
    assert "dummy request of 128 tokens exceeds max_model_len 100" in violation_message(report.violations[0])


def test_desynced_dp_is_rejected(plan):
    # Case 5 loses its 8-token graphs and pads 5..8-token batches to 16: a rank
    # with 4 adapters + base pads an agreed 8-token batch to 16, its peers to 8.
    def desync(data):
        drop_graph(data, lambda desc: desc["num_tokens"] == 8 and desc["num_active_loras"] == 5)
        row = next(r for r in data["dispatch"] if r["lora_case"] == 5 and r["lo"] == 9)
        row["lo"] = 5

    report = verify_plan(mutate(plan, desync), consistency=False)
    assert {v.kind for v in report.violations} == {"dp", "consistency"}
    assert any(
        v.kind == "dp"
        and "pads to 8 on a rank with LoRA case 0" in violation_message(v)
        and "pads to 16 on one with case 5" in violation_message(v)
        for v in report.violations
    )
    single = compile_plan(make_spec(**{**SPEC, "parallel": {"data_parallel_size": 1}}))
    assert "dp" not in kinds(mutate(single, desync))  # one rank: nobody to disagree with


def test_hand_edit_is_caught(plan):
    def edit(data):
        data["stats"]["total"]["graphs"] += 1

    report = verify_plan(mutate(plan, edit))
    assert [violation_line(v) for v in report.violations] == [
        "[consistency] stats differs from what the embedded spec compiles to"
    ]


def test_cli_verify_exit_codes(tmp_path):
    good = tmp_path / "good.plan.yaml"
    good.write_text(render_plan(compile_plan(make_spec(**SPEC)), "capplan compile good.yaml"))
    bad = tmp_path / "bad.plan.yaml"
    bad.write_text(render_plan(compile_plan(make_spec(**SPEC, fixes=[])), "capplan compile bad.yaml"))
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(good)])
    assert ok.exit_code == 0 and ok.stdout.splitlines()[-1].startswith("ok: ")
    failed = runner.invoke(app, ["verify", str(bad)])
    assert failed.exit_code == 1
    assert failed.stderr.splitlines()[0].startswith("violation: [lora_grid] LoRA case 1: ")
    assert "Traceback" not in failed.output


@settings(max_examples=40, deadline=None)
@given(specs(fixes=["lora_slot", "dummy_remainder", "mixed_ranges"]))
def test_verify_passes_on_every_fixed_plan(spec):
    report = verify_plan(compile_plan(spec))
    # A dummy longer than max_model_len is the one thing the planner cannot
    # fix by itself: the spec asks for graphs no valid request fits.
    assert {v.kind for v in report.violations} <= {"dummy_length"}, [violation_line(v) for v in report.violations]


# -- violations are records: their failure class, kind and fields, and the sentence rendered from them


def test_a_dropped_graph_yields_a_coverage_hole_record(plan):
    from capplan.analysis.verify import FAILURE_CLASSES, CoverageHole

    mutated = mutate(
        plan,
        lambda d: drop_graph(
            d, lambda desc: desc["cg_mode"] == "PIECEWISE" and desc["num_tokens"] == 8 and desc["num_active_loras"] == 0
        ),
    )
    hole = verify_plan(mutated, consistency=False).violations[0]
    assert hole == CoverageHole("mixed", 0, (0,), False, ((5, 8),), "PIECEWISE")
    assert hole.failure_class == FAILURE_CLASSES["coverage"] and hole.failure_class.number == 8
    assert hole.failure_class.label == "8: coverage hole" and hole.token_count == 4
    assert violation_message(hole) == (
        "LoRA case 0: mixed batches, 4 token count(s) (5..8) run eager although a captured PIECEWISE graph could "
        "serve them"
    )


def test_exact_vllm_plan_yields_short_kernel_grid_records_of_class_6():
    from capplan.analysis.verify import ShortKernelGrid

    report = verify_plan(compile_plan(make_spec(**SPEC, fixes=[])))
    assert report.violations and all(isinstance(v, ShortKernelGrid) for v in report.violations)
    first = report.violations[0]
    assert isinstance(first, ShortKernelGrid)
    assert (first.kind, first.failure_class.number, first.failure_class.name) == (
        "lora_grid",
        6,
        "no-LoRA slot not counted",
    )
    assert first.graphs and all(d.num_active_loras == first.lora_case for d in first.graphs)
    assert first.slots > first.kernel_grid
    assert violation_line(first).startswith(f"[lora_grid] LoRA case {first.lora_case}: {len(first.graphs)} graph(s) (")


def test_broken_dummy_ids_name_the_graph_and_the_ids(plan):
    from capplan.analysis.verify import BadAdapterIds

    def stray(data):
        g = next(g for g in data["graphs"] if g["descriptor"]["num_active_loras"] == 2)
        g["dummy"]["lora_ids"] = [1, 99]

    mutated = mutate(plan, stray)
    (bad,) = [v for v in verify_plan(mutated, consistency=False).violations if isinstance(v, BadAdapterIds)]
    target = next(g.descriptor for g in mutated.graphs if g.descriptor.num_active_loras == 2)
    assert (bad.graph, bad.lora_ids, bad.max_loras) == (target, (1, 99), 4)
    assert bad.failure_class.number == 2


def test_verify_json_carries_records(tmp_path):
    import json

    bad = tmp_path / "bad.plan.yaml"
    bad.write_text(render_plan(compile_plan(make_spec(**SPEC, fixes=[])), "capplan compile bad.yaml"))
    result = CliRunner().invoke(app, ["verify", str(bad), "--json"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert set(data) == {"ok", "violations", "eager_regions", "checked"} and data["ok"] is False
    v = data["violations"][0]
    assert v["type"] == "short_kernel_grid" and v["kind"] == "lora_grid"
    assert (v["failure_class"], v["class_number"], v["class_name"]) == (
        "6: no-LoRA slot not counted",
        6,
        "no-LoRA slot not counted",
    )
    assert isinstance(v["lora_case"], int) and isinstance(v["kernel_grid"], int) and isinstance(v["slots"], int)
    assert all(isinstance(g, str) and "@" in g for g in v["graphs"])
    assert result.stderr.splitlines()[0] == f"violation: [lora_grid] {v['message']}"
    (region,) = data["eager_regions"]
    assert region == {
        "type": "above_largest_graph",
        "lo": 65,
        "hi": 1024,
        "text": "all batches of 65..1024 tokens run eager (above the largest graph)",
    }


def test_every_violation_type_has_a_failure_class_and_a_message():
    """Each Violation subclass names a kind of FAILURE_CLASSES, a JSON `type` of its own, and
    fields that do not collide with the keys every JSON violation has."""
    import dataclasses

    from capplan.analysis import verify

    types = [
        t
        for t in vars(verify).values()
        if isinstance(t, type) and issubclass(t, verify.Violation) and t is not verify.Violation
    ]
    assert len(types) > 25 and len({t.code for t in types}) == len(types)
    fixed = {"type", "kind", "failure_class", "class_number", "class_name", "message", "token_count"}
    for t in types:
        assert t.kind in verify.FAILURE_CLASSES, t
        assert not {f.name for f in dataclasses.fields(t)} & fixed, t


@settings(max_examples=30, deadline=None)
@given(specs())
def test_verify_messages_render_from_records(spec):
    """Every violation's JSON record holds the same sentence the text form prints."""
    from capplan.present.verify import verify_json, verify_lines

    report = verify_plan(compile_plan(spec))
    data = verify_json(report)
    _, err = verify_lines(report, "p", False)
    assert err == [f"violation: [{v['kind']}] {v['message']}" for v in data["violations"]]
    out, _ = verify_lines(report, "p", False)
    assert [f"eager: {r['text']}" for r in data["eager_regions"]] == [line for line in out if line.startswith("eager")]


def test_every_violation_record_is_in_the_closed_union_that_verify_renders():
    """`AnyViolation` names every Violation subclass, so the type checker holds
    `violation_message`'s `match` (ending in `assert_never`) to a message for each: a record
    left out of the union would type-check and then fail at run time."""
    import typing

    from capplan.analysis import verify as analysis

    def subclasses(cls: type) -> set[type]:
        return {c for s in cls.__subclasses__() for c in (s, *subclasses(s))}

    records = typing.get_args(analysis.AnyViolation)
    assert set(records) == subclasses(analysis.Violation) and len(records) == len(set(records))
    assert all(r.kind in analysis.FAILURE_CLASSES for r in records)
    assert len({r.code for r in records}) == len(records)  # each named apart in JSON
