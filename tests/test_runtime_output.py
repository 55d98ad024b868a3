"""What the runtime prints and writes, without vLLM: the end-of-run report rendered from
its JSON form, and the trace file opened through capplan.files."""

import os
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from capplan.files import open_stream
from capplan.planfile import load_plan
from capplan.present.report import render_report
from capplan.runtime.report import Report

ROOT = Path(__file__).resolve().parents[1]


def _desc(mode: str, tokens: int) -> NS:
    return NS(cg_mode=NS(name=mode), num_tokens=tokens)


def test_the_report_renders_from_its_json_form():
    report = Report(load_plan(ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"), "p.plan.yaml")
    report.planned(12)
    report.capture_seconds, report.graph_memory_bytes = 3.14159, 123456789
    report.captured.update({("FULL", 1): 3, ("PIECEWISE", 0): 2})
    report.hits.update({0: 5, 3: 1})
    report.eager = 4
    report.dp_step(1, 2, 5, _desc("FULL", 8), _desc("FULL", 16), False)
    report.dp_step(1, 2, 5, _desc("FULL", 8), _desc("NONE", 0), None)
    report.dp_step(1, 2, 5, _desc("FULL", 8), _desc("NONE", 8), True)
    trace = {"steps": 9, "path": "t.jsonl", "overhead_us_per_step": 2.5, "stopped": "stopped at 1 MiB"}
    report.recorder = NS(to_json=lambda: trace)
    report._finished = True  # nothing printed at exit
    lines = render_report(report.to_json()).splitlines()
    assert lines[0] == f"capplan: plan p.plan.yaml ({report.plan.fingerprint[:19]})"
    assert lines[1] == "  FULL      case 0   planned   35  captured    0"
    assert lines[2] == "  FULL      case 1   planned   35  captured    3"
    assert lines[-4:] == [
        "  graphs: 5/496 captured (vLLM alone would capture 12), 3.1 s, graph memory 0.115 GiB",
        "  dispatch: 10 calls, 6 graph replays, 4 eager",
        "  DP rank 1/2: 2 steps, 1 padded to another rank's size (+8 tokens), 1 eager together (1 forced by "
        "another rank), 1 idle; audit: 1 of 2 steps with differing padded sizes",
        "  trace: 9 steps to t.jsonl (2.5 us per step to record; stopped at 1 MiB)",
    ]


def test_open_stream_replaces_only_its_own_kind_of_file(tmp_path):
    ours = lambda path: Path(path).read_text().startswith("# mine")  # noqa: E731
    mine = tmp_path / "trace.jsonl"
    mine.write_text("# mine\nold line\n")
    with open_stream(str(mine), ours, "a test trace") as handle:
        handle.write("# mine\n")
    assert mine.read_text() == "# mine\n"  # truncated, then written
    other = tmp_path / "config.json"
    other.write_text("{}")
    with pytest.raises(OSError, match="exists and is not a test trace; refusing to replace it"):
        open_stream(str(other), ours, "a test trace")
    assert other.read_text() == "{}"
    link = tmp_path / "link.jsonl"
    link.symlink_to(mine)
    with pytest.raises(OSError):
        open_stream(str(link), ours, "a test trace")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError):  # never blocks on a pipe without a reader, never writes into one
        open_stream(str(fifo), ours, "a test trace")
    with pytest.raises(OSError, match="not a regular file"):
        open_stream("/dev/null", ours, "a test trace")
