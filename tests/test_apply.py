"""`capplan apply` refuses every setup where the plan would be silently ignored, then runs the command."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"


def apply(*command, env=None, report=None, cwd=None):
    args = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(PLAN)]
    if report is not None:
        args += ["--report", str(report)]
    return subprocess.run(
        [*args, "--", *command], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}, cwd=cwd
    )


@pytest.fixture
def fake_vllm(tmp_path):
    """A `vllm` package the target Python can import (capplan's plugin is installed in this venv)."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
    return {"PYTHONPATH": str(tmp_path / "site")}


def last_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines and "Traceback" not in proc.stderr, proc.stderr
    return lines[-1]


def test_an_explicit_v1_runner_is_refused_not_overridden(fake_vllm):
    proc = apply(sys.executable, "-c", "print('ran')", env={**fake_vllm, "VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert last_line(proc) == (
        "error: VLLM_USE_V2_MODEL_RUNNER=0 puts the engine on vLLM's V1 model runner, where "
        "the plan cannot be in force (unset it: capplan apply runs Model Runner V2)"
    )


def test_a_plugin_filter_without_capplan_is_refused(fake_vllm):
    proc = apply(sys.executable, "-c", "print('ran')", env={**fake_vllm, "VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert proc.returncode == 1 and "leaves out capplan's plugin" in last_line(proc)


def test_a_python_without_vllm_is_refused_naming_it():
    env = {"PYTHONPATH": ""}
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, env={**os.environ, **env})
    if probe.returncode == 0:
        pytest.skip("vLLM is installed here")
    proc = apply(sys.executable, "-c", "print('ran')", env=env)
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert last_line(proc).startswith(f"error: vLLM is not installed for {sys.executable}, which runs the command")


def test_the_command_runs_with_the_plan_and_its_exit_code_and_quoting_are_kept(fake_vllm, tmp_path):
    code = "import os, sys; print(os.environ['CAPPLAN_PLAN'], os.environ['VLLM_USE_V2_MODEL_RUNNER']); sys.exit(3)"
    proc = apply(sys.executable, "-c", code, env=fake_vllm)
    assert proc.returncode == 3
    assert proc.stdout.split() == [str(PLAN), "1"]
    import shlex

    note, running = proc.stderr.splitlines()[:2]
    assert note.startswith("capplan: not a `vllm serve` or `python -m vllm.entrypoints.openai.api_server` command")
    echoed = running.split("graphs): ", 1)[1]
    assert shlex.split(echoed) == [sys.executable, "-c", code]  # quoting kept: pastes back into a shell


def test_a_promised_report_that_never_appears_fails_the_run(fake_vllm, tmp_path):
    report = tmp_path / "report.json"
    proc = apply(sys.executable, "-c", "print('no engine here')", env=fake_vllm, report=report)
    assert proc.returncode == 1
    assert last_line(proc).startswith(f"error: {report} was never written: the plan was not put in force")
    written = apply(sys.executable, "-c", f"open({str(report)!r}, 'w').write('{{}}')", env=fake_vllm, report=report)
    assert written.returncode == 0, written.stderr


def test_python_m_capplan_is_the_cli():
    proc = subprocess.run([sys.executable, "-m", "capplan", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "compile" in proc.stdout


def test_a_report_that_existed_before_the_run_is_not_this_run_s(fake_vllm, tmp_path):
    report = tmp_path / "report.json"
    report.write_text("{}")  # from an earlier run
    proc = apply(sys.executable, "-c", "print('no engine here')", env=fake_vllm, report=report)
    assert proc.returncode == 1 and "was never written" in last_line(proc)
    rewrite = (
        f"import os; open({str(report) + '.tmp'!r}, 'w').write('{{}}'); os.replace({str(report) + '.tmp'!r}, "
        f"{str(report)!r})"
    )
    assert apply(sys.executable, "-c", rewrite, env=fake_vllm, report=report).returncode == 0


@pytest.mark.parametrize("option", ["--trace", "--report"])
def test_outputs_never_name_an_input_or_a_symlink(fake_vllm, tmp_path, option):
    plan = tmp_path / "p.plan.yaml"
    plan.write_text(PLAN.read_text())
    script = tmp_path / "run.py"
    script.write_text("print('ran')\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    for target in (plan, script, link):
        before = plan.read_bytes()
        proc = subprocess.run(
            [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), option, str(target), "--",
             sys.executable, str(script)],
            capture_output=True, text=True, timeout=60, env={**os.environ, **fake_vllm},
        )  # fmt: skip
        assert proc.returncode == 2 and "ran" not in proc.stdout, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert plan.read_bytes() == before and not (tmp_path / "elsewhere.jsonl").exists()


def test_report_and_trace_cannot_share_a_file(fake_vllm, tmp_path):
    out = tmp_path / "out.json"
    report = subprocess.run(
        [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(PLAN), "--report", str(tmp_path / "r{rank}.json"),
         "--trace", str(tmp_path / "r0.json"), "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **fake_vllm},
    )  # fmt: skip
    assert report.returncode == 2 and "name one file" in report.stderr  # rank 0's report is the trace
    proc = subprocess.run(
        [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(PLAN), "--report", str(out), "--trace",
         str(out), "--", sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **fake_vllm},
    )  # fmt: skip
    assert proc.returncode == 2 and "name one file" in proc.stderr and "ran" not in proc.stdout


def test_a_script_with_an_env_dash_s_shebang_is_understood(tmp_path):
    from capplan.launcher.launch import target_python

    script = tmp_path / "serve"
    script.write_text("#!/usr/bin/env -S python3 -u\nprint('hi')\n")
    script.chmod(0o755)
    found = target_python([str(script)])
    assert found is not None and Path(found).name.startswith("python3")
    script.write_text("#!/usr/bin/env -S PYTHONUNBUFFERED=1 python3 -u\n")
    assert Path(target_python([str(script)])).name.startswith("python3")


def test_the_recorder_never_writes_through_a_symlink_or_into_a_pipe(tmp_path):
    from capplan.runtime.recorder import Recorder, max_trace_mb

    (tmp_path / "real.jsonl").write_text("keep\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "real.jsonl")
    with pytest.raises(OSError):
        Recorder(str(tmp_path / "link.jsonl"), 1 << 20, "h")
    assert (tmp_path / "real.jsonl").read_text() == "keep\n"
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):
        Recorder(str(tmp_path / "fifo"), 1 << 20, "h")  # returns at once: no reader is waited for
    for bad in ("nan", "inf", "-1", "0", "lots", "1e400", "1e-9", "0.5"):
        assert max_trace_mb(bad) == 256
    assert max_trace_mb("2.5") == 2.5
    # an existing file that is not a trace (a plan, say) is never replaced
    plan = tmp_path / "p1.plan.yaml"
    plan.write_text("format_version: 2\n")
    with pytest.raises(OSError):
        Recorder(str(plan), 1 << 20, "capplan trace: h")
    assert plan.read_text() == "format_version: 2\n"
    old = tmp_path / "old.jsonl"
    old.write_text("# capplan trace: earlier run\n{}\n")
    Recorder(str(old), 1 << 20, "capplan trace: h").close()  # an earlier trace is replaced
    assert old.read_text().startswith("# capplan trace: h")


def test_every_rank_s_output_is_checked(fake_vllm, tmp_path):
    import yaml

    spec = tmp_path / "dp.yaml"
    spec.write_text(yaml.safe_dump({"parallel": {"data_parallel_size": 2, "moe": True}}))
    plan = tmp_path / "p1.plan.yaml"
    assert subprocess.run([sys.executable, "-m", "capplan", "compile", str(spec), "-o", str(plan)]).returncode == 0
    before = plan.read_bytes()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("x: 1\n")
    (tmp_path / "in.rank1.yaml").write_text("an input of the command\n")
    cases = [
        ["--trace", str(tmp_path / "p{rank}.plan.yaml")],  # rank 1 would be the plan
        ["--trace", str(tmp_path / "cfg.yaml").replace("cfg.yaml", "in.yaml")],  # rank 1 writes in.rank1.yaml
        [
            "--report",
            str(tmp_path / "r{rank}.json"),
            "--trace",
            str(tmp_path / "r.json").replace("r.json", "r{rank}.json"),
        ],
        ["--report", str(cfg)],
    ]
    for options in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), *options, "--",
             sys.executable, "-c", "print('ran')", f"--config={cfg}", str(tmp_path / "in.rank1.yaml")],
            capture_output=True, text=True, timeout=60, env={**os.environ, **fake_vllm},
        )  # fmt: skip
        assert proc.returncode == 2 and "ran" not in proc.stdout, (options, proc.stderr)
        assert plan.read_bytes() == before


def test_a_fifo_or_missing_command_is_refused_at_once(fake_vllm, tmp_path):
    fifo = tmp_path / "ff"
    os.mkfifo(fifo)
    for command in (str(fifo), str(tmp_path / "missing" / "vllm")):
        proc = apply(command, "serve", "m", env=fake_vllm)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        line = last_line(proc)
        assert "command not found" in line or "not a regular file" in line or "is not executable" in line


def _installed_as(site: Path, version: str) -> None:
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")


@pytest.mark.parametrize(
    ("version", "refused"),
    [("0.25.1", False), ("0.26.0+cu130", False), ("0.27.0", True), ("0.33.0", True), ("0.34.0", True)],
)
def test_a_vllm_release_the_plan_was_not_compiled_for_is_refused_before_anything_starts(
    fake_vllm, tmp_path, version, refused
):
    """The example plan targets "0.25" (vLLM 0.25.0, 0.25.1, 0.26.0): another release's
    vLLM plans other graphs, so the launch stops in one line naming the release to compile for."""
    _installed_as(tmp_path / "site", version)
    proc = apply(sys.executable, "-c", "print('ran')", env=fake_vllm)
    if not refused:
        assert proc.returncode == 0 and "ran" in proc.stdout, proc.stderr
        return
    assert proc.returncode == 1 and "ran" not in proc.stdout
    line = last_line(proc)
    assert len(proc.stderr.strip().splitlines()) == 1
    if version == "0.34.0":
        assert line == (
            f"error: {sys.executable}: vLLM 0.34.0 is not supported by capplan (install one of vLLM 0.25.0, "
            "0.25.1, 0.26.0, 0.27.0, 0.27.1, 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0)"
        )
    else:
        assert line == (
            f"error: {sys.executable}: the plan was compiled for vLLM 0.25 (runs on 0.25.0, 0.25.1, 0.26.0), "
            f'not for vLLM {version}, which plans differently (recompile it with target.vllm: "{version}")'
        )


def test_the_command_gets_capplan_s_prefix_in_vllm_s_list_for_ray_workers_keeping_the_user_s(fake_vllm):
    """Ray actors get only the environment variables vLLM copies to them: the command runs with
    capplan's prefix added to vLLM's list (the user's own prefixes kept)."""
    code = "import os; print(os.environ['VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY'])"
    assert apply(sys.executable, "-c", code, env=fake_vllm).stdout.split() == ["CAPPLAN_"]
    given = {**fake_vllm, "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "MY_, LMCACHE_X_"}
    assert apply(sys.executable, "-c", code, env=given).stdout.split() == ["MY_,LMCACHE_X_,CAPPLAN_"]


@given(
    st.lists(
        st.one_of(
            st.sampled_from(["CAPPLAN_", " CAPPLAN_\t", "CAPPLAN", ""]), st.text(alphabet="ACLNP_ \t", max_size=9)
        ),
        max_size=5,
    ).map(",".join)
)
def test_capplan_s_ray_prefix_is_added_once_and_the_user_s_kept(value):
    from capplan.envvars import PREFIX, with_ray_prefix

    result = with_ray_prefix(value)
    out = result.split(",")
    users = [p.strip() for p in value.split(",") if p.strip()]
    assert PREFIX in out and "" not in out and all(p == p.strip() for p in out)
    assert [p for p in out if p in users] == users  # every prefix the user gave, in the user's order
    assert len(out) == len(users) + (PREFIX not in users)  # nothing else but capplan's, and that once
    assert with_ray_prefix(result) == result  # applied twice: unchanged


TIERS_PLAN = ROOT / "examples" / "h200-tiny-llama-025-tiers.plan.yaml"


def apply_tiers(*options, plan=TIERS_PLAN, env=None):
    code = (
        "import os; print(os.environ.get('CAPPLAN_STEP_PAUSE_MS'), os.environ.get('CAPPLAN_SLOW_CAPTURE_EVERY_STEPS'))"
    )
    args = [sys.executable, "-m", "capplan", "apply", "--runner", "mrv2", str(plan), *options]
    return subprocess.run(
        [*args, "--", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_the_operator_s_pause_bounds_reach_the_engine_and_are_said(fake_vllm):
    proc = apply_tiers("--step-pause-ms", "120", "--slow-capture-every-steps", "0", env=fake_vllm)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["120.0", "0"]
    assert (
        "capplan: deferred capture: a step waits on a capture expected to take at most 120 ms; a longer one, of a "
        "graph the traffic missed, never (idle turns only)"
    ) in proc.stderr
    spaced = apply_tiers("--slow-capture-every-steps", "40", env=fake_vllm)
    assert spaced.returncode == 0, spaced.stderr
    assert "a longer one, of a graph the traffic missed, at most 8 in a row, then once in 40 steps" in spaced.stderr
    unset = apply_tiers(env=fake_vllm)  # the engine's defaults: nothing passed, nothing said
    assert unset.returncode == 0 and unset.stdout.split() == ["None", "None"] and "deferred capture" not in unset.stderr


@pytest.mark.parametrize(
    "options, line",
    [
        (["--step-pause-ms", "0"], "error: --step-pause-ms 0: give milliseconds from 0.001 to 60000"),
        (["--step-pause-ms", "nan"], "error: --step-pause-ms nan: give milliseconds from 0.001 to 60000"),
        (["--slow-capture-every-steps", "-1"], "error: --slow-capture-every-steps -1: give 0 (never) to 1000000 steps"),
    ],
)
def test_a_pause_bound_out_of_range_is_refused_before_anything_runs(fake_vllm, options, line):
    proc = apply_tiers(*options, env=fake_vllm)
    assert proc.returncode == 2 and proc.stdout == ""
    assert last_line(proc) == line


def test_a_pause_bound_for_a_plan_that_defers_nothing_is_refused(fake_vllm):
    proc = apply_tiers("--step-pause-ms", "80", plan=PLAN, env=fake_vllm)
    assert proc.returncode == 2 and proc.stdout == ""
    assert last_line(proc) == (
        "error: --step-pause-ms bounds deferred capture, and this plan defers no graph (its spec has no tiers)"
    )


def test_a_pause_bound_set_by_hand_in_the_environment_is_checked_by_the_engine():
    from capplan.errors import EngineRefusal
    from capplan.runtime.deferred.pauses import Pauses

    assert Pauses.from_env({}) == Pauses(0.05, 100)
    assert Pauses.from_env({"CAPPLAN_STEP_PAUSE_MS": "20", "CAPPLAN_SLOW_CAPTURE_EVERY_STEPS": "7"}) == Pauses(0.02, 7)
    for env in ({"CAPPLAN_STEP_PAUSE_MS": "fast"}, {"CAPPLAN_SLOW_CAPTURE_EVERY_STEPS": "-3"}):
        with pytest.raises(EngineRefusal, match="^capplan: "):
            Pauses.from_env(env)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["CAPPLAN_STEP_PAUSE_MS", "CAPPLAN_SLOW_CAPTURE_EVERY_STEPS"]),
        st.one_of(st.text(max_size=12), st.integers(-(10**9), 10**9).map(str), st.floats().map(repr)),
    )
)
def test_the_engine_s_reading_of_the_pause_bounds_gives_bounds_in_range_or_one_line(env):
    """Whatever the environment holds: bounds within the launcher's ranges, or capplan's one-line refusal."""
    from capplan.errors import EngineRefusal
    from capplan.runtime.deferred.pauses import MAX_SLOW_EVERY, MAX_STEP_PAUSE_MS, Pauses

    try:
        pauses = Pauses.from_env(env)
    except EngineRefusal as exc:
        assert str(exc).startswith("capplan: ") and "\n" not in str(exc)
        return
    assert 0 < pauses.step_pause_s * 1000 <= MAX_STEP_PAUSE_MS and 0 <= pauses.slow_every_steps <= MAX_SLOW_EVERY
