"""Launching vLLM with a plan in force (`capplan apply`, `capplan flags`), before anything starts.

Nothing here imports vLLM, torch or capplan.runtime (the in-engine plugin): `launch` checks
that the command's Python sees vLLM, the plugin and a release the plan runs on; `cmdline`
reads a `vllm serve` / api_server command line (with vLLM's own parser where vLLM is
importable: `vllm_cli`); `engine_args` refuses what contradicts the plan, adds what it
determines, and prints the flags. The settings compared are capplan.settings' table.
"""
