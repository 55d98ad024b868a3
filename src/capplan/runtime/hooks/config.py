"""Hooks on vLLM's configuration: the server's own command read against the plan, the plan
checked where the config becomes final, the plan's fingerprint in the compile-cache key, and
the V1 runner refused.

- `FlexibleArgumentParser.parse_args` (with CAPPLAN_COMMAND, set by `capplan apply`): the
  server parses its own command completed from the plan, or stops on a flag that contradicts
  it, before anything starts (capplan.runtime.launch_line).
- `EngineArgs.create_engine_config`: in the process that starts the engine (the API
  server, or the script that builds LLM), a mismatched plan or an engine on vLLM's V1
  runner, or Ray actors the plan would not reach, stops the launch before any process is
  spawned or weight loaded (class 10).
- `VllmConfig.compute_hash`: mixes in the plan fingerprint, so the torch.compile cache is
  never shared between different plans (class 9).
- `Worker.init_device`: fails closed when vLLM put the engine on its V1 model runner,
  where none of the hooks apply and the engine would serve without the plan (class 10).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from capplan.envvars import COMMAND, PLAN, PREFIX, RAY_PREFIXES
from capplan.runtime.context import HookContext
from capplan.runtime.engine_check import breakable_problem, config_problem
from capplan.runtime.hooking import Hook, Need, PlanNotInForce, check_attributes
from capplan.runtime.log import log


def v1_runner_message(plan_path: str) -> str:
    return (
        f"capplan: vLLM chose its V1 model runner for this engine, where the plan {plan_path} cannot be in "
        "force; refusing to start (run on Model Runner V2: VLLM_USE_V2_MODEL_RUNNER=1, and no feature "
        "MRV2 lacks; or remove CAPPLAN_PLAN to run without a plan)"
    )


def ray_problem(plan_path: str, parallel_config: Any) -> str | None:
    """The refusal when Ray actors of this engine would not get CAPPLAN_PLAN, or None. A Ray
    actor does not inherit this process's environment; a worker or engine core without the
    plan would run vLLM's graphs while this process believes the plan in force. What reaches
    each kind of actor is vLLM's own rule, asked here:
    - engine cores under `--data-parallel-backend ray`: the variables `get_env_vars_to_copy`
      names (vLLM's, a few prefixes, `VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`);
    - workers of Ray's executor: vLLM's first one (`VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0`, before
      0.33.0) copies the same list; its second (the default, the only one from 0.33.0) copies
      the whole environment but what the user's `RAY_NON_CARRY_OVER_ENV_VARS` file excludes."""
    ray_cores = getattr(parallel_config, "data_parallel_backend", "mp") == "ray"
    ray_workers = bool(getattr(parallel_config, "use_ray", False))
    if not (ray_cores or ray_workers):
        return None
    import vllm.envs as envs
    from vllm.ray.ray_env import RAY_NON_CARRY_OVER_ENV_VARS, get_env_vars_to_copy

    listed = ray_cores or (ray_workers and not getattr(envs, "VLLM_USE_RAY_V2_EXECUTOR_BACKEND", True))
    if listed and PLAN not in get_env_vars_to_copy(destination="capplan's check"):
        who = "engine cores are Ray actors (--data-parallel-backend ray)" if ray_cores else "workers are Ray actors"
        return (
            f"capplan: this engine's {who}, which get only the environment variables vLLM copies to them, "
            f"and {PLAN} is not one of them: they would run without the plan {plan_path}; refusing to start "
            f"(set {RAY_PREFIXES}={PREFIX}, as capplan apply does, and keep the plan at this path on every node)"
        )
    if PLAN in RAY_NON_CARRY_OVER_ENV_VARS:
        return (
            f"capplan: vLLM's RAY_NON_CARRY_OVER_ENV_VARS file keeps {PLAN} from this engine's Ray actors: they "
            f"would run without the plan {plan_path}; refusing to start (remove {PLAN} from that file)"
        )
    return None


def _create_engine_config(ctx: HookContext, hook: Hook, original: Any) -> Any:
    @functools.wraps(original)
    def create_engine_config(*args: Any, **kwargs: Any) -> Any:
        unread = launch_line_unread(ctx)
        if unread:
            raise SystemExit(unread)
        config = original(*args, **kwargs)
        if not config.use_v2_model_runner:
            raise SystemExit(v1_runner_message(ctx.plan_path))
        problem = (
            breakable_problem(ctx.plan, ctx.plan_path, ctx.release)
            or ray_problem(ctx.plan_path, config.parallel_config)
            or config_problem(ctx.plan, ctx.plan_path, config)
        )
        if problem:
            raise SystemExit(problem)
        return config

    return create_engine_config


def _parse_args(ctx: HookContext, hook: Hook, original: Any) -> Any:
    """vLLM's server parser reads the command `capplan apply` passed, completed from the plan."""
    import sys

    from capplan.errors import CapplanError, printable
    from capplan.runtime.launch_line import ParserFailed

    reading = ctx.launch

    @functools.wraps(original)
    def parse_args(self: Any, args: Any = None, namespace: Any = None) -> Any:
        given = list(sys.argv[1:] if args is None else args)
        try:
            full, said = reading.arguments(ctx.plan, ctx.plan_path, given)
        except CapplanError as exc:
            raise SystemExit(f"capplan: {exc.one_line()}") from None
        except ParserFailed as exc:  # vLLM's own parser failed on the line: one line, no traceback
            raise SystemExit(
                f"capplan: the server's command could not be read with vLLM's parser "
                f"({printable(str(exc))[:300]}); run capplan apply --dry-run on it"
            ) from None
        if said is None:
            return original(self, args, namespace)
        for line in said:
            log.info("%s", line.removeprefix("capplan: "))
        return original(self, full, namespace)

    return parse_args


def _command_given(need: Need) -> bool:
    return bool(need.env.get(COMMAND))


def launch_line_unread(ctx: HookContext) -> str | None:
    """The refusal when this process is the server `capplan apply` started but its parser read the
    command before the plugin could complete it (the plugin loaded late): None otherwise."""
    import sys

    if not ctx.launch.unread(sys.argv[1:]):
        return None
    return (
        f"capplan: vLLM parsed this server's command before capplan's plugin was loaded, so what the plan "
        f"{ctx.plan_path} adds to it was not added; refusing to start (run capplan apply --dry-run and start "
        "the completed command it prints)"
    )


def _compute_hash(ctx: HookContext, hook: Hook, original: Any) -> Any:
    fingerprint = ctx.plan.fingerprint

    @functools.wraps(original)
    def compute_hash(*args: Any, **kwargs: Any) -> str:
        base: str = original(*args, **kwargs)
        return hashlib.sha256(f"{base}|capplan:{fingerprint}".encode()).hexdigest()[: len(base)]

    return compute_hash


def _init_device(ctx: HookContext, hook: Hook, original: Any) -> Any:
    @functools.wraps(original)
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        check_attributes(hook, self)
        if not self.use_v2_model_runner:
            raise PlanNotInForce(v1_runner_message(ctx.plan_path))
        return result

    return init_device


HOOKS = (
    Hook(
        "config.launch_line",
        "vllm.utils.argparse_utils:FlexibleArgumentParser.parse_args",
        "the server's own command, as capplan apply passed it, read by vLLM's parser here and completed from the "
        "plan; a flag against the plan stops it before any engine process starts (class 10)",
        _parse_args,
        reads=("self", "args", "namespace"),
        when=_command_given,
    ),
    Hook(
        "config.v1_runner",
        "vllm.v1.worker.gpu_worker:Worker.init_device",
        "refuse an engine vLLM put on its V1 model runner, where no hook applies (class 10)",
        _init_device,
        attributes=("use_v2_model_runner", "model_runner"),
    ),
    Hook(
        "config.early_check",
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        "check plan against the final engine config before anything starts (class 10)",
        _create_engine_config,
    ),
    Hook(
        "config.compute_hash",
        "vllm.config:VllmConfig.compute_hash",
        "put the plan fingerprint into vLLM's compile-cache key (class 9)",
        _compute_hash,
    ),
)
