"""The plan file: its format and text (`write`), loading it as the plan its spec
compiles to (`read`), comparing a file with that plan (`compare`), and where it
goes (`paths`)."""

from capplan.planfile.compare import first_difference, plan_difference, size_problem, stale_reason
from capplan.planfile.paths import default_plan_path, regenerate_command, relative
from capplan.planfile.read import load_plan, plan_from_data
from capplan.planfile.write import (
    MAX_LINE,
    int_runs,
    iter_plan_lines,
    plan_file_data,
    plan_to_json,
    render_plan,
    render_spec,
)

__all__ = [
    "MAX_LINE",
    "default_plan_path",
    "first_difference",
    "int_runs",
    "iter_plan_lines",
    "load_plan",
    "plan_difference",
    "plan_file_data",
    "plan_from_data",
    "plan_to_json",
    "regenerate_command",
    "relative",
    "render_plan",
    "render_spec",
    "size_problem",
    "stale_reason",
]
