"""capplan diff: semantic content, exit codes, and golden output in all three formats."""

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.analysis.diff import GraphDelta, NoLongerScheduled, SpecChange, diff_plans
from capplan.calibration.price import load_pricer
from capplan.cli import app
from capplan.planner import compile_plan
from capplan.present.diff import diff_json, dispatch_lines, dummy_lines, fix_lines, headline, render_text
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
runner = CliRunner()


TOY = ROOT / "src" / "capplan" / "data" / "h200-vllm025.yaml"  # the shipped runs: a 0.9B model on an H200


def test_capture_runs_price_a_plan_by_their_fit_without_an_interval():
    pricer = load_pricer(TOY)
    for lora, seconds, gib in (
        ({"enabled": False}, 8, 0.27),
        ({"enabled": True, "max_loras": 4}, 30, 0.44),
        ({"enabled": True, "max_loras": 4, "specialize_active": True}, 44, 0.94),
    ):
        # The calibration runs were plain vLLM: its exact graph set (no pruning).
        priced = pricer.price(compile_plan(make_spec(target={"vllm": "0.25"}, lora=lora, fixes=[])))
        # Seconds: three runs, three unknowns, exact. Memory: a line through three points
        # (base + per graph; the runs share the largest graph), least squares.
        assert priced.kind == "scaled" and priced.basis.startswith("fitted to 3 capture run(s)")
        assert priced.seconds.value == pytest.approx(seconds) and priced.seconds.lo is None
        assert priced.gib.value == pytest.approx(gib, rel=0.03) and priced.gib.hi is None
        assert "(no interval)" in priced.text() and any("not checked" in n for n in priced.notes)


def test_diff_counts_graphs_per_mode_and_case():
    # vLLM's own graph sets (fixes: []), as in the calibration runs.
    old = compile_plan(make_spec(lora={"enabled": True, "max_loras": 4}, fixes=[]))
    new = compile_plan(make_spec(lora={"enabled": True, "max_loras": 4, "specialize_active": True}, fixes=[]))
    d = diff_plans(old, new, load_pricer(TOY))
    assert not d.equal
    assert d.spec_changes == (SpecChange("lora.specialize_active", False, True),)
    assert [(g.cg_mode, g.lora_case, g.added_count, g.removed_count) for g in d.graph_changes] == [
        ("FULL", 1, 35, 0),
        ("FULL", 2, 35, 0),
        ("FULL", 4, 35, 0),
        ("PIECEWISE", 1, 51, 0),
        ("PIECEWISE", 2, 51, 0),
        ("PIECEWISE", 4, 51, 0),
    ]
    assert d.price.new.graphs - d.price.old.graphs == 258 == d.price.graphs
    assert headline(d).startswith("lora.specialize_active: false -> true: +258 graphs, +14.0 (no interval) s capture")
    same = diff_plans(old, compile_plan(make_spec(lora={"enabled": True, "max_loras": 4}, fixes=[])), load_pricer())
    assert same.equal and headline(same) == "no changes"


def test_diff_reports_dispatch_region_changes():
    spec = dict(
        scheduler={"max_num_seqs": 8, "max_num_batched_tokens": 64},
        speculative={"num_speculative_tokens": 2},
        cudagraph={"capture_sizes": [1, 2, 4, 8]},
        target={"vllm": "0.25"},
    )
    d = diff_plans(
        compile_plan(make_spec(**spec, fixes=[])),
        compile_plan(make_spec(**spec, fixes=["mixed_ranges"])),
        load_pricer(),
    )
    lines = dispatch_lines(d)
    assert "mixed batches of 3 token count(s) (3, 5..6; LoRA case 0): eager -> PIECEWISE:4" not in lines
    assert any(
        line.startswith("mixed batches of 1 token count(s) (3; LoRA case 0): eager -> PIECEWISE:4") for line in lines
    ), lines
    assert (
        "+ mixed_ranges: dispatch: mixed batches of 3 token count(s) (3, 5..6; LoRA case 0): eager -> PIECEWISE"
        in fix_lines(d)
    )


@pytest.fixture
def spec_pair(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The tiny model's spec without its model and GPU: no probe, start or shape prices it.
    text = (ROOT / "configs" / "h200-tiny-llama-025.yaml").read_text().replace(", gpu: NVIDIA H200", "")
    Path("old.yaml").write_text("".join(line for line in text.splitlines(True) if not line.startswith("model:")))
    Path("new.yaml").write_text(Path("old.yaml").read_text().replace("max_loras: 4", "max_loras: 8"))
    return tmp_path


def test_a_calibration_of_another_model_is_not_used_and_the_spec_s_shape_prices_it(tmp_path, monkeypatch):
    """The tiny model's own spec names its model and shape: the shape model predicts it in every
    format, and the 0.9B calibration, given, is not used (said, naming both models' differences)."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "configs" / "h200-tiny-llama-025.yaml", "old.yaml")
    Path("new.yaml").write_text(Path("old.yaml").read_text().replace("max_loras: 4", "max_loras: 8"))
    text = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml"]).stdout
    # The spec names its shape: the shape model prices it, said as a prediction (vLLM 0.25 and
    # 0.33 graphs alike).
    assert "+10 graphs, " in text and " GiB graph memory (predicted)" in text
    assert "basis: predicted by the shape model" in text and "~" not in text
    md = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "markdown"]).stdout
    assert "| capture time (predicted) |" in md and "not priced" not in md
    data = json.loads(runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "json"]).stdout)
    assert "estimate" not in data and data["price"]["new"]["kind"] == "predicted"
    told = json.loads(runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "json",
                                          "--calibration", str(TOY)]).stdout)  # fmt: skip
    # the 0.9B's runs are not used (said in the notes), and the same shape model prices it
    assert told["price"]["new"]["kind"] == "predicted"
    assert any("not used: uncalibrated: measured on llama0.9b" in n for n in told["price"]["new"]["notes"])
    assert told["price"]["delta"] == data["price"]["delta"]  # one price, whichever way it is asked


@pytest.mark.parametrize("fmt, suffix", [("text", "txt"), ("markdown", "md"), ("json", "json")])
def test_golden_diff_output(spec_pair, fmt, suffix):
    assert runner.invoke(app, ["compile", "old.yaml"]).exit_code == 0
    assert runner.invoke(app, ["compile", "new.yaml"]).exit_code == 0
    result = runner.invoke(app, ["diff", "old.plan.yaml", "new.plan.yaml", "--format", fmt])
    assert result.exit_code == 2, result.output
    golden = GOLDEN / f"diff_max_loras_4_to_8.{suffix}"
    if os.environ.get("CAPPLAN_UPDATE_GOLDEN") == "1":
        golden.write_text(result.stdout)
    assert result.stdout == golden.read_text()
    if fmt == "json":
        data = json.loads(result.stdout)
        # no probe or start of this deployment: not priced, and said so (the shipped runs price nothing)
        price = data["price"]
        assert (
            data["equal"] is False and price["new"]["kind"] == "not priced" and price["new"]["capture_seconds"] is None
        )
        assert price["delta"]["capture_seconds"] is None and price["delta"]["graphs"] == 10
        assert "capplan calibrate" in price["new"]["basis"]
    same = runner.invoke(app, ["diff", "old.plan.yaml", "old.plan.yaml", "--format", fmt])
    assert same.exit_code == 0


def test_diff_specs_directly(spec_pair):
    result = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml"])
    assert result.exit_code == 2
    assert result.stdout.startswith("capplan diff old.yaml -> new.yaml: lora.max_loras: 4 -> 8: +10 graphs")
    bad = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "html"])
    assert bad.exit_code == 1 and "--format must be text, markdown or json" in bad.stderr
    missing = runner.invoke(app, ["diff", "old.plan.yaml", "new.plan.yaml"])
    assert missing.exit_code == 1 and "no such file" in missing.stderr


def test_diff_names_kept_graphs_whose_warm_up_batch_changed():
    """max_num_seqs 64 -> 68 on the Mixtral example: no graph of the old plan is removed, but
    the larger request limit spreads some dummy batches over more requests; those graphs
    are captured from other inputs, and the diff says which."""
    from capplan.loading import load_spec

    spec = load_spec(ROOT / "configs" / "mixtral-dp2-lora.yaml")
    old = compile_plan(spec)
    new = compile_plan(spec.model_copy(update={"scheduler": spec.scheduler.model_copy(update={"max_num_seqs": 68})}))
    result = diff_plans(old, new, load_pricer(None))
    assert all(not g.removed for g in result.graph_changes)
    kept = {g.descriptor: g.dummy for g in old.graphs}
    changed = [g for g in new.graphs if g.descriptor in kept and kept[g.descriptor] != g.dummy]
    assert changed and len(result.dummy_changes) == len(changed)
    assert [c.graph for c in result.dummy_changes] == [g.descriptor for g in changed]
    assert result.dummy_changes[0].new_tokens == tuple(changed[0].dummy.tokens)
    assert dummy_lines(result)[0].startswith(f"{changed[0].descriptor.cg_mode}:")
    text = render_text(result)
    assert "warm-up (graphs kept, captured from another dummy batch or kernel grid):" in text
    assert f"... and {len(changed) - 8} more" in text  # the text form samples, the JSON form lists all


def test_diff_spec_refuses_a_spec_compile_refuses():
    """`diff --spec` compiles in memory; a spec whose plan no command could load is refused
    as `capplan compile` refuses it, not compared."""
    bad = ROOT / "tests" / "data" / "bad"
    out = runner.invoke(app, ["diff", "--spec", str(bad / "spec-huge-plan.yaml"), str(bad / "base.yaml")])
    assert out.exit_code == 1
    assert "the plan would be over the 200000 entry limit for a plan file" in out.stderr


def test_diff_names_a_kept_graph_whose_kernel_grid_alone_changed():
    from capplan.loading import load_spec

    spec = load_spec(ROOT / "configs" / "mixtral-dp2-lora.yaml")
    lora = spec.lora.model_copy(update={"specialize_active": not spec.lora.specialize_active})
    result = diff_plans(compile_plan(spec), compile_plan(spec.model_copy(update={"lora": lora})), load_pricer(None))
    grid_only = [line for line in dummy_lines(result) if "kernel grid" in line and "adapters" not in line]
    assert grid_only, result.dummy_changes[:3]
    records = [c for c in result.dummy_changes if c.old_lora_ids == c.new_lora_ids]
    assert records and all(c.old_kernel_grid != c.new_kernel_grid for c in records)
    before, after = grid_only[0].split(": dummy ", 1)[1].split(" -> ")
    assert before.split(", kernel grid")[0] == after.split(", kernel grid")[0]  # same batch, other grid


def test_dispatch_changes_are_listed_in_batch_order():
    """Per batch kind, by the smallest batch each line covers ("97..100" before "201..208"
    before "1009.."), not by the text of the graphs' names."""
    import re

    from capplan.loading import load_spec

    spec = load_spec(ROOT / "configs" / "qwen3-8b-multilora.yaml")
    smaller = spec.model_copy(update={"scheduler": spec.scheduler.model_copy(update={"max_num_seqs": 50})})
    lines = dispatch_lines(diff_plans(compile_plan(spec), compile_plan(smaller), load_pricer(None)))
    firsts: dict[str, list[int]] = {}
    for line in lines:
        kind = line.split(" batches", 1)[0]
        firsts.setdefault(kind, []).append(int(re.search(r"\((\d+)", line).group(1)))
    assert len(lines) > 10 and all(v == sorted(v) for v in firsts.values()), lines


def test_diff_names_with_line_breaks_and_backticks_stay_on_their_line(tmp_path):
    odd = tmp_path / "a\nb`x.plan.yaml"
    shutil.copy(ROOT / "examples" / "h200-tiny-llama-025.plan.yaml", odd)
    other = ROOT / "examples" / "mixtral-dp2-lora.plan.yaml"
    text = runner.invoke(app, ["diff", str(odd), str(other)]).stdout
    assert text.splitlines()[0].startswith(f"capplan diff {tmp_path}/a\\nb`x.plan.yaml -> ")
    md = runner.invoke(app, ["diff", str(odd), str(other), "--format", "markdown"]).stdout
    assert md.splitlines()[0] == f"### capplan plan diff: ``{tmp_path}/a\\nb`x.plan.yaml`` → `{other}`"


def _seqs(spec, seqs):
    return spec.model_copy(update={"scheduler": spec.scheduler.model_copy(update={"max_num_seqs": seqs})})


def test_diff_lists_changes_only_for_batches_the_new_spec_schedules(tmp_path, monkeypatch):
    """max_num_seqs 128 -> 96: no dispatch change for a batch of more than 96 requests (dispatch
    refuses such a batch on the new plan); the batches only the old spec made are listed apart,
    marked as no longer scheduled, and batches neither spec makes are not listed at all."""

    from capplan.loading import load_spec

    spec = load_spec(ROOT / "configs" / "qwen3-8b-multilora.yaml")
    old, new = compile_plan(_seqs(spec, 128)), compile_plan(_seqs(spec, 96))
    d = diff_plans(old, new, load_pricer(None))
    for change in d.dispatch_changes:
        if change.batch_kind == "uniform-decode":
            assert change.token_runs[0][0] <= 96, change
    assert d.dispatch_changes  # mixed batches of 193.. tokens still fit 96 requests
    assert d.dispatch_unscheduled == (
        NoLongerScheduled(
            "uniform-decode", ((97, 128),), tuple(old.lora_capture_cases), True, "FULL",
            "97 requests, more than max_num_seqs 96", tuple(old.lora_capture_cases),
        ),
    )  # fmt: skip
    text = render_text(d)
    assert "FULL:104 -> PIECEWISE:104" not in text
    assert "  * no longer scheduled: uniform-decode batches of 32 token count(s) (97..128; all LoRA cases): replayed " \
        "FULL in the old plan; the new spec never makes them (97 requests, more than max_num_seqs 96)" in text  # fmt: skip
    (unscheduled,) = diff_json(d)["dispatch_no_longer_scheduled"]
    assert unscheduled["token_runs"] == [[97, 128]] and unscheduled["token_count"] == 32
    assert unscheduled["reason"] == "97 requests, more than max_num_seqs 96" and unscheduled["old_mode"] == "FULL"
    back = diff_plans(new, old, load_pricer(None))
    assert back.dispatch_unscheduled == ()
    assert "uniform-decode batches of 32 token count(s) (97..128; all LoRA cases): not scheduled -> FULL" in (
        dispatch_lines(back)
    )
    monkeypatch.chdir(tmp_path)
    for name, seqs in (("old", 128), ("new", 96)):
        Path(f"{name}.yaml").write_text(
            (ROOT / "configs" / "qwen3-8b-multilora.yaml")
            .read_text()
            .replace("max_num_seqs: 256", f"max_num_seqs: {seqs}")
        )
        assert runner.invoke(app, ["compile", f"{name}.yaml"]).exit_code == 0
    refused = runner.invoke(app, ["dispatch", "new.plan.yaml", "--reqs", "97", "--tokens", "97"])
    assert refused.exit_code != 0 and "97 requests, more than max_num_seqs 96" in refused.stderr
    out = runner.invoke(app, ["diff", "old.plan.yaml", "new.plan.yaml"]).stdout
    assert "(97.." not in out.replace("no longer scheduled: uniform-decode batches of 32 token count(s) (97..", "")


def test_capture_sizes_are_listed_as_sizes_added_and_removed(tmp_path, monkeypatch):
    """A one-size change names the size, in every format, instead of the whole new list."""
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "configs" / "qwen3-8b-multilora.yaml").read_text().replace("max_num_seqs: 256", "max_num_seqs: 128")
    Path("old.yaml").write_text(text)
    sizes = [1, 2, 4, *range(8, 257, 8)]
    sizes.remove(120)
    Path("new.yaml").write_text(text.replace("capture_sizes: null", f"capture_sizes: {sizes}"))
    out = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml"]).stdout
    assert "  * capture sizes: +0 added, -1 removed (120)" in out.splitlines()
    assert "none -> [" not in out and "numbers]" not in out
    md = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "markdown"]).stdout
    assert "- `capture sizes: +0 added, -1 removed (120)`" in md
    data = json.loads(runner.invoke(app, ["diff", "--spec", "new.yaml", "old.yaml", "--format", "json"]).stdout)
    assert data["capture_sizes"] == {"added": [120], "removed": [], "old_count": 34, "new_count": 35}
    (change,) = data["spec_changes"]
    assert change["key"] == "cudagraph.capture_sizes" and change["old"] == sizes and change["new"] is None
    assert change["text"] == "capture sizes: +1 added (120), -0 removed"
    # sizes the spec derives move with max_num_seqs: listed apart from the spec's own changes
    Path("fewer.yaml").write_text(text.replace("max_num_seqs: 128", "max_num_seqs: 96"))
    out = runner.invoke(app, ["diff", "--spec", "old.yaml", "fewer.yaml"]).stdout
    assert "capture sizes (as the spec now derives them):\n  * +0 added, -8 removed (200..256 step 8)\n" in out
    data = json.loads(runner.invoke(app, ["diff", "--spec", "old.yaml", "fewer.yaml", "--format", "json"]).stdout)
    assert data["capture_sizes"]["removed"] == list(range(200, 257, 8))


def test_markdown_folds_long_lists_into_details_and_cuts_nothing():
    """A pull request gets every line: past a screen-ful a list folds into <details>."""
    import re

    from capplan.loading import load_spec
    from capplan.present.diff import SCREEN, render_markdown

    spec = load_spec(ROOT / "configs" / "mixtral-dp2-lora.yaml")
    result = diff_plans(compile_plan(spec), compile_plan(_seqs(spec, 68)), load_pricer(None))
    lines = dummy_lines(result)
    assert len(lines) > SCREEN + 1
    md = render_markdown(result)
    assert "... and" not in md and " more\n" not in md.replace("more</summary>", "")
    rest = len(lines) - SCREEN
    assert f"<details><summary>{rest} more</summary>\n\n" in md
    for line in lines:
        assert f"- {line}\n" in md
    assert md.count("<details>") == md.count("</details>")
    opened = md.index(f"<summary>{rest} more</summary>")
    closed = md.index("</details>", opened)
    assert all(f"- {line}" in md[opened:closed] for line in lines[SCREEN:])
    assert not any(f"- {line}" in md[opened:closed] for line in lines[:SCREEN])
    assert re.search(r"</details>\n", md)


def test_markdown_folds_a_long_table_with_its_header():
    from capplan.present.diff import SCREEN, _Budget, _folded

    rows = [f"| FULL | {i} | 1 | 0 |" for i in range(SCREEN + 5)]
    header = ["| mode | LoRA case | added | removed |", "|---|---:|---:|---:|"]
    out = _folded(rows, _Budget(), head=header)
    assert out.count(header[0]) == 2 and "<details><summary>5 more</summary>" in out
    assert [r for r in out if r.startswith("| FULL")] == rows
    short = _folded(rows[: SCREEN + 1], _Budget(), head=header)
    assert "<details>" not in "".join(short) and len(short) == SCREEN + 4
    # past the budget, the rest is counted and pointed at, never silently cut
    tight = _folded(rows, _Budget(10 * (len(rows[0]) + 1)), head=header)
    assert len([r for r in tight if r.startswith("| FULL")]) == 10
    assert any("15 more not listed here" in line for line in tight)


def test_the_optimized_plan_s_markdown_diff_fits_a_pull_request_comment(tmp_path):
    """The README's optimize example: a headline of a line or two, no Python repr, and a
    markdown diff far below the 65,536 characters of a comment; what it leaves out is
    counted and pointed at."""
    spec = tmp_path / "opt.yaml"
    made = runner.invoke(
        app,
        ["optimize", str(ROOT / "configs" / "qwen3-8b-multilora.yaml"),
         str(ROOT / "examples" / "traces" / "multitenant.jsonl"), "--max-graphs", "300", "-o", str(spec)],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    assert runner.invoke(app, ["compile", str(spec)]).exit_code == 0
    old, new = str(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"), str(tmp_path / "opt.plan.yaml")
    md = runner.invoke(app, ["diff", old, new, "--format", "markdown"]).stdout
    headline = md.splitlines()[2]
    assert len(headline) < 300 and headline.startswith("**capture sizes: +78 -26; cudagraph.lora_case_sizes changed")
    assert len(md) < 20_000
    assert "{'" not in md and "True" not in md and "None" not in md
    assert "more not listed here" in md and "`capplan diff` (text or --json) lists every one" in md
    text = runner.invoke(app, ["diff", old, new]).stdout
    assert "* cudagraph.lora_case_sizes: none -> case 0: " in text  # whole, in the text form


# -- the diff is records: data in typed fields, text rendered from them ------------------------------


def test_a_diff_of_two_compiled_plans_is_graph_delta_records():
    old = compile_plan(make_spec(lora={"enabled": True, "max_loras": 4}, fixes=[]))
    new = compile_plan(make_spec(lora={"enabled": True, "max_loras": 4, "specialize_active": True}, fixes=[]))
    d = diff_plans(old, new, load_pricer(TOY))
    assert all(isinstance(g, GraphDelta) for g in d.graph_changes)
    added = [x for x in new.descriptors if x not in set(old.descriptors)]
    for g in d.graph_changes:
        assert g.added == tuple(x for x in added if (x.cg_mode, x.num_active_loras) == (g.cg_mode, g.lora_case))
        assert g.removed == () and g.removed_count == 0
    assert sum(g.added_count for g in d.graph_changes) == len(added) == d.price.graphs == 258
    assert d.added_sample == tuple(added[:8]) and d.removed_sample == ()
    data = diff_json(d)
    assert [(r["cg_mode"], r["lora_case"], r["added"], r["removed"]) for r in data["graphs"]] == [
        (g.cg_mode, g.lora_case, g.added_count, g.removed_count) for g in d.graph_changes
    ]
    assert data["graphs"][0]["added_graphs"][0] == f"FULL:{d.graph_changes[0].added[0].num_tokens}x" + (
        f"{d.graph_changes[0].added[0].num_reqs}@1"
    )
    assert data["price"]["delta"]["graphs"] == 258


def test_text_rendered_from_records_equals_the_golden(spec_pair):
    """The records of the golden's pair of plans render to the golden text and markdown."""
    from capplan.planfile import load_plan
    from capplan.present.diff import render_markdown

    for name in ("old", "new"):
        assert runner.invoke(app, ["compile", f"{name}.yaml"]).exit_code == 0
    d = diff_plans(load_plan(Path("old.plan.yaml")), load_plan(Path("new.plan.yaml")), load_pricer(), "old.plan.yaml", "new.plan.yaml")  # fmt: skip
    assert render_text(d) == (GOLDEN / "diff_max_loras_4_to_8.txt").read_text()
    assert render_markdown(d) == (GOLDEN / "diff_max_loras_4_to_8.md").read_text()
    assert json.dumps(diff_json(d), indent=2) + "\n" == (GOLDEN / "diff_max_loras_4_to_8.json").read_text()
    from capplan.analysis.diff import LoraCountChange

    assert d.lora_map_changes[0] == LoraCountChange(5, 5, 8)
    assert d.spec_changes == (SpecChange("lora.max_loras", 4, 8),)


def test_dispatch_records_render_as_the_planner_s_region_lines():
    """The records say what `planner.regions` says: the same lines, in the same order."""
    from functools import partial

    from capplan.loading import load_spec
    from capplan.planner.dispatch import beyond_spec
    from capplan.planner.regions import lora_lanes, no_longer_scheduled, target_changes
    from capplan.present.diff import unscheduled_text

    spec = load_spec(ROOT / "configs" / "qwen3-8b-multilora.yaml")
    for a, b in ((128, 96), (96, 128), (256, 50)):
        old, new = compile_plan(_seqs(spec, a)), compile_plan(_seqs(spec, b))
        d = diff_plans(old, new, load_pricer(None))
        refusals = (partial(beyond_spec, spec=old.spec), partial(beyond_spec, spec=new.spec))
        lanes = lora_lanes(old, new)
        assert dispatch_lines(d) == target_changes(old, new, exact_sizes=True, refusals=refusals, lanes=lanes)
        assert [unscheduled_text(c) for c in d.dispatch_unscheduled] == no_longer_scheduled(
            old, new, refusals, lanes=lanes
        )
        for change in d.dispatch_changes:
            assert change.token_count == sum(hi - lo + 1 for lo, hi in change.token_runs)


def test_every_json_record_holds_its_sentence_and_typed_fields():
    """Each list of the JSON form is records whose `text` is the line the text form prints."""
    from capplan.loading import load_spec
    from capplan.present.diff import encoder_lines, lora_map_lines, spec_lines, tier_lines

    pairs = []
    for config in ("mixtral-dp2-lora", "qwen3-8b-multilora", "vl-tower-lora", "h200-tiny-llama-025-tiers"):
        spec = load_spec(ROOT / "configs" / f"{config}.yaml")
        pairs.append((compile_plan(spec), compile_plan(_seqs(spec, max(1, spec.scheduler.max_num_seqs // 2)))))
    tiny = ROOT / "examples" / "h200-tiny-llama-025"
    from capplan.planfile import load_plan

    pairs.append((load_plan(Path(f"{tiny}.plan.yaml")), load_plan(Path(f"{tiny}-tiers.plan.yaml"))))
    vl = load_spec(ROOT / "configs" / "vl-tower-lora.yaml")
    pairs.append((compile_plan(vl), compile_plan(vl.model_copy(update={"fixes": []}))))
    seen: set[str] = set()
    for old, new in pairs:
        d = diff_plans(old, new, load_pricer(None))
        data = json.loads(json.dumps(diff_json(d)))
        for key, lines in (
            ("spec_changes", spec_lines(d)),
            ("dummy_changes", dummy_lines(d)),
            ("dispatch_changes", dispatch_lines(d)),
            ("lora_dispatch_changes", lora_map_lines(d)),
            ("encoder_changes", encoder_lines(d)),
            ("tier_changes", tier_lines(d)),
            ("fix_changes", fix_lines(d)),
        ):
            assert [r["text"] for r in data[key]] == lines, key
            assert all(isinstance(r, dict) and len(r) > 1 for r in data[key])
            seen |= {key for r in data[key]}
    assert seen >= {"spec_changes", "dummy_changes", "dispatch_changes", "encoder_changes", "tier_changes"}


def test_records_round_trip_through_json_for_random_spec_pairs():
    """Hypothesis: for any two specs, the JSON form's typed fields agree with the records."""
    from hypothesis import given, settings

    from tests.test_properties import specs

    @settings(max_examples=25, deadline=None)
    @given(specs(), specs())
    def check(a, b):
        d = diff_plans(compile_plan(a), compile_plan(b), load_pricer())
        data = diff_json(d)
        assert data["equal"] is d.equal
        assert [r["key"] for r in data["spec_changes"]] == [c.key for c in d.spec_changes]
        assert [(r["added"], r["removed"]) for r in data["graphs"]] == [
            (g.added_count, g.removed_count) for g in d.graph_changes
        ]
        assert sum(r["added"] - r["removed"] for r in data["graphs"]) == d.price.graphs
        assert data["capture_sizes"]["added"] == list(d.capture_sizes.added)
        for r in data["dispatch_changes"]:
            assert r["token_count"] == sum(hi - lo + 1 for lo, hi in r["token_runs"])
        assert render_text(d).startswith(f"capplan diff old -> new: {data['headline']}")

    check()


# -- a review never hides a regression: every batch a change moves, in every LoRA case ---------


def _seqs_loras(seqs, loras, vllm="0.33", specialize_active=False):
    return make_spec(
        target={"vllm": vllm},
        scheduler={"max_num_seqs": seqs, "max_num_batched_tokens": 2048, "max_model_len": 4096},
        lora={"enabled": True, "max_loras": loras, "specialize": True, "specialize_active": specialize_active},
    )


def test_a_change_of_max_loras_with_another_lists_the_moved_lora_case_going_eager():
    """max_num_seqs 64 -> 48 with max_loras 4 -> 6: LoRA batches of 97..104 tokens leave their
    graph (case 5 becomes case 7), and the headline leads with the regression in every form."""
    old, new = compile_plan(_seqs_loras(64, 4)), compile_plan(_seqs_loras(48, 6))
    d = diff_plans(old, new, load_pricer(None))
    lora_eager = [
        c
        for c in d.dispatch_changes
        if c.new_target == "eager" and c.old_target == "PIECEWISE:104" and 7 in c.lora_cases
    ]
    assert lora_eager and lora_eager[0].old_lora_cases[lora_eager[0].lora_cases.index(7)] == 5
    assert lora_eager[0].token_runs == ((97, 104),)
    assert d.regression
    assert {(c.old_lora_case, c.new_lora_case) for c in d.coverage if c.to_eager} == {(0, 0), (5, 7)}
    assert d.to_eager() == 64
    assert headline(d).startswith("REGRESSION: 64 batch shape(s) go from a graph to eager (LoRA cases 0; 5 -> 7); ")
    assert "LoRA cases 0; 5 -> 7): PIECEWISE:104 -> eager" in render_text(d)
    # the moves lead, one per line, under the headline
    assert "\n  ! REGRESSION: 32 mixed batch shape(s) of LoRA case 5 -> 7 go from a graph to eager\n" in render_text(d)
    from capplan.present.diff import render_markdown

    assert "> **Regression**: 64 batch shape(s)" in render_markdown(d)
    doc = diff_json(d)
    assert doc["regression"] is True and doc["coverage"]["to_eager"] == 64
    assert {(x["old_lora_case"], x["new_lora_case"]) for x in doc["coverage"]["shifts"]} == {(0, 0), (5, 7)}


def test_a_change_that_only_adds_graphs_is_no_regression():
    old, new = compile_plan(_seqs_loras(48, 4)), compile_plan(_seqs_loras(64, 4))
    d = diff_plans(old, new, load_pricer(None))
    assert not d.regression and not headline(d).startswith("REGRESSION")
    assert diff_json(d)["regression"] is False


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.tuples(st.integers(8, 96), st.integers(8, 96)),
    loras=st.tuples(st.integers(1, 8), st.integers(1, 8)),
    active=st.tuples(st.booleans(), st.booleans()),
)
def test_every_batch_a_change_sends_to_eager_is_listed(seqs, loras, active):
    """Against the dispatcher itself: every batch both deployments schedule (any adapter mix,
    with and without base requests) that the old plan replays from a graph and the new one
    runs eager is in a dispatch change to eager and counted as a regression."""
    from capplan.planner.dispatch import Batch, Dispatcher, beyond_spec

    old = compile_plan(_seqs_loras(seqs[0], loras[0], specialize_active=active[0]))
    new = compile_plan(_seqs_loras(seqs[1], loras[1], specialize_active=active[1]))
    d = diff_plans(old, new, load_pricer(None))
    listed = {
        (c.batch_kind, case, n)
        for c in d.dispatch_changes
        if c.new_target == "eager" and c.old_target not in ("eager", "not scheduled")
        for case in c.lora_cases
        for lo, hi in c.token_runs
        for n in range(lo, hi + 1)
    }
    do, dn = Dispatcher(old), Dispatcher(new)
    top = max(do.max_tokens, dn.max_tokens)
    missed = []
    for adapters in range(min(loras) + 1):
        for base in (False, True) if adapters else (False,):
            need = max(1, adapters + base)
            for n in range(need, top + 1):
                mixed = Batch(need, n, n - need + 1, adapters, base, has_prefill=True)
                decode = Batch(n, n, 1, adapters, base)  # n requests of one token each
                for kind, batch in (("mixed", mixed), ("uniform-decode", decode)):
                    if beyond_spec(batch, old.spec) or beyond_spec(batch, new.spec):
                        continue
                    if do.dispatch(batch).graph_id >= 0 and dn.dispatch(batch).graph_id < 0:
                        if (kind, dn.lora_case(dn.lora_count(batch)), n) not in listed:
                            missed.append((kind, adapters, base, n))
    assert not missed, missed[:5]
    assert d.regression == bool(listed)


def test_a_removed_fix_that_moves_batches_to_other_lora_cases_lists_the_dispatch_change():
    """Without lora_slot, a batch of adapters plus base requests replays a graph of one case fewer
    (a graph that skips an adapter): a dispatch change, though no graph size or mode changed."""
    spec = {"scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 4096},
            "lora": {"enabled": True, "max_loras": 4, "specialize": True, "specialize_active": True}}  # fmt: skip
    old = compile_plan(make_spec(**spec))
    new = compile_plan(make_spec(**spec, fixes=[f for f in old.fixes if f != "lora_slot"]))
    d = diff_plans(old, new, load_pricer())
    moves = {(c.old_target, c.new_target, o, n) for c in d.dispatch_changes
             for o, n in zip(c.old_lora_cases, c.lora_cases)}  # fmt: skip
    assert ("PIECEWISE", "PIECEWISE", 2, 1) in moves and ("FULL", "FULL", 4, 2) in moves
    assert "(2..128; LoRA case 2 -> 1): PIECEWISE -> PIECEWISE" in render_text(d)
    same = diff_plans(old, compile_plan(make_spec(**spec)), load_pricer())
    assert same.dispatch_changes == ()  # nothing moved, nothing listed


@pytest.mark.parametrize(
    "old_k, new_k, vllm",
    [(0, 2, "0.33"), (2, 0, "0.33"), (1, 3, "0.29"), (0, 1, "0.25"), (2, 2, "0.33")],
)
def test_uniform_batches_of_either_plan_s_decode_length_are_compared_as_the_dispatcher_dispatches_them(
    old_k, new_k, vllm
):
    """Speculative tokens change the tokens a decode step gives each request: batches of one token
    per request, which a plan without speculative tokens replays from FULL graphs, replay PIECEWISE
    in a plan with them. Every uniform batch of either plan's decode length is listed exactly when
    the dispatcher sends it to another graph (checked both ways, batch by batch)."""
    from capplan.planner import Batch, Dispatcher

    def spec(k: int):
        return make_spec(
            target={"vllm": vllm},
            scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 128},
            speculative={"num_speculative_tokens": k},
        )

    old, new = compile_plan(spec(old_k)), compile_plan(spec(new_k))
    d = diff_plans(old, new, load_pricer())
    listed = {
        (c.query_len or new.decode_query_len, n): (c.old_target, c.new_target)
        for c in d.dispatch_changes
        if c.batch_kind == "uniform-decode"
        for lo, hi in c.token_runs
        for n in range(lo, hi + 1)
    }
    if old_k == new_k:
        assert all(c.query_len is None for c in d.dispatch_changes)
    else:
        assert {q for q, _ in listed} == {old.decode_query_len, new.decode_query_len}, listed

    def target(plan, batch) -> str:
        r = Dispatcher(plan).dispatch(batch)
        return "eager" if r.graph_id < 0 else f"{r.cg_mode}:{r.num_tokens}"

    for q in {old.decode_query_len, new.decode_query_len}:
        for n in range(q, 129, q):
            batch = Batch(n // q, n, q, uniform_token_count=q)
            if n // q > 16:  # more requests than either spec schedules
                continue
            a, b = target(old, batch), target(new, batch)
            assert ((q, n) in listed) == (a != b), (q, n, a, b)
            if a != b:
                assert listed[(q, n)] == (a, b), (q, n)
