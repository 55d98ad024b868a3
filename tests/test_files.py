"""What capplan does on disk: what it reads, what it writes, and what it refuses to touch."""

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.cli import app

runner = CliRunner()
SPEC = "scheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\nlora: {enabled: true, max_loras: 2}\n"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("deploy.yaml").write_text(SPEC)
    return tmp_path


def run(*args):
    return runner.invoke(app, list(args))


def one_error(result, code=1) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_a_new_plan_gets_the_umask_mode_and_a_rewrite_keeps_the_existing_mode(work):
    old = os.umask(0o022)
    try:
        assert run("compile", "deploy.yaml").exit_code == 0
        assert stat.S_IMODE(os.stat("deploy.plan.yaml").st_mode) == 0o644
        os.chmod("deploy.plan.yaml", 0o640)
        Path("deploy.yaml").write_text(SPEC.replace("max_loras: 2", "max_loras: 3"))
        assert "wrote" in run("compile", "deploy.yaml").stderr
        assert stat.S_IMODE(os.stat("deploy.plan.yaml").st_mode) == 0o640
    finally:
        os.umask(old)


def test_the_output_cannot_be_an_input(work):
    line = one_error(run("compile", "deploy.yaml", "-o", "deploy.yaml"))
    assert line == (
        "error: deploy.yaml: is also an input of this command; refusing to overwrite it "
        "(write the output somewhere else)"
    )
    assert Path("deploy.yaml").read_text() == SPEC
    trace = Path("t.jsonl")
    trace.write_text('{"num_reqs": 2, "num_tokens": 2}\n')
    line = one_error(run("optimize", "deploy.yaml", "t.jsonl", "--max-graphs", "4", "-o", "t.jsonl"))
    assert line.startswith("error: t.jsonl: is also an input of this command")
    assert trace.read_text() == '{"num_reqs": 2, "num_tokens": 2}\n'
    line = one_error(run("optimize", "deploy.yaml", "t.jsonl", "--max-graphs", "4", "--plot", "deploy.yaml"))
    assert line.startswith("error: deploy.yaml: is also an input")
    # A calibration is an input too, and one command's two outputs cannot share a path.
    cal = Path("cal.yaml")
    cal.write_text((ROOT / "src" / "capplan" / "data" / "h200-vllm025.yaml").read_text())
    before = cal.read_text()
    for args in (
        ("optimize", "deploy.yaml", "t.jsonl", "--max-graphs", "4", "--calibration", "cal.yaml", "-o", "cal.yaml"),
        ("optimize", "deploy.yaml", "t.jsonl", "--max-graphs", "4", "--calibration", "cal.yaml", "--plot", "cal.yaml"),
    ):
        assert one_error(run(*args)).startswith("error: cal.yaml: is also an input"), args
    assert cal.read_text() == before
    line = one_error(
        run("optimize", "deploy.yaml", "t.jsonl", "--max-graphs", "4", "-o", "o.svg", "--plot", "o.svg"), 2
    )
    assert "--plot o.svg is also the optimized spec's path" in line and not Path("o.svg").exists()


def test_two_specs_cannot_write_one_plan(work):
    Path("a").mkdir()
    Path("b").mkdir()
    Path("a/x.yaml").write_text(SPEC)
    Path("b/x.yaml").write_text(SPEC)
    Path("out").mkdir()
    line = one_error(run("compile", "a/x.yaml", "b/x.yaml", "--plan-dir", "out"), code=2)
    assert line.startswith("error: a/x.yaml and b/x.yaml would both be written to out/x.plan.yaml")
    assert not any(Path("out").iterdir())


def test_no_writing_through_symlinks_or_onto_devices(work):
    Path("real.plan.yaml").write_text("keep\n")
    os.symlink("real.plan.yaml", "link.plan.yaml")
    line = one_error(run("compile", "deploy.yaml", "-o", "link.plan.yaml"))
    assert line.startswith("error: link.plan.yaml: is a symbolic link; refusing to write through it")
    assert os.path.islink("link.plan.yaml") and Path("real.plan.yaml").read_text() == "keep\n"
    os.symlink("/proc/self/fd/1", "stdout.plan.yaml")
    assert "is a symbolic link" in one_error(run("compile", "deploy.yaml", "-o", "stdout.plan.yaml"))
    if os.path.exists("/dev/null"):
        line = one_error(run("compile", "deploy.yaml", "-o", "/dev/null"))
        assert line.startswith("error: /dev/null: not a regular file")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    Path("folder.plan.yaml").mkdir()
    assert "folder.plan.yaml: is a directory" in one_error(run("compile", "deploy.yaml", "-o", "folder.plan.yaml"))


def test_write_errors_name_the_users_path_on_one_line(work, monkeypatch):
    line = one_error(run("compile", "deploy.yaml", "-o", "no\nwhere/x.plan.yaml"))
    assert line == "error: no\\nwhere/x.plan.yaml: cannot write: folder no\\nwhere does not exist (create it first)"
    import capplan.files as files

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    line = one_error(run("compile", "deploy.yaml"))
    assert line == "error: deploy.plan.yaml: cannot write (No space left on device)"
    assert sorted(os.listdir(".")) == ["deploy.yaml"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_named(work):
    Path("ro").mkdir()
    os.chmod("ro", 0o555)
    try:
        line = one_error(run("compile", "deploy.yaml", "-o", "ro/x.plan.yaml"))
        assert line == "error: ro/x.plan.yaml: cannot write (Permission denied)"
    finally:
        os.chmod("ro", 0o755)


def test_sigterm_during_a_write_leaves_the_old_plan_and_no_temp_file(work):
    assert run("compile", "deploy.yaml").exit_code == 0
    before = Path("deploy.plan.yaml").read_bytes()
    Path("deploy.yaml").write_text(SPEC.replace("max_loras: 2", "max_loras: 3"))
    code = textwrap.dedent("""
        import os, signal, sys
        import capplan.files as files
        real = files.os.fsync
        def killed(fd):
            real(fd)
            os.kill(os.getpid(), signal.SIGTERM)
        files.os.fsync = killed
        from capplan.cli import main
        sys.argv = ["capplan", "compile", "deploy.yaml"]
        main()
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + 15, proc.stderr
    assert "Traceback" not in proc.stderr
    assert Path("deploy.plan.yaml").read_bytes() == before
    assert sorted(os.listdir(".")) == ["deploy.plan.yaml", "deploy.yaml"]


def test_temp_files_of_killed_writers_are_swept(work):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = Path(f".deploy.plan.yaml.capplan-{dead}.tmp")
    stale.write_text("half a plan")
    live = Path(f".deploy.plan.yaml.capplan-{os.getppid()}.tmp")  # a process that is still running
    live.write_text("being written")
    other = Path(".deploy.plan.yaml.someone-else.tmp")
    other.write_text("not ours")
    assert run("compile", "deploy.yaml").exit_code == 0
    assert not stale.exists() and live.exists() and other.exists()


def test_special_files_are_refused_as_inputs(work):
    if os.path.exists("/dev/zero"):
        line = one_error(run("compile", "/dev/zero"))
        assert line.startswith("error: /dev/zero: not a regular file")
        assert one_error(run("show", "/dev/zero")).startswith("error: /dev/zero: not a regular file")
    os.mkfifo("fifo.yaml")
    proc = subprocess.run(
        [sys.executable, "-m", "capplan", "compile", "fifo.yaml"], cwd=work, capture_output=True, text=True, timeout=30
    )  # must not block waiting for a writer
    assert proc.returncode == 1 and proc.stderr.startswith("error: fifo.yaml: not a regular file")


def test_dispatch_refuses_batches_the_deployment_never_schedules():
    plan = str(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml")
    line = one_error(run("dispatch", plan, "--reqs", "20", "--tokens", "20", "--loras", "15", "--base"), code=2)
    assert line == "error: 15 adapters, more than max_loras 8"
    line = one_error(run("dispatch", plan, "--reqs", "300", "--tokens", "300"), code=2)
    assert line == "error: 300 requests, more than max_num_seqs 256"
    line = one_error(run("dispatch", plan, "--reqs", "2", "--tokens", "9000"), code=2)
    assert line == "error: 9000 tokens, more than max_num_batched_tokens 8192"


def test_a_comment_that_looks_like_a_vllm_log_line_does_not_change_the_format(work):
    """Formats are decided by the whole file: a JSON trace stays a JSON trace."""
    lines = ["# copied from a log: Batchsize forward time stats (batchsize, count, median_time(ms)): [(8, 1, 1.0)]"]
    lines += ['{"num_reqs": 4, "num_tokens": 4, "count": 5}'] * 100
    Path("t.jsonl").write_text("\n".join(lines) + "\n")
    assert run("compile", "deploy.yaml").exit_code == 0
    result = run("simulate", "deploy.plan.yaml", "t.jsonl", "--json")
    assert result.exit_code == 0, result.output
    import json

    assert json.loads(result.stdout)["steps"] == 500
    assert "note:" not in result.stderr


def test_blank_and_comment_lines_are_skipped_with_line_numbers_kept(work):
    from capplan.batches import BatchFileError
    from capplan.files import text_lines

    trace = work / "t.jsonl"
    trace.write_text('\n  \n# a comment\n\t# another\r\n{"num_reqs": 1}\r\n\n  {"x": 2}  \n#\n')
    lines = list(text_lines(trace, "batch file", BatchFileError, 1 << 20))
    assert lines == [(5, '{"num_reqs": 1}'), (7, '  {"x": 2}  ')]
    # Line numbers stay right across many skipped lines, lone-CR line ends and other whitespace.
    trace.write_text('\u00a0\u3000{"z": 3}\r\u3000# c\r' + "#\n" * 200_000 + "\n" * 199_998 + '{"y": 1}\n')
    assert list(text_lines(trace, "batch file", BatchFileError, 1 << 20)) == [
        (1, '\u00a0\u3000{"z": 3}'),
        (400_001, '{"y": 1}'),
    ]
    trace.write_text("#\n" * 200_000 + "\n" * 200_000 + '{"y": 1}\n')
    assert list(text_lines(trace, "batch file", BatchFileError, 1 << 20)) == [(400_001, '{"y": 1}')]


def test_a_name_with_a_line_break_stays_on_one_line_in_outputs(work):
    name = "t\nmultimodal: {tower_connector_lora: true}\n#.jsonl"
    Path(name).write_text('{"num_reqs": 2, "num_tokens": 2}\n')
    result = run("optimize", "deploy.yaml", name, "--max-graphs", "4", "--max-pad-ratio", "1000", "-o", "o.yaml")
    assert result.exit_code == 0, result.output
    text = Path("o.yaml").read_text()
    assert "\nmultimodal:" not in text and "t\\nmultimodal" in text.splitlines()[0]


def test_two_names_of_one_folder_cannot_write_one_plan(work):
    Path("a").mkdir()
    Path("a/s.yaml").write_text(SPEC)
    Path("alias").symlink_to("a")
    line = one_error(run("compile", "a/s.yaml", "alias/s.yaml"), 2)
    assert "would both be written to" in line


def test_the_runtime_report_writer_never_follows_a_symlink_and_never_half_writes(tmp_path):
    import json
    import signal

    from capplan.files import write_for_runtime

    target = tmp_path / "report.json"
    (tmp_path / "elsewhere.json").write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    assert "symbolic link" in write_for_runtime(link, "{}")
    assert (tmp_path / "elsewhere.json").read_text() == "keep"
    # a symlink planted at the temporary name is replaced, not followed
    planted = tmp_path / f".report.json.capplan-{os.getpid()}.tmp"
    planted.symlink_to(tmp_path / "elsewhere.json")
    handler = signal.getsignal(signal.SIGTERM)
    assert write_for_runtime(target, json.dumps({"ok": 1})) is None
    assert signal.getsignal(signal.SIGTERM) is handler  # the engine's handlers are left alone
    assert json.loads(target.read_text()) == {"ok": 1}
    assert (tmp_path / "elsewhere.json").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.json", "link.json", "report.json"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask_now())


def _umask_now() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
