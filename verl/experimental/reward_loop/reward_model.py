"""A generative reward model served to the reward function: upstream's `reward_router_address`.

Upstream's reward loop, given `reward_model.enable=true` together with `custom_reward_function.path`
(and `reward_model.use_reward_loop`, its default), scores every sample with the function alone and
serves the reward model to it: a rollout engine per replica behind a router, whose address
(`host:port`) and the reward model's tokenizer reach the function as the keyword arguments
`reward_router_address` and `reward_model_tokenizer`. The function asks the model whatever it likes,
e.g. FAPO's `compute_score_fapo` posts the judge prompt's ids to `http://{reward_router_address}/generate`
and parses the verdict.

Here the same: `RewardModelManager` (upstream's name) starts `num_replicas` Ray actors, each holding the
reward model in the rollout engine `reward_model.rollout.name` (`hf`, the built-in engine, on CPU) behind
`verl.experimental.reward_loop.generation_server` (SGLang's `/generate`, OpenAI's `/v1/chat/completions`),
and, with more than one replica, a round-robin router in front of them. `num_replicas` is upstream's:
the workers the model is given (`reward_model.n_gpus_per_node x nnodes` in its own pool with
`enable_resource_pool`, else the trainer's `n_gpus_per_node x nnodes`) divided by
`reward_model.rollout.tensor_model_parallel_size`.

The trainer starts the servers in `init_workers` (`RayPPOTrainer.reward_model_manager`), before the first
reward. `with_reward_model(compute_score, config)` is what the reward managers call: it passes the two
keyword arguments on every call, finding the servers on the first one (or starting them, for a driver
that scores without `init_workers`). They are one named Ray actor per job (`get_if_exists`), so the
training and validation reward functions, and a reward function shipped to another process
(`launch_reward_fn_async`), share them; they live as long as the process that started them.

Placement and limits:
- CPU: each replica is an actor that reserves no CPU (it shares the cores with the trainer's workers, as
  upstream's colocated servers share its GPUs); only the built-in engine's `tensor_model_parallel_size=1`.
- GPU: each replica reserves `tensor_model_parallel_size` GPUs, so the model needs GPUs of its own
  (`reward_model.enable_resource_pool=true`); colocated on the trainer's GPUs (upstream sleeps the engines
  between uses) is refused, naming that key. Not run on a GPU yet.
- The engines stay loaded for the whole run (`reward_model.rollout.free_cache_engine` is not read).
"""

from __future__ import annotations

import inspect
import itertools
import threading
from collections.abc import Callable

ACTOR_NAME = "verl_reward_model_servers"
"""The named actor (one per Ray job and served model, `actor_name`) holding the replicas and the router."""
_HANDLES: list = []
"""The handles this process got: Ray ends an actor once its creator drops every handle to it, so they are
kept for the life of the process (the trainer's, which starts the servers in `init_workers`)."""


def actor_name(spec: dict) -> str:
    """`ACTOR_NAME` and a digest of what is served (another model or layout in the same job: other servers)."""
    import hashlib
    import json

    return f"{ACTOR_NAME}_{hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]}"


def uses_generative_reward_model(config) -> bool:
    """Upstream's reward loop with a reward model and a custom reward function (module docstring)."""
    rm = config.get("reward_model") or {}
    custom = config.get("custom_reward_function") or {}
    return bool(rm.get("enable")) and bool(custom.get("path")) and bool(rm.get("use_reward_loop", True))


def serving_spec(config) -> dict:
    """Everything the servers need from the trainer config, as plain data (picklable, no OmegaConf).

    `config` is the trainer config, or (upstream's `RewardModelManager(config.reward_model)`) the
    `reward_model` section alone: then the model is served on its own `n_gpus_per_node x nnodes` (upstream's
    standalone layout) with the packaged rollout defaults under `reward_model.rollout`."""
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})

    section_only = "reward_model" not in config
    rm = config if section_only else config.reward_model
    trainer = {} if section_only else config.trainer
    rollout = plain(rm.get("rollout"))
    tp = int(rollout.get("tensor_model_parallel_size") or 1)
    if section_only or rm.get("enable_resource_pool"):
        world = int(rm.n_gpus_per_node) * int(rm.nnodes)
    else:
        world = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    if world < tp or world % tp:
        raise ValueError(
            f"reward_model.rollout.tensor_model_parallel_size={tp} does not divide the {world} workers the reward "
            "model is served on (reward_model.n_gpus_per_node x nnodes with enable_resource_pool, else the trainer's)"
        )
    model = rm.model
    return {
        "model_path": str(model.path),
        "trust_remote_code": bool(model.get("trust_remote_code", False)),
        "rollout": rollout,
        "base_rollout": None if section_only else plain(config.actor_rollout_ref.rollout),
        "num_replicas": world // tp,
        "tp": tp,
        "own_pool": section_only or bool(rm.get("enable_resource_pool")),
        "device": str(trainer.get("device", "auto")),
    }


def _check_engine(spec: dict) -> None:
    name = spec["rollout"].get("name")
    if not name or name == "???":
        raise ValueError(
            "reward_model.rollout.name must name the engine that serves the generative reward model (hf: the "
            "built-in one; vllm, sglang on GPU)"
        )
    for key in ("data_parallel_size", "expert_parallel_size"):
        if int(spec["rollout"].get(key) or 1) != 1:
            raise ValueError(
                f"reward_model.rollout.{key}={spec['rollout'][key]}: a reward model replica is one engine of "
                "tensor_model_parallel_size devices; set it to 1 (replicas = the workers / tp share the load)"
            )
    if name == "hf" and spec["tp"] != 1:
        raise ValueError(
            f"reward_model.rollout.tensor_model_parallel_size={spec['tp']}: the built-in engine (rollout.name=hf) "
            "serves on one device; set it to 1 (more replicas then share the load)"
        )


class _Replica:
    """One reward model replica: its engine behind a generation server, in a Ray actor."""

    def __init__(self, spec: dict):
        import ray

        from verl.experimental.reward_loop.generation_server import (
            ServerThread,
            build_engine_server,
            serving_rollout_config,
        )

        rollout = serving_rollout_config(spec["rollout"], base=spec["base_rollout"])
        server = build_engine_server(spec["model_path"], rollout, spec["model_path"], spec["trust_remote_code"])
        self.thread = ServerThread(server, host=ray.util.get_node_ip_address()).start()

    def address(self) -> str:
        return self.thread.address


class _Servers:
    """The replicas and (with more than one) the router: the named actor `ACTOR_NAME`."""

    def __init__(self, spec: dict):
        import ray

        _check_engine(spec)
        gpu = _on_gpu(spec["device"])
        if gpu and not spec["own_pool"]:
            raise ValueError(
                "a generative reward model on GPU needs GPUs of its own here: set reward_model.enable_resource_pool="
                "true with reward_model.n_gpus_per_node / nnodes (upstream can also colocate it with the trainer, "
                "sleeping its engines between uses; that is not implemented)"
            )
        options = {"num_gpus": spec["tp"], "num_cpus": 1} if gpu else {"num_cpus": 0}
        replica_cls = ray.remote(_Replica)
        self.replicas = [replica_cls.options(**options).remote(spec) for _ in range(spec["num_replicas"])]
        self.addresses = ray.get([r.address.remote() for r in self.replicas])
        self.router = None
        if len(self.addresses) > 1:
            self.router = _RouterThread(self.addresses, ray.util.get_node_ip_address()).start()

    def router_address(self) -> str:
        return self.router.address if self.router is not None else self.addresses[0]


def _on_gpu(device: str) -> bool:
    """Whether the replicas take GPUs: trainer.device, or with `auto` whether the Ray cluster has any (the
    driver that starts them may run on a node without one)."""
    if device != "auto":
        from verl.utils.device import preference_uses_accelerator

        return preference_uses_accelerator(device)
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


class _RouterThread:
    """Round-robin forwarding of every POST / GET to the replicas (upstream's naive router)."""

    def __init__(self, addresses: list[str], host: str):
        from verl.experimental.reward_loop.generation_server import ServerThread

        self._next = itertools.cycle(addresses)
        self._server_thread = ServerThread(self, host=host)  # serves self.app() in its thread

    def start(self) -> _RouterThread:
        self._server_thread.start()
        return self

    @property
    def address(self) -> str:
        return self._server_thread.address

    def app(self):
        import aiohttp
        from aiohttp import web

        async def client_session(_app):  # made in the server's loop, closed with it
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
            yield
            await self._session.close()

        async def forward(request):
            url = f"http://{next(self._next)}{request.path_qs}"
            body = await request.read()
            async with self._session.request(
                request.method, url, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

        app = web.Application(client_max_size=64 << 20)
        app.cleanup_ctx.append(client_session)
        app.router.add_route("*", "/{tail:.*}", forward)
        return app


class RewardModelManager:
    """Upstream's name: the reward model's servers for this job (started on first use, then shared).

    `RewardModelManager(config)` takes the trainer config (the `reward_model`, `trainer` and
    `actor_rollout_ref.rollout` sections are read) or, as upstream's, the `reward_model` section alone
    (`serving_spec`); `get_router_address()` is what the reward function receives as `reward_router_address`.
    """

    def __init__(self, config, resource_pool=None):
        if resource_pool is not None:
            raise NotImplementedError(
                "RewardModelManager(resource_pool=...): the servers place themselves (module docstring)"
            )
        self.spec = config if isinstance(config, dict) and "model_path" in config else serving_spec(config)
        self._actor = None

    @property
    def actor(self):
        import ray

        if self._actor is None:
            if not ray.is_initialized():
                raise RuntimeError(
                    "a generative reward model is served from the Ray cluster: call ray.init() first (main_ppo does)"
                )
            servers = ray.remote(_Servers).options(
                name=actor_name(self.spec), get_if_exists=True, num_cpus=0, lifetime=None, max_concurrency=4
            )
            self._actor = servers.remote(self.spec)
            _HANDLES.append(self._actor)
        return self._actor

    def get_router_address(self) -> str:
        import ray

        return ray.get(self.actor.router_address.remote())

    def wake_up(self) -> None:
        """Upstream's; the engines here stay loaded for the run (module docstring)."""

    def sleep(self) -> None:
        """Upstream's; the engines here stay loaded for the run (module docstring)."""


class _RewardModelArgs:
    """`reward_router_address` and `reward_model_tokenizer`, made on first use and dropped when pickled."""

    def __init__(self, spec: dict):
        self.spec = spec
        self._lock = threading.Lock()
        self._kwargs: dict | None = None

    def __getstate__(self):
        return {"spec": self.spec}

    def __setstate__(self, state):
        self.__init__(state["spec"])

    def get(self) -> dict:
        with self._lock:
            if self._kwargs is None:
                from verl.utils.tokenizer import hf_tokenizer

                address = RewardModelManager(self.spec).get_router_address()
                tokenizer = hf_tokenizer(self.spec["model_path"], trust_remote_code=self.spec["trust_remote_code"])
                self._kwargs = {
                    "reward_router_address": address,
                    "reward_model_tokenizer": tokenizer,
                }
            return self._kwargs


def reward_model_args(config) -> _RewardModelArgs:
    """What a custom reward loop class is built with: `.get()` -> the two keyword arguments (servers found or
    started on first use)."""
    return _RewardModelArgs(serving_spec(config))


def with_reward_model(compute_score: Callable, config) -> Callable:
    """`compute_score` called with `reward_router_address` and `reward_model_tokenizer` as well (module
    docstring); refuses a function that cannot take them, naming it."""
    try:
        params = inspect.signature(compute_score).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in ("reward_router_address", "reward_model_tokenizer") if k not in params]
    if params and missing and not takes_kwargs:
        name = getattr(compute_score, "__name__", repr(compute_score))
        raise TypeError(
            f"custom_reward_function {name}{inspect.signature(compute_score)} does not take {missing}: with "
            "reward_model.enable=true the reward function is given the reward model (upstream's reward loop); "
            "add those keyword arguments (or **kwargs), or drop reward_model.enable"
        )
    args = reward_model_args(config)

    if inspect.iscoroutinefunction(compute_score):

        async def score(*a, **kw):
            return await compute_score(*a, **kw, **args.get())

    else:

        def score(*a, **kw):
            return compute_score(*a, **kw, **args.get())

    score.__name__ = getattr(compute_score, "__name__", "compute_score")
    return score


__all__ = [
    "RewardModelManager",
    "reward_model_args",
    "serving_spec",
    "uses_generative_reward_model",
    "with_reward_model",
]
