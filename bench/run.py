"""capplan vs vLLM's own MRV2 planning code, measured in one process.

    python -m bench                 # full run: small, typical, extreme specs
    python -m bench --quick         # fewer repeats and queries
    python -m bench --capplan-only  # no vLLM (smoke test)

vLLM's side is the real 0.33.0 code on CPU (the conformance oracle's venv,
prepared by tests/conformance/oracle/setup_oracle.sh); when vLLM is not
importable here the script re-runs itself in that venv. Prints a table and
writes JSON (bench/results.json by default).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORACLE_VERSION = "0.33.0"


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _reexec_in_oracle(oracle_dir: Path, argv: list[str], module: str = "bench") -> int:
    python = oracle_dir / "venv" / "bin" / "python"
    src = oracle_dir / "src" / ORACLE_VERSION
    if not python.exists() or not src.is_dir():
        print(
            f"error: vLLM {ORACLE_VERSION} is not importable and {oracle_dir} has no oracle venv "
            "(run: bash tests/conformance/oracle/setup_oracle.sh .cache/vllm-oracle), "
            "or pass --capplan-only",
            file=sys.stderr,
        )
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (src, ROOT / "src", ROOT))), "CAPPLAN_BENCH_CHILD": "1"}
    return subprocess.call([str(python), "-m", module, *argv], cwd=ROOT, env=env)


def add_oracle_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--oracle-dir", type=Path, default=Path(os.environ.get("CAPPLAN_ORACLE_DIR", ROOT / ".cache" / "vllm-oracle"))
    )


def run_in_oracle_if_needed(args, argv: list[str], module: str) -> int | None:
    """None when this process can go on (vLLM importable, or not wanted); else the exit code
    of the same command re-run in the oracle venv."""
    if args.capplan_only or _vllm_importable():
        return None
    if os.environ.get("CAPPLAN_BENCH_CHILD"):
        print("error: vLLM still not importable in the oracle venv", file=sys.stderr)
        return 2
    return _reexec_in_oracle(args.oracle_dir, argv, module)


def oracle_module(args):
    """tests/conformance/oracle/vllm_oracle (vLLM's own planning code), or None with --capplan-only."""
    if args.capplan_only:
        return None
    sys.path.insert(0, str(ROOT / "tests" / "conformance" / "oracle"))
    import vllm_oracle

    return vllm_oracle


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def _timed(fn) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# --- workloads ---------------------------------------------------------------


def realistic_queries(spec, count: int, seed: int = 0) -> list[tuple]:
    """(num_reqs, num_tokens, max_query_len, adapters, base, has_prefill): decode
    steps, mixed decode+prefill-chunk steps and lone prefill chunks, with LoRA mixes."""
    rng = random.Random(seed)
    seqs, budget = spec.scheduler.max_num_seqs, spec.scheduler.max_num_batched_tokens
    dql = spec.decode_query_len
    max_loras = spec.lora.max_loras if spec.lora.enabled else 0
    out = []
    while len(out) < count:
        kind = rng.random()
        if kind < 0.6:  # uniform decode step
            reqs = min(seqs, max(1, int(rng.expovariate(1 / max(seqs / 4, 1)))))
            tokens, mql, prefill = reqs * dql, dql, False
        elif kind < 0.9:  # decodes plus one prefill chunk
            reqs = rng.randint(2, max(2, seqs)) if seqs > 1 else 1
            chunk = rng.randint(2, max(2, budget - reqs))
            tokens = min(budget, reqs - 1 + chunk)
            mql, prefill = tokens - (reqs - 1), True
        else:  # a lone prefill chunk
            reqs, tokens = 1, rng.randint(1, budget)
            mql, prefill = tokens, True
        adapters = rng.randint(0, min(reqs, max_loras)) if max_loras else 0
        base = adapters < reqs and rng.random() < 0.5
        out.append((reqs, tokens, mql, adapters, base, prefill))
    return out


# --- sections ----------------------------------------------------------------


def bench_compile(spec_data: dict, repeats: int, vllm_side) -> dict:
    from capplan.loading import spec_from_data
    from capplan.planfile import render_plan
    from capplan.planner import compile_plan

    def capplan_compile():
        render_plan(compile_plan(spec_from_data(spec_data, "bench")), "bench.yaml")

    normalized = spec_from_data(spec_data, "bench").model_dump(mode="json")
    ours, theirs = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        ours.append(_timed(capplan_compile))
        if vllm_side:
            theirs.append(_timed(lambda: vllm_side.build_manager(normalized)))
    result = {"capplan_s": _stats(ours)}
    if theirs:
        result["vllm_s"] = _stats(theirs)
        result["ratio"] = result["capplan_s"]["median"] / result["vllm_s"]["median"]
    return result


def bench_dispatch(spec_data: dict, count: int, repeats: int, vllm_side) -> dict:
    from capplan.loading import spec_from_data
    from capplan.planner import Batch, Dispatcher, compile_plan

    spec = spec_from_data({**spec_data, "fixes": []}, "bench")
    fixed_spec = spec_from_data(spec_data, "bench")
    queries = realistic_queries(spec, count)
    batches = [Batch(r, t, q, k, b, p) for r, t, q, k, b, p in queries]
    exact, fixed = Dispatcher(compile_plan(spec)), Dispatcher(compile_plan(fixed_spec))

    def run(dispatcher):
        dispatch = dispatcher.dispatch
        return lambda: [dispatch(b) for b in batches]

    def lookup_only():
        # Where the time goes: the same loop without the candidate walk.
        case_of, table = exact.case_of, exact.table
        for b in batches:
            k = b.num_active_loras
            table.get(case_of[k] if k < len(case_of) else k)

    result: dict = {
        "queries": count,
        "eager_share": sum(exact.dispatch(b).cg_mode == "NONE" for b in batches) / count,
    }
    runs = {"capplan_ns": run(exact), "capplan_fixed_plan_ns": run(fixed), "capplan_loop_and_lookup_ns": lookup_only}
    if vllm_side is not None:
        manager = vllm_side.build_manager(spec.model_dump(mode="json")).manager
        derive = vllm_side.uniform_rule()
        args = [(r, t, q, k, p) for r, t, q, k, _, p in queries]

        def vllm_run():
            dispatch = manager.dispatch
            return [
                dispatch(r, t, derive(r, t, q, p), num_active_loras=k, max_query_len=None if p else q)
                for r, t, q, k, p in args
            ]

        def vllm_derive_only():
            for r, t, q, _, p in args:
                derive(r, t, q, p)

        theirs = vllm_run()
        ours = run(exact)()
        mismatches = sum(
            1
            for a, b in zip(ours, theirs)
            if (a.cg_mode, a.num_tokens, a.num_reqs, a.uniform_token_count, a.num_active_loras)
            != (b.cg_mode.name, b.num_tokens, b.num_reqs, b.uniform_token_count, b.num_active_loras)
        )
        result["identical_results"] = mismatches == 0
        result["mismatches"] = mismatches
        runs.update({"vllm_ns": vllm_run, "vllm_uniform_rule_ns": vllm_derive_only})
    # Interleaved: each repeat times every variant once, so a slow spell of
    # this shared machine lands on both sides of the ratio alike.
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            samples[name].append(_timed(fn) / count * 1e9)
    result.update({name: _stats(values) for name, values in samples.items()})
    if vllm_side is not None:
        result["ratio"] = result["capplan_ns"]["median"] / result["vllm_ns"]["median"]
    return result


def bench_load_verify(spec_data: dict, repeats: int) -> dict:
    from capplan.analysis.verify import verify_plan
    from capplan.loading import spec_from_data
    from capplan.planfile import load_plan, render_plan
    from capplan.planner import compile_plan

    plan = compile_plan(spec_from_data(spec_data, "bench"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.plan.yaml"
        path.write_text(render_plan(plan, "bench.yaml"))
        load = [_timed(lambda: load_plan(path)) for _ in range(repeats)]
        size = path.stat().st_size
    report = verify_plan(plan)
    verify = [_timed(lambda: verify_plan(plan)) for _ in range(max(1, repeats // 3))]
    return {
        "plan_bytes": size,
        "graphs": len(plan.graphs),
        "load_s": _stats(load),
        "verify_s": _stats(verify),
        "verify_ok": report.ok,
    }


def bench_cli(repeats: int) -> dict:
    """Whole-process wall time of the CLI, with the environment a user has."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CAPPLAN_BENCH_CHILD")}
    exe = shutil.which("capplan", path=str(ROOT / ".venv" / "bin")) or shutil.which("capplan")
    if exe is None:
        return {"skipped": "no capplan command found (pip install -e .)"}
    python = str(Path(exe).with_name("python"))
    # `pip install` byte-compiles a package; an editable install writes its
    # bytecode on first import, unless PYTHONDONTWRITEBYTECODE is set (as on
    # some CI and sandbox machines), when every process would compile
    # capplan's source again. Time what an installed capplan does.
    package = subprocess.run(
        [python, "-c", "import capplan, os; print(os.path.dirname(capplan.__file__))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    compiled = subprocess.run(
        [python, "-m", "compileall", "-q", "--invalidation-mode", "timestamp", package],
        env=env,
        capture_output=True,
        text=True,
    )
    bytecode = (
        "compiled, as pip install leaves it"
        if compiled.returncode == 0
        else f"not compiled ({package} not writable): every process compiles capplan's source"
    )
    plan = ROOT / "examples" / "qwen3-8b-multilora.plan.yaml"
    dispatch = [exe, "dispatch", str(plan), "--reqs", "3", "--tokens", "17", "--loras", "2", "--base"]
    commands = {
        "capplan --help": ([exe, "--help"], env),
        # Every query loads the plan: YAML, spec validation, compile, comparison.
        "capplan dispatch": (dispatch, env),
        "capplan compile --check": (
            [
                exe,
                "compile",
                str(ROOT / "configs" / "qwen3-8b-multilora.yaml"),
                "--plan-dir",
                str(ROOT / "examples"),
                "--check",
            ],
            env,
        ),
        # Where a dispatch's time goes: the interpreter alone, and the
        # import of pydantic plus capplan's schema classes (no work done).
        "  floor: python -c pass": ([python, "-c", "pass"], env),
        "  floor: import schemas": ([python, "-c", "import capplan.schemas.plan"], env),
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):  # interleaved, so the machine's drift hits every command alike
        for name, (cmd, cmd_env) in commands.items():
            start = time.perf_counter()
            subprocess.run(cmd, env=cmd_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            samples[name].append(time.perf_counter() - start)
    out: dict = {name: _stats(values) for name, values in samples.items()}
    out["bytecode"] = bytecode
    probe = subprocess.run(
        [
            python,
            "-c",
            "import sys\nfrom capplan.cli import app\n"
            "try:\n    app(['dispatch', sys.argv[1], '--reqs', '1', '--tokens', '1'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'vllm', 'triton') if m in sys.modules))",
            str(plan),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    out["heavy_modules_imported"] = json.loads(probe.stdout.strip().splitlines()[-1].replace("'", '"'))
    return out


# --- report --------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _range_ms(st: dict) -> str:
    return f"{_ms(st['median'])} ({st['min'] * 1e3:.1f}-{st['max'] * 1e3:.1f})"


def _range_ns(st: dict) -> str:
    return f"{st['median']:.0f} ns ({st['min']:.0f}-{st['max']:.0f})"


def render_table(results: dict) -> str:
    lines = [
        f"capplan benchmark on {results['machine']} (vLLM {results.get('vllm', 'not run')}); "
        "medians with (min-max) over repeats",
        "",
    ]
    head = f"{'spec':<9} {'measure':<26} {'capplan':>26} {'vLLM':>26} {'ratio':>7}"
    lines += [head, "-" * len(head)]
    for name, r in results["specs"].items():
        c = r["compile"]
        lines.append(
            f"{name:<9} {'compile (spec -> plan)':<26} {_range_ms(c['capplan_s']):>26} "
            f"{_range_ms(c['vllm_s']) if 'vllm_s' in c else '-':>26} " + (f"{c['ratio']:.2f}x" if "ratio" in c else "")
        )
        d = r["dispatch"]
        lines.append(
            f"{'':<9} {'dispatch per call':<26} {_range_ns(d['capplan_ns']):>26} "
            f"{_range_ns(d['vllm_ns']) if 'vllm_ns' in d else '-':>26} "
            + (f"{d['ratio']:.2f}x" if "ratio" in d else "")
        )
        if "identical_results" in d:
            verdict = "yes" if d["identical_results"] else "NO ({} differ)".format(d["mismatches"])
            lines.append(f"{'':<9} {'  same result as vLLM':<26} {verdict:>26}   ({d['queries']} queries)")
        lines.append(
            f"{'':<9} {'  loop + table lookup':<26} {_range_ns(d['capplan_loop_and_lookup_ns']):>26}"
            + (f" {_range_ns(d['vllm_uniform_rule_ns']):>26} (uniform rule)" if "vllm_uniform_rule_ns" in d else "")
        )
        lv = r["load_verify"]
        lines.append(
            f"{'':<9} {'load plan ({} KiB)'.format(lv['plan_bytes'] // 1024):<26} {_range_ms(lv['load_s']):>26}"
        )
        lines.append(
            f"{'':<9} {'verify ({} graphs)'.format(lv['graphs']):<26} {_range_ms(lv['verify_s']):>26}"
            f"   {'ok' if lv['verify_ok'] else 'VIOLATIONS'}"
        )
    cli = results.get("cli", {})
    for name, st in cli.items():
        if isinstance(st, dict) and "median" in st:
            lines.append(f"{'cli':<9} {name:<26} {_range_ms(st):>26}")
    if "bytecode" in cli:
        lines.append(f"{'cli':<9} {'  capplan bytecode':<26} {cli['bytecode']:>26}")
    if "heavy_modules_imported" in cli:
        lines.append(f"{'cli':<9} {'torch/vllm imported':<26} {str(cli['heavy_modules_imported'] or 'none'):>26}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats and 20k dispatch queries")
    parser.add_argument("--capplan-only", action="store_true", help="skip vLLM (no ratios)")
    parser.add_argument("--specs", default="small,typical,extreme", help="comma-separated: small,typical,extreme")
    parser.add_argument("--queries", type=int, default=None, help="dispatch queries (default 100000)")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results.json", help="where to write JSON")
    add_oracle_option(parser)
    args = parser.parse_args(argv)
    code = run_in_oracle_if_needed(args, argv, "bench")
    if code is not None:
        return code

    from bench.specs import SPECS

    vllm_side = oracle_module(args)
    repeats = 5 if args.quick else 30
    count = args.queries or (20_000 if args.quick else 100_000)
    results: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "specs": {},
    }
    if vllm_side is not None:
        results["vllm"] = vllm_side.VLLM_VERSION
    for name in args.specs.split(","):
        spec_data = SPECS[name]
        print(f"[bench] {name}: compile", file=sys.stderr, flush=True)
        entry = {"compile": bench_compile(spec_data, repeats, vllm_side)}
        print(f"[bench] {name}: dispatch ({count} queries)", file=sys.stderr, flush=True)
        entry["dispatch"] = bench_dispatch(spec_data, count, 9 if not args.quick else 3, vllm_side)
        print(f"[bench] {name}: load and verify", file=sys.stderr, flush=True)
        entry["load_verify"] = bench_load_verify(spec_data, 5 if args.quick else 10)
        results["specs"][name] = entry
    print("[bench] CLI start", file=sys.stderr, flush=True)
    results["cli"] = bench_cli(3 if args.quick else 10)
    table = render_table(results)
    sys.stdout.write(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"[bench] wrote {args.json}", file=sys.stderr)
    mismatched = any(not r["dispatch"].get("identical_results", True) for r in results["specs"].values())
    return 1 if mismatched else 0
