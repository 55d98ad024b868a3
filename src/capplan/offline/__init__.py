"""Offline GPU drivers: `capplan apply --smoke` and `capplan calibrate`.

Each builds vLLM engines in child processes of its own (`python -m
capplan.offline.smoke`, `python -m capplan.offline.calibrate`), with a plan in
force through CAPPLAN_PLAN, and reads what they report back through files. They
import vLLM only in those children, lazily, and never import the in-engine
plugin (`capplan.runtime`) or the launcher (`capplan.launcher`): the plugin is
loaded by vLLM itself in the engine process, and its report reaches the driver
through CAPPLAN_REPORT.
"""
