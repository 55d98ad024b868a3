from capplan.planner import compile_plan
from capplan.planner.hashing import fingerprint, spec_hash
from capplan.planner.lora_cases import lora_capture_cases
from tests.conftest import make_spec

TINY = dict(
    scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64},
    cudagraph={"capture_sizes": [1, 2, 4, 8]},
    speculative={"num_speculative_tokens": 2},
)


def ranges(plan):
    label = lambda i: f"{plan.graphs[i].descriptor.cg_mode[0]}{plan.graphs[i].descriptor.num_tokens}"  # noqa: E731
    return [(r.lo, r.hi, [label(i) for i in r.candidates]) for r in plan.dispatch if r.lora_case == 0]


def test_025_union_ranges():
    plan = compile_plan(make_spec(**TINY, target={"vllm": "0.25"}, fixes=[]))
    assert ranges(plan) == [
        (1, 1, ["P1"]),
        (2, 2, ["P2"]),
        (3, 3, ["F3"]),
        (4, 4, ["P4"]),
        (5, 6, ["F6"]),
        (7, 8, ["P8"]),
    ]  # no FULL:9: rounding 8 up to 9 passes the max capture size


def test_per_mode_ranges():
    plan = compile_plan(make_spec(**TINY, fixes=[]))
    assert ranges(plan) == [
        (1, 1, ["F3", "P1"]),
        (2, 2, ["F3", "P2"]),
        (3, 3, ["F3", "P4"]),
        (4, 4, ["F6", "P4"]),
        (5, 6, ["F6", "P8"]),
        (7, 8, ["P8"]),
    ]


def test_ranges_are_stored_per_case_and_cover_without_gaps():
    plan = compile_plan(make_spec(lora={"enabled": True, "max_loras": 2, "specialize_active": True}))
    for case in plan.lora_capture_cases:
        rows = [r for r in plan.dispatch if r.lora_case == case]
        assert rows[0].lo == 1 and rows[-1].hi == plan.max_capture_size
        assert all(a.hi + 1 == b.lo for a, b in zip(rows, rows[1:]))
        assert all(plan.graphs[i].descriptor.num_active_loras == case for r in rows for i in r.candidates)


def test_fingerprint_covers_graph_settings_only():
    base = make_spec(lora={"enabled": True, "max_loras": 4})
    fp = lambda s: fingerprint(s, [1], lora_capture_cases(s))  # noqa: E731
    longer = make_spec(lora={"enabled": True, "max_loras": 4}, scheduler={"max_model_len": 9999})
    assert fp(longer) == fp(base) and spec_hash(longer) != spec_hash(base)
    # Failure class 9: specialize_active must reach the key even though the
    # capture cases alone would not show it when specialize is off.
    active = make_spec(lora={"enabled": True, "max_loras": 4, "specialize": False, "specialize_active": True})
    plain = make_spec(lora={"enabled": True, "max_loras": 4, "specialize": False})
    assert lora_capture_cases(active) == lora_capture_cases(plain)
    assert fp(active) != fp(plain)


def test_deviations_say_when_nothing_changed():
    plan = compile_plan(make_spec())
    by_fix = {d.fix: d.changes for d in plan.deviations}
    assert by_fix == {
        "lora_slot": ["no change: LoRA is off"],
        "dummy_remainder": ["no change: vLLM 0.31+ already spreads the remainder"],
        "mixed_ranges": ["no change: vLLM 0.31+ already builds ranges per mode"],
        "prune_unreachable": ["no change: every (graph, LoRA case) pair can be reached by some batch"],
    }
    assert compile_plan(make_spec(fixes=[])).deviations == []
