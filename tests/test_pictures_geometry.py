"""The SVG pictures' geometry: every text inside the view box (its extent estimated as
len * font size * 0.6), no two texts on one line overlapping (axis labels included), and a
mark for every bucket of the data."""

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
NS = "{http://www.w3.org/2000/svg}"
runner = CliRunner()


def _boxes(svg: str):
    root = ET.fromstring(svg)
    vb = [float(v) for v in root.get("viewBox").split()]
    boxes = []
    for el in root.iter(f"{NS}text"):
        text = "".join(el.itertext())
        size = float(el.get("font-size"))
        x, y = float(el.get("x")), float(el.get("y"))
        length = len(text) * size * 0.6
        anchor = el.get("text-anchor", "start")
        lo = {"start": 0.0, "middle": -length / 2, "end": -length}[anchor]
        rotate = re.match(r"rotate\((-?\d+)", el.get("transform", ""))
        if rotate and rotate.group(1) == "-90":  # reads upward from (x, y): the extent turns
            boxes.append((text, x - size, y - lo - length, x, y - lo))
        else:
            boxes.append((text, x + lo, y - size, x + lo + length, y + size * 0.25))
    return root, vb, boxes


def check_geometry(svg: str) -> ET.Element:
    root, (vx, vy, vw, vh), boxes = _boxes(svg)
    assert float(root.get("width")) == vw and float(root.get("height")) == vh
    for text, x0, y0, x1, y1 in boxes:
        assert vx <= x0 and x1 <= vx + vw and vy <= y0 and y1 <= vy + vh, (text, x0, y0, x1, y1, vw, vh)
    by_line: dict[float, list] = {}
    for box in boxes:
        by_line.setdefault(box[4], []).append(box)
    for line in by_line.values():
        line.sort(key=lambda b: b[1])
        for a, b in zip(line, line[1:]):
            assert a[3] <= b[1], f"{a[0]!r} and {b[0]!r} overlap"
    return root


def _titles(root: ET.Element) -> list[str]:
    return [el.findtext(f"{NS}title") for el in root.iter(f"{NS}rect") if el.find(f"{NS}title") is not None]


def _qwen(tmp_path: Path, seqs: int) -> Path:
    spec = tmp_path / f"qwen-{seqs}.yaml"
    text = (ROOT / "configs" / "qwen3-8b-multilora.yaml").read_text()
    spec.write_text(text.replace("max_num_seqs: 256", f"max_num_seqs: {seqs}"))
    assert runner.invoke(app, ["compile", str(spec)]).exit_code == 0
    return tmp_path / f"qwen-{seqs}.plan.yaml"


@pytest.mark.parametrize("plan", [*sorted((ROOT / "examples").glob("*.plan.yaml")), 128], ids=str)
def test_the_plan_picture_fits_and_marks_every_graph(tmp_path, plan):
    """With max_num_seqs 128 the FULL grid has 19 sizes, each 16 px wide: every 3-digit
    label drawn would run into the next (104112120128)."""
    from capplan.planfile.read import load_plan

    if plan == 128:
        plan = _qwen(tmp_path, 128)
    assert runner.invoke(app, ["show", str(plan), "--plot", str(tmp_path / "p.svg")]).exit_code == 0
    root = check_geometry((tmp_path / "p.svg").read_text())
    titles = set(_titles(root))
    plan = load_plan(plan)
    for g in plan.graphs:
        d = g.descriptor
        assert f"{d.cg_mode}:{d.num_tokens}@{d.num_active_loras}" in titles


def test_the_diff_picture_title_fits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = (ROOT / "configs" / "qwen3-8b-multilora.yaml").read_text()
    Path("a-long-name-for-the-old-deployment-spec.yaml").write_text(
        text.replace("max_num_seqs: 256", "max_num_seqs: 128")
    )
    Path("b-long-name-for-the-new-deployment-spec.yaml").write_text(
        text.replace("max_num_seqs: 256", "max_num_seqs: 96")
    )
    names = ["a-long-name-for-the-old-deployment-spec.yaml", "b-long-name-for-the-new-deployment-spec.yaml"]
    out = runner.invoke(app, ["diff", "--spec", *names, "--plot", "d.svg"])
    assert out.exit_code == 2, out.output
    svg = Path("d.svg").read_text()
    root = check_geometry(svg)
    caption = " ".join(el.text for el in root.iter(f"{NS}text") if el.get("font-size") == "12")
    assert caption.startswith(f"capplan diff {names[0]} -> {names[1]}: REGRESSION: ")  # batches sent eager lead
    assert "scheduler.max_num_seqs: 128 -> 96" in caption
    assert "not priced)" in caption  # the whole headline, not cut


def test_the_simulate_picture_draws_every_bucket_and_the_eager_steps(tmp_path):
    import json

    trace = tmp_path / "t.jsonl"
    rows = [{"num_reqs": 4, "num_tokens": n, "count": 3} for n in (8, 100, 300)]
    rows.append({"num_reqs": 200, "num_tokens": 4000, "count": 50})  # past the largest graph: eager
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = runner.invoke(app, ["simulate", str(QWEN), str(trace), "--plot", str(tmp_path / "s.svg"), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    root = check_geometry((tmp_path / "s.svg").read_text())
    titles = _titles(root)
    for row in data["by_size"]:
        assert f"{row['num_tokens']}: {row['steps']:g}" in titles
    assert f"eager: {data['eager_steps']:g}" in titles and data["eager_steps"] == 50
    eager = next(el for el in root.iter(f"{NS}rect") if el.findtext(f"{NS}title") == "eager: 50")
    assert float(eager.get("height")) > 0


def test_the_optimize_picture_keeps_the_chosen_label_inside(tmp_path):
    trace = ROOT / "examples" / "traces" / "bursty.jsonl"
    spec = ROOT / "configs" / "qwen3-8b-multilora.yaml"
    # a graph budget far right of the curve; no graph budget: the chosen point is the curve's last
    for budget in (["--max-graph-memory", "100"], ["--max-graphs", "100"], ["--max-graphs", "600"]):
        out = runner.invoke(
            app,
            ["optimize", str(spec), str(trace), *budget, "--plot", str(tmp_path / "o.svg"), "--calibration",
             str(ROOT / "src" / "capplan" / "data" / "h200-vllm025.yaml"), "-o", str(tmp_path / "o.yaml")],
        )  # fmt: skip
        assert out.exit_code == 0, out.output
        root = check_geometry((tmp_path / "o.svg").read_text())
        assert any((el.text or "").startswith("chosen: ") for el in root.iter(f"{NS}text"))


@pytest.mark.parametrize("sizes", [[1, 2, 4, *range(8, 257, 8)], list(range(96, 132, 8)), [5], []])
def test_axis_labels_never_run_together(sizes):
    from capplan.present.plot import tick_labels

    centers = [10 + 16 * i for i in range(len(sizes))]
    labels = [str(s) for s in sizes]
    chosen = tick_labels(centers, labels, 9)
    if sizes:
        assert chosen[-1] == len(sizes) - 1
    for a, b in zip(chosen, chosen[1:]):
        assert centers[a] + len(labels[a]) * 9 * 0.3 <= centers[b] - len(labels[b]) * 9 * 0.3
