"""Capture tiers: the ready and deferred graphs, their fallbacks, and every intermediate state.

`verify` proves statically that every graph of every fallback chain replays the deferred
graph's batches; the property test here checks the same dynamically, dispatching random
batches in random intermediate states (random subsets of the deferred graphs captured).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.analysis.verify import verify_plan
from capplan.cli import app
from capplan.errors import SpecError
from capplan.loading import spec_from_data
from capplan.planfile import load_plan
from capplan.planfile.write import plan_file_data
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.planner.dispatch import compatible
from capplan.planner.lora_cases import kernel_slots
from capplan.planner.tiers import anchors, chain, replayed
from capplan.present.verify import violation_message
from capplan.releases import ALIASES, RELEASES
from capplan.schemas.plan import address

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
BASE = {
    "target": {"vllm": "0.25"},
    "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "max_model_len": 512},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE"},
    "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
}


def tiered(ready: object = "full_decode", **extra: object) -> dict:
    return {**BASE, **extra, "tiers": {"ready": ready}}


def plan_of(data: dict):
    return compile_plan(spec_from_data(data, "spec"))


def test_full_decode_rule_and_anchors_are_ready():
    plan = plan_of(tiered())
    deferred = set(plan.tiers.deferred)
    for g in plan.graphs:
        d = g.descriptor
        if d.cg_mode == "FULL" and d.uniform_token_count is not None:
            assert g.id not in deferred, address(d)
    assert not anchors(plan.graphs) & deferred
    assert deferred and all(plan.graphs[g].descriptor.cg_mode == "PIECEWISE" for g in deferred)
    assert plan.tiers.deferred == sorted(deferred)  # capture order: the plan's
    assert verify_plan(plan).ok


def test_fallback_is_the_next_larger_graph_of_its_mode_and_case():
    plan = plan_of(tiered(["FULL:1x1@0"]))
    by_address = {address(g.descriptor): g.id for g in plan.graphs}
    eight = by_address["PIECEWISE:8@4"]
    assert address(plan.graphs[plan.tiers.fallback[eight]].descriptor) == "PIECEWISE:16@4"
    links = [address(plan.graphs[g].descriptor) for g in chain(plan.tiers, eight)]
    # the chain ends at the largest graph of 8's kernel class (tokens neither 1 nor a multiple of 16)
    assert links[0] == "PIECEWISE:8@4" and links[-1] == "PIECEWISE:56@4"
    assert all(link.endswith("@4") and link.startswith("PIECEWISE") for link in links)
    # Once PIECEWISE:16@4 is captured, batches of PIECEWISE:8@4 replay it.
    ready = set(range(len(plan.graphs))) - set(plan.tiers.deferred)
    assert replayed(plan.tiers, eight, ready) == by_address["PIECEWISE:56@4"]
    assert replayed(plan.tiers, eight, ready | {by_address["PIECEWISE:16@4"]}) == by_address["PIECEWISE:16@4"]
    assert replayed(plan.tiers, eight, ready | {eight}) == eight


def test_tiers_change_when_not_which_graphs():
    plain, tiers = plan_of(BASE), plan_of(tiered())
    assert plain.descriptors == tiers.descriptors and plain.dispatch == tiers.dispatch
    assert plain.fingerprint == tiers.fingerprint  # the compile cache and the engine check ignore tiers
    assert plain.spec_hash != tiers.spec_hash
    assert plain.tiers is None


def test_plan_file_marks_deferred_graphs_and_reads_back(tmp_path):
    spec = tmp_path / "tiers.yaml"
    spec.write_text(yaml.safe_dump(tiered(["FULL:8x8@4"])))
    result = runner.invoke(app, ["compile", str(spec)])
    assert result.exit_code == 0, result.output
    path = tmp_path / "tiers.plan.yaml"
    text = path.read_text()
    assert "- {graph: PIECEWISE:8@4, dummy: [[8, 1]], grid: 4, deferred: PIECEWISE:16@4}" in text
    assert "# deferred: captured while serving" in text
    assert "  deferred: " in text  # graph_counts
    assert max(len(line) for line in text.splitlines()) <= 120
    plan = load_plan(path)
    assert plan == plan_of(tiered(["FULL:8x8@4"]))
    assert plan_file_data(plan)["graph_counts"]["deferred"] == len(plan.tiers.deferred)
    assert runner.invoke(app, ["verify", str(path)]).exit_code == 0
    shown = runner.invoke(app, ["show", str(path)])
    assert (
        "Tiers: 25 ready (1 graph named in the spec; the largest of each mode and LoRA case; and the largest of "
        "each kernel class"
        in shown.output
        and "53 deferred (FULL 16, PIECEWISE 37)" in shown.output
    )


def test_a_hand_moved_graph_is_a_one_line_difference(tmp_path):
    spec = tmp_path / "tiers.yaml"
    spec.write_text(yaml.safe_dump(tiered()))
    assert runner.invoke(app, ["compile", str(spec)]).exit_code == 0
    path = tmp_path / "tiers.plan.yaml"
    text = path.read_text()
    edited = text.replace(", deferred: PIECEWISE:16@4}", "}", 1)
    assert edited != text
    path.write_text(edited)
    result = runner.invoke(app, ["show", str(path)])
    assert result.exit_code == 1 and "deferred" in result.output


def _mutated(plan, gid: int, fallback: int):
    tiers = plan.tiers.model_copy(update={"fallback": {**plan.tiers.fallback, gid: fallback}})
    return plan.model_copy(update={"tiers": tiers})


def test_verify_fails_when_a_fallback_under_provisions_the_lora_grid():
    plan = plan_of(tiered())
    by_address = {address(g.descriptor): g.id for g in plan.graphs}
    # PIECEWISE:8@4 serves batches of up to 4 kernel slots; PIECEWISE:16@1 records a grid of 1.
    bad = _mutated(plan, by_address["PIECEWISE:8@4"], by_address["PIECEWISE:16@1"])
    report = verify_plan(bad, consistency=False)
    kinds = {v.kind for v in report.violations}
    assert kinds == {"lora_grid"}, report.violations
    assert "PIECEWISE:8@4 -> PIECEWISE:16@1" in violation_message(report.violations[0])
    assert verify_plan(plan, consistency=False).ok


def test_verify_fails_on_a_fallback_of_another_mode_a_deferred_anchor_and_a_loop():
    plan = plan_of(tiered(["FULL:1x1@0"]))
    by_address = {address(g.descriptor): g.id for g in plan.graphs}
    other_mode = _mutated(plan, by_address["PIECEWISE:8@0"], by_address["FULL:16x16@0"])
    assert {v.kind for v in verify_plan(other_mode, consistency=False).violations} == {"tiers"}
    smaller = _mutated(plan, by_address["PIECEWISE:16@0"], by_address["PIECEWISE:8@0"])  # a loop 8 <-> 16
    messages = [violation_message(v) for v in verify_plan(smaller, consistency=False).violations]
    assert any("loop" in m for m in messages), messages
    top = by_address["PIECEWISE:64@0"]
    tiers = plan.tiers.model_copy(
        update={"deferred": sorted([*plan.tiers.deferred, top]), "fallback": {**plan.tiers.fallback, top: top}}
    )
    anchor_deferred = plan.model_copy(update={"tiers": tiers})
    messages = [violation_message(v) for v in verify_plan(anchor_deferred, consistency=False).violations]
    assert any("largest of its mode and LoRA case but deferred" in m for m in messages), messages


def test_spec_refuses_tiers_where_they_cannot_be_safe():
    with pytest.raises(SpecError, match="captures at DP-synced steps, which capplan does not keep in lockstep"):
        spec_from_data(tiered(parallel={"data_parallel_size": 2, "moe": True, "pipeline_parallel_size": 2}), "s")
    with pytest.raises(SpecError, match="speculative decoding"):
        spec_from_data(tiered(speculative={"num_speculative_tokens": 1}), "s")
    # every reason at once, each with its fix
    with pytest.raises(SpecError) as every:
        spec_from_data(
            {**tiered(), "target": {"vllm": "0.29.0"},
             "parallel": {"data_parallel_size": 2, "moe": True, "pipeline_parallel_size": 2},
             "speculative": {"num_speculative_tokens": 1}},
            "s",
        )  # fmt: skip
    message = every.value.message
    assert "DP-synced steps" in message and "speculative decoding" in message
    # the ready list's forms, in words
    for ready, said in (
        ([], r"tiers.ready: \[\] names no graph"),
        ("full", "tiers.ready: neither a list nor full_decode"),
        (["FULL:1@0x"], r"tiers.ready: \[0\] 'FULL:1@0x' is not a graph address"),
    ):
        with pytest.raises(SpecError, match=said):
            spec_from_data(tiered(ready), "s")
    with pytest.raises(SpecError, match=r"tiers.ready\[0\]: FULL:999x999@0 is not a graph"):
        spec_from_data(tiered(["FULL:999x999@0"]), "s")
    for release in (*RELEASES, *ALIASES):  # every supported release defers
        assert spec_from_data({**tiered(), "target": {"vllm": release}}, "s").tiers is not None


@st.composite
def tier_specs(draw):
    seqs = draw(st.sampled_from([4, 8, 16, 32]))
    budget = draw(st.sampled_from([64, 128, 256]))
    lora = draw(st.booleans())
    data = {
        "target": {"vllm": draw(st.sampled_from(["0.25", "0.25.0", "0.26.0"]))},
        "scheduler": {"max_num_seqs": seqs, "max_num_batched_tokens": budget, "max_model_len": 512},
        "cudagraph": {"mode": draw(st.sampled_from(["FULL_AND_PIECEWISE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY"]))},
        "lora": {
            "enabled": lora,
            "max_loras": draw(st.integers(1, 4)),
            "specialize_active": draw(st.booleans()),
        }
        if lora
        else {"enabled": False},
        "fixes": draw(st.sampled_from([[], ["lora_slot", "dummy_remainder", "mixed_ranges", "prune_unreachable"]])),
    }
    plan = compile_plan(spec_from_data(data, "s"))
    names = [address(g.descriptor) for g in plan.graphs]
    picked = draw(st.lists(st.sampled_from(names), min_size=1, max_size=8, unique=True)) if names else []
    ready: object = draw(st.sampled_from(["full_decode", picked])) if picked else "full_decode"
    return {**data, "tiers": {"ready": ready, "every_steps": draw(st.integers(1, 16))}}, draw(st.integers(0, 2**32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(tier_specs())
def test_every_intermediate_state_replays_a_captured_graph_that_fits(case):
    data, seed = case
    rng = random.Random(seed)
    plan = plan_of(data)
    untiered = plan_of({k: v for k, v in data.items() if k != "tiers"})
    # Tiers add no violation (with fixes: [] the plan keeps vLLM's own failure classes).
    assert verify_plan(plan).violations == verify_plan(untiered).violations
    tiers = plan.tiers
    ready = set(range(len(plan.graphs))) - set(tiers.deferred)
    dispatcher = Dispatcher(plan)
    seqs, budget = plan.spec.scheduler.max_num_seqs, plan.spec.scheduler.max_num_batched_tokens
    max_loras = plan.spec.lora.max_loras if plan.spec.lora.enabled else 0
    for _ in range(6):
        captured = ready | {g for g in tiers.deferred if rng.random() < rng.random()}
        for _ in range(80):
            reqs = rng.randint(1, seqs)
            q = rng.choice([1, 1, 2, rng.randint(1, 64)])
            tokens = min(budget, reqs * q) if rng.random() < 0.6 else rng.randint(reqs, max(reqs, budget))
            adapters = rng.randint(0, min(reqs, max_loras))
            base = adapters > 0 and adapters < reqs and rng.random() < 0.5
            batch = Batch(reqs, tokens, -(-tokens // reqs), adapters, base)
            final = dispatcher.dispatch(batch)
            if final.graph_id < 0:
                continue
            gid = replayed(tiers, final.graph_id, captured)
            assert gid in captured, "replays a graph that is not captured"
            g = plan.graphs[gid]
            d = g.descriptor
            assert d.cg_mode == final.cg_mode and d.num_tokens >= tokens
            assert compatible(d, reqs, final.uniform_token_count, None)
            if plan.spec.lora.enabled and adapters:
                # As much of the batch's slots as its own graph covers (under fixes: [] vLLM's
                # own graphs can fall short, failure class 6; a fallback never falls shorter).
                own = plan.graphs[final.graph_id].dummy.kernel_grid
                assert g.dummy.kernel_grid >= min(kernel_slots(adapters, base), own), (address(d), adapters, base)


def test_optimize_ready_share_alone_keeps_sizes(tmp_path):
    spec = ROOT / "examples" / "served" / "llama0.9b.yaml"
    trace = ROOT / "examples" / "served" / "trace-a.jsonl"
    out = tmp_path / "tiers.yaml"
    result = runner.invoke(app, ["optimize", str(spec), str(trace), "--ready-share", "0.9", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "ready tier: " in result.output and "Rests on the trace alone" in result.output
    written = yaml.safe_load(out.read_text())
    assert written["cudagraph"]["capture_sizes"] is None  # the spec's own sizes
    chosen = compile_plan(spec_from_data(written, "w"))
    default = compile_plan(spec_from_data(yaml.safe_load(spec.read_text()), "d"))
    assert chosen.descriptors == default.descriptors
    assert 0 < len(chosen.graphs) - len(chosen.tiers.deferred) < len(chosen.graphs) // 4
    as_json = runner.invoke(
        app, ["optimize", str(spec), str(trace), "--ready-share", "0.9", "-o", str(tmp_path / "j.yaml"), "--json"]
    )
    data = json.loads(as_json.output)
    assert data["tiers"]["covered_steps"] >= 0.9 * data["tiers"]["graph_steps"]
    assert data["tiers"]["basis"] == "the trace alone (no calibration)"


def test_optimize_ready_share_with_a_budget_tiers_the_optimized_plan(tmp_path):
    spec = ROOT / "examples" / "served" / "llama0.9b.yaml"
    trace = ROOT / "examples" / "served" / "trace-a.jsonl"
    out = tmp_path / "both.yaml"
    result = runner.invoke(
        app,
        ["optimize", str(spec), str(trace), "--max-graphs", "120", "--objective", "padding", "--ready-share", "0.8",
         "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("# ready tier: ") and "tiers:" in text
    written = yaml.safe_load(text)
    assert written["cudagraph"]["capture_sizes"] and written["tiers"]["ready"]
    assert verify_plan(compile_plan(spec_from_data(written, "w"))).ok


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--ready-share", "0"], "--ready-share must be above 0"),
        (["--ready-share", "0.5", "--plot", "curve.svg"], "--plot draws the capture-size curve"),
    ],
)
def test_optimize_ready_share_refusals_write_nothing(tmp_path, args, fragment):
    spec = tmp_path / "s.yaml"
    spec.write_text((ROOT / "examples" / "served" / "llama0.9b.yaml").read_text())
    trace = tmp_path / "t.jsonl"
    trace.write_text((ROOT / "examples" / "served" / "trace-a.jsonl").read_text())
    before = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(app, ["optimize", str(spec), str(trace), *args])
    assert result.exit_code in (1, 2) and fragment in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_optimize_ready_share_refuses_dp_under_pipeline_parallelism(tmp_path):
    spec = tmp_path / "dp.yaml"
    served = yaml.safe_load((ROOT / "examples" / "served" / "llama0.9b.yaml").read_text())
    spec.write_text(
        yaml.safe_dump({**served, "parallel": {"data_parallel_size": 2, "moe": True, "pipeline_parallel_size": 2}})
    )
    trace = tmp_path / "t.jsonl"
    trace.write_text((ROOT / "examples" / "served" / "trace-a.jsonl").read_text())
    result = runner.invoke(app, ["optimize", str(spec), str(trace), "--ready-share", "0.9"])
    assert result.exit_code == 2 and "which capplan does not keep in lockstep across pipeline stages" in result.output
    assert not (tmp_path / "dp.optimized.yaml").exists()


def test_diff_lists_moves_between_tiers(tmp_path):
    for name, ready in (("a", ["FULL:8x8@4"]), ("b", ["FULL:8x8@4", "PIECEWISE:8@4"])):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(tiered(ready)))
        assert runner.invoke(app, ["compile", str(tmp_path / f"{name}.yaml")]).exit_code == 0
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(BASE))
    assert runner.invoke(app, ["compile", str(tmp_path / "c.yaml")]).exit_code == 0
    result = runner.invoke(app, ["diff", str(tmp_path / "a.plan.yaml"), str(tmp_path / "b.plan.yaml")])
    assert result.exit_code == 2
    assert "PIECEWISE:8@4: deferred -> ready" in result.output
    data = json.loads(
        runner.invoke(
            app, ["diff", str(tmp_path / "c.plan.yaml"), str(tmp_path / "a.plan.yaml"), "--format", "json"]
        ).output
    )
    assert data["tier_changes"][0]["text"].startswith("deferred capture on: ")
    assert data["tier_changes"][0]["type"] == "switch" and data["tier_changes"][0]["on"] is True
    assert any(
        c["key"] == "tiers.ready" and c["text"].startswith("tiers.ready: none -> ") for c in data["spec_changes"]
    )


def test_ready_choice_covers_the_share_it_claims():
    from capplan.batches import read_rank_traces
    from capplan.loading import load_spec
    from capplan.traffic.tiers import choose_ready

    spec = load_spec(ROOT / "examples" / "served" / "llama0.9b.yaml")
    files = read_rank_traces([ROOT / "examples" / "served" / "trace-a.jsonl"], spec)
    choice = choose_ready(spec, [f.batches for f in files], 0.5)
    plan = choice.plan
    ready = set(range(len(plan.graphs))) - set(plan.tiers.deferred)
    dispatcher = Dispatcher(plan)
    covered = total = 0
    for item in files[0].batches:
        gid = dispatcher.dispatch(item.batch).graph_id
        if gid >= 0:
            total += item.count
            covered += item.count if gid in ready else 0
    assert (covered, total) == (choice.covered, choice.graph_steps)
    assert covered >= 0.5 * total
    # The trace's choice alone (before the planner's additions) is the fewest graphs that reach it.
    assert choice.named == len(plan.spec.tiers.ready)


def test_checked_in_example_is_what_optimize_writes(tmp_path):
    spec = ROOT / "examples" / "served" / "llama0.9b.yaml"
    trace = ROOT / "examples" / "served" / "trace-a.jsonl"
    out = tmp_path / "llama0.9b.tiers.yaml"
    assert (
        runner.invoke(app, ["optimize", str(spec), str(trace), "--ready-share", "0.95", "-o", str(out)]).exit_code == 0
    )
    assert out.read_text() == (ROOT / "examples" / "served" / "llama0.9b.tiers.yaml").read_text()
    plan = ROOT / "examples" / "served" / "llama0.9b.tiers.plan.yaml"
    assert load_plan(plan) == compile_plan(spec_from_data(yaml.safe_load(out.read_text()), "x"))


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_deployment_that_can_defer_verifies_in_every_intermediate_state(config):
    """Each example config on a release deferred capture is built for, tiered two ways (the
    full_decode rule, and only the largest graphs ready), verifies: every intermediate state."""
    data = yaml.safe_load(config.read_text())
    spec = spec_from_data({k: v for k, v in data.items() if k != "tiers"}, config.name)
    if spec.parallel.data_parallel_size > 1 or spec.speculative.num_speculative_tokens:
        pytest.skip(f"{config.name}: tiers are refused for DP or speculative decoding")
    smallest = min(compile_plan(spec).graphs, key=lambda g: g.descriptor.num_tokens)
    for ready in ("full_decode", [address(smallest.descriptor)]):
        plan = plan_of({**data, "tiers": {"ready": ready}})
        report = verify_plan(plan)
        assert report.ok and report.checked["deferred_fallbacks"] > 0, report.violations


def test_every_deferred_graph_shares_its_kernel_class_with_a_ready_graph():
    """No deferred capture is the first of its kernel class (tokens and requests equal to 1, a
    multiple of 16 or neither, below 128 or not) in its mode, decode shape and LoRA case: the
    first capture of a class compiles kernels (0.9-5.3 s on the H200), the others take ms."""
    from capplan.planner.tiers import kernel_class, shape

    assert [kernel_class(n) for n in (1, 2, 16, 56, 128, 136, None)] == [
        ("1", True), ("other", True), ("16", True), ("other", True), ("16", False), ("other", False), None,
    ]  # fmt: skip
    for data in (tiered(["FULL:1x1@0"]), {**tiered(["FULL:1x1@0"]), "scheduler": {**BASE["scheduler"]}}):
        plan = plan_of(data)
        deferred = set(plan.tiers.deferred)

        def key(g):
            d = g.descriptor
            return (*shape(d), d.num_active_loras, kernel_class(d.num_tokens), kernel_class(d.num_reqs))

        warm = {key(g) for g in plan.graphs if g.id not in deferred}
        assert deferred and all(key(plan.graphs[g]) in warm for g in deferred)
        # and the warm graph of a class is its largest, so a chain ends at it
        for g in plan.graphs:
            if g.id in deferred:
                same = [h for h in plan.graphs if key(h) == key(g)]
                assert max(same, key=lambda h: h.descriptor.num_tokens).id not in deferred


def test_per_graph_memory_bound_is_the_readings_total_and_largest_over_their_count():
    import math

    from capplan.runtime.deferred.estimate import per_graph_bound

    mib = 2**20
    assert per_graph_bound([2 * mib, 4 * mib, 0]) == math.ceil(10 * mib / 3)
    assert per_graph_bound([3] * 40) == math.ceil(3 * 41 / 40)  # no spread: the size and one more reading's worth
    assert per_graph_bound([7]) == 14  # one reading: twice it
    assert per_graph_bound([5, -3]) == 5  # memory given back counts as none
    assert per_graph_bound([]) == 0
    # half the graphs open a 2 MiB granule: the bound nears 1 MiB from above as readings add up
    pages = [0, 2 * mib] * 20
    few, many = per_graph_bound(pages[:9]), per_graph_bound(pages)
    assert 1 * mib < many < few


@settings(max_examples=400, deadline=None)
@given(
    cost=st.integers(1, 8 * 2**20),
    granule=st.sampled_from([2 * 2**20, 20 * 2**20]),
    room=st.floats(0, 1, exclude_max=True),
    n=st.integers(1, 80),
)
def test_per_graph_memory_bound_covers_graphs_taken_in_whole_granules(cost, granule, room, n):
    """The allocator hands out whole granules: a graph that does not fit the room left in the
    open one opens more, the rest fit without a reading. Whatever the room at the start, once
    any reading moved, the bound of n readings is at least what each graph took."""
    from capplan.runtime.deferred.estimate import per_graph_bound

    left = int(room * granule)
    readings = []
    for _ in range(n):
        opened = 0 if cost <= left else -(-(cost - left) // granule)
        left += opened * granule - cost
        readings.append(opened * granule)
    if any(readings):
        assert per_graph_bound(readings) >= cost
    else:
        assert per_graph_bound(readings) == 0  # every graph fit the room already held: none took memory


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**34), max_size=60))
def test_per_graph_memory_bound_is_between_the_mean_and_twice_the_largest(sizes):
    """Generated capture readings (memory given back included): a whole number of bytes, never
    negative, never under the mean it bounds, never over twice the largest reading."""
    from capplan.runtime.deferred.estimate import per_graph_bound

    bound = per_graph_bound(sizes)
    use = [max(s, 0) for s in sizes]
    assert isinstance(bound, int) and bound >= 0
    if use:
        assert sum(use) / len(use) - 1 <= bound <= 2 * max(use) + 1


def test_with_dp_ranks_that_pad_alike_every_lora_case_of_a_size_is_in_one_tier():
    """MoE DP: each rank replays the DP-agreed batch with its own LoRA count, so a size is ready
    or deferred in every LoRA case at once, and the runtime captures a deferred size's cases
    together (`case_groups`); a dense model's DP ranks are independent engines."""
    from capplan.planner.tiers import across_cases, case_groups

    for moe, closed in ((True, True), (False, False)):
        spec = spec_from_data(
            tiered(["FULL:1x1@0", "PIECEWISE:24@1"], parallel={"data_parallel_size": 2, "moe": moe}), "s"
        )
        plan = compile_plan(spec)
        assert plan.tiers is not None and plan.tiers.deferred
        deferred = set(plan.tiers.deferred)
        tiers_of: dict[tuple, set[bool]] = {}
        for g in plan.graphs:
            tiers_of.setdefault(across_cases(g.descriptor), set()).add(g.id in deferred)
        assert all(len(t) == 1 for t in tiers_of.values()) is closed
        groups = case_groups(plan.graphs, plan.tiers.deferred)
        assert sorted(g for group in groups for g in group) == sorted(plan.tiers.deferred)
        for group in groups:
            assert len({across_cases(plan.graphs[g].descriptor) for g in group}) == 1
        assert verify_plan(plan).ok


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.large_base_example])
@given(tier_specs())
def test_dp_ranks_with_different_lora_counts_replay_one_size_in_every_group_state(case):
    """Generated MoE DP tier specs: in any state the runtime can be in (the ready set and any
    deferred groups captured), two ranks replaying one batch with different LoRA counts replay
    graphs of one size and mode wherever the final plan gives them one."""
    from capplan.planner.tiers import case_groups

    data, seed = case
    rng = random.Random(seed)
    plan = plan_of({**data, "parallel": {"data_parallel_size": 2, "moe": True}})
    tiers = plan.tiers
    groups = case_groups(plan.graphs, tiers.deferred)
    ready = set(range(len(plan.graphs))) - set(tiers.deferred)
    dispatcher = Dispatcher(plan)
    seqs, budget = plan.spec.scheduler.max_num_seqs, plan.spec.scheduler.max_num_batched_tokens
    max_loras = plan.spec.lora.max_loras if plan.spec.lora.enabled else 0

    def size(gid: int) -> tuple[str, int]:
        d = plan.graphs[gid].descriptor
        return d.cg_mode, d.num_tokens

    for _ in range(6):
        captured = set(ready)
        for group in groups:
            if rng.random() < 0.5:
                captured |= set(group)
        for _ in range(60):
            reqs = rng.randint(1, seqs)
            tokens = min(budget, reqs * rng.choice([1, 1, 2, rng.randint(1, 64)]))
            a, b = (rng.randint(0, min(reqs, max_loras)) for _ in range(2))
            ga = dispatcher.dispatch(Batch(reqs, tokens, -(-tokens // reqs), a, a > 0 and a < reqs)).graph_id
            gb = dispatcher.dispatch(Batch(reqs, tokens, -(-tokens // reqs), b, False)).graph_id
            if ga < 0 or gb < 0 or size(ga) != size(gb):
                continue
            ra, rb = replayed(tiers, ga, captured), replayed(tiers, gb, captured)
            assert ra >= 0 and rb >= 0 and size(ra) == size(rb), (
                plan.graphs[ra].descriptor,
                plan.graphs[rb].descriptor,
            )


class _Runtime:
    """vLLM's CudaRTLibrary as the held block uses it, recording the calls; `refuse`: cudaMalloc
    fails as the driver does when memory is short (vLLM's CUDART_CHECK raises RuntimeError)."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[str, object]] = []
        self.refuse = refuse
        outer = self

        class Lib:
            def cudaGetLastError(self) -> int:
                outer.calls.append(("cudaGetLastError", None))
                return 2

        self.lib = Lib()

    def cudaMalloc(self, size: int) -> object:
        self.calls.append(("cudaMalloc", size))
        if self.refuse:
            raise RuntimeError("CUDART error: out of memory")
        return ("pointer", size)

    def cudaFree(self, pointer: object) -> None:
        self.calls.append(("cudaFree", pointer))


def test_held_block_is_driver_memory_given_back_without_leaving_an_error():
    from capplan.runtime.deferred.held import HeldBlock

    rt = _Runtime()
    block = HeldBlock.take(64, free=100, library=rt)
    assert block is not None and block.size == 64
    block.give_back()
    assert rt.calls == [("cudaMalloc", 64), ("cudaFree", ("pointer", 64))]
    # more than the device has free: not asked for at all
    rt = _Runtime()
    assert HeldBlock.take(101, free=100, library=rt) is None and rt.calls == []
    # the driver refuses (another process took memory meanwhile): the runtime's last error is
    # cleared, so PyTorch's check after the next kernel launch does not report it
    rt = _Runtime(refuse=True)
    assert HeldBlock.take(64, free=100, library=rt) is None
    assert rt.calls == [("cudaMalloc", 64), ("cudaGetLastError", None)]


def test_the_hold_is_each_modes_bound_times_its_pending_graphs():
    """Readings per mode, each mode's first left out (the pool's base); a mode without readings
    borrows every mode's, and with none at all the first captures stand in; the deferred graphs'
    own readings stand alone once there are SAMPLES_MIN of them."""
    from types import SimpleNamespace

    from capplan.runtime.deferred.capture import DeferredCapture
    from capplan.runtime.deferred.estimate import per_graph_bound

    plan = plan_of(tiered(["FULL:1x1@0"]))
    assert plan.tiers is not None
    deferred = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"]))
    mode = {g.id: g.descriptor.cg_mode for g in plan.graphs}
    pending = {m: sum(1 for g in deferred.pending if mode[g] == m) for m in ("PIECEWISE", "FULL")}
    assert pending["PIECEWISE"] and pending["FULL"]
    mib = 2**20
    deferred.state.estimate.reading("PIECEWISE", 40 * mib, deferred=False)  # the pool's base: not a reading
    assert deferred.state.pending_bound() == 80 * mib * len(deferred.pending)  # only a first: it stands in, twice
    for used in (2, 4, 0, 2):
        deferred.state.estimate.reading("PIECEWISE", used * mib, deferred=False)
    pw = per_graph_bound([2 * mib, 4 * mib, 0, 2 * mib])
    assert deferred.state.estimate.per_graph_bytes("FULL") == pw  # no FULL reading yet: the PIECEWISE ones
    deferred.state.estimate.reading("FULL", 9 * mib, deferred=False)
    deferred.state.estimate.reading("FULL", 1 * mib, deferred=False)
    assert deferred.state.estimate.per_graph_bytes("FULL") == 2 * mib
    assert deferred.state.pending_bound() == pw * pending["PIECEWISE"] + 2 * mib * pending["FULL"]
    # Deferred graphs' own readings join the ready ones, and replace them once there are enough.
    from capplan.runtime.deferred.estimate import SAMPLES_MIN

    for _ in range(SAMPLES_MIN - 1):
        deferred.state.estimate.reading("FULL", 0, deferred=True)
    assert deferred.state.estimate.per_graph_bytes("FULL") == per_graph_bound(
        [mib] + [0] * (SAMPLES_MIN - 1)
    )  # 9 MiB: the base
    deferred.state.estimate.reading("FULL", mib, deferred=True)
    assert deferred.state.estimate.per_graph_bytes("FULL") == per_graph_bound([0] * (SAMPLES_MIN - 1) + [mib])


def test_attention_warm_makes_ready_the_first_graph_of_each_attention_kernel():
    """Where the attention backend switches kernels on the request count (vLLM's TRITON_ATTN:
    split-KV for at most seq_threshold_3D one-token requests), each (side, specialization)
    class gets a ready graph, its largest; no threshold adds nothing."""
    from capplan.planner.tiers import attention_warm, shape, specialization

    plan = plan_of(tiered(["FULL:1x1@0"]))
    graphs, mns = plan.graphs, BASE["scheduler"]["max_num_seqs"]
    ready = set(range(len(graphs))) - set(plan.tiers.deferred)
    assert attention_warm(graphs, ready, mns, []) == set()

    def key(d, t):
        reqs = d.num_reqs or min(d.num_tokens, mns)
        return (*shape(d), reqs <= t, reqs == d.num_tokens, specialization(d.num_tokens), specialization(reqs))

    for t in (8, 16, 24):
        extra = attention_warm(graphs, ready, mns, [t])
        assert extra and extra <= set(plan.tiers.deferred)
        warm = {key(graphs[g].descriptor, t) for g in ready | extra}
        assert all(key(g.descriptor, t) in warm for g in graphs)  # no deferred capture is first of its kernel
        for gid in extra:  # each added graph is the largest of a class no ready graph was in
            d = graphs[gid].descriptor
            same = [g for g in graphs if key(g.descriptor, t) == key(d, t)]
            assert not {g.id for g in same} & ready
            assert d.num_tokens == max(g.descriptor.num_tokens for g in same)
    # 16 one-token requests run the split kernel with threshold 16, not with 8.
    sixteen = {address(graphs[g].descriptor) for g in attention_warm(graphs, ready, mns, [16])}
    assert "PIECEWISE:16@0" in sixteen
    assert "PIECEWISE:16@0" not in {address(graphs[g].descriptor) for g in attention_warm(graphs, ready, mns, [8])}
    assert attention_warm(graphs, ready | attention_warm(graphs, ready, mns, [16]), mns, [16]) == set()


def test_runtime_makes_the_attention_warm_graphs_ready_before_the_first_capture():
    """The live attention builders' seq_threshold_3D (read from the capture's attn_groups, once)
    moves the planner's attention_warm graphs from pending to ready, in plan order, and the
    report counts them; builders without one (FLASH_ATTN) change nothing."""
    from types import SimpleNamespace

    from capplan.planner.tiers import attention_warm
    from capplan.runtime.deferred.capture import DeferredCapture

    plan = plan_of(tiered(["FULL:1x1@0"]))

    one_rank = SimpleNamespace(tp_size=1, is_first_pp_rank=True, is_last_pp_rank=True)  # vLLM's manager

    def groups(*thresholds):
        builders = [SimpleNamespace(seq_threshold_3D=t) for t in thresholds] + [SimpleNamespace()]
        return {"self": one_rank, "attn_groups": [[SimpleNamespace(metadata_builders=builders)]]}

    plain = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"]))
    odd = [SimpleNamespace(seq_threshold_3D=v) for v in (True, "16", 16.0, None)]  # not a threshold
    plain.warm_attention({"self": one_rank, "attn_groups": [[SimpleNamespace(metadata_builders=odd)], []]})
    assert (
        plain.state.start.warmed == []
        and plain.pending == list(plan.tiers.deferred)
        and plain.state.start.attention_thresholds == []
    )

    deferred = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"]))
    ready_before = set(deferred.state.graphs.ready_ids)
    deferred.warm_attention(groups(16, 16))
    extra = attention_warm(plan.graphs, ready_before, BASE["scheduler"]["max_num_seqs"], [16])
    assert extra and deferred.state.start.warmed == sorted(extra) and deferred.state.start.attention_thresholds == [16]
    assert deferred.pending == [g for g in plan.tiers.deferred if g not in extra]
    assert (
        deferred.state.graphs.ready_ids == sorted(ready_before | extra)
        and deferred.state.graphs.captured == ready_before | extra
    )
    deferred.warm_attention(groups(8))  # read once: a later capture's builders change nothing
    assert deferred.state.start.attention_thresholds == [16] and deferred.state.start.warmed == sorted(extra)


def test_dp_ranks_that_pad_to_one_another_make_every_lora_case_of_an_attention_warm_size_ready():
    """With DP ranks that pad to one another each rank may replay any LoRA case of a size, so the
    graphs made ready for the attention kernels close over their case groups, as the planner
    closes the ready set: every case of a warmed size is ready, on every rank alike."""
    from types import SimpleNamespace

    from capplan.planner.tiers import across_cases, attention_warm
    from capplan.runtime.deferred.capture import DeferredCapture

    plan = plan_of(tiered(["FULL:1x1@0"], parallel={"data_parallel_size": 2, "moe": True}))
    graphs = plan.graphs
    groups = {
        "self": SimpleNamespace(tp_size=1, is_first_pp_rank=True, is_last_pp_rank=True),  # vLLM's manager
        "attn_groups": [[SimpleNamespace(metadata_builders=[SimpleNamespace(seq_threshold_3D=16)])]],
    }
    ranks = [DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"])) for _ in range(2)]
    ready_before = set(ranks[0].state.graphs.ready_ids)
    for rank in ranks:
        assert rank.synced
        rank.warm_attention(groups)
    assert ranks[0].state.start.warmed == ranks[1].state.start.warmed and ranks[0].pending == ranks[1].pending
    alone = attention_warm(graphs, ready_before, BASE["scheduler"]["max_num_seqs"], [16])
    sizes = {across_cases(graphs[g].descriptor) for g in alone}
    want = {g.id for g in graphs if across_cases(g.descriptor) in sizes} - ready_before
    assert alone < want  # one case of a size would leave the other ranks' cases deferred
    assert set(ranks[0].state.start.warmed) == want
    assert not want & set(ranks[0].pending)


def _split_kv(rule: str, reqs: int, query: int, tokens: int, threshold: int, block_q: int, max_num_seqs: int) -> bool:
    """vLLM's own choice of TRITON_ATTN's split-KV kernel, written from its source for this
    test (not from capplan): before 0.33.0 one-token requests up to the threshold; 0.33.0
    `unified_attention`'s use_3d for a causal batch, and the scratch-rows check after it."""
    if rule != "0.33":
        return query == 1 and reqs <= threshold
    return query <= 8 and reqs * -(-query // block_q) <= threshold and tokens <= min(threshold, max_num_seqs)


def _compile_of(g, rule: str, threshold: int, block_q: int, max_num_seqs: int) -> tuple[object, ...]:
    """What a graph's capture compiles of the attention: mode, kernel, and the specializations
    of its requests, longest query and tokens."""
    from capplan.planner.tiers import specialization

    d, reqs = g.descriptor, g.dummy.num_reqs
    mixed_full = d.cg_mode == "FULL" and d.uniform_token_count is None and rule != "0.25"
    query = d.num_tokens if mixed_full else g.dummy.max_query_len
    split = _split_kv(rule, reqs, query, d.num_tokens, threshold, block_q, max_num_seqs)
    return (d.cg_mode, split, specialization(reqs), specialization(query), specialization(d.num_tokens))


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "PIECEWISE"])
@pytest.mark.parametrize("max_num_seqs", [8, 32])
def test_attention_warm_leaves_no_kernel_compile_to_a_deferred_capture_under_vllms_rule(mode, max_num_seqs):
    """Against vLLM's kernel choice on every release's rule and every BLOCK_Q a model can give:
    each graph's compile (mode, kernel, specializations of requests, longest query and tokens)
    is one a ready or warmed graph compiles first. From 0.31.0 a FULL graph of mixed batches
    gives attention max_query_len equal to its tokens (`capture_graph`'s prepare step)."""
    from capplan.planner.tiers import attention_warm

    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    spec = {**tiered(["FULL:1x1@0"] if mode != "PIECEWISE" else ["PIECEWISE:1@0"])}
    spec.update(
        scheduler={**BASE["scheduler"], "max_num_seqs": max_num_seqs}, cudagraph={"mode": mode, "capture_sizes": sizes}
    )
    plan = plan_of(spec)
    graphs = plan.graphs
    ready = set(range(len(graphs))) - set(plan.tiers.deferred)
    for threshold in (4, 8, 16, 32, 64):
        warmed = attention_warm(graphs, ready, max_num_seqs, [threshold])
        assert not warmed & ready
        for rule in ("0.25", "0.31", "0.33"):
            for block_q in (1, 2, 4, 8, 16):
                how = (rule, threshold, block_q, max_num_seqs)
                first = {_compile_of(graphs[g], *how) for g in ready | warmed}
                missed = [address(g.descriptor) for g in graphs if _compile_of(g, *how) not in first]
                assert not missed, (threshold, rule, block_q, missed)


@settings(max_examples=60, deadline=None)
@given(
    ready_share=st.floats(0.0, 1.0),
    thresholds=st.lists(st.integers(-4, 600), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_attention_warm_covers_every_kernel_class_from_any_ready_set(ready_share, thresholds, seed):
    """From any ready set and any thresholds: the graphs added are outside the ready set, with
    them every graph's attention class has a ready graph, and a second call adds nothing."""
    from capplan.planner.tiers import attention_warm, shape, specialization

    plan = plan_of(tiered(["FULL:1x1@0"]))
    graphs, mns = plan.graphs, BASE["scheduler"]["max_num_seqs"]
    rng = random.Random(seed)
    ready = {g.id for g in graphs if rng.random() < ready_share}
    extra = attention_warm(graphs, ready, mns, thresholds)
    assert not extra & ready
    if not thresholds:
        assert extra == set()
        return

    def key(d):
        reqs = d.num_reqs or min(d.num_tokens, mns)
        sides = tuple(reqs <= t for t in sorted(thresholds))
        return (*shape(d), sides, reqs == d.num_tokens, specialization(d.num_tokens), specialization(reqs))

    covered = {key(graphs[g].descriptor) for g in ready | extra}
    assert all(key(g.descriptor) in covered for g in graphs)
    assert attention_warm(graphs, ready | extra, mns, thresholds) == set()


def test_a_shared_gpu_is_said_where_a_capture_was_read_by_the_device(capsys):
    """Other processes on the GPU move the device's memory: where a capture before the hold was
    read by it, the start says the hold is then an estimate, unless NVML shows this process
    alone; read by this process's own memory it is quiet. The report carries the count and how
    the captures were read."""
    from types import SimpleNamespace

    from capplan.runtime.deferred.capture import DeferredCapture

    plan = plan_of(tiered(["FULL:1x1@0"]))
    deferred = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"]))
    by_device, by_process, mixed = {"process": 0, "device": 5}, {"process": 5, "device": 0}, {"process": 4, "device": 1}
    for readings, others, said in (
        (by_device, 0, None),
        (by_device, 3, "3 other process(es) hold memory on this GPU, and 5 capture(s)"),
        (by_device, None, "NVML cannot say whether other processes hold memory on this GPU, and 5 capture(s)"),
        (by_process, 3, None),
        (by_process, None, None),
        (mixed, 3, "3 other process(es) hold memory on this GPU, and 1 capture(s)"),
    ):
        deferred.state.vllm.readings = readings
        deferred.state.shared_gpu(others, 3 * 2**30)
        err = capsys.readouterr().err
        if said is None:
            assert err == ""
        else:
            assert said in err and "3.00 GiB held for the deferred graphs is an estimate, not a bound" in err
            assert err.count("\n") == 1
        report = deferred.to_json()
        assert report["other_gpu_processes_at_start"] == others and report["memory_readings"] == readings
    deferred.state.vllm.readings = by_device
    deferred.state.shared_gpu(2, 0)  # nothing held: nothing to qualify
    assert capsys.readouterr().err == ""


class FakeNvml:
    """NVML as vLLM's pynvml answers: a device found by its UUID, and its processes."""

    def __init__(self, uuid: str = "GPU-1234"):
        self.uuid, self.calls, self.processes = uuid, [], {}
        self.fail_listing = False

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != self.uuid:
            raise RuntimeError("not found")
        return "handle"

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from types import SimpleNamespace

        assert handle == "handle"
        if self.fail_listing:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes.items()]


def fake_vllm_nvml(monkeypatch, nvml):
    import sys
    from types import ModuleType

    import_utils = ModuleType("vllm.utils.import_utils")
    import_utils.import_pynvml = lambda: nvml
    for name, module in (
        ("vllm", ModuleType("vllm")),
        ("vllm.utils", ModuleType("vllm.utils")),
        ("vllm.utils.import_utils", import_utils),
    ):
        monkeypatch.setitem(sys.modules, name, module)


def test_process_memory_reads_this_process_alone_and_counts_the_others(monkeypatch):
    """NVML found by the device's UUID (torch's, with or without `GPU-`): this process's own
    memory, the other processes counted; a device NVML does not find is no answer (NVML shut
    again), and a process NVML does not list, or lists without a value, reads None."""
    import os

    from capplan.runtime.deferred.device_memory import ProcessMemory

    nvml = FakeNvml()
    fake_vllm_nvml(monkeypatch, nvml)
    me = os.getpid()
    nvml.processes = {me: 5 * 2**20, me + 1: 7 * 2**30, me + 2: None}
    for uuid in ("1234", "GPU-1234"):
        memory = ProcessMemory.open(uuid)
        assert memory is not None and memory.own() == 5 * 2**20 and memory.others() == 2
    assert nvml.calls == ["init", "init"]  # kept open while serving
    nvml.processes[me + 1] = 9 * 2**30  # another process allocates: this one's reading stays
    assert memory.own() == 5 * 2**20
    nvml.processes[me] = None  # NVML does not say
    assert memory.own() is None
    nvml.processes = {me + 10: 2**30}  # PIDs of another namespace: this one may be the process
    assert memory.own() is None and memory.others() is None
    nvml.processes = {me + 10: 2**30, me + 11: 2**30, me + 12: 2**30}  # at least two are others
    assert memory.own() is None and memory.others() == 2
    nvml.processes = {}  # NVML sees no process of this namespace, not even this one
    assert memory.others() is None
    nvml.fail_listing = True
    assert memory.own() is None and memory.others() is None
    assert ProcessMemory.open("9999") is None and nvml.calls[-1] == "shutdown"

    class ShutdownFails(FakeNvml):
        def nvmlShutdown(self):
            raise RuntimeError("NVML_ERROR_UNINITIALIZED")

    fake_vllm_nvml(monkeypatch, ShutdownFails())
    assert ProcessMemory.open("9999") is None  # no answer, never an error into the engine


def test_process_memory_without_nvml_is_no_answer(monkeypatch):
    from capplan.runtime.deferred.device_memory import ProcessMemory

    class Broken(FakeNvml):
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    fake_vllm_nvml(monkeypatch, Broken())
    assert ProcessMemory.open("1234") is None


def test_a_capture_is_read_by_this_process_where_both_readings_have_it(monkeypatch):
    """The growth of this process's memory where NVML listed it before and after the capture;
    else the device's, never one reading against the other. Both leave out the default pool."""
    import os
    import sys
    from types import SimpleNamespace

    from capplan.runtime.deferred.device_memory import ProcessMemory, growth, in_use

    MiB = 2**20
    state = {"free": 100_000 * MiB, "default": 300 * MiB, "graph": 40 * MiB}
    cuda = SimpleNamespace(
        mem_get_info=lambda: (state["free"], 140_000 * MiB),
        current_device=lambda: 0,
        memory_snapshot=lambda: [
            {"device": 0, "segment_pool_id": (0, 0), "total_size": state["default"]},
            {"device": 0, "segment_pool_id": (1, 0), "total_size": state["graph"]},
            {"device": 1, "segment_pool_id": (0, 0), "total_size": 999 * MiB},  # another device's
        ],
        memory_reserved=lambda device=None: state["default"] + state["graph"],
    )
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    nvml = FakeNvml()
    fake_vllm_nvml(monkeypatch, nvml)
    me = os.getpid()
    nvml.processes = {me: 1000 * MiB, me + 1: 30_000 * MiB}
    memory = ProcessMemory.open("1234")
    before = in_use(memory)
    assert before == (700 * MiB, 39_700 * MiB)
    # The capture takes 6 MiB; meanwhile another process frees 3 GiB and the steps' cache grows.
    nvml.processes = {me: 1106 * MiB, me + 1: 27_000 * MiB}
    state["default"] += 100 * MiB
    state["free"] += 3072 * MiB - 106 * MiB
    after = in_use(memory)
    assert growth(before, after) == (6 * MiB, True)
    assert growth(before, (None, after[1])) == (-3072 * MiB + 6 * MiB, False)  # the device's: the other moved it
    assert growth((None, before[1]), after)[1] is False
    assert in_use(None)[0] is None
    nvml.processes = {me: 200 * MiB}  # below the 440 MiB PyTorch alone holds: another process's PID
    assert in_use(memory)[0] is None


def fake_gpu(monkeypatch, nvml, state):
    """torch.cuda and vLLM's gpu_sync_allowed as vLLM's capture call (`VllmCapture`) uses them, on a fake GPU whose
    device memory is `state["device"]` (this process's NVML figure: `nvml.processes`)."""
    import contextlib
    import sys
    from types import ModuleType, SimpleNamespace

    cuda = SimpleNamespace(
        is_available=lambda: True,
        synchronize=lambda: None,
        current_device=lambda: 0,
        get_device_properties=lambda i: SimpleNamespace(uuid="1234"),
        mem_get_info=lambda: (140_000 * 2**20 - state["device"], 140_000 * 2**20),
        memory_snapshot=lambda: [{"device": 0, "segment_pool_id": (0, 0), "total_size": 0}],
        memory_reserved=lambda device=None: 0,
    )
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    fake_vllm_nvml(monkeypatch, nvml)
    sync = ModuleType("vllm.utils.gpu_sync_debug")
    sync.gpu_sync_allowed = contextlib.nullcontext
    monkeypatch.setitem(sys.modules, "vllm.utils.gpu_sync_debug", sync)


def test_captures_are_read_by_this_process_and_counted_where_nvml_lists_it(monkeypatch):
    """Through vLLM's capture call (`VllmCapture`): NVML opened once, each capture's memory the growth of this
    process's figure while another process allocates on the same GPU, counted as read by the
    process; where NVML stops listing this process, the device's growth, counted as such."""
    import inspect
    import os
    from types import SimpleNamespace

    from capplan.runtime.deferred.capture import DeferredCapture
    from capplan.runtime.hooking import Call

    MiB, me = 2**20, os.getpid()
    nvml = FakeNvml()
    state = {"device": 50_000 * MiB}
    nvml.processes = {me: 1000 * MiB, me + 1: 40_000 * MiB}
    fake_gpu(monkeypatch, nvml, state)

    def capture(*, takes: int, others_take: int) -> str:  # vLLM's capture, as the manager runs it
        if me in nvml.processes:
            nvml.processes[me] += takes
        nvml.processes[me + 1] += others_take
        state["device"] += takes + others_take
        return "done"

    plan = plan_of(tiered(["FULL:1x1@0"]))
    ctx = SimpleNamespace(plan=plan, release=RELEASES["0.33.0"], vllm_descs={0: SimpleNamespace(cg_mode="FULL")})
    deferred = DeferredCapture(ctx)
    manager = SimpleNamespace(_capture_descs=None)
    signature = inspect.signature(capture)
    runs = []
    for takes, others_take in ((6 * MiB, 3072 * MiB), (2 * MiB, -2048 * MiB), (0, 512 * MiB)):
        call = Call(signature, (), {"takes": takes, "others_take": others_take})
        got = deferred.state.vllm(0, call, manager, capture)
        runs.append((got.result, got.used))
    assert runs == [("done", 6 * MiB), ("done", 2 * MiB), ("done", 0)]
    assert deferred.state.vllm.readings == {"process": 3, "device": 0} and nvml.calls == ["init"]
    del nvml.processes[me]  # NVML no longer lists this process: the device's reading, said so
    call = Call(signature, (), {"takes": 4 * MiB, "others_take": 100 * MiB})
    used = deferred.state.vllm(0, call, manager, capture).used
    assert used == 104 * MiB and deferred.state.vllm.readings == {"process": 3, "device": 1}
    assert deferred.to_json()["memory_readings"] == {"process": 3, "device": 1}


def test_without_nvml_every_capture_is_read_by_the_device(monkeypatch):
    import inspect
    from types import SimpleNamespace

    from capplan.runtime.deferred.capture import DeferredCapture
    from capplan.runtime.hooking import Call

    class NoNvml(FakeNvml):
        def nvmlInit(self):
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    state = {"device": 10 * 2**30}
    fake_gpu(monkeypatch, NoNvml(), state)

    def capture(*, takes: int) -> None:
        state["device"] += takes

    ctx = SimpleNamespace(
        plan=plan_of(tiered(["FULL:1x1@0"])),
        release=RELEASES["0.33.0"],
        vllm_descs={0: SimpleNamespace(cg_mode="FULL")},
    )
    deferred = DeferredCapture(ctx)
    for takes in (2**20, 3 * 2**20):
        call = Call(inspect.signature(capture), (), {"takes": takes})
        assert deferred.state.vllm(0, call, SimpleNamespace(_capture_descs={}), capture).used == takes
    assert deferred.state.vllm.memory is None and deferred.state.vllm.readings == {"process": 0, "device": 2}


VALUES = st.one_of(
    st.none(),
    st.integers(min_value=-(2**40), max_value=2**50),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
)


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    listing=st.dictionaries(st.integers(min_value=0, max_value=2**22), VALUES, max_size=6),
    listed=st.booleans(),
    mine=VALUES,
)
def test_process_memory_answers_any_listing_with_a_count_and_an_int_or_none(monkeypatch, listing, listed, mine):
    """Whatever NVML lists (any PIDs, values of any type, this process or not): the reading is
    this process's int value or None, never another type; the count of others is never
    negative; a capture read from two listings is the process's only where both have an int."""
    import os

    from capplan.runtime.deferred.device_memory import ProcessMemory, growth

    nvml = FakeNvml()
    fake_vllm_nvml(monkeypatch, nvml)
    memory = ProcessMemory.open("1234")
    assert memory is not None
    nvml.processes = {pid: used for pid, used in listing.items() if pid != os.getpid()}
    if listed:
        nvml.processes[os.getpid()] = mine
    own = memory.own()
    assert own is None or (type(own) is int and own == mine)
    assert (own is None) == (not listed or type(mine) is not int)
    others = memory.others()
    assert others is None or 0 <= others < len(nvml.processes)
    if listed:
        assert others == len(nvml.processes) - 1  # listed: every other entry is another process
    used, by_process = growth((own, 10), (None if own is None else own + 7, 25))
    assert (used, by_process) == ((7, True) if own is not None else (15, False))


def test_the_hold_on_a_gpu_start_refuses_serving_records_and_the_count_is_nvmls(monkeypatch, capsys):
    """The hold (`DeferredState.hold_pending`) where torch sees a GPU (fakes of torch.cuda, NVML and vLLM's CudaRTLibrary): at
    start the bound is taken as one block and the other processes NVML lists are recorded (quiet:
    every capture was read by the process); a start with less free memory than the bound stops
    with one line naming the plan; while serving, no room is a recorded shortfall, as is a
    driver that refuses (its error cleared), never an error into the step."""
    import os
    import sys
    from types import ModuleType, SimpleNamespace

    from capplan.errors import EngineRefusal
    from capplan.runtime.deferred.capture import DeferredCapture
    from capplan.runtime.deferred.device_memory import ProcessMemory

    MiB, me = 2**20, os.getpid()
    nvml = FakeNvml()
    nvml.processes = {me: 900 * MiB, me + 1: MiB, me + 2: MiB}
    state = {"device": 10_000 * MiB}
    fake_gpu(monkeypatch, nvml, state)
    runtimes: list[_Runtime] = []

    def library() -> _Runtime:
        runtimes.append(_Runtime(refuse=state.get("refuse", False)))
        return runtimes[-1]

    wrapper = ModuleType("vllm.distributed.device_communicators.cuda_wrapper")
    wrapper.CudaRTLibrary = library
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.cuda_wrapper", wrapper)

    plan = plan_of(tiered(["FULL:1x1@0"]))
    deferred = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"], plan_path="p.plan.yaml"))
    deferred.state.vllm.memory = ProcessMemory.open("1234")
    deferred.state.vllm.readings = {"process": 4, "device": 0}
    for mode in ("PIECEWISE", "FULL"):
        for used in (40, 2, 0, 2):  # each mode's first is the pool's base
            deferred.state.estimate.reading(mode, used * MiB, deferred=False)
    want = deferred.state.pending_bound()
    assert want > 0
    deferred.state.hold_pending("start")
    assert (
        deferred.state.hold.held_bytes == deferred.state.hold.peak_bytes == want
        and deferred.state.hold.block is not None
    )
    assert runtimes[-1].calls == [("cudaMalloc", want)]
    assert deferred.state.other_processes == 2 and capsys.readouterr().err == ""
    report = deferred.to_json()
    assert report["other_gpu_processes_at_start"] == 2 and report["reserve_shortfall"] is False
    assert set(report["held_per_graph_mib_at_start"]) == {"PIECEWISE", "FULL"}
    deferred.state.hold.release()
    assert (
        deferred.state.hold.block is None
        and deferred.state.hold.held_bytes == 0
        and runtimes[-1].calls[-1][0] == "cudaFree"
    )

    state["device"] = 140_000 * MiB - want + 1  # one byte too few free
    deferred.state.hold_pending("serving")
    assert deferred.state.hold.shortfall and deferred.state.hold.block is None and deferred.state.hold.held_bytes == 0
    state["device"] = 10_000 * MiB
    state["refuse"] = True  # free by the count, but the driver refuses: another process took it
    deferred.state.hold.shortfall = False
    deferred.state.hold_pending("serving")
    assert deferred.state.hold.shortfall and runtimes[-1].calls[-1] == ("cudaGetLastError", None)

    fresh = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"], plan_path="p.plan.yaml"))
    fresh.state.estimate.ready_readings, fresh.state.estimate.firsts = (
        deferred.state.estimate.ready_readings,
        deferred.state.estimate.firsts,
    )
    state["device"], state["refuse"] = 140_000 * MiB - want + 1, False
    with pytest.raises(EngineRefusal) as refused:
        fresh.state.hold_pending("start")
    message = str(refused.value)
    assert message.startswith("capplan: p.plan.yaml: not enough GPU memory left to hold back")
    assert "refusing to start" in message and "\n" not in message


NEXT_PLAN = plan_of(tiered(["FULL:1x1@0"]))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=60), st.booleans())
def test_the_next_deferred_graph_is_the_most_missed_and_plan_order_decides_ties(draws, by_misses):
    from capplan.runtime.deferred.graphs import GraphSets

    sets = GraphSets(NEXT_PLAN)
    pending = list(sets.pending)
    for d in draws:
        sets.resolve(pending[d % len(pending)])  # each a dispatch that replayed the graph's fallback
    got = sets.next(by_misses)
    if not by_misses or not draws:
        assert got == pending[0]  # plan order: ranks that capture together pick alike
        return
    most = max(sets.misses[g] for g in pending)
    assert sets.misses[got] == most and got == next(g for g in pending if sets.misses[g] == most)
    sets.take([got])
    assert got not in sets.pending and sets.pending == [g for g in pending if g != got]


def test_a_capture_sets_vllm_s_list_to_its_graph_and_puts_the_list_back_even_when_it_fails(monkeypatch):
    """The one swap of vLLM's capture list (vllm_capture.capture_list): the capture sees its graph
    alone; after it, and after a capture that raised, the manager has the list it had."""
    import inspect
    from types import SimpleNamespace

    from capplan.runtime.deferred.capture import DeferredCapture
    from capplan.runtime.hooking import Call

    fake_gpu(monkeypatch, FakeNvml(), {"device": 10 * 2**30})
    desc = SimpleNamespace(cg_mode="FULL")
    plan = plan_of(tiered(["FULL:1x1@0"]))
    deferred = DeferredCapture(SimpleNamespace(plan=plan, release=RELEASES["0.33.0"], vllm_descs={0: desc}))
    vllms = {"PIECEWISE": ["a", "b"]}
    manager = SimpleNamespace(_capture_descs=vllms)
    seen = []

    def capture(*, fail: bool) -> str:
        seen.append(manager._capture_descs)
        if fail:
            raise ValueError("CUDA error: out of memory")
        return "done"

    signature = inspect.signature(capture)
    assert deferred.state.vllm(0, Call(signature, (), {"fail": False}), manager, capture).result == "done"
    assert manager._capture_descs is vllms
    with pytest.raises(RuntimeError, match=r"capture of graph \S+ failed \(ValueError: CUDA error: out of memory\)"):
        deferred.state.vllm(0, Call(signature, (), {"fail": True}), manager, capture)
    assert manager._capture_descs is vllms
    assert seen == [{"FULL": [desc]}, {"FULL": [desc]}]
