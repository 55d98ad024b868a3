"""What `capplan verify` prints: eager ranges and the verdict on stdout, violations on stderr."""

from __future__ import annotations

from capplan.analysis.verify import VerifyReport
from capplan.present.jsondoc import dumps


def verify_lines(report: VerifyReport, plan_name: str, as_json: bool) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr lines) of a verify report."""
    if as_json:
        out = [dumps(report.to_json(), indent=2)]
    else:
        out = [f"eager: {region}" for region in report.eager_regions]
        checked = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in report.checked.items())
        if report.ok:
            out.append(f"ok: {plan_name} is free of every failure class ({checked} checked)")
    return out, [f"violation: {violation.line()}" for violation in report.violations]
