"""Properties over random valid specs (hypothesis)."""

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from capplan.loading import spec_from_data
from capplan.planfile import render_plan
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.planner.lora_cases import kernel_slots

MODES = ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


@st.composite
def specs(draw, fixes=None):
    seqs = draw(st.integers(1, 48))
    budget = draw(st.integers(seqs, 1024))
    mode = draw(st.sampled_from(MODES))
    cudagraph = {"mode": mode}
    if mode != "NONE" and draw(st.booleans()):
        sizes = draw(st.lists(st.integers(1, budget), min_size=1, max_size=12, unique=True))
        cudagraph["capture_sizes"] = sorted(sizes)
    lora_on = draw(st.booleans())
    return spec_from_data(
        {
            "target": {"vllm": draw(st.sampled_from(["0.25", "0.33"]))},
            "scheduler": {
                "max_num_seqs": seqs,
                "max_num_batched_tokens": budget,
                "max_model_len": draw(st.integers(1, 4096)),
            },
            "cudagraph": cudagraph,
            "lora": {
                "enabled": lora_on,
                "max_loras": draw(st.integers(1, 9)),
                "specialize": draw(st.booleans()),
                "specialize_active": draw(st.booleans()),
            },
            "speculative": {"num_speculative_tokens": draw(st.integers(0, 4))},
            "parallel": {"data_parallel_size": draw(st.sampled_from([1, 2, 4])), "moe": True},
            "fixes": fixes
            if fixes is not None
            else draw(st.lists(st.sampled_from(["lora_slot", "dummy_remainder", "mixed_ranges"]), unique=True)),
        },
        "hypothesis",
    )


@st.composite
def batches(draw, spec):
    reqs = draw(st.integers(1, spec.scheduler.max_num_seqs))
    tokens = draw(st.integers(reqs, spec.scheduler.max_num_batched_tokens))
    max_q = draw(st.integers(-(-tokens // reqs), tokens - reqs + 1))
    adapters = draw(st.integers(0, min(reqs, spec.lora.max_loras))) if spec.lora.enabled else 0
    base = draw(st.booleans()) if adapters < reqs else False
    return Batch(reqs, tokens, max_q, adapters, base, draw(st.booleans()))


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(specs())
def test_compile_is_deterministic_and_round_trips(spec):
    """The text YAML reads back is exactly the format's data, every line fits in
    MAX_LINE, every graph address is unique, and the file loads back to the plan."""
    import yaml

    from capplan.planfile import MAX_LINE, first_difference, plan_file_data, plan_from_data

    plan = compile_plan(spec)
    text = render_plan(plan, "x.yaml")
    assert render_plan(compile_plan(spec), "x.yaml") == text
    data = yaml.safe_load(text)
    assert first_difference(data, plan_file_data(plan)) is None
    assert max(len(line) for line in text.splitlines()) <= MAX_LINE
    addresses = [g["graph"] for g in data["graphs"]]
    assert len(set(addresses)) == len(addresses)
    loaded, problem = plan_from_data(data, "x")
    assert problem is None and loaded == plan


@FAST
@given(st.data())
def test_dispatch_returns_a_compatible_graph_or_eager(data):
    spec = data.draw(specs())
    plan = compile_plan(spec)
    dispatcher = Dispatcher(plan)
    for _ in range(20):
        batch = data.draw(batches(spec))
        desc = dispatcher.dispatch(batch)
        case = dispatcher.lora_case(dispatcher.lora_count(batch))
        assert desc.num_active_loras == case
        if desc.cg_mode == "NONE":
            continue
        graph = plan.graphs[desc.graph_id].descriptor
        assert tuple(desc[:6]) == (
            graph.cg_mode,
            graph.num_tokens,
            graph.num_reqs,
            graph.uniform_token_count,
            graph.max_query_len,
            graph.num_active_loras,
        )
        assert desc.num_tokens >= batch.num_tokens
        assert desc.num_reqs is None or desc.num_reqs >= batch.num_reqs


def fixed_plan_dispatches(data, count: int = 20):
    """A random plan with every fix, and `count` random batches with what each replays."""
    spec = data.draw(specs(fixes=["lora_slot", "dummy_remainder", "mixed_ranges"]))
    plan = compile_plan(spec)
    dispatcher = Dispatcher(plan)
    batches_drawn = [data.draw(batches(spec)) for _ in range(count)]
    return spec, plan, [(b, dispatcher.dispatch(b)) for b in batches_drawn]


@FAST
@given(st.data())
def test_fixed_plans_cover_every_batch_a_piecewise_graph_can_hold(data):
    # Failure class 8: with per-mode ranges, a batch only runs eager when no
    # graph of its LoRA case is large enough (or the mode captures none).
    _, plan, results = fixed_plan_dispatches(data)
    for batch, desc in results:
        if desc.cg_mode != "NONE":
            continue
        case = desc.num_active_loras
        assert not any(
            d.num_active_loras == case and d.num_reqs is None and d.num_tokens >= batch.num_tokens
            for d in plan.descriptors
        )


@FAST
@given(st.data())
def test_lora_slot_grid_always_covers_the_batch(data):
    # Failure class 6: the graph a batch replays records a LoRA grid with a
    # block for every distinct id in the batch, the no-adapter -1 included.
    spec, plan, results = fixed_plan_dispatches(data)
    for batch, desc in results:
        if desc.cg_mode != "NONE" and spec.lora.enabled:
            grid = plan.graphs[desc.graph_id].dummy.kernel_grid
            assert grid >= kernel_slots(batch.num_active_loras, batch.base)


@FAST
@given(st.data())
def test_padded_tokens_do_not_depend_on_lora_count(data):
    # Failure class 7: DP ranks re-dispatch the agreed token count with their
    # own LoRA counts; the padded size must be the same for every count.
    spec = data.draw(specs())
    plan = compile_plan(spec)
    assert plan.dp.padded_tokens_lora_invariant
    dispatcher = Dispatcher(plan)
    batch = data.draw(batches(spec))
    results = set()
    for adapters in range(0, min(batch.num_reqs, spec.lora.max_loras if spec.lora.enabled else 0) + 1):
        desc = dispatcher.dispatch(
            Batch(
                batch.num_reqs,
                batch.num_tokens,
                batch.max_query_len,
                adapters,
                batch.base and adapters < batch.num_reqs,
                batch.has_prefill,
            )
        )
        results.add((desc.cg_mode, desc.num_tokens))
    assert len(results) == 1


@FAST
@given(st.data())
def test_fast_dispatch_equals_explained_dispatch(data):
    spec = data.draw(specs())
    dispatcher = Dispatcher(compile_plan(spec))
    for _ in range(30):
        batch = data.draw(batches(spec))
        assert dispatcher.dispatch(batch) == dispatcher.explain(batch, [])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs(fixes=["lora_slot", "mixed_ranges"]))
@example(
    spec_from_data(
        {  # configs/h200-tiny-llama-025.yaml: unreachable pairs used to be listed
            "target": {"vllm": "0.25"},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": 512},
            "lora": {"enabled": True, "max_loras": 4, "specialize_active": True},
        },
        "example",
    )
)
def test_pruning_does_not_change_what_mixed_ranges_reports(spec):
    """mixed_ranges' changes are listed for reachable (tokens, LoRA case) pairs only, and
    pruning changes no reachable batch's dispatch: the report is the same with it."""

    def report(fixes):
        data = spec.model_dump(mode="json")
        plan = compile_plan(spec_from_data({**data, "fixes": fixes}, "hypothesis"))
        return next(d.changes for d in plan.deviations if d.fix == "mixed_ranges")

    plain, pruned = report(["lora_slot", "mixed_ranges"]), report(["lora_slot", "mixed_ranges", "prune_unreachable"])
    if plain[0].startswith("no change"):
        assert pruned[0].startswith("no change"), pruned
    else:
        assert pruned == plain
