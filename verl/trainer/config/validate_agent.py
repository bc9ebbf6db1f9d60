"""Rules of the rollout's agent-loop and multi-turn keys: the loop names, the agent-loop config file,
the tool format and the multi-turn limits.

Split from validate.py. These keys name things owned by the agent loop (`verl.experimental`, above
the workers layer), so the rollout section's class cannot check them itself; the tables are read
through `verl.trainer.config.fields`.
"""

from __future__ import annotations

import os

from verl.trainer.config.errors import did_you_mean


def _check_agent_loop_keys(rollout: dict, errors: list[str]):
    """Tracing and over-sampling: keys only the agent-loop rollout reads."""
    import importlib.util

    trace, rate = rollout["trace"], rollout["over_sample_rate"]
    backend, multi_turn = trace["backend"], rollout["multi_turn"]["enable"]
    if backend is not None and not multi_turn:
        errors.append(
            f"actor_rollout_ref.rollout.trace.backend={backend} traces agent-loop episodes only (as upstream), and "
            "multi_turn.enable=false generates without agent loops, so nothing would be traced; set "
            "actor_rollout_ref.rollout.multi_turn.enable=true or trace.backend=null"
        )
    package = {"mlflow": "mlflow", "weave": "weave"}.get(backend)
    if package and importlib.util.find_spec(package) is None:
        errors.append(
            f"actor_rollout_ref.rollout.trace.backend={backend} needs the {package} package, which is not installed; "
            f"run `pip install {package}` or set trace.backend=null"
        )
    _check_agent_loop_names(rollout["agent"], errors)
    limit = trace["max_samples_per_step_per_worker"]
    if limit is not None and limit < 0:
        errors.append(
            f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={limit} must be >= 0, or null to "
            "trace every episode"
        )
    if not 0 <= rate < 1:
        errors.append(
            f"actor_rollout_ref.rollout.over_sample_rate={rate} must be in [0, 1): the share of each batch's "
            "episodes cut once the others have finished (0: off)"
        )
    elif rate > 0 and not multi_turn:
        errors.append(
            f"actor_rollout_ref.rollout.over_sample_rate={rate} cuts the slowest agent-loop episodes, and "
            "multi_turn.enable=false generates without agent loops (one batch, nothing to cut); set "
            "actor_rollout_ref.rollout.multi_turn.enable=true or over_sample_rate=0"
        )


def _check_agent_loop_names(agent: dict, errors: list[str]):
    """The agent-loop config file reads as a list of loops, and the default loop is one that exists:
    registered here, registered by that file, or an import path (imported when the worker builds it)."""
    from verl.trainer.config.fields import agent_loop_choices, agent_loop_file_names

    names = set(agent_loop_choices())
    path = agent["agent_loop_config_path"]
    if path:
        try:
            names.update(agent_loop_file_names(path))
        except (OSError, ValueError) as e:
            errors.append(str(e))
            return
    default = agent["default_agent_loop"]
    if default not in names and "." not in default:
        errors.append(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={default!r} is not an agent loop: choose one of "
            f"{sorted(names)}, register it in agent.agent_loop_config_path, or give the import path of an "
            "AgentLoopBase subclass"
        )


def _check_tool_format(rollout: dict, errors: list[str]):
    """`multi_turn.format` names one of the agent loop's tool parsers (a table above the workers layer,
    so the rollout section's class cannot list the choices itself)."""
    from verl.trainer.config.fields import tool_format_choices

    choices = tool_format_choices()
    value = rollout["multi_turn"]["format"]
    if value not in choices:
        key = "actor_rollout_ref.rollout.multi_turn.format"
        hint = did_you_mean(str(value), list(choices))
        errors.append(f"{key}={value!r} is not a valid choice.{hint} Valid values: {', '.join(choices)}")


def _check_multi_turn(c: dict, errors: list[str]):
    rollout = c["actor_rollout_ref"]["rollout"]
    _check_tool_format(rollout, errors)
    _check_agent_loop_keys(rollout, errors)
    mt = rollout["multi_turn"]
    if not mt["enable"]:
        return
    path = mt["tool_config_path"]
    if path and not os.path.isfile(os.path.expanduser(path)):
        errors.append(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path!r} does not exist; point it at a tool "
            "config YAML (see docs/multi_turn.md) or leave it null for no tools"
        )
    # the turn and call limits are MultiTurnConfig's own checks
