"""The environment variables that pass capplan's settings from the launcher to the engine
(pure names: both sides import them from here)."""

from __future__ import annotations

PLAN = "CAPPLAN_PLAN"
"""The plan file the vLLM plugin puts in force in every engine and worker process."""
