"""The command line's words: each command's help text and each argument's and option's
declaration, so that `capplan.cli` holds only what each command does."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from capplan.calibration.budget import MARGIN_RULE
from capplan.runtime.deferred.pauses import DEFAULT_SLOW_EVERY, DEFAULT_STEP_PAUSE_MS, SLOW_BURST

PlanFile = Annotated[Path, typer.Argument(help="Plan file (.plan.yaml).", show_default=False)]
PlanOrDeploymentSpec = Annotated[
    Path,
    typer.Argument(
        help="Plan file (.plan.yaml), or a spec whose deployment section names the deployment's vLLM config.",
        show_default=False,
    ),
]
CalibrationOption = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="The deployment's calibration, which prices capture (default: a .capplan/calibration folder beside "
        "the plans or above them; else the shape model, where the spec gives the model's layers and hidden size; "
        "else not priced, said with what would price it).",
    ),
]
ModelConfigOption = Annotated[
    Path | None,
    typer.Option("--model-config", help="The model's config.json: its shape, for the shape model's prediction."),
]

COMPILE_HELP = """Compile SPEC into a capture plan (atomic write; summary on stderr).

With --check, nothing is written: exit 0 when each plan holds exactly what its
spec compiles to (comments, the spec's file name and where you run it from do
not matter), 1 with `plan is stale: run COMMAND` otherwise.
"""
CompileSpecs = Annotated[list[Path], typer.Argument(help="Deployment spec(s) (YAML).", show_default=False)]
CompileOutput = Annotated[
    Path | None,
    typer.Option("-o", "--output", help="Plan path (one spec only). Default: SPEC with .plan.yaml."),
]
CompilePlanDir = Annotated[
    Path | None,
    typer.Option("--plan-dir", help="Put each plan in this folder as NAME.plan.yaml."),
]
CompileDryRun = Annotated[bool, typer.Option("--dry-run", help="Print what would be written; write nothing.")]
CompileAsJson = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Also print the plan as JSON on stdout (the plan file is still written; add --dry-run to write nothing).",
    ),
]
CompileCheck = Annotated[
    bool,
    typer.Option(
        "--check",
        help="Recompile in memory and compare with the existing plan; exit 1 if stale. Writes nothing.",
    ),
]
CompileSkipNonSpecs = Annotated[
    bool,
    typer.Option(
        "--skip-non-specs",
        help="Skip YAML files with none of a spec's sections (target, scheduler, cudagraph, lora, "
        "speculative, parallel, fixes), e.g. a CI config; for hooks that see every YAML file.",
    ),
]

SHOW_HELP = """What will be captured and how token ranges and LoRA counts dispatch.

By default one screen: per mode and LoRA case the graph sizes and counts, the
batches that run eager and what each fix changed; --full prints every table.

Graphs are named MODE:TOKENS[xREQUESTS]@LORA_CASE: PIECEWISE:128@4 is the
PIECEWISE graph of 128 tokens for LoRA case 4; FULL:64x64@4 the FULL graph of
64 tokens padded to 64 requests.
"""
ShowAsJson = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Machine-readable plan: capture_sizes, lora_capture_cases, lora_dispatch_map, "
        "descriptors (capture order), and everything else the plan holds.",
    ),
]
ShowFull = Annotated[
    bool,
    typer.Option(
        "--full",
        help="Every table: graphs per mode and LoRA case, the LoRA dispatch map, each LoRA case's token "
        "ranges with their candidates, and every deviation (the default is a one-screen summary).",
    ),
]
ShowPlot = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Draw the plan: captured and pruned graphs per capture size and LoRA case, per mode, and the "
        "batches that run eager (.svg, or .png with capplan[plot]).",
    ),
]

DISPATCH_HELP = """Which captured graph serves a batch (or eager), and why.
"""
DispatchReqs = Annotated[int | None, typer.Option("--reqs", help="Requests in the batch.")]
DispatchTokens = Annotated[int | None, typer.Option("--tokens", help="Tokens scheduled in the batch.")]
DispatchLoras = Annotated[int, typer.Option("--loras", help="Distinct LoRA adapters in the batch.")]
DispatchBase = Annotated[bool, typer.Option("--base", help="Some requests use no adapter (base model).")]
DispatchUniform = Annotated[
    int | None,
    typer.Option("--uniform", help="Uniform tokens per request. Default: derived as vLLM does."),
]
DispatchMaxQueryLen = Annotated[
    int | None,
    typer.Option(
        "--max-query-len",
        help="Longest request in tokens. Default: ceil(tokens / reqs), the most even batch.",
    ),
]
DispatchHasPrefill = Annotated[
    bool,
    typer.Option("--has-prefill", help="The batch holds a real prefill chunk (from vLLM 0.28: no decode graph)."),
]
DispatchQueries = Annotated[
    Path | None,
    typer.Option(
        "--queries",
        help="A batch file, the format simulate reads: JSON lines {num_reqs, num_tokens, "
        "max_query_len?, num_active_loras?, base?, has_prefill?, uniform_token_count?, count?}; "
        "prints one descriptor object per line, in order.",
    ),
]
DispatchEncoderItems = Annotated[
    str | None,
    typer.Option(
        "--encoder-items",
        help="Instead of a batch: one encoder batch, the output tokens of each item (image, video), "
        "comma-separated, e.g. 300,1200,40; prints how vLLM packs it onto the plan's encoder graphs.",
    ),
]
DispatchDpRanks = Annotated[
    str | None,
    typer.Option(
        "--dp-ranks",
        help="Under DP sync (an MoE model, data_parallel_size > 1): the other ranks' batches in the same step, "
        "comma-separated, each TOKENS (that many one-token requests), REQSxTOKENS or idle, e.g. 64x64,idle,8x900; "
        "prints what this rank replays once the ranks have padded to one another.",
    ),
]
DispatchAsJson = Annotated[bool, typer.Option("--json", help="Print the descriptor as a JSON object.")]

VERIFY_HELP = """Prove the plan free of every failure class in docs/design.md.

Checks, over every reachable batch (requests 1..max_num_seqs, tokens
1..max_num_batched_tokens, uniform or mixed, 0..max_loras adapters with and
without base requests, every DP rank mix): each batch replays a compatible
graph or an explicit, reported eager fallback; the LoRA grid of the graph
it replays covers all its kernel slots; every LoRA graph's dummy records
the LoRA kernels with the right adapter count and no dummy request is too
long; DP ranks always agree on the padded token count; and the plan is
exactly what its spec compiles to. Exit 0 when it holds, 1 with one line
per violation.
"""
VerifyAsJson = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]

SIMULATE_HELP = """Replay a batch trace through the plan's dispatcher: hit rate, eager, padding, unused graphs,
and with a step-time calibration the predicted total step time.

TRACE has one batch per line, e.g.
{"num_reqs": 8, "num_tokens": 8, "max_query_len": 1, "num_active_loras": 2, "base": true, "count": 120}
(num_reqs and num_tokens required; `adapters` is accepted for num_active_loras).
Every batch must fit the plan's spec (max_num_seqs, max_num_batched_tokens,
max_loras). A vLLM log with VLLM_LOG_BATCHSIZE_INTERVAL also parses, but it
is partial: padded token counts only, no requests or adapters, and on MRV2
no FULL graph replays (vLLM logs only steps through set_forward_context);
setting the variable at launch crashed FULL graph capture on vLLM 0.25.
Synthetic traces: examples/traces/.

With data parallelism, pass one trace per rank: the ranks' steps are
aligned (by the recorder's dp_step) and run through vLLM's DP sync (padding
to the largest token count across ranks, the lowest mode wins, idle ranks
run a dummy batch); counts are per rank. One trace for a DP plan is taken
to run on every rank, and the output says so.

Step time is predicted only from points the calibration measured, or that
lie between two measured points of the same mode and LoRA case (the
neighbours bound the error); otherwise the points to measure are listed.
"""
SimulateTraces = Annotated[
    list[Path],
    typer.Argument(
        help="Batch trace: JSON lines, or a vLLM batch-size log. Under DP, one trace per rank "
        "(capplan apply --trace writes TRACE.rank0.jsonl, TRACE.rank1.jsonl, ...).",
        show_default=False,
    ),
]
SimulateAsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
SimulatePlot = Annotated[
    Path | None,
    typer.Option("--plot", help="Write hits and padding per captured size (.svg, or .png with matplotlib)."),
]
SimulateCalibration = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="The deployment's calibration: it prices the plan's capture as show does, and when it has step "
        "times (capplan calibrate-steps, calibrate-trace) the total step time is predicted.",
    ),
]

OPTIMIZE_HELP = """Choose capture sizes for a trace under a graph, memory, capture-time or slowdown budget.

The objective is the trace's predicted total step time when the
calibration has step times (capplan calibrate, calibrate-trace): every
candidate plan is compiled and the trace replayed through it; a step costs
the measured time of what it runs (a FULL or PIECEWISE graph of its padded
size, or eager), interpolated only between measured sizes of the same mode
and LoRA case. A candidate whose replay needs an unmeasured price is never
chosen; when none is left, optimize refuses and names the points to
measure (or, with --padding-fallback, chooses by padded tokens and says
so). Without step times the objective is padded tokens, and the largest
size stays the spec's max capture size.

Step times rest on the calibration's model and GPU: a spec that names
another model (spec `model`, `target.gpu`) gets no step-time objective
from it. A memory or capture-time budget is priced as show prices each
candidate plan (the deployment's probes and starts, else the shape model
where the spec gives the model's shape); where nothing prices it, the
budget is refused with what would price it.

With LoRA and one DP rank, sizes are chosen per LoRA case
(cudagraph.lora_case_sizes, run by capplan's runtime): a case the trace
rarely uses keeps few sizes, always including the largest. The budget is
split across cases exactly (knapsack over each case's optimal curve).
Under DP, pass one trace per rank: candidates are scored through DP sync.

Exact: dynamic programming over the sorted token counts of the trace
(optimal 1-D bucketing) for every number of sizes, under a padding bound
(--max-pad-ratio, default 2: no batch pads past twice its tokens, so a set
fitted to one trace does not send tomorrow's 17-token batch to a 256-token
graph). The choice is fitted on the first 80% of the trace's steps and scored
on the last 20% (--holdout); the last line says what it rests on and how it
did there. Prints the trade-off
curve, writes a spec with explicit cudagraph.capture_sizes whose compiled
plan verifies, and leaves everything else in the spec as it was.

--ready-share S also writes the spec's tiers: the graphs that replay S of
the trace's graph steps are ready (captured before the engine reports
ready), the rest deferred (captured while it serves). Given alone it keeps
the spec's capture sizes and only chooses the tiers. The share rests on the
trace alone; the planner adds the largest graph of each mode and LoRA case.
"""
OptimizeSpec = Annotated[Path, typer.Argument(help="Spec YAML to start from.", show_default=False)]
DropUnschedulable = Annotated[
    bool,
    typer.Option(
        "--drop-unschedulable",
        help="Leave out the trace's batches this deployment never schedules (more requests than max_num_seqs, "
        "tokens than max_num_batched_tokens, adapters than max_loras) instead of refusing the trace, and say how "
        "many steps were dropped and why: a trace recorded on another deployment, fitted to this one.",
    ),
]
OptimizeTraces = Annotated[
    list[Path],
    typer.Argument(help="Batch trace (see capplan simulate --help); under DP, one per rank.", show_default=False),
]
OptimizeMaxGraphs = Annotated[
    int | None, typer.Option("--max-graphs", min=1, help="Budget: graphs captured (after pruning).")
]
OptimizeMaxGraphMemory = Annotated[
    float | None,
    typer.Option(
        "--max-graph-memory",
        min=0.0,
        help="Budget: graph memory in GiB, each candidate priced as show prices it (the deployment's probes and "
        "starts, --calibration or a .capplan/calibration folder beside the spec; else the shape model) and held "
        "to it by its price's upper bound.",
    ),
]
OptimizeMaxCaptureSeconds = Annotated[
    float | None,
    typer.Option(
        "--max-capture-seconds",
        min=0.0,
        help="Budget: capture time in seconds (priced and held to it as --max-graph-memory).",
    ),
]
OptimizeMaxSlowdown = Annotated[
    float | None,
    typer.Option(
        "--max-slowdown",
        min=0.0,
        max=1000.0,
        help="Budget: the fewest graphs whose predicted step time on the trace stays within PCT percent of "
        "the default plan's, bounds included (the candidate's upper bound against the default's lower).",
    ),
]
OptimizeObjective = Annotated[
    str | None,
    typer.Option(
        "--objective",
        help="step-time (predicted from the calibration's step times; the default when it has them) "
        "or padding (padded tokens; the default otherwise).",
    ),
]
OptimizePaddingFallback = Annotated[
    bool,
    typer.Option(
        "--padding-fallback",
        help="When step time cannot choose (the calibration lacks prices the trace needs), choose by "
        "padded tokens instead and say so, rather than refusing.",
    ),
]
OptimizeOutput = Annotated[
    Path | None,
    typer.Option("-o", "--output", help="Where to write the optimized spec (default: SPEC.optimized.yaml)."),
]
OptimizePlot = Annotated[Path | None, typer.Option("--plot", help="Write the trade-off curve (.svg or .png).")]
OptimizeCalibration = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="The deployment's calibration: its step times (the step-time objective) and its probes and starts "
        "(memory and capture-time budgets).",
    ),
]
OptimizeSharedSizes = Annotated[
    bool,
    typer.Option(
        "--shared-sizes", help="One size list for every LoRA case (what plain vLLM can run; always so under DP)."
    ),
]
OptimizeAsJson = Annotated[bool, typer.Option("--json", help="Print the curve and the choice as JSON.")]
OptimizeReadyShare = Annotated[
    float | None,
    typer.Option(
        "--ready-share",
        min=0.0,
        max=1.0,
        help="Also choose the ready tier (spec tiers: graphs captured before the engine reports ready, the "
        "rest while it serves): the fewest graphs replaying this share of the trace's graph steps. Alone, "
        "without a budget, capture sizes stay as the spec has them.",
    ),
]
OptimizeMaxPadRatio = Annotated[
    float,
    typer.Option(
        "--max-pad-ratio",
        help="No batch of n tokens, in the trace or not, may pad past this many times n (2: at most double). "
        "Sizes the trace never hits are added where a gap would break it.",
    ),
]
OptimizeHoldout = Annotated[
    float,
    typer.Option(
        "--holdout",
        help="Fit on the first part of the trace and score the choice on this last share of its steps, "
        "against the default sizes (0: fit on all of it). One trace only; DP rank traces are fitted whole.",
    ),
]
OptimizeJudgeOn = Annotated[
    list[Path] | None,
    typer.Option(
        "--judge-on",
        help="Other traffic (a trace file; repeat for more) the choice is judged on and never fitted on: under "
        "the padded-tokens objective, where it pads more or runs more steps eager than the spec's own sizes on "
        "any of them, the spec's own sizes are written, with the reason.",
        show_default=False,
    ),
]
OptimizeFullCurve = Annotated[
    bool, typer.Option("--full-curve", help="Print every point of the curve, not only those near the budget.")
]

DIFF_HELP = """Semantic diff: graphs added/removed per mode and LoRA case, dispatch changes,
fixes, and the change in capture time and graph memory, each plan priced as
show prices it (with an interval and what it rests on, or "not priced" and
what would price it).

Exit 0 when the plans are equal, 2 when they differ, 1 on error.

With --policy, a verdict leads: pass, warn or deny from the thresholds the
repository sets (graphs, capture_seconds, graph_memory_gib, batches_to_eager,
lora_case_moves, graphs_not_priced; each an increase above warn/deny, or
warn_percent/deny_percent of the old plan's value), or pass where an override
names the new plan's fingerprint (a change of its graphs clears it). The exit
code is then the verdict's, for CI to gate on: 0 pass, 3 warn, 4 deny (1 on
error). A policy file:

  thresholds:
    graphs: {warn_percent: 10, deny: 200}
    capture_seconds: {warn: 10, deny: 60}
    batches_to_eager: {deny: 0}
    lora_case_moves: {warn: 0}
    graphs_not_priced: {warn: 0}
  overrides:
    - {fingerprint: "sha256:...", reason: "8 adapters for the new tenant", by: "alice"}
"""
DiffOld = Annotated[Path, typer.Argument(help="Old plan (or spec with --spec).", show_default=False)]
DiffNew = Annotated[Path, typer.Argument(help="New plan (or spec with --spec).", show_default=False)]
DiffFmt = Annotated[str, typer.Option("--format", help="text | markdown (pastes into a pull request) | json.")]
DiffSpecs = Annotated[bool, typer.Option("--spec", help="OLD and NEW are specs: compile both in memory and compare.")]
DiffPolicy = Annotated[
    Path | None,
    typer.Option(
        "--policy",
        help="The repository's review policy (e.g. .capplan/review.yaml): lead with a verdict, pass, warn or "
        "deny, and exit with it (0, 3, 4).",
    ),
]
DiffPlot = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        help="Draw graphs added, removed and kept per capture size and LoRA case (.svg, or .png with "
        "capplan[plot]); link it from the markdown diff.",
    ),
]

GIT_SETUP_HELP = """Make `git diff` show plans as `capplan diff` does, in the repository you are in.

Adds `*.plan.yaml diff=capplan` to the repository's .gitattributes (commit
it, so every clone knows which files are plans) and sets
`diff.capplan.command` in this clone's git config (each clone runs this
once). Then `git diff`, and `git log -p --ext-diff` / `git show --ext-diff`,
print graphs added and removed per mode and LoRA case, dispatch and spec
changes for every plan; `git diff --no-ext-diff` shows the raw lines. All
or nothing: when either step fails, neither is left changed.

The driver runs this capplan's Python: by a path relative to the repository
when it lies inside it (a `.venv` rebuilt or a clone moved keeps working),
else by its absolute path; once that Python is gone it runs `capplan` from
PATH, and with none there `git diff` prints one line saying to run
`capplan git-setup` again.
"""
GitSetupCommand = Annotated[
    str | None,
    typer.Option(
        "--command",
        help="How git runs capplan (default: this capplan's Python, relative to the repository when inside "
        "it, so git finds it whatever PATH it runs with and a rebuilt venv keeps working).",
    ),
]

GIT_DIFF_HELP = """git's external diff driver: PATH OLD-FILE OLD-HEX OLD-MODE NEW-FILE NEW-HEX NEW-MODE [...].

Prints the semantic diff of the two plans; when either side cannot be
loaded (a plan of another format, say), says why and prints the raw
unified diff, or says why not when a side cannot be read either. Exits 0,
as git requires of a diff driver, unless git called it wrongly.
"""
GitDiffArgs = Annotated[list[str] | None, typer.Argument()]

APPLY_HELP = """Run a vLLM command with PLAN in force: capplan apply --runner mrv2 PLAN -- vllm serve MODEL ...

For `vllm serve` and `python -m vllm.entrypoints.openai.api_server`, the
server reads its flags with vLLM's own parser, in its own process, before any
engine process starts or weight loads: one that contradicts the plan
(max_loras, max_num_seqs, capture sizes, cudagraph mode, ...) stops it with
one line, and what the plan determines and the command leaves out is added
(said in the log), so `capplan apply --runner mrv2 PLAN -- vllm serve MODEL`
is a complete launch. The launcher itself imports no vLLM (it adds well under
a second before vLLM starts); --dry-run reads the line with vLLM's parser
here, prints the completed command and starts nothing. A vLLM release the
plan was not compiled for is refused before the command starts. Any other
command that starts vLLM works too (python my_script.py), checked by each
engine instead. vLLM loads capplan's plugin (entry point vllm.general_plugins) in every engine
and worker process, and CAPPLAN_PLAN names the plan. Setting
CAPPLAN_PLAN=PATH yourself does the same without this wrapper; where Ray
actors get only the variables vLLM copies to them (--data-parallel-backend
ray, or vLLM's first Ray executor), also set
VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=CAPPLAN_ (this wrapper adds it;
without it the engine refuses to start).
"""
ApplyRunner = Annotated[str, typer.Option("--runner", help="Model runner: mrv2.")]
ApplyDryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Check the command's flags against the plan and print the command that would run, with the "
        "flags the plan adds; start nothing.",
    ),
]
ApplyReport = Annotated[
    Path | None,
    typer.Option(
        "--report",
        help="Write the end-of-run report as JSON here; {pid} and {rank} "
        "(the DP rank) are filled in, so each process of a DP launch writes its own.",
    ),
]
ApplySmoke = Annotated[
    Path | None,
    typer.Option(
        "--smoke",
        help="Instead of a command: build the plan's engine on DIR (base/ plus LoRA "
        "adapter folders), generate LoRA batches with graphs and eager, compare. Needs a GPU.",
    ),
]
ApplyCalibration = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="A calibration (file or folder) of this deployment (capplan calibrate-start) with starts of this "
        "plan whose capture ran first (a start with --kv-cache-memory-bytes: vLLM then skips its profiling pass, after "
        "which a capture's reading undercounts): the engine "
        "leaves the graph memory those starts measured, plus --graph-margin, free beside the KV cache and skips "
        "vLLM's profiling capture (0.29.0 on: capture paid once). Used only where the "
        "engine's GPU, vLLM, torch, model shape, parallel sizes and LoRA rank are the calibration's; else vLLM's "
        "own profiling sizes the KV cache, and the log and --report say why. A capture that outgrows what was "
        "left stops the engine before serving, with one line naming the figures.",
    ),
]
ApplyGraphMargin = Annotated[
    float | None,
    typer.Option(
        "--graph-margin",
        help=f"GiB left beside the calibration's measured graph memory (default: {MARGIN_RULE} of it, the "
        "reserve `show` and `flags` print).",
        show_default=False,
    ),
]
ApplyStepPause = Annotated[
    float | None,
    typer.Option(
        "--step-pause-ms",
        help="Plans with tiers: the longest a serving step may wait on a deferred capture, in ms (default "
        f"{DEFAULT_STEP_PAUSE_MS:g}). "
        "A capture expected to take longer (the slowest of its mode's recent captures) waits for an idle turn, "
        "or, for a graph the traffic missed, is spaced by --slow-capture-every-steps.",
        show_default=False,
    ),
]
ApplySlowEvery = Annotated[
    int | None,
    typer.Option(
        "--slow-capture-every-steps",
        help="Plans with tiers: a graph the traffic missed whose capture is expected to exceed --step-pause-ms "
        f"is still captured before a step: up to {SLOW_BURST} on consecutive capture turns, then once in this "
        f"many steps (a token bucket: in any run of S steps at most {SLOW_BURST} + S / N; default "
        f"{DEFAULT_SLOW_EVERY}: over a long run at most {100 / DEFAULT_SLOW_EVERY:g}% of steps wait on one; 0: never, "
        "such graphs land on idle turns only, which sustained load may never give).",
        show_default=False,
    ),
]
ApplyTolerance = Annotated[float, typer.Option("--tolerance", help="Max |logprob| difference for --smoke.")]
ApplyTrace = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        help="Record every step's batch here as JSON lines, the format simulate and optimize read "
        "(same as CAPPLAN_TRACE=PATH). {rank} is filled in; with DP > 1 each rank writes its own "
        "file. Stops at CAPPLAN_TRACE_MAX_MB (default 256).",
    ),
]

INIT_HELP = """Write a spec from an existing vLLM deployment: capplan init --config vllm.yaml -o deploy.yaml

The deployment is its `vllm serve --config` YAML file, its serve line (after
--: capplan init -o deploy.yaml -- vllm serve MODEL --max-num-seqs 64 ...),
or both. They are read as vLLM reads them: by vLLM's own argument parser
where vLLM is importable, else by capplan's own reader, which refuses what it
does not read. Every setting the plan covers goes into the spec (the model
into model.name); the spec's header comment names every setting it could not
carry and why, and each setting the deployment leaves to the spec's default.
Without -o the spec goes to stdout. An existing file is replaced only with --force.
"""
InitConfig = Annotated[
    Path | None, typer.Option("--config", help="The deployment's vLLM config file (what `vllm serve --config` reads).")
]
InitOutput = Annotated[
    Path | None, typer.Option("--output", "-o", help="Write the spec here (default: print it to stdout).")
]
InitVllm = Annotated[
    str | None,
    typer.Option(
        "--vllm",
        help="target.vllm: the vLLM release the deployment runs (default: the installed vLLM where capplan "
        "plans for it, else the spec's default).",
    ),
]
InitMoe = Annotated[
    bool | None,
    typer.Option(
        "--moe/--dense",
        help="parallel.moe: whether the model is a mixture of experts (needed with data parallelism).",
        show_default=False,
    ),
]
InitForce = Annotated[bool, typer.Option("--force", help="Replace an existing output file.")]

FLAGS_HELP = """Print the vLLM arguments that match PLAN, for launching vLLM without `capplan apply`.

Scheduler limits, max_loras and the specialize switches, DP (and TP/PP when
the spec names them), and a --compilation-config with the cudagraph mode and
the plan's capture sizes. The serve and python lines are whole shell lines:
they start with CAPPLAN_PLAN=PLAN (what puts the plan in force in the engine's
environment) and name the spec's model (MODEL when the spec names none).
Speculative decoding needs your draft method: the line before says what to
add. --format json lists the arguments alone; set CAPPLAN_PLAN yourself (and,
with --data-parallel-backend ray, VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=CAPPLAN_).
--format yaml gives them as a `vllm serve --config` file's keys, to merge into yours.

Given a spec whose deployment section names the deployment's vLLM config
(vllm.yaml, serve line or script) in place of PLAN: that deployment's own
line, every setting it gives kept, with only what the plan adds (what
`capplan apply` would run), CAPPLAN_PLAN naming the plan `capplan compile`
writes beside the spec.
"""
FlagsCalibration = Annotated[
    Path | None,
    typer.Option(
        "--calibration",
        help="A calibration of this deployment's starts (capplan calibrate-start; default: a .capplan/calibration/ "
        "folder found above PLAN): where its starts measured this plan, say on stderr how much graph memory to "
        "leave free beside the KV cache, in place of vLLM's estimate.",
    ),
]
FlagsFormat = Annotated[
    str,
    typer.Option(
        "--format",
        help="serve: a `vllm serve` line; python: a `python -m vllm.entrypoints.openai.api_server` line; "
        "json: the arguments as a JSON list (for Kubernetes manifests, Ray, your own scripts); "
        "yaml: the keys of a `vllm serve --config` file.",
    ),
]

CALIBRATE_HELP = """Measure decode step times (and capture runs) offline on this machine's GPU, into a calibration file.

Builds three engines from SPEC, each in its own process with a plan in
force: the spec's own plan (capture cost; decode step time replaying each
measured size, per LoRA case), a plan of the smallest size only (capture
cost of a few graphs; eager decode step times) and a plan of every fourth
size with LoRA off (capture cost). Pass the file to show, diff, simulate
and optimize with --calibration; optimize then minimizes predicted step
time. Needs a GPU and vLLM; extra LLM(...) keywords come from the JSON
object in CAPPLAN_SMOKE_LLM_ARGS. Takes a few minutes.
"""
PROBE_HELP = """Probe the deployment on this GPU: capture PLAN once with vLLM's dummy weights, into a calibration.

Starts `vllm serve MODEL --load-format dummy` under `capplan apply PLAN`
(the plan in force, the line completed from the plan), reads each graph's
seconds and pool growth between one graph and the next of vLLM's one
capture, and stops the server once every graph is captured.
MODEL is the model's folder or its config.json alone (no weights and no
adapters are read; without a tokenizer the server runs with
--skip-tokenizer-init). Arguments after `--` go to `vllm serve` as the
deployment runs it (e.g. --max-lora-rank 16 --max-model-len 4096). Unless
they give one, the KV cache is given 4 GiB (--kv-cache-memory-bytes), so
vLLM skips its profiling capture and every graph's growth is a first
capture's, the memory a reserve beside the KV cache must hold (after that
pass the capture reuses memory the pass left allocated).

The calibration records each capture's seconds and graph-pool growth by
mode, size and LoRA case, the capture's total, the model's shape, the GPU,
vLLM, torch and the host's CPU. (Start reports of `capplan apply` record
vLLM's profiling pass, its graph-memory estimate and the KV cache vLLM
sized.) Its header says where the probe's time went: when vLLM's first log
line and its model loading came (seconds from launch, as the probe saw the
log grow), then, as vLLM's log says them, model loading, torch.compile
(cold, or from vLLM's cache) and capture. A probe stops vLLM 10 s after
SIGTERM at the latest (SIGKILL to its process group).
With MODEL the folder the deployment serves, a cold probe's compile is
kept in vLLM's cache for the deployment's own start on this machine (vLLM
keys the cache by the model's path and the compiled settings, not by the
KV cache's size or the weights). show, diff and flags
price plans of this deployment from it (--calibration, or a
.capplan/calibration folder beside the plans). The start report is kept
beside the calibration (OUTPUT with .report.json); vLLM's log (OUTPUT with
.log) when the probe fails or with --keep-log. Exit 1 when vLLM fails or the capture does not finish
within --timeout seconds. Needs a GPU and vLLM.
"""
ProbeModel = Annotated[
    Path, typer.Option("--model", help="The model's folder, or its config.json alone (dummy weights are used).")
]
ProbeTimeout = Annotated[int, typer.Option("--timeout", help="Seconds to wait for every graph to be captured.")]
ProbeKeepLog = Annotated[
    bool, typer.Option("--keep-log", help="Keep vLLM's log beside the calibration (OUTPUT with .log) when it succeeds.")
]

CalibrateSpec = Annotated[Path, typer.Argument(help="Spec YAML of the deployment to measure.", show_default=False)]
CalibrateModel = Annotated[
    Path,
    typer.Option("--model", help="Model folder: the base model in MODEL/base, LoRA adapters in sibling folders."),
]
CalibrateOutput = Annotated[Path, typer.Option("-o", "--output", help="Calibration YAML to write.")]
CalibrateName = Annotated[str | None, typer.Option("--name", help="Calibration name (default: GPU, vLLM, model).")]

CALIBRATE_TRACE_HELP = """Fit step times as served from a recorded trace, into a calibration file. No GPU needed.

The interval between two recorded steps is the second step's period as the
engine ran it (scheduling and output included); intervals over 0.1 s are
idle time. Steps are dispatched through PLAN: graph steps give the time of
a FULL or PIECEWISE replay per LoRA case and padded size, eager steps the
time per token count. Medians of at least 3 steps become the calibration's
step_times. Without --calibration the file holds what the trace covers and
nothing more (no capture runs, no other step times); with it, its capture
runs, its identity and its step times for token counts the trace never
reached (eager decode, say) are kept.
"""
CalibrateTracePlan = Annotated[Path, typer.Argument(help="The plan the trace was recorded under.", show_default=False)]
CalibrateTraceTrace = Annotated[
    Path, typer.Argument(help="Trace recorded by capplan apply --trace (with step times).", show_default=False)
]
CalibrateTraceCalibration = Annotated[
    Path | None,
    typer.Option("--calibration", help="Calibration whose capture runs (and step times outside the trace) to keep."),
]
CalibrateTraceName = Annotated[
    str | None, typer.Option("--name", help="Calibration name (default: the base's, + served).")
]

SCHEMA_HELP = """Print the spec's JSON Schema (for editor completion and validation).

--defaults prints every field at its default as a spec file instead, each with
its description.
"""
SchemaDefaults = Annotated[
    bool,
    typer.Option("--defaults", help="Print every spec field at its default, as YAML with each field described."),
]


CALIBRATE_START_HELP = """Make a calibration of this deployment from the reports its starts left. No GPU needed.

Each REPORT is a file `capplan apply --report` (CAPPLAN_REPORT) wrote; each is
checked against PLAN, the plan the start ran: a report of another plan (another
fingerprint: another setting or release), of deferred capture, of a capture
that did not finish, or whose memory reading another process disturbed is
refused with the reason, and nothing is written. Several starts make one
calibration, every figure with the spread of its starts. Reports record the
deployment (model shape, dtype, GPU, releases, attention backend, parallel
sizes, LoRA rank) as vLLM's config gave it; for reports of earlier runtimes,
which do not, give it (--model-config, --gpu, --vllm, ...) and the
calibration records it as given. A given value that contradicts a recorded
one is refused. Put the calibration in a `.capplan/calibration/` folder
beside (or above) the plans, and show and diff find it.
"""
CalibrateStartReports = Annotated[list[Path], typer.Argument(help="Start reports (capplan apply --report).")]
CalibrateStartPlan = Annotated[
    list[Path],
    typer.Option("--plan", help="The plan the starts ran; give it again for starts of other plans of the deployment."),
]
CalibrateStartModelConfig = Annotated[
    Path | None, typer.Option("--model-config", help="The model's config.json (its shape), recorded as given.")
]
CalibrateStartModel = Annotated[str | None, typer.Option("--model", help="The model's name, recorded as given.")]
CalibrateStartGpu = Annotated[str | None, typer.Option("--gpu", help="The GPU the starts ran on, e.g. 'NVIDIA H200'.")]
CalibrateStartVllm = Annotated[str | None, typer.Option("--vllm", help="The vLLM release the starts ran.")]
CalibrateStartTorch = Annotated[str | None, typer.Option("--torch", help="The torch version the starts ran.")]
CalibrateStartBackend = Annotated[str | None, typer.Option("--attention-backend", help="vLLM's attention backend.")]
CalibrateStartRank = Annotated[int | None, typer.Option("--lora-rank", help="max_lora_rank the starts ran with.")]
CalibrateStartName = Annotated[str | None, typer.Option("--name", help="Calibration name (default: the file's stem).")]
