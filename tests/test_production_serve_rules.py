"""The production-size serve-first run's own rules (tests/gpu/production_serve.py), on the CPU:
every start gets the same traffic, the token comparison measures what both sides computed from
the same prefix, and a landing is placed against the traffic's first request."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import production_serve as ps  # noqa: E402


def request(tokens: list[str], tops: list[dict[str, float]]) -> dict:
    return {"tokens": tokens, "top": tops}


def test_the_fault_control_runs_first_then_the_null_comes_third_and_the_pairs_alternate_which_arm_leads():
    assert ps.order(3) == ["fault", "full", "tiers", "full", "tiers", "tiers", "full"]
    assert ps.order(4)[-2:] == ["full", "tiers"] and ps.order(1) == ["fault", "full", "tiers"]


def test_every_start_gets_the_same_traffic_whatever_its_place_in_the_run():
    assert ps.traffic() == ps.traffic()
    got = ps.traffic()
    assert got[-1]["at"] < ps.LOAD_SECONDS and len(got) == int(ps.LOAD_SECONDS * ps.RATE) - 1
    assert {r["model"] for r in got} == {"base", "a1", "a2", "a3", "a4"}


def test_the_distance_is_zero_for_the_same_output_and_small_at_a_near_tie():
    ref = request(["a", "b"], [{"a": -0.1, "x": -2.5}, {"b": -0.69, "y": -0.70}])
    assert ps.distance(ref, ref) == 0.0
    flipped = request(["a", "y", "q"], [{"a": -0.12, "x": -2.45}, {"y": -0.68, "b": -0.71}, {"q": -9.0}])
    assert ps.distance(ref, flipped) == 0.05  # the near tie's step counts, the steps after it do not
    assert ps.distance(ref, flipped) <= ps.TAU


def test_a_logprob_moved_by_whole_nats_or_a_top_token_lost_differs():
    ref = request(["a"], [{"a": -0.1, "x": -2.5}])
    assert ps.distance(ref, request(["a"], [{"a": -1.4, "x": -0.6}])) == 1.9
    assert ps.distance(ref, request(["z"], [{"z": -0.1, "q": -3.0}])) is None  # no match
    assert ps.distance(ref, {"tokens": None}) is None
    got = ps.compare({"0:0": ref, "0:1": ref}, {"0:0": ref, "0:1": request(["a"], [{"a": -1.4, "x": -0.6}])})
    assert got["differing"] == 1 and got["differing_requests"] == ["0:1"] and got["max_distance"] == 1.9


def test_a_landing_is_placed_against_the_first_request_for_the_deferred_graphs_the_traffic_used():
    names = ["FULL:1x1@0", "FULL:8x8@1", "PIECEWISE:512@1", "PIECEWISE:1024@0"]
    start = {
        "before_load": {"hits_by_graph": {"0": 5, "1": 2}, "pending": names[1:]},
        "after_load": {"hits_by_graph": {"0": 9, "1": 2, "2": 40}, "pending": []},
        "load": {"first_sent_unix": 1000.0},
        "report": {"deferred": {"captures": [
            {"graph": "FULL:8x8@1", "landed_unix": 1002.0},
            {"graph": "PIECEWISE:512@1", "landed_unix": 1031.5},
            {"graph": "PIECEWISE:1024@0", "landed_unix": 1040.0},
        ]}},
    }  # fmt: skip
    got = ps.landing(start, names)
    # graph 1 was not used by the traffic, graph 3 not used at all, graph 0 was ready
    assert got["graphs_used"] == 2 and got["deferred_when_traffic_began"] == 1
    assert got["landed_s"] == {"PIECEWISE:512@1": 31.5} and got["landed_within_30s"] == 0


def _start(index: int, kind: str, healthy: float, p99: float, gib: float, checked: dict) -> dict:
    rep = {"graph_memory_gib": gib} if kind in ("full", "null") else {
        "deferred": {"all_graph_memory_gib": gib, "all_first_capture": True, "pending": []}}  # fmt: skip
    out = {"index": index, "kind": kind, "healthy_s": healthy, "check": checked, "report": rep}
    if kind in ("fault", "null"):  # a control runs its check only
        return out | ({"fault_installed": True, "fault_swaps_at_least": 20} if kind == "fault" else {})
    return out | {"load": {"itl_ms": {"p50": 10.0, "p99": p99, "max": 2 * p99}, "throughput_tok_s": 1800.0}}


CHECK = {"0:0": request(["a"], [{"a": -0.1, "x": -2.5}])}
WRONG = {"0:0": request(["a"], [{"a": -2.0, "x": -0.2}])}


def _summary(tmp_path, *starts: tuple) -> dict:
    """The summary of starts given as (kind, healthy, p99, graph memory, check), in run order."""
    ps.summarize(tmp_path / "s.json", [_start(i, *s) for i, s in enumerate(starts)], tmp_path)
    return json.loads((tmp_path / "s.json").read_text())


def test_the_summary_pairs_tiers_with_full_and_compares_against_the_first_full_plan_start(tmp_path):
    got = _summary(
        tmp_path,
        ("fault", 200.0, 99.0, 1.2, WRONG),
        ("tiers", 80.0, 50.0, 1.2, CHECK),
        ("full", 100.0, 50.0, 1.2, CHECK),
        ("full", 110.0, 55.0, 1.2, CHECK),
        ("tiers", 88.0, 60.5, 1.26, CHECK),
    )
    assert got["reference"] == "start2-full:check" and got["pairs"] == 2
    assert got["ratios_tiers_over_full"]["healthy_s"]["ratios"] == [0.8, 0.8]
    assert got["ratios_tiers_over_full"]["itl_p99_ms"]["ratios"] == [1.0, 1.1]
    assert got["ratios_tiers_over_full"]["graph_memory_gib"]["ratios"] == [1.0, 1.05]
    assert got["comparisons"]["start0-fault:check"]["differing"] == 1  # the control caught
    assert got["comparisons"]["start3-full:check"]["differing"] == 0  # the null
    assert got["verdict"] == {
        "null_differing": {"start3-full": 0},
        "fault_differing": {"start0-fault": 1},
        "fault_bit": True,
        "tiers_differing": {"start1-tiers": 0, "start4-tiers": 0},
        "errors": {},
        "power": True,
        "tiers_agree": True,
    }


def test_a_check_only_null_start_is_compared_but_never_paired(tmp_path):
    """fault, full, null, tiers: the null sits between the pair's two starts."""
    got = _summary(
        tmp_path,
        ("fault", 200.0, 99.0, 1.2, WRONG),
        ("full", 100.0, 50.0, 1.2, CHECK),
        ("null", 100.0, 50.0, 1.2, CHECK),
        ("tiers", 80.0, 55.0, 1.1, CHECK),
    )
    assert got["pairs"] == 1 and got["ratios_tiers_over_full"]["itl_p99_ms"] == {"pairs": 1, "geomean": 1.1}
    assert got["verdict"]["null_differing"] == {"start2-null": 0} and got["verdict"]["tiers_agree"] is True


def test_the_rule_judges_the_tiered_starts_only_where_the_null_is_quiet_and_the_control_caught():
    ref = _start(1, "full", 100.0, 50.0, 1.2, CHECK)

    def verdict(null: int, fault: int, tiers: int | None, **fault_facts) -> dict:
        done = [_start(0, "fault", 1, 1, 1, {}) | fault_facts, ref, _start(2, "full", 1, 1, 1, {}),
                _start(3, "tiers", 1, 1, 1, {})]  # fmt: skip
        comparisons = {"start2-full:check": {"differing": null}, "start0-fault:check": {"differing": fault}}
        if tiers is not None:
            comparisons["start3-tiers:check"] = {"differing": tiers}
        return ps.judge(done, ref, comparisons)

    assert verdict(0, 3, 0)["tiers_agree"] is True
    assert verdict(0, 3, 1)["tiers_agree"] is False
    assert verdict(0, 3, None)["tiers_agree"] is False  # a tiered start that never ran its check
    noisy = verdict(2, 3, 0)  # the null differs: no power, no verdict on the tiers
    assert noisy["power"] is False and noisy["tiers_agree"] is None
    missed = verdict(0, 0, 0)  # the control was not caught
    assert missed["power"] is False and missed["tiers_agree"] is None
    idle = verdict(0, 3, 0, fault_swaps_at_least=0)  # differences the fault did not cause
    assert idle["fault_bit"] is False and idle["power"] is False
    assert verdict(0, 3, 0, fault_installed=False)["power"] is False
    assert ps.judge([], None, {})["power"] is False


def test_the_first_start_compiles_the_cache_and_is_never_paired(tmp_path):
    """Without the fault control first (--order full,tiers,full,tiers), the first start still pays
    the compile: its ratios would say nothing of the plans."""
    got = _summary(
        tmp_path,
        ("full", 300.0, 90.0, 1.2, CHECK),
        ("tiers", 80.0, 55.0, 1.1, CHECK),
        ("full", 100.0, 50.0, 1.2, CHECK),
        ("tiers", 88.0, 50.0, 1.1, CHECK),
    )
    assert got["pairs"] == 1 and got["reference"] == "start0-full:check"
    assert got["ratios_tiers_over_full"]["itl_p99_ms"] == {"pairs": 1, "geomean": 1.1}  # tiers 1 with full 2
    assert got["verdict"]["power"] is False and got["verdict"]["tiers_agree"] is None  # no control


@pytest.mark.parametrize(
    "args",
    [["--order", "full,bogus"], ["--order", ""], ["--order"], ["--pairs", "x"], ["--until", "soon"]],
)
def test_bad_arguments_stop_with_one_line_and_write_nothing(tmp_path, monkeypatch, args):
    work = tmp_path / "work"
    monkeypatch.setattr(sys, "argv", ["production_serve.py", str(work), str(tmp_path / "s.json"), "starts", *args])
    with pytest.raises(SystemExit) as stop:
        ps.main()
    assert isinstance(stop.value.code, str) and "\n" not in stop.value.code
    assert not work.exists() and not (tmp_path / "s.json").exists()
