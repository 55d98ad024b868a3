"""The review verdict (`capplan diff --policy`): pass, warn or deny from the repository's
thresholds, absolute and percent; an override accepts one plan by its fingerprint and is
cleared when the plan's graphs change; exit codes CI gates on; a bad policy is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from capplan.analysis.diff import diff_plans
from capplan.analysis.review import review
from capplan.calibration.price import load_pricer
from capplan.cli import app
from capplan.errors import InputError
from capplan.loading import load_policy, spec_from_data
from capplan.planner import compile_plan
from capplan.schemas.review import ReviewPolicy

runner = CliRunner()
BASE = {"scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 256}, "lora": {"enabled": True, "max_loras": 4}}


def plan(**changes):
    data = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        section, key = path.split("__")
        data[section][key] = value
    return compile_plan(spec_from_data(data, "s"))


def verdict(old, new, policy: dict):
    d = diff_plans(old, new, load_pricer(None))
    return d, review(d, ReviewPolicy.model_validate(policy), new.fingerprint)


def test_thresholds_absolute_and_percent_give_pass_warn_and_deny():
    old, new = plan(), plan(scheduler__max_num_seqs=64)
    d, _ = verdict(old, new, {})
    grown = d.price.graphs
    assert grown > 0
    pct = 100 * grown / d.price.old.graphs
    assert verdict(old, new, {"thresholds": {"graphs": {"warn": grown}}})[1].level == "pass"  # not above
    warned = verdict(old, new, {"thresholds": {"graphs": {"warn": grown - 1, "deny": grown}}})[1]
    assert warned.level == "warn" and warned.findings[0].limit == f"warn {grown - 1}"
    denied = verdict(old, new, {"thresholds": {"graphs": {"warn_percent": 1, "deny_percent": pct - 0.1}}})[1]
    assert denied.level == "deny" and denied.findings[0].percent == round(pct, 1)
    assert denied.headline.startswith(f"DENY: +{grown} graph(s), +{round(pct, 1):g}% (over deny_percent")
    # a decrease never exceeds a limit
    assert verdict(new, old, {"thresholds": {"graphs": {"deny": 0}}})[1].level == "pass"
    # an unchanged plan has nothing to review
    assert verdict(old, old, {"thresholds": {"graphs_not_priced": {"deny": 0}}})[1].level == "pass"


def test_unpriced_measures_are_said_and_graphs_not_priced_gates_them():
    old, new = plan(), plan(scheduler__max_num_seqs=64)
    policy = {"thresholds": {"capture_seconds": {"deny": 0}, "graphs_not_priced": {"warn": 0}}}
    _, v = verdict(old, new, policy)
    assert v.level == "warn" and v.not_judged == ("capture_seconds: not priced (graphs_not_priced gates what is not)",)
    assert v.findings[0].measure == "graphs_not_priced"
    assert v.findings[0].change == len(new.graphs) - len(old.graphs)  # the graphs left unpriced that were not
    assert verdict(new, old, policy)[1].level == "pass"  # fewer unpriced graphs: a decrease passes


def test_a_percent_of_nothing_and_a_percent_of_a_count():
    empty = compile_plan(spec_from_data({"cudagraph": {"mode": "NONE"}}, "s"))
    grown = plan()
    d, v = verdict(empty, grown, {"thresholds": {"graphs": {"deny_percent": 10}}})
    assert d.price.old.graphs == 0 and v.level == "deny"  # from none: more than any percent
    assert v.findings[0].percent is None and "from none" in v.findings[0].text
    assert json.dumps(json.loads(json.dumps(v.findings[0].percent))) == "null"
    with pytest.raises(ValueError, match="no old value to take a percent of"):
        ReviewPolicy.model_validate({"thresholds": {"batches_to_eager": {"deny_percent": 0}}})


def test_batches_sent_eager_and_lora_case_moves():
    old = plan(scheduler__max_num_seqs=64)
    new = compile_plan(spec_from_data({**BASE, "scheduler": {"max_num_seqs": 48, "max_num_batched_tokens": 256},
                                       "lora": {"enabled": True, "max_loras": 6}}, "s"))  # fmt: skip
    d, v = verdict(old, new, {"thresholds": {"batches_to_eager": {"deny": 0}, "lora_case_moves": {"warn": 0}}})
    assert d.regression and v.level == "deny"
    levels = {f.measure: f.level for f in v.findings}
    assert levels == {"batches_to_eager": "deny", "lora_case_moves": "warn"}


def test_an_override_accepts_its_plan_only_and_is_cleared_when_the_graphs_change():
    old, new = plan(), plan(scheduler__max_num_seqs=64)
    accept = {"fingerprint": new.fingerprint, "reason": "larger batches for the launch", "by": "alice"}
    policy = {"thresholds": {"graphs": {"deny": 0}}, "overrides": [accept]}
    v = verdict(old, new, policy)[1]
    assert (v.level, v.judged) == ("pass", "deny") and v.headline.startswith("PASS (a deny accepted by alice: larger")
    other = plan(scheduler__max_num_seqs=128)
    assert verdict(old, other, policy)[1].level == "deny"  # another plan: the override does not apply


@pytest.fixture
def specs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("old.yaml").write_text(yaml.safe_dump(BASE))
    Path("new.yaml").write_text(
        yaml.safe_dump({**BASE, "scheduler": {"max_num_seqs": 64, "max_num_batched_tokens": 256}})
    )
    return tmp_path


@pytest.mark.parametrize(("policy", "code", "word"), [
    ("thresholds: {graphs: {warn: 1000}}\n", 0, "PASS"),
    ("thresholds: {graphs: {warn: 0}}\n", 3, "WARN"),
    ("thresholds: {graphs: {warn: 0, deny: 1}}\n", 4, "DENY"),
    ("", 0, "PASS"),  # an empty policy: nothing to exceed
])  # fmt: skip
def test_exit_codes_and_every_format_lead_with_the_verdict(specs, policy, code, word):
    Path("review.yaml").write_text(policy)
    text = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--policy", "review.yaml"])
    assert text.exit_code == code, text.output
    assert text.stdout.startswith(f"verdict: {word}")
    md = runner.invoke(
        app, ["diff", "--spec", "old.yaml", "new.yaml", "--policy", "review.yaml", "--format", "markdown"]
    )
    assert md.exit_code == code and f"**Verdict: {word}" in md.stdout
    js = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--policy", "review.yaml", "--format", "json"])
    doc = json.loads(js.stdout)
    assert js.exit_code == code and doc["verdict"]["level"] == word.lower()
    assert doc["verdict"]["fingerprint"].startswith("sha256:")
    if word != "PASS":
        assert "to accept this plan, add under overrides: in review.yaml: - {fingerprint: " in text.stdout
    plain = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--format", "json"])
    assert plain.exit_code == 2 and json.loads(plain.stdout)["verdict"] is None  # no policy: the diff's own codes


@pytest.mark.parametrize(("text", "message"), [
    ("thresholds: {graph: {warn: 1}}\n", "review.yaml: thresholds.graph.'[key]': must be \"graphs\", "),
    ("thresholds: {graphs: {}}\n", "review.yaml: thresholds.graphs: give warn, deny, warn_percent or deny_percent"),
    ("thresholds: {graphs: {warn: 5, deny: 1}}\n", "review.yaml: thresholds.graphs: warn (5) is above deny (1)"),
    ("thresholds: {graphs: {warn: -1}}\n", "review.yaml: thresholds.graphs.warn: must be >= 0"),
    ("thresholds: {graphs: {warn: yes}}\n", "review.yaml: thresholds.graphs.warn: "),
    ("overrides: [{fingerprint: abc, reason: x}]\n", "review.yaml: overrides.0.fingerprint: must be sha256: and 64"),
    ("overrides: [{fingerprint: 'sha256:" + "0" * 64 + "'}]\n", "review.yaml: overrides.0.reason: is required"),
    ("- 1\n", "review.yaml: "),
])  # fmt: skip
def test_a_bad_policy_is_one_line_naming_the_field_exit_1(specs, text, message):
    Path("review.yaml").write_text(text)
    result = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--policy", "review.yaml"])
    assert result.exit_code == 1 and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}"), line


def test_a_missing_or_linked_policy(specs):
    result = runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--policy", "nope.yaml"])
    assert result.exit_code == 1 and result.stderr.strip() == "error: nope.yaml: no such file"
    Path("real.yaml").write_text("thresholds: {graphs: {warn: 0}}\n")
    os.symlink("real.yaml", "link.yaml")  # read through a link like any input: nothing is written
    assert runner.invoke(app, ["diff", "--spec", "old.yaml", "new.yaml", "--policy", "link.yaml"]).exit_code == 3


LIMIT = st.dictionaries(
    st.sampled_from(["warn", "deny", "warn_percent", "deny_percent", "other"]),
    st.one_of(st.none(), st.integers(-5, 10**13), st.floats(allow_nan=True), st.text(max_size=4), st.booleans()),
    max_size=4,
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(
    st.none(), st.integers(), st.text(max_size=8), st.lists(st.integers(), max_size=2),
    st.fixed_dictionaries({}, optional={
        "thresholds": st.one_of(st.dictionaries(st.sampled_from(["graphs", "capture_seconds", "lora_case_moves", "x"]),
                                                LIMIT, max_size=3), st.integers()),
        "overrides": st.lists(st.dictionaries(st.sampled_from(["fingerprint", "reason", "by"]),
                                              st.one_of(st.text(max_size=70), st.integers()), max_size=3), max_size=2),
        "extra": st.integers(),
    }),
))  # fmt: skip
def test_any_policy_file_loads_or_is_one_input_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("policy") / "review.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        policy = load_policy(path)
    except InputError as exc:
        assert "\n" not in exc.message and exc.message.startswith(str(path))
        return
    for limit in policy.thresholds.values():
        assert all(v is None or v >= 0 for v in (limit.warn, limit.deny, limit.warn_percent, limit.deny_percent))
