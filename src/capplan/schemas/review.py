"""The review policy: the thresholds a repository sets on what a plan change may cost, and the
overrides its reviewers accepted (`capplan diff --policy FILE`; `capplan/analysis/review.py`
judges a diff by it). Validation only."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from capplan.schemas.spec import PRINTABLE

Measure = Literal[
    "graphs", "capture_seconds", "graph_memory_gib", "batches_to_eager", "lora_case_moves", "graphs_not_priced"
]
MEASURES: tuple[Measure, ...] = (
    "graphs", "capture_seconds", "graph_memory_gib", "batches_to_eager", "lora_case_moves", "graphs_not_priced"
)  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Limit(_Strict):
    """How much one measure may grow: above `warn` (or `warn_percent` of the old plan's value)
    the verdict is at least warn, above `deny` (or `deny_percent`) it is deny. A decrease never
    exceeds a limit."""

    warn: float | None = Field(None, ge=0, le=1e12, description="Warn when the measure grows by more than this.")
    deny: float | None = Field(None, ge=0, le=1e12, description="Deny when the measure grows by more than this.")
    warn_percent: float | None = Field(
        None, ge=0, le=1e6, description="Warn when it grows by more than this percent of the old plan's value."
    )
    deny_percent: float | None = Field(
        None, ge=0, le=1e6, description="Deny when it grows by more than this percent of the old plan's value."
    )

    @model_validator(mode="before")
    @classmethod
    def _ints_are_numbers(cls, data: object) -> object:
        if isinstance(data, dict):  # YAML's 200 is an int: a limit takes it as the number it is
            return {k: float(v) if type(v) is int else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _something_and_in_order(self) -> Limit:
        if all(v is None for v in (self.warn, self.deny, self.warn_percent, self.deny_percent)):
            raise ValueError("give warn, deny, warn_percent or deny_percent")
        for a, b in (("warn", "deny"), ("warn_percent", "deny_percent")):
            low, high = getattr(self, a), getattr(self, b)
            if low is not None and high is not None and low > high:
                raise ValueError(f"{a} ({low:g}) is above {b} ({high:g}): a warning comes before a denial")
        return self


PERCENT_OF_OLD: frozenset[Measure] = frozenset({"graphs", "capture_seconds", "graph_memory_gib"})  # have an old value


class Override(_Strict):
    """A reviewer's acceptance of one plan, whatever the thresholds say: it applies to the plan
    of this fingerprint only, so it is cleared when the plan's graphs change."""

    fingerprint: str = Field(description="The accepted plan's fingerprint.")
    reason: str = Field(min_length=1, max_length=500, pattern=PRINTABLE, description="Why it was accepted.")
    by: str | None = Field(None, min_length=1, max_length=200, pattern=PRINTABLE, description="Who accepted it.")

    @field_validator("fingerprint")
    @classmethod
    def _a_fingerprint(cls, value: str) -> str:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", value):
            raise ValueError("must be sha256: and 64 lowercase hex digits, as `capplan diff --policy` prints it")
        return value


class ReviewPolicy(_Strict):
    """`.capplan/review.yaml` (any name, given with `--policy`)."""

    thresholds: dict[Measure, Limit] = Field(default_factory=dict, description="A limit per measure.")
    overrides: list[Override] = Field(default_factory=list, max_length=10_000, description="Accepted plans.")

    @model_validator(mode="after")
    def _percent_of_an_old_value(self) -> ReviewPolicy:
        for measure, limit in self.thresholds.items():
            if measure not in PERCENT_OF_OLD and (limit.warn_percent is not None or limit.deny_percent is not None):
                raise ValueError(
                    f"thresholds.{measure}: counts what the change does (no old value to take a percent of); "
                    "give warn or deny"
                )
        return self
