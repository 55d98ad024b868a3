"""The environment variables that pass capplan's settings from the launcher to the engine
(pure names: both sides import them from here)."""

from __future__ import annotations

PLAN = "CAPPLAN_PLAN"
"""The plan file the vLLM plugin puts in force in every engine and worker process."""

COMMAND = "CAPPLAN_COMMAND"
"""The server command `capplan apply` runs, as a JSON list: the plugin reads it with vLLM's parser
in the server process (capplan.runtime.launch_line), so the launcher imports no vLLM."""

CALIBRATION = "CAPPLAN_CALIBRATION"
"""A calibration file (or folder) of the deployment: where it measured the plan, the engine leaves
that graph memory free beside the KV cache instead of estimating it by a throwaway capture."""

GRAPH_MARGIN = "CAPPLAN_GRAPH_MARGIN_GIB"
"""The margin, in GiB, left beside the calibration's measured graph memory."""

CAPTURE_EACH = "CAPPLAN_CAPTURE_EACH"
"""Set to 1 (`capplan calibrate` does): each graph of the real capture is read between one graph and
the next of vLLM's one capture, and the report records each one's seconds and growth (`captures`)."""

PREFIX = "CAPPLAN_"
"""What every capplan environment variable starts with (the plan, the report, the DP audit, the trace)."""

RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
"""vLLM's list of the environment variable prefixes it copies to Ray actors, besides its own
(`vllm.ray.ray_env.get_env_vars_to_copy`). Ray actors do not inherit the launching process's
environment; those that get only that list (engine cores under `--data-parallel-backend ray`,
the workers of vLLM's first Ray executor) never see the plan without `PREFIX` in it."""


def with_ray_prefix(value: str | None) -> str:
    """`RAY_PREFIXES`' value with capplan's prefix added at the end where the user's list lacks it."""
    prefixes = [p.strip() for p in (value or "").split(",") if p.strip()]
    return ",".join(prefixes if PREFIX in prefixes else [*prefixes, PREFIX])
