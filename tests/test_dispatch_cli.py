"""`capplan dispatch` as a process: the typer-free fast path, its fallback, and the table cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capplan.cli import app
from capplan.dispatch_cache import cache_dir, load_dispatcher
from capplan.planner import Batch, Dispatcher, compile_plan
from capplan.planner.render import render_plan
from tests.conftest import make_spec

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
ARGS = ["--reqs", "3", "--tokens", "17", "--loras", "2", "--base"]


def _entry(args, env):
    code = "import sys; from capplan.entry import main; sys.argv = ['capplan', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT)


def _dispatch_probe(plan, env):
    """`capplan dispatch PLAN ARGS` in a process that then prints which heavy modules it imported."""
    code = ("import sys; from capplan.entry import main; sys.argv = ['capplan', 'dispatch', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('typer', 'pydantic', 'yaml', 'torch', 'vllm') if m in sys.modules))")
    return subprocess.run([sys.executable, "-c", code, str(plan), *ARGS], capture_output=True, text=True,
                          env=env, cwd=ROOT)


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "CAPPLAN_CACHE_DIR": str(tmp_path / "cache")}


def test_fast_path_prints_what_typer_prints_and_imports_neither_typer_nor_pydantic_when_cached(env, tmp_path):
    typer_out = CliRunner().invoke(app, ["dispatch", str(PLAN), *ARGS]).stdout
    first = _entry(["dispatch", str(PLAN), *ARGS], env)
    assert first.returncode == 0 and first.stdout == typer_out
    assert len(list((tmp_path / "cache").glob("dispatch-*.json"))) == 1
    again = _dispatch_probe(PLAN, env)
    assert again.stdout.startswith(typer_out) and again.stdout.strip().endswith("[]")


def test_json_and_queries_through_the_fast_path(env, tmp_path):
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"num_reqs": 4, "num_tokens": 4, "max_query_len": 1, "num_active_loras": 0}\n')
    out = _entry(["dispatch", str(PLAN), "--queries", str(queries)], env)
    typer_out = CliRunner().invoke(app, ["dispatch", str(PLAN), "--queries", str(queries)]).stdout
    assert out.returncode == 0 and out.stdout == typer_out
    js = _entry(["dispatch", str(PLAN), *ARGS, "--json"], env)
    assert json.loads(js.stdout)["num_active_loras"] == 4


def test_usage_errors_fall_back_to_typer_and_library_errors_stay_one_line(env):
    bad = _entry(["dispatch", str(PLAN), "--reqs", "x", "--tokens", "3"], env)
    assert bad.returncode == 2 and "Invalid value for '--reqs'" in bad.stderr  # typer's own message
    abbrev = _entry(["dispatch", str(PLAN), "--req", "3", "--tokens", "3"], env)
    assert abbrev.returncode == 2 and "No such option" in abbrev.stderr
    helped = _entry(["dispatch", "--help"], env)
    assert helped.returncode == 0 and "Which captured graph serves a batch" in helped.stdout
    missing = _entry(["dispatch", str(PLAN), "--reqs", "3"], env)
    assert missing.returncode == 2 and missing.stderr == "error: give --reqs and --tokens (or --queries FILE.jsonl)\n"
    nofile = _entry(["dispatch", "nope.plan.yaml", *ARGS], env)
    assert nofile.returncode == 1 and nofile.stderr.startswith("error: ") and nofile.stderr.count("\n") == 1


def test_cache_is_keyed_by_content_so_an_edited_plan_is_loaded_and_refused_in_full(env, tmp_path):
    plan = tmp_path / "p.plan.yaml"
    plan.write_text(PLAN.read_text())
    assert _entry(["dispatch", str(plan), *ARGS], env).returncode == 0
    plan.write_text(PLAN.read_text().replace("num_active_loras: 4", "num_active_loras: 2", 1))
    edited = _entry(["dispatch", str(plan), *ARGS], env)
    assert edited.returncode == 1 and "error: " in edited.stderr


def test_cached_tables_dispatch_exactly_like_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPPLAN_CACHE_DIR", str(tmp_path))
    spec = make_spec(scheduler={"max_num_seqs": 16, "max_num_batched_tokens": 96},
                     speculative={"num_speculative_tokens": 1}, target={"vllm": "0.25"},
                     lora={"enabled": True, "max_loras": 4, "specialize_active": True})
    plan = compile_plan(spec)
    path = tmp_path / "x.plan.yaml"
    path.write_text(render_plan(plan, "test"))
    load_dispatcher(path)  # fills the cache
    assert cache_dir() == tmp_path and len(list(tmp_path.glob("dispatch-*.json"))) == 1
    cached, direct = load_dispatcher(path), Dispatcher(plan)
    assert not hasattr(cached.plan, "graphs")  # really the light tables
    for r in range(1, 17):
        for t in range(r, 97):
            for k in range(0, min(r, 4) + 1):
                for base in (False, True):
                    b = Batch(r, t, -(-t // r), k, base and k < r)
                    assert cached.dispatch(b) == direct.dispatch(b)
                    assert cached.explain(b, []) == direct.explain(b, [])


def test_cache_keeps_only_the_newest_entries(tmp_path, monkeypatch):
    import capplan.dispatch_cache as cache

    monkeypatch.setenv("CAPPLAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "MAX_ENTRIES", 3)
    paths = []
    for seqs in range(4, 10):  # six different plans, each a new cache entry
        path = tmp_path / f"p{seqs}.plan.yaml"
        path.write_text(render_plan(compile_plan(make_spec(scheduler={"max_num_seqs": seqs})), "test"))
        load_dispatcher(path)
        paths.append(path)
        os.utime(sorted((tmp_path / "cache").glob("dispatch-*.json"), key=os.path.getmtime)[-1],
                 (1000 + seqs, 1000 + seqs))  # distinct, increasing mtimes
    kept = sorted(os.path.getmtime(p) for p in (tmp_path / "cache").glob("dispatch-*.json"))
    assert kept == [1007, 1008, 1009]  # the three newest
    stale, fresh = tmp_path / "cache" / ".dispatch-x.1.ab.tmp", tmp_path / "cache" / ".dispatch-y.2.cd.tmp"
    stale.write_text("{"), fresh.write_text("{")
    os.utime(stale, (1000, 1000))
    cache._evict(tmp_path / "cache")
    assert not stale.exists() and fresh.exists()  # an interrupted write's leftover, an hour old
    monkeypatch.setattr(cache, "_full", lambda _p: pytest.fail("the newest plan should be cached"))
    load_dispatcher(paths[-1])


def test_first_query_on_a_canonical_plan_reads_no_yaml(env):
    """An unseen plan that is byte-canonical is checked by recompiling its spec: no YAML parse, no typer."""
    first = _dispatch_probe(PLAN, {**env, "CAPPLAN_NO_CACHE": "1"})
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("graph #") and first.stdout.strip().endswith("['pydantic']")


def test_compile_stores_the_tables_so_the_first_dispatch_on_its_plan_loads_nothing(env, tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("lora: {enabled: true, max_loras: 4, specialize_active: true}\n")
    plan = tmp_path / "s.plan.yaml"
    made = _entry(["compile", str(spec), "-o", str(plan)], env)
    assert made.returncode == 0, made.stderr
    assert len(list((tmp_path / "cache").glob("dispatch-*.json"))) == 1
    first = _dispatch_probe(plan, env)
    assert first.returncode == 0 and first.stdout.strip().endswith("[]"), first.stderr  # served from the cache
    uncached = _entry(["dispatch", str(plan), *ARGS], {**env, "CAPPLAN_NO_CACHE": "1"})
    assert first.stdout.startswith(uncached.stdout) and uncached.stdout.startswith("graph #")
    # The stored entry answers for these exact bytes only: an edit is loaded, and refused, in full.
    plan.write_text(plan.read_text().replace("num_active_loras: 4", "num_active_loras: 2", 1))
    edited = _entry(["dispatch", str(plan), *ARGS], env)
    assert edited.returncode == 1 and "error: " in edited.stderr
    # An unchanged recompile stores it again (a cleared cache is refilled); CAPPLAN_NO_CACHE stores nothing.
    for entry in (tmp_path / "cache").glob("dispatch-*.json"):
        entry.unlink()
    assert _entry(["compile", str(spec), "-o", str(plan)], {**env, "CAPPLAN_NO_CACHE": "1"}).returncode == 0
    assert not list((tmp_path / "cache").glob("dispatch-*.json"))
    again = _entry(["compile", str(spec), "-o", str(plan)], env)
    assert again.returncode == 0 and "unchanged" in again.stderr
    assert len(list((tmp_path / "cache").glob("dispatch-*.json"))) == 1
