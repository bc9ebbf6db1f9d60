"""The Ray-facing workers on the Megatron-core backend (`strategy=megatron`).

The RPC bodies are the role workers of `verl.workers.engine_workers`, written once on the engine
interface (the FSDP backend's workers are siblings, not parents): same RPCs, roles, returned keys,
so the trainer does not know which backend it drives. This module says what is megatron's: the
engines (`verl.workers.engine.megatron`, `megatron` sections), the role logic
(`MegatronPPOActor` / `MegatronPPOCritic`) and the mesh dispatch of the data RPCs.

Design decisions:
- Layout: the worker group's ranks are carved into megatron's tensor / context / pipeline / data
  parallel groups (`verl.utils.megatron.parallel_state`). Data-carrying RPCs use the mesh-aware
  dispatch (`make_nd_compute_dataproto_dispatch_fn`): every rank of one data-parallel replica
  receives the same chunk, and only one rank per replica (tensor and context rank 0 on the last
  pipeline stage, where the loss and the log-probs live) is collected.
- Rollout (hybrid engine): the generation engine is the same one the FSDP workers use, holding
  full HF weights. Only the collecting rank of each data-parallel replica builds one and
  generates; the other ranks of the replica take part in the weight gather (a collective over
  the tensor and pipeline groups) and return nothing. Generation is thus data-parallel over
  replicas, not tensor-parallel; a tensor-parallel engine (vLLM/SGLang with
  `rollout.tensor_model_parallel_size`) is the route for models that do not fit one device.
- Weights, optimizer, checkpoints and offload: see `verl.workers.engine.megatron`.
- `megatron.sequence_parallel` changes memory, not results (tested); it runs on CPU and GPU
  without TransformerEngine or apex (`verl.models.mcore.config.RMSNorm`).

`MegatronWorker` is upstream's base of hand-built megatron workers (recipes such as GKD): a
`Worker` whose `_init_hf_config_and_tf_config` sets the tokenizer, the HF config and this
backend's megatron `TransformerConfig`, for models the recipe then builds with
`verl.utils.megatron_utils.get_model`.
"""

from __future__ import annotations

import torch

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.workers import engine_workers, reward_model_worker
from verl.workers.engine import BaseEngine, MegatronEngine, MegatronEngineWithValueHead
from verl.workers.engine.megatron.transformer_impl import megatron_optim_settings

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "MegatronWorker", "RewardModelWorker", "megatron_optim_settings"]

_ACTOR_MESH = make_nd_compute_dataproto_dispatch_fn("actor")
_CRITIC_MESH = make_nd_compute_dataproto_dispatch_fn("critic")
_REWARD_MESH = make_nd_compute_dataproto_dispatch_fn("reward")


def _on_mesh(rpc, mesh):
    """The shared worker's RPC `rpc` (its body), registered with the megatron mesh dispatch `mesh`."""
    return register(dispatch_mode=mesh)(rpc.__wrapped__)


class ActorRolloutRefWorker(engine_workers.ActorRolloutRefWorker):
    """Actor (megatron training), rollout (generation engine) and reference policy, in any combination."""

    strategy = "megatron"

    def __init__(
        self,
        config,
        role: str,
        project_name: str | None = None,
        experiment_name: str | None = None,
        rollout_wrapper=None,
    ):
        if role == "rollout":
            raise ValueError(
                "the megatron workers do not serve a rollout-only pool: a rollout pool only generates, so use "
                "verl.workers.fsdp_workers.ActorRolloutRefWorker for it (main_ppo does, for any actor strategy)"
            )
        super().__init__(config, role, project_name, experiment_name, rollout_wrapper)

    def _actor_engine_config(self):
        return self.actor_config.megatron

    def _ref_engine_config(self):
        # upstream's reference section may leave out its own megatron layout: the actor's then (the
        # raw section says whether it holds one; the built one always has the defaults)
        return self.ref_config.megatron if "megatron" in self.config.ref else self.actor_config.megatron

    def _engine_options(self, role: str) -> dict:
        # upstream's ref section may leave load_weight out (then the actor's; the config check makes them equal)
        section = self.actor_config if role == "actor" or "load_weight" not in self.config.ref else self.ref_config
        return {"load_weight": section.load_weight}

    def _make_actor(self, engine: BaseEngine, trains: bool):
        from verl.workers.actor.megatron_actor import MegatronPPOActor

        optimizer = engine.optimizer if trains else None
        return MegatronPPOActor(self.actor_config, engine.chunks, engine.hf_config, optimizer)

    def _register_outputs(self) -> None:
        self._register_dispatch_collect_info("actor", MegatronEngine.data_parallel_rank(), self.is_collect)

    generate_sequences = _on_mesh(engine_workers.ActorRolloutRefWorker.generate_sequences, _ACTOR_MESH)
    compute_log_prob = _on_mesh(engine_workers.ActorRolloutRefWorker.compute_log_prob, _ACTOR_MESH)
    compute_ref_log_prob = _on_mesh(engine_workers.ActorRolloutRefWorker.compute_ref_log_prob, _ACTOR_MESH)
    update_actor = _on_mesh(engine_workers.ActorRolloutRefWorker.update_actor, _ACTOR_MESH)


class CriticWorker(engine_workers.CriticWorker):
    """The value model on megatron: the LM body with a [1, hidden] head, trained with the clipped value loss."""

    strategy = "megatron"

    def _engine_config(self):
        return self.critic_config.megatron

    def _engine_options(self) -> dict:
        return {"load_weight": self.critic_config.load_weight}

    def _make_critic(self, engine: BaseEngine):
        from verl.workers.critic.megatron_critic import MegatronPPOCritic

        return MegatronPPOCritic(self.critic_config, engine.chunks, engine.optimizer, hf_config=engine.hf_config)

    def _register_outputs(self) -> None:
        self._register_dispatch_collect_info("critic", MegatronEngine.data_parallel_rank(), self.is_collect)

    compute_values = _on_mesh(engine_workers.CriticWorker.compute_values, _CRITIC_MESH)
    update_critic = _on_mesh(engine_workers.CriticWorker.update_critic, _CRITIC_MESH)


def _pooled_columns(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id) -> torch.Tensor:
    """[B] column of each row's pooled token after `left_align`: the token HF's
    `*ForSequenceClassification` pools (the rightmost one that is not the pad token), or the last
    real token when the config has no pad token (HF then only scores unpadded single rows)."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device)
    if pad_token_id is None:
        keep = attention_mask.bool()
    else:
        keep = input_ids != pad_token_id
    last = (columns * keep.long()).argmax(dim=1)
    first = attention_mask.long().argmax(dim=1)
    return (last - first).clamp(min=0)


class RewardModelWorker(reward_model_worker.RewardModelWorker):
    """The learned reward model on megatron (`reward_model.strategy=megatron`), tensor/pipeline parallel.

    An HF `*ForSequenceClassification` checkpoint becomes a GPTModel whose output layer is its
    [1, hidden] `score` head (the critic's value head, with a zero bias), so the model gives a score
    at every token; each row's score is the one at the token HF's classifier pools."""

    def _build_model(self) -> None:
        MegatronEngineWithValueHead.init_parallel(self.config.megatron)
        self._register_dispatch_collect_info(
            "reward", MegatronEngine.data_parallel_rank(), MegatronEngine.is_mp_src_rank_with_outputs()
        )
        self.reward_model = MegatronEngineWithValueHead(
            self.config.model,
            self.config.megatron,
            sequence_classifier=True,
            load_weight=self.config.load_weight,
        )

    @torch.no_grad()
    def _sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from tensordict import TensorDict

        from verl.workers.actor.megatron_actor import broadcast_from_last_stage, run_megatron_schedule

        model = self.reward_model
        rows = len(input_ids)
        batch = TensorDict(
            {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0),
                "responses": input_ids[:, -1:],  # the schedule's row layout wants one; nothing reads it
                "pooled": _pooled_columns(input_ids, attention_mask, model.hf_config.get_text_config().pad_token_id),
            },
            batch_size=[rows],
        )
        micro = int(self.config.micro_batch_size_per_gpu or rows)

        def score_fn(micro_batch, output):
            scores = micro_batch["_aligned"].full(output[..., 0]).gather(1, micro_batch["pooled"][:, None]).squeeze(1)
            return output.new_zeros(()), {"scores": scores}

        model.eval_mode()
        with model.on_device():
            results = run_megatron_schedule(model.chunks, list(batch.split(micro)), score_fn, forward_only=True)
        results = broadcast_from_last_stage(results)
        return torch.cat([r["scores"] for r in results]).float().cpu()

    compute_rm_score = _on_mesh(reward_model_worker.RewardModelWorker.compute_rm_score, _REWARD_MESH)


# Upstream's name for the actor-rollout worker its agent-loop (server-mode) rollout needs; this worker
# serves both modes (synchronous generation and agent loops), so recipes that ask for it get it.
AsyncActorRolloutRefWorker = ActorRolloutRefWorker


class MegatronWorker(Worker):
    """Upstream's base class of hand-built megatron workers; `self.config` holds the role's section
    (its `model` subsection is read) before `_init_hf_config_and_tf_config` is called."""

    def _init_hf_config_and_tf_config(
        self,
        model_path,
        tokenizer_or_path,
        dtype,
        override_model_config,
        override_transformer_config,
        trust_remote_code=False,
        megatron_config=None,
        enable_mtp=False,
    ):
        """Set `local_path`, `tokenizer` and `processor` (from `tokenizer_or_path`: None reads the
        model's, a path another's, an object is used as both), the HF config (`hf_config`: the
        tokenizer's bos/eos/pad ids and `override_model_config["model_config"]` applied;
        multi-token-prediction layers dropped unless `enable_mtp`), `architectures`,
        `share_embeddings_and_output_weights` and the megatron config `tf_config` with parameters in
        `dtype`, the `megatron_config` layout and `override_transformer_config` on top. This backend
        converts weights itself, so `bridge` and `provider` are None whatever `use_mbridge` says,
        and `peft_cls` is None (LoRA: use the engine workers, `model.lora`)."""
        from verl.models.mcore import hf_to_mcore_config
        from verl.utils import hf_processor, hf_tokenizer
        from verl.utils.fs import copy_to_local
        from verl.utils.model import load_model_config, update_model_config

        model = self.config.model
        self.local_path = copy_to_local(model_path)
        if tokenizer_or_path is None or isinstance(tokenizer_or_path, str):
            source = self.local_path if tokenizer_or_path is None else copy_to_local(tokenizer_or_path)
            self.tokenizer = hf_tokenizer(source, trust_remote_code=trust_remote_code)
            self.processor = hf_processor(source, trust_remote_code=trust_remote_code)
        else:
            self.tokenizer = self.processor = tokenizer_or_path
        template = model.get("custom_chat_template", None)
        if template is not None:
            (self.processor if self.processor is not None else self.tokenizer).chat_template = template

        hf_config = load_model_config(self.local_path, trust_remote_code)
        overrides = {
            "bos_token_id": self.tokenizer.bos_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
            "pad_token_id": self.tokenizer.pad_token_id,
            **dict((override_model_config or {}).get("model_config", {}) or {}),
        }
        self.share_embeddings_and_output_weights = getattr(hf_config, "tie_word_embeddings", False)
        if enable_mtp and not getattr(hf_config, "num_nextn_predict_layers", 0):
            raise ValueError(
                f"enable_mtp=True, but the model at {model_path} has no multi-token-prediction layers "
                "(num_nextn_predict_layers is 0 or missing); set model.mtp.enable=false"
            )
        if not enable_mtp and hasattr(hf_config, "num_nextn_predict_layers"):
            hf_config.num_nextn_predict_layers = 0
        self.enable_mtp = enable_mtp
        update_model_config(hf_config, overrides)
        self.architectures = getattr(hf_config, "architectures", None)

        lora = model.get("lora", None) or {}
        if int(lora.get("rank", 0) or 0) > 0:
            raise NotImplementedError(
                "model.lora.rank > 0 on a hand-built megatron worker: LoRA on megatron is built by verl's engine "
                "workers (verl.workers.megatron_workers.ActorRolloutRefWorker); set lora.rank=0 here"
            )
        tf_config = hf_to_mcore_config(hf_config, megatron_config, dtype)
        if enable_mtp:
            tf_config.mtp_num_layers = hf_config.num_nextn_predict_layers
            tf_config.mtp_loss_scaling_factor = model.mtp.mtp_loss_scaling_factor
        for key, value in dict(override_transformer_config or {}).items():
            if not hasattr(tf_config, key):
                raise ValueError(
                    f"override_transformer_config.{key}: megatron's TransformerConfig has no field {key!r}"
                )
            setattr(tf_config, key, value)
        self.hf_config, self.tf_config = hf_config, tf_config
        self.bridge = self.provider = None
        self.vanilla_bridge = True if megatron_config is None else megatron_config.get("vanilla_mbridge", True)
        self.peft_cls = None
