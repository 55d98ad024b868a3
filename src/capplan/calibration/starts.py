"""Calibrations from the reports engine starts leave (`capplan apply --report`, CAPPLAN_REPORT).

A start's report holds the plan's fingerprint, the graphs captured and what capture took (its
seconds, and the fall in the GPU's free memory across it: the graph pool's growth). Checked
against the plan it ran and the deployment's identity, one report is one `Start`; several
merge into one calibration, every figure with the spread of its starts (not the last one
winning). Reports of earlier runtimes record no identity: the operator gives the model's
config.json, the GPU and the release, and the calibration records that they were given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from capplan.errors import InputError, printable
from capplan.files import json_value, read_text, shown
from capplan.schemas.calibration import Calibration, CaptureCost, GraphSizes, Identity, ModelShape, Start
from capplan.schemas.plan import Plan
from capplan.schemas.report import KNOWN_FORMATS, Capture, KVCache, StartReport
from capplan.schemas.report import Identity as Measured
from capplan.schemas.spec import Model

MAX_REPORT_BYTES = 64 << 20
FOLDER = ".capplan/calibration"  # found beside the plans, or in a folder above them


class _Report(BaseModel):
    """What a calibration reads of a start report of any format it knows (the report holds more;
    format 1 is checked whole against `StartReport` first)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    report_format: int = 0
    fingerprint: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    graphs_planned: int = Field(ge=0)
    graphs_captured: int = Field(ge=0)
    capture_seconds: float
    graph_memory_gib: float | None
    deferred: dict[str, object] | None = None
    identity: Measured | None = None  # reports of earlier runtimes have none
    profiling_capture: dict[str, object] | None = None  # vLLM's profiling pass before the capture, if it ran
    after_profiling: bool | None = None  # from `profiling_capture`; None where the report has no such key
    captures: list[Capture] | None = None  # each graph's capture, where the start measured each
    vllm_estimate_gib: float | None = None
    kv_cache: KVCache | None = None


@dataclass(frozen=True)
class Given:
    """The identity the operator gives for reports that do not record it."""

    shape: ModelShape | None = None
    model: str | None = None
    gpu: str | None = None
    vllm: str | None = None
    torch: str | None = None
    attention_backend: str | None = None
    lora_rank: int | None = None


def read_report(path: Path) -> _Report:
    """A start report's figures; one line naming the file and what is wrong otherwise."""
    name = shown(path)
    try:
        data = json_value(read_text(path, "start report", InputError, MAX_REPORT_BYTES))
    except ValueError as exc:
        raise InputError(f"{name}: not a start report ({exc})", "give the file CAPPLAN_REPORT named") from None
    if not isinstance(data, dict) or "fingerprint" not in data or "graphs_captured" not in data:
        raise InputError(
            f"{name}: not a start report (no fingerprint and graphs captured)",
            "give the file capplan apply --report (CAPPLAN_REPORT) wrote",
        )
    fmt = data.get("report_format", 0)  # reports before the format was versioned carry none: format 0
    if type(fmt) is not int or fmt not in KNOWN_FORMATS:
        raise InputError(
            f"{name}: report format {printable(repr(fmt)[:30])}; this capplan reads formats "
            f"{', '.join(map(str, KNOWN_FORMATS))} (the format is the report's report_format)",
            "read it with the capplan release whose runtime wrote it, or upgrade capplan",
        )
    try:
        if fmt > 0:
            StartReport.model_validate(data)
        report = _Report.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InputError(
            f"{name}: {where}: {err['msg'].lower()}", "give the file capplan apply --report wrote, unedited"
        ) from None
    if "profiling_capture" in data:  # reports since vLLM's profiling pass is counted apart say it
        report.after_profiling = report.profiling_capture is not None
    return report


def start_of(path: Path, plans: list[Plan]) -> tuple[Start, Measured]:
    """One start, from its report, checked against the plan it ran (the one of `plans` with its
    fingerprint): a report of another plan, of deferred capture, of a capture that did not
    finish, or whose memory reading another process disturbed is refused with the reason."""
    name = shown(path)
    r = read_report(path)
    plan = next((p for p in plans if p.fingerprint == r.fingerprint), plans[0])
    if r.fingerprint != plan.fingerprint:
        raise InputError(
            f"{name}: a start of another plan (fingerprint {r.fingerprint[7:19]}, the plan's {plan.fingerprint[7:19]})",
            "give the plan that start ran (another vLLM release or setting gives another fingerprint)",
        )
    if r.deferred is not None:
        raise InputError(
            f"{name}: a start with deferred capture: its capture covers only the ready graphs",
            "calibrate from starts of the plan without tiers",
        )
    if r.graphs_captured != r.graphs_planned or r.graphs_captured != len(plan.graphs):
        raise InputError(
            f"{name}: captured {r.graphs_captured} of the plan's {len(plan.graphs)} graphs; the start did not finish "
            "capturing",
            "give a report written after capture finished",
        )
    if r.graph_memory_gib is None or r.graph_memory_gib <= 0:
        raise InputError(
            f"{name}: graph memory {r.graph_memory_gib} GiB: the GPU's free memory did not fall across capture "
            "(another process on the GPU, or no GPU reading)",
            "calibrate from starts that had the GPU to themselves",
        )
    if not 0 < r.capture_seconds <= 1e6:
        raise InputError(f"{name}: capture_seconds {r.capture_seconds}: not a capture time")
    lora = sum(1 for g in plan.graphs if g.descriptor.num_active_loras > 0)
    top = max(g.descriptor.num_tokens for g in plan.graphs)
    try:
        start = Start(
            report=shown(path),
            fingerprint=r.fingerprint,
            graphs=len(plan.graphs),
            lora_graphs=lora,
            max_tokens=top,
            capture_seconds=r.capture_seconds,
            graph_memory_gib=r.graph_memory_gib,
            after_profiling=r.after_profiling,
            report_format=r.report_format,
            graph_sizes=graph_sizes(plan),
            captures=_captures(name, r, plan),
            vllm_estimate_gib=r.vllm_estimate_gib,
            profiling_seconds=_profiling_seconds(r),
            kv_cache_tokens=r.kv_cache.tokens if r.kv_cache is not None else None,
            host_cpu=r.identity.host_cpu if r.identity else None,
            host_cores=r.identity.host_cores if r.identity else None,
        )
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise InputError(
            f"{name}: {'.'.join(str(p) for p in err['loc'])} {err.get('input')!r}: {err['msg'].lower()}",
            "give the file capplan apply --report wrote, unedited",
        ) from None
    return start, r.identity or Measured()


def graph_sizes(plan: Plan) -> list[GraphSizes]:
    """The plan's graphs by mode and LoRA case, their sizes largest first (so that a calibration
    of this plan can price another plan graph by graph)."""
    found: dict[tuple[str, int], list[int]] = {}
    for g in plan.graphs:
        found.setdefault((g.descriptor.cg_mode, g.descriptor.num_active_loras), []).append(g.descriptor.num_tokens)
    return [
        GraphSizes.model_validate({"cg_mode": m, "lora_case": c, "sizes": sorted(v, reverse=True)})
        for (m, c), v in sorted(found.items())
    ]


def _captures(name: str, r: _Report, plan: Plan) -> list[CaptureCost]:
    """Each graph's capture, where the start measured each (CAPPLAN_CAPTURE_EACH): one per plan graph,
    in the plan's order, each the graph the plan has there; otherwise refused."""
    if r.captures is None:
        return []
    got = [(c.graph, c.cg_mode, c.num_tokens, c.lora_case) for c in r.captures]
    want = [(i, g.descriptor.cg_mode, g.descriptor.num_tokens, g.descriptor.num_active_loras)
            for i, g in enumerate(plan.graphs)]  # fmt: skip
    if got != want:
        raise InputError(
            f"{name}: its captures are not the plan's graphs in the plan's order ({len(got)} rows, {len(want)} graphs)",
            "give the file capplan calibrate or capplan apply --report wrote for this plan, unedited",
        )
    return [CaptureCost(cg_mode=c.cg_mode, lora_case=c.lora_case, num_tokens=c.num_tokens, seconds=c.seconds,
                        mib=round(c.bytes / 2**20, 3)) for c in r.captures]  # fmt: skip


def _profiling_seconds(r: _Report) -> float | None:
    seconds = (r.profiling_capture or {}).get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None


HOST = ("host_cpu", "host_cores")

SHAPE_DECIDES = ("num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "vocab_size", "num_experts")  # fmt: skip


def identity_of(plan: Plan, given: Given, measured: Measured) -> Identity:
    """The deployment's identity: what the starts recorded (measured), what the operator gave
    for what they did not (recorded as given), and the parallel sizes the plan's spec pins
    where neither says. A given value that contradicts a recorded one is refused."""
    spec = plan.spec
    values: dict[str, object] = {}
    given_fields: list[str] = []
    for key in ("shape", "model", "gpu", "vllm", "torch", "attention_backend", "lora_rank"):
        have, want = getattr(measured, key), getattr(given, key)
        if have is not None and want is not None and not _agrees(key, have, want):
            raise InputError(
                f"--{'model-config' if key == 'shape' else key.replace('_', '-')}: {_said(want)}, but the starts "
                f"recorded {_said(have)}",
                "leave it out: the reports record it",
            )
        if have is not None:
            values[key] = have
        elif want is not None:
            values[key] = want
            given_fields.append(key)
    shape = values.get("shape")
    assert shape is None or isinstance(shape, ModelShape)
    name = values.pop("model", None)
    model = spec.model
    if name is not None or shape is not None:
        model = Model(
            name=name if isinstance(name, str) else (model.name if model else None),
            hidden_size=shape.hidden_size if shape else None,
            num_layers=shape.num_layers if shape else None,
            dtype=shape.dtype if shape else None,
            architecture=model.architecture if model else None,
            parameters=model.parameters if model else None,
        )
    sizes = {
        "tensor_parallel_size": measured.tensor_parallel_size or spec.parallel.tensor_parallel_size or 1,
        "pipeline_parallel_size": measured.pipeline_parallel_size or spec.parallel.pipeline_parallel_size or 1,
        "data_parallel_size": measured.data_parallel_size or spec.parallel.data_parallel_size,
    }
    if "model" in given_fields or ("shape" in given_fields and name is None):
        given_fields.append("model")
    return Identity(model=model, given=sorted(set(given_fields)), **sizes, **values)  # type: ignore[arg-type]


def _agrees(key: str, have: object, want: object) -> bool:
    if isinstance(have, ModelShape) and isinstance(want, ModelShape):
        return all(
            getattr(have, f) is None or getattr(want, f) is None or getattr(have, f) == getattr(want, f)
            for f in SHAPE_DECIDES
        )
    if key == "vllm":
        return str(have).split("+", 1)[0] == str(want).split("+", 1)[0]
    return have == want


def _said(value: object) -> str:
    if isinstance(value, ModelShape):
        return f"{value.num_layers} layers, hidden {value.hidden_size}"
    return str(value)


def _one_deployment(measured: list[Measured], reports: list[Path]) -> Measured:
    """The identity every start recorded (they must agree: starts of one deployment)."""
    first = measured[0]
    for m, path in zip(measured[1:], reports[1:]):
        for key in Measured.model_fields:
            if key in HOST:
                continue  # starts of one deployment may run on several hosts: each start records its own
            if (
                key == "model"
                and first.shape is not None
                and m.shape is not None
                and _agrees("shape", first.shape, m.shape)
            ):
                continue  # the same shape from another folder (a probe's config.json): the same graphs to capture
            a, b = getattr(first, key), getattr(m, key)
            if a is not None and b is not None and not _agrees(key, a, b):
                raise InputError(
                    f"{shown(path)}: a start of another deployment ({key} {_said(b)}; {shown(reports[0])}: {_said(a)})",
                    "calibrate each deployment apart",
                )
    return first


def calibration_from_starts(reports: list[Path], plans: list[Plan], given: Given, name: str) -> Calibration:
    """One calibration of the deployment from its starts' reports (at least one), every report
    checked against the plan it ran (the one of `plans` with its fingerprint); the plans must be
    of one deployment (one release and parallel layout), and the release the operator gives must
    be theirs."""
    if not reports:
        raise InputError("no start report given", "give the report(s) capplan apply --report wrote")
    plan = plans[0]
    for p in plans:
        if not p.graphs:
            raise InputError(
                "--plan: a plan that captures no graphs (cudagraph mode NONE): no start of it measures capture",
                "calibrate from starts of a plan with graphs",
            )
    for other in plans[1:]:
        if (other.spec.target.vllm, other.spec.parallel) != (plan.spec.target.vllm, plan.spec.parallel):
            raise InputError(
                "--plan: plans of different deployments (another vLLM release or parallel layout)",
                "calibrate each deployment apart",
            )
    read = [start_of(path, plans) for path in reports]
    seen: set[str] = set()
    for path in reports:
        key = str(path.resolve())
        if key in seen:
            raise InputError(f"{shown(path)}: given twice; each start counts once")
        seen.add(key)
    measured = _one_deployment([m for _, m in read], reports)
    release = measured.vllm or given.vllm
    if release is not None:
        from capplan.releases import release_problem

        problem = release_problem(plan.spec.target.vllm, release)
        if problem is not None:
            said = "the starts ran" if measured.vllm else "--vllm"
            raise InputError(f"{said} vLLM {release}: a start of another release: {problem[0]}", problem[1])
    return Calibration(name=name, identity=identity_of(plan, given, measured), starts=[s for s, _ in read])


def find_folder(start: Path) -> Path | None:
    """The calibration folder (`.capplan/calibration`) in `start`'s folder or the nearest folder
    above it, the way git finds its config; None when there is none."""
    here = (start if start.is_dir() else start.parent).resolve()
    for folder in (here, *here.parents):
        candidate = folder / FOLDER
        if candidate.is_dir():
            return candidate
    return None


def merged_folder(folder: Path) -> Calibration | None:
    """The calibrations in a calibration folder, their starts merged into one (they must be of
    one deployment: the first one's identity, and each other one's must equal it)."""
    from capplan.loading import load_calibration

    cals = [load_calibration(p) for p in sorted(folder.glob("*.yaml")) if p.is_file()]
    cals = [c for c in cals if c.starts]
    if not cals:
        return None
    first = cals[0]
    for other in cals[1:]:
        if other.identity != first.identity:
            raise InputError(
                f"{shown(folder)}: calibrations {first.name} and {other.name} are of different deployments",
                "keep one deployment's calibrations per folder (give the other with --calibration)",
            )
    return Calibration(name=shown(folder), identity=first.identity, starts=[s for c in cals for s in c.starts])
