"""The time-to-healthy harness's pairing (tests/gpu/deferred_serve.py `starts`), on CPU: which
starts are warm-ups, which pairs form a ratio, and that the arms alternate."""

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
