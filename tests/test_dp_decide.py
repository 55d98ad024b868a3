"""The plan check's decision, as every rank takes it from the gathered (identity, verdict) pairs."""

from capplan.runtime.dp_check import AUDITED, NO_PLAN, decide

A = "sha256:aaaaaaaaaaaaaaaaaaaa|fp1"
B = "sha256:bbbbbbbbbbbbbbbbbbbb|fp2"


def test_same_plan_and_no_objection_starts():
    assert decide([(A, None), (A, None)], 0) is None
    assert decide([(NO_PLAN, None)] * 4, 3) is None  # nobody has a plan: vLLM as usual


def test_different_plans_refuse_on_every_rank_with_the_same_facts():
    lines = [decide([(A, None), (B, None)], r, f" (rank {r})") for r in (0, 1)]
    for r, line in enumerate(lines):
        assert line.startswith(f"capplan (rank {r}): the engine's ranks loaded different plans")
        assert "rank 0: sha256:aaaaaaaaaaa" in line and "rank 1: sha256:bbbbbbbbbbb" in line
        assert "\n" not in line


def test_a_rank_without_a_plan_is_named():
    line = decide([(A, None), (NO_PLAN, None)], 0)
    assert "rank 1: no plan" in line


def test_one_rank_refusing_stops_the_others_naming_it():
    why = "capplan: p.yaml does not match this engine (lora.max_loras: plan 4, engine 8)"
    gathered = [(A, None), (A, None), (A, why)]
    assert decide(gathered, 2) == why  # the rank at fault says its own reason
    other = decide(gathered, 0, " (rank 0)")
    assert other.startswith("capplan (rank 0): rank 2 refused the plan, so this rank stops too")
    assert other.endswith(why)


def test_different_plans_also_carry_a_rank_s_own_refusal():
    why = "capplan: engine mismatch"
    line = decide([(A, None), (B, why)], 0)
    assert "different plans" in line and line.endswith(f"Rank 1 also refused its own plan: {why}")


def test_ranks_differing_only_in_the_audit_refuse_naming_it():
    """CAPPLAN_DP_AUDIT adds an all-reduce to every step: set on one rank alone, it would pair
    with another rank's next collective. Ranks of one plan that differ in it refuse, saying so."""
    line = decide([(A + AUDITED, None), (A, None), (A + AUDITED, None)], 1, " (rank 1)")
    assert line.startswith("capplan (rank 1): CAPPLAN_DP_AUDIT=1 is set on rank(s) 0, 2 only")
    assert decide([(A + AUDITED, None)] * 2, 0) is None
    assert "different plans" in decide([(A + AUDITED, None), (B, None)], 0)
