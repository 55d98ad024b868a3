"""The largest inputs capplan's readers admit, for timing what a user waits on in CI and
pre-commit: `verify` and `show --plot` of the largest tiered plan, `optimize --ready-share`
on its spec, `simulate` of a one-million-step recorded trace.

    python -m bench.largest DIR     # writes the inputs into DIR and prints the commands to time

The spec is the largest tiered one whose plan file loads (800 capture sizes, 256 adapters
with specialize_active: 16,578 graphs, 3.15M deferred fallbacks to prove); the traces are
seeded, so every run times the same files. Time the printed commands with farm-bench.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import yaml

SIZES = 800
SPEC = {
    "target": {"runner": "mrv2", "vllm": "0.25"},
    "scheduler": {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "max_model_len": 8192},
    "lora": {"enabled": True, "max_loras": 256, "specialize": True, "specialize_active": True},
    "cudagraph": {"mode": "FULL_AND_PIECEWISE", "capture_sizes": list(range(1, SIZES + 1))},
    "tiers": {"ready": "full_decode"},
}


def _ready_trace(path: Path, steps: int = 20_000) -> None:
    """Batches of the largest spec's deployment: up to 790 requests, decode or short chunks."""
    rng = random.Random(0)
    with path.open("w") as out:
        for _ in range(steps):
            reqs = rng.randint(1, SIZES - 10)
            query = 1 if rng.random() < 0.7 else rng.randint(2, 8)
            loras = rng.randint(0, min(reqs, 256))
            line = {"num_reqs": reqs, "num_tokens": reqs + query - 1, "max_query_len": query}
            out.write(json.dumps({**line, "num_active_loras": loras, "base": loras < reqs}) + "\n")


def _recorded_trace(path: Path, steps: int = 1_000_000) -> None:
    """A recorder's trace of a qwen3-8b-multilora deployment: one line a step, each with its `t`."""
    rng = random.Random(2)
    t = 0.0
    with path.open("w") as out:
        out.write("# capplan trace: a seeded stand-in for a recorded serve\n")
        for _ in range(steps):
            reqs = rng.randint(1, 256)
            loras = rng.randint(0, min(reqs, 8))
            t += rng.random() * 0.02
            line = {"num_reqs": reqs, "num_tokens": reqs, "max_query_len": 1, "num_active_loras": loras}
            out.write(json.dumps({**line, "base": loras < reqs, "t": round(t, 4)}) + "\n")


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    spec = folder / "largest.yaml"
    spec.write_text(yaml.safe_dump(SPEC, default_flow_style=True, width=10**9))
    capplan = str(Path(sys.executable).with_name("capplan"))
    subprocess.run([capplan, "compile", str(spec), "-o", str(folder / "largest.plan.yaml")], check=True)
    _ready_trace(folder / "ready.jsonl")
    _recorded_trace(folder / "recorded.jsonl")
    qwen = folder / "qwen3.plan.yaml"
    subprocess.run([capplan, "compile", str(root / "configs" / "qwen3-8b-multilora.yaml"), "-o", str(qwen)], check=True)
    for command in (
        f"capplan verify {folder}/largest.plan.yaml",
        f"capplan optimize {spec} {folder}/ready.jsonl --ready-share 0.9 -o {folder}/ready.yaml",
        f"capplan show {folder}/largest.plan.yaml --plot {folder}/largest.png",
        f"capplan simulate {qwen} {folder}/recorded.jsonl",
    ):
        print(command)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/capplan-largest"))
