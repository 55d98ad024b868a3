"""What an operator trips on in everyday use, each fixed and kept fixed."""

import re
import subprocess
import sys
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from capplan.cli import app

ROOT = Path(__file__).resolve().parents[1]
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()  # the command reference
runner = CliRunner()
SPEC = "scheduler: {max_num_seqs: 8, max_num_batched_tokens: 64}\nlora: {enabled: true, max_loras: 2}\n"


def capplan(*args, cwd=None, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "capplan", *args], capture_output=True, text=True, cwd=cwd, timeout=120, **kwargs
    )


def test_compile_json_says_the_plan_is_still_written(tmp_path):
    helped = runner.invoke(app, ["compile", "--help"])
    assert "the plan file is still written" in " ".join(helped.stdout.split())
    (tmp_path / "s.yaml").write_text(SPEC)
    out = runner.invoke(app, ["compile", str(tmp_path / "s.yaml"), "--json", "-o", str(tmp_path / "x.plan.yaml")])
    assert out.exit_code == 0 and (tmp_path / "x.plan.yaml").exists() and out.stdout.startswith("{")


def test_the_precommit_hook_skips_other_yaml_but_not_a_misspelt_spec(tmp_path):
    hook = (ROOT / ".pre-commit-hooks.yaml").read_text()
    assert "args: [--check, --skip-non-specs]" in hook
    (tmp_path / "ci.yaml").write_text("jobs: {build: {runs-on: ubuntu-latest}}\n")
    (tmp_path / "deploy.yaml").write_text(SPEC)
    assert capplan("compile", "deploy.yaml", cwd=tmp_path).returncode == 0
    ok = capplan("compile", "--check", "--skip-non-specs", "ci.yaml", "deploy.yaml", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "ci.yaml: skipped, not a capplan spec" in ok.stderr
    # YAML capplan's strict reader refuses, in files that are not specs: skipped too.
    others = {
        "k8s.yaml": "apiVersion: v1\nkind: Namespace\n---\napiVersion: v1\nkind: Namespace\n",
        "compose.yml": "services:\n  ssh:\n    ports:\n      - 22:22\n",
        "playbook.yml": "- hosts: all\n  tasks:\n    - file: {path: /etc/x, mode: 0644}\n",
        "stack.yaml": "Outputs:\n  Id: {Value: !Ref Bucket}\n",
        "chart.yaml": "image: {{ .Values.image }}\n",
    }
    for name, text in others.items():
        (tmp_path / name).write_text(text)
    skipped = capplan("compile", "--check", "--skip-non-specs", *others, cwd=tmp_path)
    assert skipped.returncode == 0, skipped.stderr
    assert skipped.stderr.count("skipped, not a capplan spec") == len(others)
    # A spec the strict reader refuses is still a spec: the hook fails and says why.
    (tmp_path / "octal.yaml").write_text(SPEC + "speculative: {num_speculative_tokens: 01}\n")
    octal = capplan("compile", "--check", "--skip-non-specs", "octal.yaml", cwd=tmp_path)
    assert octal.returncode == 1 and "leading zero" in octal.stderr
    (tmp_path / "flow.yaml").write_text('{"scheduler": {"max_num_seqs": 16}, "scheduler": {"max_num_seqs": 8}}\n')
    flow = capplan("compile", "--check", "--skip-non-specs", "flow.yaml", cwd=tmp_path)
    assert flow.returncode == 1 and "duplicate key" in flow.stderr
    (tmp_path / "typo.yaml").write_text(SPEC + "schedular: {max_num_seqs: 4}\n")
    typo = capplan("compile", "--check", "--skip-non-specs", "typo.yaml", cwd=tmp_path)
    assert typo.returncode == 1 and "schedular: unknown key" in typo.stderr


def test_debug_works_after_the_subcommand(tmp_path):
    (tmp_path / "bad.yaml").write_text("lora: {enabled: true, max_loras: -1}\n")
    plain = capplan("compile", "bad.yaml", cwd=tmp_path)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr
    after = capplan("compile", "bad.yaml", "--debug", cwd=tmp_path)
    before = capplan("--debug", "compile", "bad.yaml", cwd=tmp_path)
    assert "Traceback" in after.stderr and "Traceback" in before.stderr


def test_a_closed_pipe_is_not_an_error():
    plan = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capplan",
            "dispatch",
            str(plan),
            "--reqs",
            "3",
            "--tokens",
            "17",
            "--loras",
            "2",
            "--base",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # the reader is gone before anything is written (`| head -0`)
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "error" not in stderr.lower() and "Traceback" not in stderr, stderr


def test_misused_diff_names_the_command_that_works():
    spec_a, spec_b = ROOT / "configs" / "qwen3-8b-multilora.yaml", ROOT / "configs" / "h200-tiny-llama-025.yaml"
    out = runner.invoke(app, ["diff", str(spec_a), str(spec_b)])
    assert out.exit_code == 1  # 2 is diff's "the plans differ"
    assert out.stderr.strip() == (
        f"error: {spec_a} is a spec, not a plan (compare specs with: capplan diff --spec {spec_a} {spec_b})"
    )
    plan_a, plan_b = (
        ROOT / "examples" / "qwen3-8b-multilora.plan.yaml",
        ROOT / "examples" / "h200-tiny-llama-025.plan.yaml",
    )
    out = runner.invoke(app, ["diff", "--spec", str(plan_a), str(plan_b)])
    assert out.exit_code == 1 and f"compare plans without --spec: capplan diff {plan_a} {plan_b}" in out.stderr


def test_lora_settings_without_enabled_are_refused(tmp_path):
    (tmp_path / "s.yaml").write_text("lora: {max_loras: 4}\n")
    out = runner.invoke(app, ["compile", str(tmp_path / "s.yaml"), "--dry-run"])
    assert out.exit_code == 1 and "lora.max_loras is set but lora.enabled is not" in out.stderr
    (tmp_path / "off.yaml").write_text("lora: {enabled: false, max_loras: 4}\n")  # said explicitly: fine
    assert runner.invoke(app, ["compile", str(tmp_path / "off.yaml"), "--dry-run"]).exit_code == 0


def test_text_diff_bullets_are_not_minus_signs():
    old, new = ROOT / "configs" / "h200-tiny-llama-025.yaml", ROOT / "configs" / "mixtral-dp2-lora.yaml"
    out = runner.invoke(app, ["diff", "--spec", str(old), str(new)])
    lines = out.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if i and not line.startswith("  "))  # after the price lines
    items = [line for line in lines[first:] if line.startswith("  ")]
    assert items and all(line.startswith(("  * ", "  - ", "  + ")) for line in items)
    assert all(line.startswith("  * ") for line in items if ": +" in line or line.startswith("  * graph"))


def _synopsis() -> list[str]:
    block = CLI_DOC.split("## What it does", 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines() if line.startswith("capplan ")]


def test_the_synopsis_lists_every_command_and_option():
    lines = _synopsis()
    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        if sub.hidden:
            continue
        mine = [line for line in lines if line.startswith(f"capplan {name}")]
        assert mine, f"docs/cli.md synopsis has no line for {name}"
        options = [o for p in sub.params for o in p.opts if o.startswith("--")]
        missing = [o for o in options if not any(re.search(rf"{re.escape(o)}\b", line) for line in mine)]
        assert not missing, f"docs/cli.md synopsis of {name} leaves out {missing}"


def test_the_sample_summary_is_what_compile_prints(tmp_path):
    sample = re.search(r"`wrote deploy\.plan\.yaml: (\d+ graphs: PIECEWISE \d+ \(case 0: \d+), \.\.\.\)`", CLI_DOC)
    assert sample, "docs/cli.md's compile sample line is gone"
    (tmp_path / "deploy.yaml").write_text((ROOT / "configs" / "qwen3-8b-multilora.yaml").read_text())
    out = capplan("compile", "deploy.yaml", cwd=tmp_path)
    assert out.stderr.startswith(f"wrote deploy.plan.yaml: {sample.group(1)}"), out.stderr


def test_the_plan_picture_marks_captured_pruned_and_eager(tmp_path):
    from capplan.present.plot import CAPTURED, PRUNED

    plan = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
    out = runner.invoke(app, ["show", str(plan), "--plot", str(tmp_path / "plan.svg")])
    assert out.exit_code == 0, out.output
    svg = (tmp_path / "plan.svg").read_text()
    assert svg.startswith("<svg") and "capplan show qwen3-8b-multilora.plan.yaml: 496 graphs" in svg
    assert f'fill="{CAPTURED}"><title>PIECEWISE:512@0</title>' in svg
    assert f'fill="{PRUNED}"><title>PIECEWISE:1@9</title>' in svg  # pruned: one token holds one adapter
    assert "eager: all batches of 513..8192 tokens run eager" in svg
    assert svg.count("<title>") == 496 + 20  # every captured graph, every pruned one
    assert (ROOT / "docs" / "qwen3-8b-multilora.plan.svg").read_text() == svg.replace(str(tmp_path), "")


def test_the_diff_picture_marks_added_and_removed(tmp_path):
    from capplan.present.plot import ADDED, REMOVED

    old = ROOT / "configs" / "qwen3-8b-multilora.yaml"
    new = tmp_path / "q.yaml"
    new.write_text(old.read_text().replace("max_loras: 8", "max_loras: 4"))
    out = runner.invoke(app, ["diff", "--spec", str(old), str(new), "--plot", str(tmp_path / "d.svg")])
    assert out.exit_code == 2, out.output
    svg = (tmp_path / "d.svg").read_text()
    assert f'fill="{ADDED}"><title>FULL:16@5</title>' in svg and f'fill="{REMOVED}"><title>FULL:16@9</title>' in svg


def _optimize_qwen3(tmp_path, *extra):
    """optimize the qwen3 example on the chat trace with a 300-graph budget."""
    spec, trace = ROOT / "configs" / "qwen3-8b-multilora.yaml", ROOT / "examples" / "traces" / "chat.jsonl"
    args = ["optimize", str(spec), str(trace), "--max-graphs", "300", "-o", str(tmp_path / "o.yaml"), *extra]
    return runner.invoke(app, args)


def test_the_optimize_curve_marks_budget_and_choice_and_the_text_stops_near_it(tmp_path):
    out = _optimize_qwen3(tmp_path, "--plot", str(tmp_path / "c.svg"))
    assert out.exit_code == 0, out.output
    svg = (tmp_path / "c.svg").read_text()
    # the best set within 300 graphs pads more than vLLM's sizes on the held-out steps: the spec's own kept
    assert "budget 300" in svg and "chosen: 496 graphs" in svg and "(log)" in svg
    assert "more point(s), up to 665 graphs (--full-curve prints them)" in out.stdout
    best = next(line for line in out.stdout.splitlines() if "<- best in budget, not kept" in line)
    rows = [line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert max(int(line.split()[1]) for line in rows) <= 2 * int(best.split()[1])
    full = _optimize_qwen3(tmp_path, "--full-curve")
    assert "--full-curve prints them" not in full.stdout and " 665 " in full.stdout


def test_png_pictures_need_the_plot_extra(tmp_path):
    import importlib.util

    plan = ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"
    out = runner.invoke(app, ["show", str(plan), "--plot", str(tmp_path / "p.png")])
    if importlib.util.find_spec("matplotlib") is None:
        from capplan.install_hints import pip_install

        assert out.exit_code == 2 and pip_install("plot") in out.stderr
    else:
        assert out.exit_code == 0 and (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_picture_that_cannot_be_drawn_writes_nothing(tmp_path):
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        import pytest

        pytest.skip("matplotlib is installed: PNG pictures can be drawn")
    out = _optimize_qwen3(tmp_path, "--plot", str(tmp_path / "c.png"))
    assert out.exit_code == 2 and not any(tmp_path.iterdir())


def test_diff_of_a_spec_and_a_plan_says_to_compile_the_spec(tmp_path):
    spec, plan = ROOT / "configs" / "qwen3-8b-multilora.yaml", ROOT / "examples" / "h200-tiny-llama-025.plan.yaml"
    for args in (["diff", str(spec), str(plan)], ["diff", "--spec", str(plan), str(spec)]):
        out = runner.invoke(app, args)
        assert out.exit_code == 1, args
        assert out.stderr.strip().endswith(
            f"(compile the spec first (capplan compile {spec}) and compare the two plans)"
        )
    # Refusals of the picture exit 1 too: 2 is only ever "the plans differ".
    same = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
    out = runner.invoke(app, ["diff", str(same), str(same), "--plot", str(tmp_path / "d.pdf")])
    assert out.exit_code == 1 and "d.pdf" in out.stderr
