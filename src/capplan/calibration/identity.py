"""What a calibration was measured on, against the deployment a spec describes.

A calibration records what it was measured on (`identity`: the model, the GPU, vLLM, torch and
the parallel sizes). Figures for a spec that names another model, GPU or parallel layout are
withheld (`Basis`), and they read "not checked" unless every field that decides them was
compared on both sides (`not_compared` says which those are). Capture prices
(`capplan.calibration.price`) and step times (`capplan.traffic.steps`) are both judged here.
"""

from __future__ import annotations

from dataclasses import dataclass

from capplan.schemas.calibration import Calibration, Identity
from capplan.schemas.spec import Model, Spec


@dataclass(frozen=True)
class Basis:
    """What a calibration's estimates rest on for one spec. `usable` False: the calibration is
    of another model or GPU, and its numbers are withheld."""

    calibration: str
    usable: bool
    note: str
    unchecked: tuple[str, ...] = ()  # what was not compared (`not_compared`), where usable

    def label(self) -> str:
        return f"calibration {self.calibration}: {self.note}"


def _params(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def _identity_text(identity: Identity | None) -> str:
    if identity is None:
        return "model and GPU not recorded"
    parts = []
    m = identity.model
    if m is not None and _names_a_model(m):
        parts.append(m.name or m.architecture or "model")
        if m.parameters:
            parts.append(f"{_params(m.parameters)} parameters")
    if not parts:
        parts.append("an unrecorded model")
    parts.append(f"on {identity.gpu}" if identity.gpu else "GPU not recorded")
    layout = [
        f"{name} {size}"
        for name, size in (("TP", identity.tensor_parallel_size), ("PP", identity.pipeline_parallel_size))
        if size is not None
    ]
    if layout:
        parts.append(" ".join(layout))
    if identity.vllm:
        parts.append(f"vLLM {identity.vllm}")
    return ", ".join(parts)


def same_gpu(named: str, measured: str) -> bool:
    """Whether a GPU a spec names is the one a calibration measured: the name's words (case and
    the vendor word aside) begin the measured name's, as torch reports it ("NVIDIA H100" names
    "NVIDIA H100 80GB HBM3"; "H100 PCIe" does not)."""
    words = named.lower().replace("nvidia", "").split()
    return bool(words) and measured.lower().replace("nvidia", "").split()[: len(words)] == words


def model_differences(have: Model, want: Model) -> list[str]:
    """Fields both give that differ (parameter counts within 5%)."""
    out = []
    for field in ("architecture", "hidden_size", "num_layers", "dtype"):
        a, b = getattr(have, field), getattr(want, field)
        if a is not None and b is not None and a != b:
            out.append(f"{field} {a} vs {b}")
    same_size = False
    if have.parameters and want.parameters:
        same_size = abs(have.parameters - want.parameters) <= 0.05 * want.parameters
        if not same_size:
            out.append(f"parameters {_params(have.parameters)} vs {_params(want.parameters)}")
    # Two names of one model (a path and a hub id) agree only when both also give the same
    # architecture and parameter count; otherwise different names are different models.
    same_shape = same_size and have.architecture is not None and have.architecture == want.architecture
    if have.name and want.name and have.name != want.name and not same_shape:
        out.append(f"name {have.name} vs {want.name}")
    return out


def _names_a_model(model: Model | None) -> bool:
    return model is not None and any(v is not None for v in model.__dict__.values())


def not_compared(cal: Identity | None, spec: Spec) -> list[str]:
    """What decides step times and graph memory but was not compared, because one side (or
    both) does not give it, grouped by side. Compared are: the model (the same name on both
    sides, or the architecture and parameter count on both), its dtype (on both, or implied
    by the same name on both when neither gives one), the GPU, the tensor- and
    pipeline-parallel sizes, and the LoRA rank where the spec gives one. Anything missing makes
    an estimate "not checked"."""
    ident = cal or Identity()
    spec_lacks: list[str] = []
    cal_lacks: list[str] = []
    apart: list[str] = []
    sm = spec.model if _names_a_model(spec.model) else None
    cm = ident.model if _names_a_model(ident.model) else None
    if sm is None:
        spec_lacks.append("model")
    if cm is None:
        cal_lacks.append("model")
    if sm is not None and cm is not None:
        same_name = sm.name is not None and sm.name == cm.name
        shape = all(v is not None for v in (sm.architecture, sm.parameters, cm.architecture, cm.parameters))
        if not (same_name or shape):
            apart.append("no model name, or architecture and parameters, on both sides")
        if not ((sm.dtype and cm.dtype) or (same_name and not sm.dtype and not cm.dtype)):
            (spec_lacks if not sm.dtype else cal_lacks).append("model.dtype")
    if not spec.target.gpu:
        spec_lacks.append("target.gpu")
    if not ident.gpu:
        cal_lacks.append("gpu")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(spec.parallel, name) is None:
            spec_lacks.append(f"parallel.{name}")
        if getattr(ident, name) is None:
            cal_lacks.append(name)
    if spec.lora.enabled and spec.lora.max_lora_rank is not None and ident.lora_rank is None:
        cal_lacks.append("lora_rank")  # (a spec that gives none is compared on the rest)
    out = []
    if spec_lacks:
        out.append(f"the spec does not give {', '.join(spec_lacks)}")
    if cal_lacks:
        out.append(f"the calibration does not record {', '.join(cal_lacks)}")
    return out + apart


def judge(cal: Calibration, spec: Spec) -> Basis:
    """Whether a calibration's estimates apply to a spec's deployment: withheld when a field
    both give differs, "not checked" unless every deciding field was compared (not_compared)."""
    ident = cal.identity
    said = _identity_text(ident)
    problems = []
    spec_model = spec.model if _names_a_model(spec.model) else None
    cal_model = ident.model if ident is not None and _names_a_model(ident.model) else None
    if spec_model is not None and cal_model is not None:
        problems += model_differences(cal_model, spec_model)
    if spec.target.gpu and ident is not None and ident.gpu and not same_gpu(spec.target.gpu, ident.gpu):
        problems.append(f"GPU {ident.gpu} vs {spec.target.gpu}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        want, have = getattr(spec.parallel, name), getattr(ident, name) if ident is not None else None
        if want is not None and have is not None and want != have:
            problems.append(f"{name} {have} vs {want}")
    rank = spec.lora.max_lora_rank if spec.lora.enabled else None
    if rank is not None and ident is not None and ident.lora_rank is not None and ident.lora_rank != rank:
        problems.append(f"LoRA rank {ident.lora_rank} vs {rank}")
    if problems:
        return Basis(
            cal.name, False, f"uncalibrated: measured on {said}; differs from the spec ({'; '.join(problems)})"
        )
    unchecked = not_compared(ident, spec)
    if unchecked:
        return Basis(
            cal.name,
            True,
            f"measured on {said}; not checked against this deployment ({'; '.join(unchecked)})",
            tuple(unchecked),
        )
    return Basis(cal.name, True, f"measured on {said}")
