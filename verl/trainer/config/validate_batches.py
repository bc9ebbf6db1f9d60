"""Batch-size rules of the PPO config: which roles run, how many ranks there are, and whether each
role's batches split evenly over its data-parallel ranks.

Split from validate.py (which calls these after the structural walk). Semantics are upstream's:
`data.train_batch_size` and `ppo_mini_batch_size` count prompts (x `rollout.n` sequences), split
evenly over the data-parallel ranks; `*_micro_batch_size_per_gpu` counts sequences on one rank. Each
message names the key, the numbers that do not divide, and a value that would.
"""

from __future__ import annotations

from verl.trainer.config.interpolation import plain
from verl.utils.ulysses_keys import role_sp


def _get(c: dict, key: str):
    node = c
    for part in key.split("."):
        node = node[part]
    return node


def need_critic(cfg) -> bool:
    """Whether the run trains a value function (upstream: critic.enable, else adv_estimator == gae)."""
    c = plain(cfg)
    enable = c["critic"].get("enable")
    return bool(enable) if enable is not None else c["algorithm"]["adv_estimator"] == "gae"


def need_reference_policy(cfg) -> bool:
    """Whether the run needs the frozen reference policy (any KL term)."""
    c = plain(cfg)
    return bool(c["actor_rollout_ref"]["actor"]["use_kl_loss"] or c["algorithm"]["use_kl_in_reward"])


def world_size(cfg) -> int:
    """Worker processes (GPUs, or CPU processes) in the trainer's worker group."""
    c = plain(cfg)
    return c["trainer"]["nnodes"] * c["trainer"]["n_gpus_per_node"]


def _next_multiple(start: int, ok) -> int:
    m = max(start, 1)
    while not ok(m):
        m += 1
    return m


def _check_rollout_layout(c: dict, errors: list[str]) -> int | None:
    """Rollout tensor parallelism must tile the workers; returns the world size when it does."""
    world = world_size(c)
    tp = c["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"]
    if tp < 1 or world < 1:
        return None
    if world % tp:
        errors.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {world} workers "
            f"(trainer.nnodes x trainer.n_gpus_per_node), so the engine's tensor-parallel groups cannot be formed; "
            f"use a divisor of {world} or change trainer.n_gpus_per_node"
        )
        return None
    return world


def _check_micro(
    errors: list[str],
    *,
    role: str,
    global_key: str,
    per_gpu_key: str,
    values: dict,
    dp: int,
    dynamic: bool,
    dynamic_key: str,
    per_rank_batch: int | None = None,
    batch_desc: str = "",
):
    """One role's micro-batch: exactly one spelling, required unless packing by tokens, and tiling the mini-batch."""
    g, p = values[global_key.rsplit(".", 1)[-1]], values[per_gpu_key.rsplit(".", 1)[-1]]
    if g is not None and p is not None:
        errors.append(
            f"{global_key}={g} and {per_gpu_key}={p} are both set, but they say the same thing two ways; "
            f"keep only {per_gpu_key} ({global_key} is deprecated)"
        )
        return
    if g is not None:
        if g % dp:
            errors.append(
                f"{global_key}={g} is not divisible by the {dp} data-parallel ranks; set {per_gpu_key} instead"
            )
            return
        p = g // dp
    if p is None:
        if not dynamic:
            errors.append(
                f"{role} needs a micro-batch size: set {per_gpu_key} (sequences per forward pass on one rank), "
                f"or {dynamic_key}=true to pack micro-batches by token count"
            )
        return
    if p < 1:
        errors.append(f"{per_gpu_key}={p} must be at least 1")
        return
    if per_rank_batch is None or dynamic:
        return
    if p >= per_rank_batch:  # an upper bound: the whole mini-batch of a rank fits in one micro-batch
        return
    if per_rank_batch % p:
        divisors = [d for d in range(1, per_rank_batch + 1) if per_rank_batch % d == 0 and d <= p]
        errors.append(
            f"{per_gpu_key}={p} does not divide the {per_rank_batch} sequences each rank gets per mini-batch "
            f"({batch_desc}), so gradient accumulation would drop or double-count sequences; "
            f"use a divisor such as {divisors[-1]}"
        )


def _check_train_batches(c: dict, errors: list[str], world: int, warns: list[str]):
    """Batch arithmetic of the actor (and the critic when it is trained)."""
    arr = c["actor_rollout_ref"]
    n = arr["rollout"]["n"]
    tbs = c["data"]["train_batch_size"]
    try:
        sp = role_sp(arr["actor"], "actor_rollout_ref.actor")[0]
    except ValueError:
        sp = 1  # two different sizes: _check_ulysses reports it
    dp = world // sp if world % sp == 0 else world
    _check_megatron_batch(c, errors, world)
    if (tbs * n) % world:
        good = _next_multiple(tbs, lambda m: (m * n) % world == 0)
        errors.append(
            f"data.train_batch_size x actor_rollout_ref.rollout.n = {tbs} x {n} = {tbs * n} sequences per step is not "
            f"divisible by the {world} workers (trainer.nnodes x trainer.n_gpus_per_node), so the batch cannot be "
            f"split evenly across them; set data.train_batch_size={good} (or another value making the product a "
            f"multiple of {world}) or change trainer.n_gpus_per_node"
        )
    roles = [("actor", "actor_rollout_ref.actor", arr["actor"])]
    if need_critic(c):
        roles.append(("critic", "critic", c["critic"]))
    for role, prefix, sec in roles:
        mini = sec["ppo_mini_batch_size"]
        if mini < 1:
            continue
        if mini > tbs and sec["use_dynamic_bsz"]:
            # upstream's rule: with token packing a mini-batch larger than the batch is the whole batch
            warns.append(
                f"{prefix}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={tbs}, so each step "
                "takes one optimizer step over the whole batch"
            )
            continue
        if mini > tbs:
            errors.append(
                f"{prefix}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={tbs}: a mini-batch is a "
                f"slice of the step's batch (both count prompts); set {prefix}.ppo_mini_batch_size to at most {tbs}"
            )
            continue
        if tbs % mini:
            divs = [d for d in range(1, tbs + 1) if tbs % d == 0 and d <= mini]
            errors.append(
                f"data.train_batch_size={tbs} is not divisible by {prefix}.ppo_mini_batch_size={mini}, so the last "
                f"optimizer step of each batch would see fewer prompts; use a divisor such as {divs[-1]}"
            )
        if (mini * n) % dp:
            errors.append(
                f"{prefix}.ppo_mini_batch_size x rollout.n = {mini} x {n} = {mini * n} sequences is not divisible by "
                f"the {dp} data-parallel ranks, so a mini-batch cannot be split evenly; make it a multiple of {dp} "
                f"(e.g. {prefix}.ppo_mini_batch_size={_next_multiple(mini, lambda m: (m * n) % dp == 0)})"
            )
            continue
        per_rank = mini * n // dp
        _check_micro(
            errors,
            role=role,
            global_key=f"{prefix}.ppo_micro_batch_size",
            per_gpu_key=f"{prefix}.ppo_micro_batch_size_per_gpu",
            values=sec,
            dp=dp,
            dynamic=sec["use_dynamic_bsz"],
            dynamic_key=f"{prefix}.use_dynamic_bsz",
            per_rank_batch=per_rank,
            batch_desc=f"{prefix}.ppo_mini_batch_size {mini} x rollout.n {n} / {dp} ranks",
        )


def _check_megatron_batch(c: dict, errors: list[str], world: int):
    """Upstream's rule for a megatron actor with fixed micro-batches: a step's sequences split into whole
    micro-batches of every data-parallel group (data-parallel size = ranks / (tp x pp x cp))."""
    actor = c["actor_rollout_ref"]["actor"]
    meg = actor.get("megatron")
    if actor["strategy"] != "megatron" or not meg or actor["use_dynamic_bsz"]:
        return
    model_parallel = meg["tensor_model_parallel_size"] * meg["pipeline_model_parallel_size"]
    copies = model_parallel * meg["context_parallel_size"]
    micro = actor["ppo_micro_batch_size_per_gpu"]
    if not isinstance(micro, int) or micro < 1 or copies < 1 or world % copies:
        return  # reported by the micro-batch and layout checks
    minimal = world // copies * micro
    sequences = c["data"]["train_batch_size"] * c["actor_rollout_ref"]["rollout"]["n"]
    if sequences % minimal:
        errors.append(
            f"data.train_batch_size x rollout.n = {sequences} sequences per step do not split into whole "
            f"micro-batches of the {world // copies} megatron data-parallel groups ({world} ranks / tp x pp x cp = "
            f"{copies}) of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}, i.e. into multiples of "
            f"{minimal}; change data.train_batch_size or the micro-batch size"
        )


def _check_forward_batches(c: dict, errors: list[str], world: int):
    """Micro-batches of the forward-only passes (old log-probs, reference, values, reward model)."""
    arr = c["actor_rollout_ref"]
    rollout = arr["rollout"]
    passes = [("old-log-prob pass", "actor_rollout_ref.rollout", rollout, "log_prob")]
    if need_reference_policy(c):
        passes.append(("reference policy", "actor_rollout_ref.ref", arr["ref"], "log_prob"))
    for role, prefix, sec, stem in passes:
        _check_micro(
            errors,
            role=role,
            global_key=f"{prefix}.{stem}_micro_batch_size",
            per_gpu_key=f"{prefix}.{stem}_micro_batch_size_per_gpu",
            values=sec,
            dp=world,
            dynamic=sec["log_prob_use_dynamic_bsz"],
            dynamic_key=f"{prefix}.log_prob_use_dynamic_bsz",
        )
    critic = c["critic"]
    trained_micro = critic["ppo_micro_batch_size"], critic["ppo_micro_batch_size_per_gpu"]
    if need_critic(c) and (
        trained_micro != (None, None) or critic["use_dynamic_bsz"] or "forward_micro_batch_size" in critic
    ):
        # the Megatron critic has no forward_* keys: its value pass uses the training micro-batch (whose
        # absence is reported once, for the training pass)
        forward = {
            "forward_micro_batch_size": critic.get("forward_micro_batch_size"),
            "forward_micro_batch_size_per_gpu": critic.get(
                "forward_micro_batch_size_per_gpu", critic["ppo_micro_batch_size_per_gpu"]
            ),
        }
        _check_micro(
            errors,
            role="critic value pass",
            global_key="critic.forward_micro_batch_size",
            per_gpu_key="critic.forward_micro_batch_size_per_gpu",
            values=forward,
            dp=world,
            dynamic=c["critic"]["use_dynamic_bsz"],
            dynamic_key="critic.use_dynamic_bsz",
        )
    rm = c["reward_model"]
    if rm["enable"] and not rm["model"]["path"]:
        errors.append(
            "reward_model.enable=true but reward_model.model.path is null; set it to the reward model's directory"
        )
    # upstream's reward loop batches reward-model requests itself: no micro-batch needed with it
    if rm["enable"] and not rm.get("use_reward_loop", False):
        _check_micro(
            errors,
            role="reward model",
            global_key="reward_model.micro_batch_size",
            per_gpu_key="reward_model.micro_batch_size_per_gpu",
            values=rm,
            dp=world,
            dynamic=rm["use_dynamic_bsz"],
            dynamic_key="reward_model.use_dynamic_bsz",
        )
