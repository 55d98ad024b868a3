"""The vLLM command line a plan was compiled for: read it, refuse what contradicts the plan,
add what the plan determines and the command leaves out, and print it for other launchers.

Reads the flags of `vllm serve MODEL ...` and `python -m vllm.entrypoints.openai.api_server
...` the way vLLM's argument parser does (`--flag value`, `--flag=value`, `--no-flag`,
JSON for `--compilation-config`/`-cc` and `--speculative-config`/`-sc`, dotted keys such
as `-cc.cudagraph_mode=FULL`, the human-readable integers 1k/1K of the token limits).
Nothing here imports vLLM: `capplan apply` checks a launch in well under a second, before
anything starts. What only vLLM resolves (a model's own defaults, a `--config` file) is
left to the in-engine check, which still refuses a mismatch before capture.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from capplan.errors import CapplanError, printable
from capplan.files import json_depth
from capplan.limits import MAX_DEPTH, MAX_INT_DIGITS
from capplan.runtime.vllm_cli import Resolved
from capplan.schemas.plan import Plan

SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.main")

# vLLM flag (and its short alias) -> (the plan setting it sets, the kind of value it takes).
SCALARS: dict[str, tuple[str, str]] = {
    "--max-num-seqs": ("scheduler.max_num_seqs", "int"),
    "--max-num-batched-tokens": ("scheduler.max_num_batched_tokens", "human_int"),
    "--max-model-len": ("scheduler.max_model_len", "human_int"),
    "--max-loras": ("lora.max_loras", "int"),
    "--data-parallel-size": ("parallel.data_parallel_size", "int"),
    "--tensor-parallel-size": ("parallel.tensor_parallel_size", "int"),
    "--pipeline-parallel-size": ("parallel.pipeline_parallel_size", "int"),
    "--max-cudagraph-capture-size": ("cudagraph.max_capture_size", "int"),
}
SHORT = {"-dp": "--data-parallel-size", "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
SWITCHES: dict[str, str] = {
    "--enable-lora": "lora.enabled",
    "--specialize-active-lora": "lora.specialize_active",
    "--enable-tower-connector-lora": "multimodal.tower_connector_lora",
    "--enforce-eager": "enforce_eager",
}
JSON_ARGS = {
    "--compilation-config": "compilation",
    "-cc": "compilation",
    "--speculative-config": "speculative",
    "-sc": "speculative",
}
# compilation-config key -> plan setting
COMPILATION: dict[str, str] = {
    "cudagraph_mode": "cudagraph.mode",
    "cudagraph_capture_sizes": "cudagraph.capture_sizes",
    "max_cudagraph_capture_size": "cudagraph.max_capture_size",
    "cudagraph_specialize_lora": "lora.specialize",
    "cudagraph_mm_encoder": "multimodal.encoder_cudagraphs",
    "encoder_cudagraph_token_budgets": "multimodal.token_budgets",
    "encoder_cudagraph_max_vision_items_per_batch": "multimodal.max_vision_items_per_batch",
    "encoder_cudagraph_max_frames_per_batch": "multimodal.max_frames_per_batch",
}
SIZES_FLAG = "--cudagraph-capture-sizes"


def human_int(text: str) -> int:
    """vLLM's human-readable integers: 4096, 1k (1000), 1K (1024), 25.6k."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text.strip())
    if not match or len(match.group(1)) > MAX_INT_DIGITS:
        raise ValueError(text)
    number, suffix = match.groups()
    if not suffix:
        return int(number)
    scale = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}.get(suffix) or 2 ** (10 * "KMGT".index(suffix) + 10)
    return int(float(number) * scale)


@dataclass
class Command:
    """A vLLM server command line as capplan reads it."""

    argv: list[str]
    start: int  # index of the first engine argument (after `serve MODEL` or `-m MODULE`)
    values: dict[str, object] = field(default_factory=dict)  # plan setting -> the command's value
    flags: dict[str, str] = field(default_factory=dict)  # plan setting -> how the command set it
    json_at: dict[str, int] = field(default_factory=dict)  # "compilation"/"speculative" -> index of its JSON
    dotted: set[str] = field(default_factory=set)  # JSON args given as dotted keys
    unread: list[str] = field(default_factory=list)  # what capplan did not read (e.g. --config FILE)
    resolved: Resolved | None = None  # vLLM's own reading of the command, when vLLM was importable


def server_start(argv: list[str]) -> int | None:
    """Where the engine arguments begin in a vLLM server command, or None when `argv` is not one."""
    if not argv:
        return None
    name = Path(argv[0]).name
    if name == "vllm" and len(argv) > 1 and argv[1] == "serve":
        return 3 if len(argv) > 2 and not argv[2].startswith("-") else 2
    if name.startswith("python") and "-m" in argv:
        at = argv.index("-m")
        if at + 1 < len(argv) and argv[at + 1] in SERVER_MODULES:
            rest = at + 2
            if argv[at + 1] == "vllm.entrypoints.cli.main":
                if rest >= len(argv) or argv[rest] != "serve":
                    return None
                rest += 1
                return rest + 1 if rest < len(argv) and not argv[rest].startswith("-") else rest
            return rest
    return None


def read_command(argv: list[str]) -> Command | None:
    """The plan settings a vLLM server command sets, or None when `argv` is not a vLLM server command.
    CapplanError names a flag whose value vLLM itself would refuse."""
    start = server_start(argv)
    if start is None:
        return None
    cmd = Command(list(argv), start)
    i = start
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        name = SHORT.get(name, name)

        def value(name: str = name, eq: str = eq, inline: str = inline, i: int = i) -> str:
            if eq:
                return inline
            if i + 1 >= len(argv):
                raise CapplanError(f"{printable(name)} needs a value")
            return argv[i + 1]

        step = 1 if eq else 2
        if name in SCALARS:
            key, kind = SCALARS[name]
            raw = value()
            if key == "scheduler.max_model_len" and raw in ("auto", "-1"):
                cmd.unread.append(f"{name} {raw}")
            else:
                number = _integer(name, raw, kind)
                cmd.values[key] = number
                written = token.partition("=")[0]  # as the user wrote it (-tp, not --tensor-parallel-size)
                cmd.flags[key] = f"{written} {raw}" + (f" (vLLM reads {number})" if raw.strip() != str(number) else "")
            i += step
        elif name in SWITCHES or (name.startswith("--no-") and "--" + name[5:] in SWITCHES):
            on = not name.startswith("--no-")
            key = SWITCHES[name if on else "--" + name[5:]]
            cmd.values[key] = on
            cmd.flags[key] = name
            i += 1
        elif name == SIZES_FLAG:
            j = i + 1
            sizes = [inline] if eq else []
            while not eq and j < len(argv) and re.fullmatch(r"\d+", argv[j]):
                sizes.append(argv[j])
                j += 1
            if not sizes:
                raise CapplanError(f"{SIZES_FLAG} needs one or more token counts")
            cmd.values["cudagraph.capture_sizes"] = sorted({_integer(name, s, "int") for s in sizes})
            cmd.flags["cudagraph.capture_sizes"] = f"{SIZES_FLAG} {' '.join(sizes)}"
            i = j if not eq else i + 1
        elif name in JSON_ARGS:
            which = JSON_ARGS[name]
            raw = value()
            try:
                data = _json(name, raw)
            except ValueError:
                raise CapplanError(f"{name}: not JSON ({printable(raw[:60])})", "give a JSON object") from None
            if not isinstance(data, dict):
                raise CapplanError(f"{name}: not a JSON object", "give a JSON object")
            cmd.json_at[which] = i + (0 if eq else 1)
            _read_json(cmd, which, data, name)
            i += step
        elif "." in name and name.split(".", 1)[0] in JSON_ARGS:
            head, _, key = name.partition(".")
            which = JSON_ARGS[head]
            if key.count(".") >= MAX_DEPTH:
                raise CapplanError(f"{printable(name)[:60]}...: dotted key deeper than {MAX_DEPTH} levels")
            raw = value()
            try:
                parsed: object = _json(name, raw)
            except ValueError:
                parsed = raw
            cmd.dotted.add(which)
            _read_json(cmd, which, {key: parsed}, head, dotted=True)
            i += step
        elif name == "--config":
            cmd.unread.append(f"--config {value()}")
            i += step
        elif token.startswith("-") and not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            i += 2  # another flag with its value (--port 8000)
        else:
            i += 1
    return cmd


def _dest(flag: str) -> str:
    """The EngineArgs field a flag sets: vLLM names each after its flag."""
    return flag[2:].replace("-", "_")


# EngineArgs field -> (plan setting, the flag that sets it), from the tables above.
RESOLVED: dict[str, tuple[str, str]] = {
    **{_dest(flag): (key, flag) for flag, (key, _) in SCALARS.items()},
    **{_dest(flag): (key, flag) for flag, key in SWITCHES.items()},
    _dest(SIZES_FLAG): ("cudagraph.capture_sizes", SIZES_FLAG),
}


def read_with_vllm(python: str, argvs: list[list[str]], env: dict[str, str]) -> list[dict] | None:
    """vLLM's own reading of server commands (one run of `python`, vLLM imported once); None
    when vLLM is not importable there. Each result goes to `prepare(..., resolution=)`."""
    from capplan.runtime.vllm_cli import resolve_lines

    keys = (*COMPILATION, "mode")
    fields = (*RESOLVED, "optimization_level", "spec_tokens", "spec_method")
    return resolve_lines(python, [parser_args(a) for a in argvs], env, fields, keys)


def read_resolved(argv: list[str], resolved: Resolved) -> Command:
    """The plan settings the operator gave, as vLLM's own parser resolved the command (a
    `--config` file included): only what the operator gave counts, each named by its flag and,
    for a value from the file, the file."""
    start = server_start(argv)
    assert start is not None
    cmd = Command(list(argv), start)
    try:  # where the command's own JSON sits, for complete() to merge into it
        syntax = read_command(argv)
    except CapplanError:
        syntax = None
    if syntax is not None:
        cmd.json_at, cmd.dotted = syntax.json_at, syntax.dotted
    config = next((a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                   if (a == "--config" and i + 1 < len(argv)) or a.startswith("--config=")), None)  # fmt: skip

    def where(dest: str) -> str:
        return f" (in --config {printable(config or '?')})" if dest in resolved.from_config else ""

    for dest, (key, flag) in RESOLVED.items():
        if dest not in resolved.given:
            continue
        value = resolved.values.get(dest)
        if key == "scheduler.max_model_len" and (not isinstance(value, int) or value < 0):
            cmd.unread.append(f"{flag} {value}")  # vLLM takes it from the model
            continue
        if key == "cudagraph.capture_sizes" and isinstance(value, list):
            value = sorted(set(value))
        cmd.values[key] = value
        cmd.flags[key] = f"{flag} {_short(value)}{where(dest)}"
    cc_where = where("compilation_config")
    for name in resolved.compilation_given() & set(COMPILATION):
        value = resolved.compilation.get(name)
        if value is None:
            continue
        if name in ("cudagraph_capture_sizes", "encoder_cudagraph_token_budgets") and isinstance(value, list):
            value = sorted(set(value)) if name == "cudagraph_capture_sizes" else sorted(value)
        cmd.values[COMPILATION[name]] = value
        cmd.flags[COMPILATION[name]] = f"--compilation-config {name} {_short(value)}{cc_where}"
    level = resolved.values.get("optimization_level")
    if "optimization_level" in resolved.given and resolved.level_mode and "cudagraph.mode" not in cmd.values:
        # an -O level sets the cudagraph mode where none is given: the operator's choice, as vLLM reads it
        cmd.values["cudagraph.mode"] = resolved.level_mode
        cmd.flags["cudagraph.mode"] = (
            f"-O{str(level).lstrip('O')} (vLLM's optimization level: cudagraph mode {resolved.level_mode})"
            + where("optimization_level")
        )
    if "spec_tokens" in resolved.given or "spec_method" in resolved.given:
        cmd.values["speculative.present"] = True
        k = resolved.values.get("spec_tokens")
        if k is not None:
            cmd.values["speculative.num_speculative_tokens"] = k
            cmd.flags["speculative.num_speculative_tokens"] = f"--spec-tokens {k}{where('spec_tokens')}"
    if "speculative_config" in resolved.given and resolved.speculative is not None:
        cmd.values["speculative.present"] = True
        k = resolved.speculative.get("num_speculative_tokens")
        if k is not None:
            cmd.values["speculative.num_speculative_tokens"] = k
            cmd.flags["speculative.num_speculative_tokens"] = (
                f"--speculative-config num_speculative_tokens {k}{where('speculative_config')}"
            )
    if any(a.startswith("--config=") for a in argv):
        cmd.unread.append("--config=FILE (vLLM reads a config file only as `--config FILE`: it ignores this one)")
    cmd.resolved = resolved
    return cmd


def _integer(flag: str, raw: str, kind: str) -> int:
    try:
        if len(raw.strip()) > MAX_INT_DIGITS + 1:
            raise ValueError(raw)
        return human_int(raw) if kind == "human_int" else int(raw)
    except ValueError:
        raise CapplanError(
            f"{flag} {printable(raw)[:40]}: not an integer of at most {MAX_INT_DIGITS} digits",
            "give a count, e.g. 4096" + (" or 4k" if kind == "human_int" else ""),
        ) from None


def _json(flag: str, raw: str) -> object:
    """A JSON value of the command line, bounded as capplan's readers bound JSON (nesting,
    integer digits); ValueError when it is not JSON. Duplicate keys keep the last, as vLLM's
    json.loads does."""
    if raw.count("[") + raw.count("{") > MAX_DEPTH and json_depth(raw) > MAX_DEPTH:
        raise CapplanError(f"{flag}: JSON nested deeper than {MAX_DEPTH} levels", "give a flat JSON object")
    try:
        return _BOUNDED_JSON.decode(raw)
    except RecursionError:
        raise CapplanError(f"{flag}: JSON nested too deeply", "give a flat JSON object") from None
    except CapplanError as exc:
        raise CapplanError(f"{printable(flag)[:60]}: {exc.message}", exc.hint) from None


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise CapplanError(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})", "give a count")
    return int(text)


_BOUNDED_JSON = json.JSONDecoder(parse_int=_bounded_int)

# What each JSON key capplan reads must hold, as vLLM's config classes type it: a wrong type
# is refused by vLLM too, so it is refused here, naming the key, before anything starts.
_KINDS: dict[str, str] = {
    "cudagraph_mode": "mode",
    "cudagraph_capture_sizes": "int_list",
    "max_cudagraph_capture_size": "int",
    "cudagraph_specialize_lora": "bool",
    "cudagraph_mm_encoder": "bool",
    "encoder_cudagraph_token_budgets": "int_list",
    "encoder_cudagraph_max_vision_items_per_batch": "int",
    "encoder_cudagraph_max_frames_per_batch": "int",
    "num_speculative_tokens": "int",
}
_KIND_WORDS = {
    "mode": "a cudagraph mode name or number",
    "int_list": "a list of integers",
    "int": "an integer",
    "bool": "true or false",
}


def _typed(where: str, key: str, got: object) -> object:
    """`got`, when it has the type vLLM gives `key` (null: vLLM's default); else CapplanError."""
    kind = _KINDS[key]
    if got is None:
        return None

    def is_int(v: object) -> bool:
        return type(v) is int

    ok = {
        "mode": isinstance(got, str) or is_int(got),
        "int_list": isinstance(got, list) and all(is_int(v) for v in got),
        "int": is_int(got),
        "bool": isinstance(got, bool),
    }[kind]
    if not ok:
        raise CapplanError(
            f"{where}: must be {_KIND_WORDS[kind]} (got {printable(json.dumps(got))[:40]})",
            "vLLM refuses this value too; fix it in the command",
        )
    return got


def _read_json(cmd: Command, which: str, data: dict, flag: str, dotted: bool = False) -> None:
    def shown(key: str) -> str:
        return f"{flag}.{key}" if dotted else f"{flag} {key}"

    if which == "speculative":
        if "num_speculative_tokens" in data:
            got = _typed(shown("num_speculative_tokens"), "num_speculative_tokens", data["num_speculative_tokens"])
            cmd.values["speculative.num_speculative_tokens"] = got
            cmd.flags["speculative.num_speculative_tokens"] = shown("num_speculative_tokens")
        cmd.values.setdefault("speculative.present", True)
        return
    for key, setting in COMPILATION.items():
        if key in data:
            got = _typed(shown(key), key, data[key])
            if key == "cudagraph_capture_sizes" and isinstance(got, list):
                got = sorted(set(got))
            if key == "encoder_cudagraph_token_budgets" and isinstance(got, list):
                got = sorted(got)
            cmd.values[setting] = got
            cmd.flags[setting] = f"{shown(key)} {_short(got)}"


def plan_values(plan: Plan) -> dict[str, object]:
    """The settings of vLLM's command line a plan determines."""
    spec = plan.spec
    out: dict[str, object] = {
        "scheduler.max_num_seqs": spec.scheduler.max_num_seqs,
        "scheduler.max_num_batched_tokens": spec.scheduler.max_num_batched_tokens,
        "scheduler.max_model_len": spec.scheduler.max_model_len,
        "parallel.data_parallel_size": spec.parallel.data_parallel_size,
        "cudagraph.mode": spec.cudagraph.mode.value,
        "cudagraph.capture_sizes": plan.capture_sizes,
        "lora.enabled": spec.lora.enabled,
        "lora.specialize": spec.lora.specialize,
        "speculative.num_speculative_tokens": spec.speculative.num_speculative_tokens,
    }
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = getattr(spec.parallel, name)
        if size is not None:
            out[f"parallel.{name}"] = size
    if spec.lora.enabled:
        out["lora.max_loras"] = spec.lora.max_loras
        out["lora.specialize_active"] = spec.lora.specialize_active
    mm = spec.multimodal
    if mm is not None:
        out["multimodal.tower_connector_lora"] = mm.tower_connector_lora
        if spec.rules.encoder_graphs:
            out["multimodal.encoder_cudagraphs"] = mm.encoder_cudagraphs
            if mm.encoder_cudagraphs and mm.token_budgets:
                out["multimodal.token_budgets"] = sorted(mm.token_budgets)
            if mm.encoder_cudagraphs and mm.max_vision_items_per_batch:
                out["multimodal.max_vision_items_per_batch"] = mm.max_vision_items_per_batch
    return out


def contradictions(plan: Plan, cmd: Command) -> list[str]:
    """Each flag of the command that contradicts the plan, as 'FLAG sets X, the plan Y'."""
    want = plan_values(plan)
    out = []
    for key, have in cmd.values.items():
        if key == "enforce_eager":
            if have and want["cudagraph.mode"] != "NONE":
                out.append(f"--enforce-eager runs no CUDA graph, the plan cudagraph.mode {want['cudagraph.mode']}")
            continue
        if key == "cudagraph.max_capture_size":  # not a plan value of its own: the plan's largest graph
            if have != plan.max_capture_size:
                out.append(f"{cmd.flags[key]}: the plan's largest graph is {plan.max_capture_size} tokens")
            continue
        if key == "speculative.present" or key not in want:
            continue
        if have != want[key]:
            out.append(f"{cmd.flags[key]}: the plan has {key} {_short(want[key])}")
    if plan.tiers is not None:
        for key in ("parallel.tensor_parallel_size", "parallel.pipeline_parallel_size"):
            size = cmd.values.get(key)
            if isinstance(size, int) and size > 1 and key not in want:
                out.append(
                    f"{cmd.flags[key]}: the plan defers graphs (spec tiers), which capplan does not do under tensor "
                    "or pipeline parallelism"
                )
    k = plan.spec.speculative.num_speculative_tokens
    if k and "speculative.num_speculative_tokens" not in cmd.values:
        out.append(
            f"the plan needs {k} speculative token(s): add --speculative-config with your draft method and "
            f'"num_speculative_tokens": {k}'
        )
    return out


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, list | bool) else str(value)
    return text if len(text) <= 50 else text[:47] + "..."


def complete(plan: Plan, cmd: Command) -> tuple[list[str], list[str]]:
    """(the command with what the plan determines and it leaves out, what was added)."""
    want = plan_values(plan)
    argv = list(cmd.argv)
    added: list[str] = []
    for flag, (key, _) in SCALARS.items():
        if key in want and key not in cmd.values:
            added += [flag, str(want[key])]
    for flag, key in SWITCHES.items():
        if key in want and key not in cmd.values and (want[key] or key == "lora.specialize_active"):
            added.append(flag if want[key] else "--no-" + flag[2:])
    missing = {name: want[s] for name, s in COMPILATION.items() if s in want and s not in cmd.values}
    if "cudagraph.max_capture_size" in cmd.values:
        missing.pop("cudagraph_capture_sizes", None)  # vLLM derives the sizes from the ceiling given
    merged: list[str] = []  # keys put into the command's own --compilation-config JSON
    given = cmd.resolved.json_keys.get("compilation_config", []) if cmd.resolved is not None else []
    from_file = cmd.resolved is not None and "compilation_config" in cmd.resolved.from_config
    here = "compilation" in cmd.json_at or "compilation" in cmd.dotted  # capplan's reader found it on the line
    if missing and (from_file or (given and not here)):
        # vLLM keeps the last compilation config it is given: one more would replace the operator's, so
        # capplan merges only into the last JSON object (or the dotted keys) it finds on the line
        raise CapplanError(
            f"the plan needs {', '.join(f'{k} {_short(v)}' for k, v in missing.items())} in the compilation config, "
            "which the command gives "
            + ("in its --config file" if from_file else "in a spelling capplan does not merge into"),
            "add them where the command sets its compilation config (capplan never replaces it)",
        )
    if missing and "compilation" in cmd.json_at:
        at = cmd.json_at["compilation"]
        head, eq, text = argv[at].partition("=") if argv[at].startswith("-") else ("", "", argv[at])
        joined = json.dumps({**json.loads(text), **missing}, separators=(",", ":"))
        argv[at] = f"{head}={joined}" if eq else joined
        merged = [f"{k} (in {head or argv[at - 1]})" for k in missing]
    elif missing and "compilation" in cmd.dotted:
        added += [f"-cc.{k}={json.dumps(v, separators=(',', ':'))}" for k, v in missing.items()]
    elif missing:
        added += ["--compilation-config", json.dumps(missing, separators=(",", ":"))]
    return argv + added, added + merged


def flags_for(plan: Plan) -> list[str]:
    """The vLLM engine arguments that match a plan, in `vllm serve` form."""
    return complete(plan, Command(["vllm", "serve", "MODEL"], 3))[0][3:]


def render(plan: Plan, form: str, plan_path: str = "PLAN") -> str:
    """`capplan flags`: the arguments as `vllm serve`, `python -m ...api_server` or JSON (one
    entry per argument, for manifests). The two command forms are whole shell lines: the
    spec's model (MODEL when it names none) and CAPPLAN_PLAN, which puts the plan in force."""
    args = flags_for(plan)
    note = ""
    k = plan.spec.speculative.num_speculative_tokens
    if k:
        note = f'# and --speculative-config with your draft method and "num_speculative_tokens": {k}\n'
    if form == "json":
        return json.dumps(args, indent=2)
    model = plan.spec.model.name if plan.spec.model is not None and plan.spec.model.name else "MODEL"
    env = [f"CAPPLAN_PLAN={plan_path}"]
    if form == "python":
        return note + shlex.join([*env, "python", "-m", "vllm.entrypoints.openai.api_server", "--model", model, *args])
    return note + shlex.join([*env, "vllm", "serve", model, *args])


def parser_args(argv: list[str]) -> list[str]:
    """The arguments vLLM's server parser reads from a server command (`vllm serve`'s model first)."""
    name = Path(argv[0]).name
    if name == "vllm":
        return argv[2:]
    at = argv.index("-m")
    rest = argv[at + 2 :]
    return rest[1:] if argv[at + 1] == "vllm.entrypoints.cli.main" else rest


def prepare(
    plan: Plan, plan_path: str, argv: list[str], python: str | None = None, resolution: dict | None = None
) -> tuple[list[str], list[str]]:
    """`capplan apply`'s launch: (the command to run, the lines to tell the user). CapplanError,
    before anything starts, when a value the command gives (on its line or in its --config
    file) contradicts the plan. The command is read by vLLM's own parser, run with `python`
    (default: the command's interpreter), where vLLM is importable; by capplan's reader else."""
    import os
    import sys

    from capplan.runtime.launch import target_python
    from capplan.runtime.vllm_cli import resolution_of

    if server_start(argv) is None:
        return argv, [
            "capplan: not a `vllm serve` or `python -m vllm.entrypoints.openai.api_server` command: its flags "
            "are not read here (each engine still checks the plan before it captures)"
        ]
    python = python or target_python(argv) or sys.executable
    if resolution is None:
        results = read_with_vllm(python, [argv], dict(os.environ))
        resolution = None if results is None else results[0]
    resolved = None if resolution is None else resolution_of(resolution)
    reader: list[str] = []
    own = None if resolved is not None else read_command(argv)
    cmd = read_resolved(argv, resolved) if resolved is not None else own
    assert cmd is not None  # a server command (server_start above)
    if own is not None:
        reader = [
            f"capplan: vLLM's argument parser could not be run with {printable(python)} (vLLM is not importable "
            "there): the flags were read by capplan's own reader"
            + (", which does not read --config files" if any(u.startswith("--config") for u in cmd.unread) else "")
        ]
    problems = contradictions(plan, cmd)
    if problems:
        raise CapplanError(
            f"the command contradicts {printable(plan_path)}: {'; '.join(problems)}",
            "change the flag, or the spec and recompile; `capplan flags PLAN` prints the matching arguments",
        )
    full, added = complete(plan, cmd)
    lines = [*reader, f"capplan: added from the plan: {shlex.join(added)}"] if added else list(reader)
    if cmd.unread:
        lines.append(f"capplan: not read here, checked by the engine: {shlex.join(cmd.unread)}")
    return full, lines
