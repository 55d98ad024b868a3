"""Run on the oracle's Python, in a fresh process, with one release's vLLM sources on the path: the
plugin loaded where vLLM's API server loads it (while `vllm serve` builds its parser) imports no
vLLM module the server would not import without capplan, and the engine's hooks go in at the import
of their modules, in this process and in one forked from it (vLLM's engine core under default
multiprocessing), the guard's too.

    python lazy_hooks_check.py PLAN

Prints one JSON object:
- "alone": the vLLM modules the server's parser imports with no plugin (a forked child, first);
- "guard": with the plugin and no plan: the modules it added, then whether dp.guard is in place
  after the manager's module is imported;
- "plan": with CAPPLAN_PLAN: the modules the plugin added; then, in a forked child and in this
  process, after the engine's modules are imported: the hooks in place, the selected ones, and
  the number of the plan's graphs as vLLM's descriptors;
- "refused": in a forked child, a hook whose parameter vLLM lacks, waiting for the model
  runner's import: what that import raised.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ENGINE = ("vllm.v1.worker.gpu.cudagraph_utils", "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_worker")


def vllm_modules() -> set[str]:
    return {m for m in sys.modules if m == "vllm" or m.startswith("vllm.")}


def build_server_parser(plugin) -> None:
    """`vllm serve`'s parser, built as vLLM's entry point builds it; vLLM loads its general plugins
    while it adds the engine arguments (the plugin is not an installed distribution here: vLLM's
    plugin loader is given it)."""
    import vllm.plugins as plugins

    plugins.load_plugins_by_group = lambda group: (
        {"capplan": plugin} if plugin and group == plugins.DEFAULT_PLUGINS_GROUP else {}
    )
    from vllm import platforms

    if platforms.current_platform.is_unspecified():  # as capplan's own reading does on a CPU
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from vllm.entrypoints.cli import serve as serve_cli
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    serve_cli.ServeSubcommand().subparser_init(top.add_subparsers(required=False, dest="subparser"))


def in_child(work) -> dict:
    """work() in a forked child; what it returned (a dict), or {"error": ...}."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = work()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


def hooks_in_place(selected) -> dict:
    from capplan.runtime.hooking import MARK, resolve
    from capplan.runtime.imports import module_of
    from capplan.runtime.registry import installed

    for module in (*ENGINE, *(module_of(h.at or h.target) for h in selected)):
        __import__(module)
    placed = [
        h.name for h in selected if h.install is not None and getattr(resolve(h.at or h.target), MARK, None) == h.name
    ]
    ctx = installed()
    return {
        "in_place": placed,
        "selected": [h.name for h in selected if h.install is not None],
        "descriptors": len(ctx.vllm_descs) if ctx is not None else None,
    }


def main() -> None:
    plan_path = sys.argv[1]
    os.environ.pop("CAPPLAN_PLAN", None)
    from capplan.runtime import plugin

    start = vllm_modules()

    def alone() -> dict:
        build_server_parser(None)
        return {"modules": sorted(vllm_modules() - start)}

    def guard() -> dict:
        build_server_parser(plugin.register)
        added = sorted(vllm_modules() - start)
        from capplan.runtime.hooking import MARK, resolve
        from capplan.runtime.hooks import dp

        __import__(ENGINE[0])
        return {"modules": added, "guard_in_place": getattr(resolve(dp.GUARD.target), MARK, None) == dp.GUARD.name}

    result = {"alone": in_child(alone), "guard": in_child(guard)}
    os.environ["CAPPLAN_PLAN"] = plan_path
    build_server_parser(plugin.register)
    import vllm

    from capplan.planfile import load_plan
    from capplan.runtime import registry
    from capplan.runtime.hooking import Hook, Need
    from capplan.runtime.imports import when_imported
    from capplan.runtime.versions import detect_release

    release = detect_release(vllm.__version__)
    selected = registry.selected(Need(release, load_plan(Path(plan_path)), os.environ))
    plan_result = {"modules": sorted(vllm_modules() - start)}

    def broken() -> dict:
        hook = Hook("t.broken", "vllm.v1.worker.gpu.model_runner:create_lora_capture_hook", "test", reads=("no_such",))
        when_imported(ENGINE[1], lambda: registry.checked([hook], release, vllm.__version__))
        try:
            __import__(ENGINE[1])
        except Exception as exc:  # noqa: BLE001 - what the import raised is the result
            return {"raised": type(exc).__name__, "line": str(exc), "imported": ENGINE[1] in sys.modules}
        return {"raised": None}

    result["refused"] = in_child(broken)
    plan_result["forked"] = in_child(lambda: hooks_in_place(selected))
    plan_result["here"] = hooks_in_place(selected)
    result["plan"] = plan_result
    print(json.dumps(result))


if __name__ == "__main__":
    main()
