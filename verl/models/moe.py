"""Mixture-of-experts models on the FSDP path: the router load-balancing (auxiliary) loss.

A Qwen3-MoE or Mixtral model (transformers' own classes, see `verl.models.factory` preset
`tiny-moe`) trains under FSDP like any causal LM: its expert weights are ordinary parameters that
FSDP2 shards with the rest. What MoE adds to an update is the router's load-balancing loss, which
keeps the tokens spread over the experts.

Design decisions:
- The switch and the coefficient are the model's own HF config keys, as transformers' training
  uses them: the loss is added when `output_router_logits` is true, times `router_aux_loss_coef`.
  Both are set through `actor_rollout_ref.model.override_config` (upstream's route for HF config
  keys). Released MoE checkpoints ship `output_router_logits: false`, so the loss is off by default,
  as in upstream verl: its FSDP actor never adds it, and its megatron workers set
  `moe_router_load_balancing_type="none"` ("hurts perf in RL"); megatron's coefficient is
  `override_transformer_config.moe_aux_loss_coeff`.
- The loss is transformers' Switch-Transformer form (`load_balancing_loss`): over all MoE layers'
  router logits [T, E] together, E * sum_e f_e * P_e, f_e the fraction of the top-k choices that
  went to expert e, P_e the mean router probability of e. Gradients flow through P only.
- The router logits are recorded with forward hooks on the router modules (the class transformers
  itself records, `_can_record_outputs["router_logits"]`), so every forward path of the actor
  (remove-padding, shared-prompt) yields them without changing its calls.
- The model's `output_router_logits` is switched off once read (the actor and the reference take
  it over), so transformers computes no second copy of the loss in the forward.
- Which tokens count: every token the router saw, so the loss needs the packed (remove-padding)
  forward, where every routed token is real; padded rows would route pad tokens. Ulysses (sp > 1)
  routes a slice of each sequence per rank; the loss over a slice is not the loss over the
  sequence, so that combination is refused rather than computed differently.
- Logged per micro-batch as `actor/load_balancing_loss` (megatron-core's name for the same loss;
  upstream verl logs none on FSDP), weighted like the rest of the loss across micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

METRIC = "actor/load_balancing_loss"
_OVERRIDE = "actor_rollout_ref.model.override_config"


def decoder_config(config):
    """The config holding the decoder's fields: a vision-language model's `text_config` (Qwen3-VL-MoE keeps its
    experts there), else `config` itself."""
    text = getattr(config, "text_config", None)
    return text if text is not None else config


def num_experts(config) -> int:
    """Routed experts per MoE layer (0 for a dense model); Qwen3-MoE names it `num_experts`,
    Mixtral `num_local_experts`; a vision-language model's are in its `text_config`."""
    config = decoder_config(config)
    for key in ("num_experts", "num_local_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def is_moe(config) -> bool:
    return num_experts(config) > 0 and bool(getattr(decoder_config(config), "num_experts_per_tok", 0))


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss over all layers' router logits.

    Args:
        router_logits: one [T, E] tensor per MoE layer (T routed tokens, E experts).
        top_k: experts chosen per token.

    Returns:
        0-d tensor E * sum_e f_e * P_e (float32 or wider), where over all layers and tokens f_e is
        the share of the T*k choices that picked expert e (no gradient) and P_e the mean softmax
        probability of e. A uniform router gives k; all tokens on one expert with probability 1, E*k.
    """
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one MoE layer")
    logits = torch.cat([layer.reshape(-1, layer.shape[-1]) for layer in router_logits])
    experts = logits.shape[-1]
    dtype = torch.promote_types(logits.dtype, torch.float32)
    probs = torch.softmax(logits.to(dtype), dim=-1)
    chosen = torch.topk(probs.detach(), top_k, dim=-1).indices
    counts = torch.zeros(experts, dtype=dtype, device=logits.device).index_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=dtype, device=logits.device)
    )
    fraction = counts / logits.shape[0]  # choices per token summed over k: sums to top_k
    return experts * (fraction * probs.mean(dim=0)).sum()


class RouterAuxLoss:
    """The actor's load-balancing term: off for a dense model or `output_router_logits: false`.

    `with aux.recording() as logits:` collects the router logits of the forwards it wraps;
    `aux.loss(logits)` turns them into the loss (None when off)."""

    def __init__(self, module: torch.nn.Module, use_remove_padding: bool, sp_size: int, trains: bool = True):
        """`trains=False` (a reference policy, which only computes log-probs) turns it off."""
        config = getattr(module, "config", None)
        # `override_config` sets the top-level key; a vision-language model reads its text config's
        configs = [] if config is None else list({id(c): c for c in (config, decoder_config(config))}.values())
        wanted = (
            config is not None and is_moe(config) and any(getattr(c, "output_router_logits", False) for c in configs)
        )
        if wanted:
            # The actor computes the loss from its hooks and owns the flag from here on: transformers'
            # own copy in every forward would be a second computation, and it fails on the 4-D masks
            # of the shared-prompt forward (it expects a [B, S] padding mask).
            for c in configs:
                c.output_router_logits = False
        self.enabled = trains and wanted
        self.module = module
        if not self.enabled:
            return
        coef = getattr(config, "router_aux_loss_coef", None)
        self.coef = float(
            (coef if coef is not None else getattr(decoder_config(config), "router_aux_loss_coef", 0.0)) or 0.0
        )
        self.top_k = int(decoder_config(config).num_experts_per_tok)
        if not use_remove_padding:
            raise ValueError(
                f"{_OVERRIDE}.output_router_logits=true adds the MoE load-balancing loss, which counts every token "
                "the router sees; the padded forward routes pad tokens too. Set "
                "actor_rollout_ref.model.use_remove_padding=true, or output_router_logits=false"
            )
        if sp_size > 1:
            raise ValueError(
                f"{_OVERRIDE}.output_router_logits=true (the MoE load-balancing loss) with "
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp_size} (or the same key in its fsdp_config): "
                "each rank routes only a slice of "
                "each sequence, so the loss would differ from sp=1; set one of them back (sp=1 or "
                "output_router_logits=false)"
            )
        self.router_class = _router_class(module)

    @contextlib.contextmanager
    def recording(self):
        logits: list[torch.Tensor] = []
        if not self.enabled:
            yield logits
            return

        def keep(_module, _inputs, output):
            logits.append(output[0] if isinstance(output, tuple) else output)

        hooks = [m.register_forward_hook(keep) for m in self.module.modules() if isinstance(m, self.router_class)]
        try:
            yield logits
        finally:
            for hook in hooks:
                hook.remove()

    def loss(self, logits: list[torch.Tensor]) -> torch.Tensor | None:
        if not self.enabled:
            return None
        if torch.is_grad_enabled() and not any(t.requires_grad for t in logits):
            raise RuntimeError(
                "the MoE router logits of this forward carry no gradient (reentrant activation checkpointing "
                "runs the forward without autograd), so the load-balancing loss would not train the router; "
                "use non-reentrant checkpointing (transformers' default) or output_router_logits=false"
            )
        return load_balancing_loss(logits, self.top_k)


def _router_class(module: torch.nn.Module) -> type:
    """The router module class transformers records `router_logits` from (output index 0)."""
    for m in module.modules():
        recorder = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type) and getattr(recorder, "index", 0) == 0:
            return target
    raise ValueError(
        f"{type(module).__name__} declares no router-logits output (transformers' _can_record_outputs), so its "
        f"load-balancing loss cannot be computed; set {_OVERRIDE}.output_router_logits=false"
    )


# ----------------------------------------------------------------------------- routing records

ROUTED_EXPERTS = "routed_experts"
"""Upstream's batch key of recorded MoE routing: [B, S, num_moe_layers, top_k] expert ids over the
columns of `input_ids` (zeros at padding), see `verl.models.mcore.router_replay`."""


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids 0..num_experts-1."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


class RoutingRecorder:
    """The top-k expert ids an HF MoE model's routers choose, forward by forward.

    Read from the routers' own outputs (transformers' router modules return (logits, scores,
    indices)) by forward hooks, so what is recorded is the choice the experts were run with, not a
    top-k recomputed beside it. Hooks exist only inside `with recorder:`; a model without MoE
    layers, or whose routers do not return their indices, is refused when the recorder is built.
    """

    def __init__(self, module: torch.nn.Module):
        config = getattr(module, "config", None)
        if config is None or not is_moe(config):
            raise ValueError(
                f"{type(module).__name__} has no mixture-of-experts layers, so it has no routing to record; "
                "set actor_rollout_ref.rollout.enable_rollout_routing_replay=false"
            )
        router_class = _router_class(module)
        self.routers = [m for m in module.modules() if isinstance(m, router_class)]
        self.top_k = int(decoder_config(config).num_experts_per_tok)
        self.num_experts = num_experts(config)
        self.dtype = routing_dtype(self.num_experts)
        self._layers: list[torch.Tensor] = []
        self._hooks: list = []

    def _keep(self, router, _inputs, output):
        indices = output[-1] if isinstance(output, tuple) else None
        if indices is None or indices.is_floating_point() or indices.shape[-1] != self.top_k:
            raise RuntimeError(
                f"{type(router).__name__} does not return its top-{self.top_k} expert indices as its last output, "
                "so the rollout cannot record routing for this model; set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=false"
            )
        self._layers.append(indices.detach().reshape(-1, self.top_k))

    def __enter__(self) -> RoutingRecorder:
        self._layers = []
        self._hooks = [router.register_forward_hook(self._keep) for router in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._layers = [], []

    def take(self) -> torch.Tensor:
        """[tokens, num_moe_layers, top_k] (int64) of the one forward since the last `take`, tokens in
        the order the model flattened them (row-major over [batch, sequence])."""
        if len(self._layers) != len(self.routers):
            raise RuntimeError(
                f"routing recorder: {len(self._layers)} router calls since the last forward, expected one per "
                f"MoE layer ({len(self.routers)})"
            )
        layers, self._layers = self._layers, []
        return torch.stack(layers, dim=1).long()
