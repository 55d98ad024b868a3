"""The time-to-healthy harness's pairing (tests/gpu/deferred_serve.py `starts`), on CPU: which
starts are warm-ups, which pairs form a ratio, and that the arms alternate."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.gpu.deferred_serve import WARMUP, counted_starts, pair_ratios, start_order


def start(kind: str, healthy: float | None, **extra: object) -> dict:
    return {"kind": kind, "healthy_s": healthy, **extra}


def test_both_arms_warm_up_before_the_pairs_and_the_arms_alternate():
    order = start_order(3)
    assert order[: len(WARMUP)] == ["full", "tiers"]
    pairs = order[len(WARMUP) :]
    assert pairs == ["tiers", "full", "full", "tiers", "tiers", "full"]
    assert start_order(0) == ["full", "tiers"]


def test_warm_ups_are_never_counted():
    done = [
        start("full", 270.0, warmup=True),
        start("tiers", 164.0, warmup=True),
        start("tiers", 120.0, warmup=False),
        start("full", 150.0, warmup=False),
    ]
    counted = counted_starts(done)
    assert [d["healthy_s"] for d in counted] == [120.0, 150.0]
    assert pair_ratios(counted) == [120.0 / 150.0]


def test_a_work_begun_with_one_warm_up_counts_from_its_second_start():
    done = [start("full", 270.0), start("tiers", 164.0), start("full", 150.0)]
    counted = counted_starts(done)
    assert [d["healthy_s"] for d in counted] == [164.0, 150.0]
    assert pair_ratios(counted) == [164.0 / 150.0]


def test_a_pair_with_a_failed_start_or_one_kind_twice_gives_no_ratio():
    counted = [
        start("tiers", 100.0),
        start("full", None),  # never healthy
        start("full", 120.0),
        start("full", 125.0),  # two of one kind (an --order run)
        start("full", 130.0),
        start("tiers", 104.0),
        start("tiers", 99.0),  # unpaired
    ]
    assert pair_ratios(counted) == [104.0 / 130.0]


def test_engine_init_is_read_from_vllms_log_and_paired_like_time_to_healthy(tmp_path):
    from tests.gpu.deferred_serve import log_facts

    log = tmp_path / "start2-tiers.log"
    log.write_text(
        "(EngineCore pid=1) INFO [kv_cache_utils.py:1] GPU KV cache size: 4,108,896 tokens\n"
        "(EngineCore pid=1) INFO [core.py:405] init engine (profile, create kv cache, warmup model) "
        "took 21.51 s (compilation: 3.59 s)\n"
    )
    facts = log_facts(log)
    assert facts["init_engine_s"] == 21.51 and facts["kv_cache_tokens"] == 4108896
    (tmp_path / "none.log").write_text("no engine here\n")
    assert log_facts(tmp_path / "none.log")["init_engine_s"] is None
    counted = [start("tiers", 95.0, init_engine_s=21.5), start("full", 154.0, init_engine_s=67.9)]
    assert pair_ratios(counted, "init_engine_s") == [21.5 / 67.9]


def test_summary_reads_a_finished_work_without_vllm_and_takes_engine_init_from_older_starts_logs(tmp_path):
    """`summary` on a WORK whose starts were recorded before the engine init was read: each
    start's own log gives it, and both ratios get an interval."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    inits = {2: 21.0, 3: 70.0, 4: 60.0, 5: 25.0, 6: 24.0, 7: 50.0}
    kinds = ["full", "tiers", "tiers", "full", "full", "tiers", "tiers", "full"]
    lines = []
    for i, kind in enumerate(kinds):
        lines.append(json.dumps({"kind": kind, "index": i, "healthy_s": 100.0 + i, "warmup": i < 2}))
        if i in inits:
            (tmp_path / f"start{i}-{kind}.log").write_text(
                f"init engine (profile, create kv cache, warmup model) took {inits[i]} s\n"
            )
    (tmp_path / "starts.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "summary.json"
    script = Path(__file__).parent / "gpu" / "deferred_serve.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(out), "summary", "--release", "0.33.0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    assert summary["release"] == "0.33.0"
    assert summary["init_engine_ratio_tiers_over_full"]["ratios"] == [0.3, 0.4167, 0.48]
    assert summary["healthy_ratio_tiers_over_full"]["pairs"] == 3
    assert "ci95" in summary["init_engine_ratio_tiers_over_full"]


@settings(max_examples=30, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.lists(st.fixed_dictionaries({"kind": st.sampled_from(["full", "tiers"]), "index": st.integers(0, 9)})).map(
            lambda starts: "".join(__import__("json").dumps(d) + "\n" for d in starts)
        ),
    )
)
def test_summary_of_an_unreadable_work_is_one_line_and_writes_nothing(tmp_path_factory, text):
    """Generated starts.jsonl contents (and a missing one): exit 1 with one line, no traceback,
    no summary written; the record itself is never the output."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    work = tmp_path_factory.mktemp("work")
    out = work / "out" / "summary.json"
    script = Path(__file__).parent / "gpu" / "deferred_serve.py"
    record = work / "starts.jsonl"
    if text:
        record.write_bytes(text.encode())
    try:
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        readable = record.exists() and all(
            isinstance(d, dict) and d.get("kind") in ("full", "tiers") and type(d.get("index")) is int for d in lines
        )
    except ValueError:
        readable = False
    for target in (out, record):
        done = subprocess.run(
            [sys.executable, str(script), str(work), str(target), "summary"], capture_output=True, text=True
        )
        if target == record or not readable:
            assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
            assert "Traceback" not in done.stderr and (readable or not out.exists())
            assert record.read_bytes() == text.encode() if text else not record.exists()
        else:
            assert done.returncode == 0 and json.loads(out.read_text())["starts"] == lines, done.stderr
