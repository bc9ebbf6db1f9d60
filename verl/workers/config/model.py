"""Typed config of the policy model, with upstream verl's names and defaults: `HFModelConfig` (the
`_target_` of actor_rollout_ref.model, model/hf_model.yaml) and its nested `MtpConfig`; `TiledMLPConfig`
and `MegatronLoRAConfig` are this project's classes for the sections upstream keeps as plain dicts.

Each field carries its runtime default (the YAML holds the same value: a test builds the section from
the composed YAML and compares) and the `doc(...)` metadata the validator and docgen read.

Deliberately left out: upstream's derived fields (`local_path`, `hf_config`, `tokenizer`, `processor`,
...), which its `__post_init__` fills by downloading and loading the model. Here a config section is
data only; the workers load the model and tokenizer where they need them, so building a config never
touches the file system or the network.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.base_config import BaseConfig
from verl.workers.config._fields import _SPEED, IGNORED, UNSUPPORTED, doc

__all__ = ["HFModelConfig", "MegatronCriticLoRAConfig", "MegatronLoRAConfig", "MtpConfig", "TiledMLPConfig"]


@dataclass
class TiledMLPConfig(BaseConfig):
    """Tiled MLP (the MLP's activations computed in sequence shards to save memory)."""

    enabled: bool = doc(
        "Compute the decoder MLPs in token chunks, recomputed chunk by chunk in the backward, so one chunk's "
        "intermediate activations exist at a time (FSDP actor and critic; Llama, Qwen2/2.5, Qwen3 MLPs; "
        f"verl.models.transformers.tiled_mlp). {_SPEED}.",
        default=False,
    )
    num_shards: int = doc("Number of token chunks (more: less memory, more kernel launches).", default=4)


@dataclass
class MtpConfig(BaseConfig):
    """Multi-token prediction heads: trained on the megatron actor (docs/megatron.md); no speculative decoding."""

    enable: bool = doc(
        "Build the actor's model with its multi-token-prediction layers (HF `num_nextn_predict_layers`), load "
        "and checkpoint them (strategy=megatron).",
        default=False,
    )
    enable_train: bool = doc("Train the MTP layers: their loss joins the actor's (with enable).", default=False)
    enable_rollout: bool = doc(
        "Speculative decoding with the MTP layers in vLLM/SGLang, which none of this build's rollout engines does.",
        status=UNSUPPORTED,
        neutral=False,
        default=False,
    )
    detach_encoder: bool = doc(
        "Cut the MTP loss's gradient into the decoder and the embedding (the MTP layers and the LM head, tied or "
        "not, still learn from it).",
        default=False,
    )
    mtp_loss_scaling_factor: float = doc(
        "Weight of the MTP loss (the mean over MTP layers of each one's mean cross-entropy).", default=0.1
    )
    speculative_algorithm: str = doc(
        "Speculative decoding algorithm; used only by enable_rollout, which is not implemented.",
        status=IGNORED,
        default="EAGLE",
    )
    speculative_num_steps: int = doc(
        "Speculative steps; used only by enable_rollout, which is not implemented.",
        status=IGNORED,
        default=3,
    )
    speculative_eagle_topk: int = doc(
        "EAGLE top-k; used only by enable_rollout, which is not implemented.",
        status=IGNORED,
        default=1,
    )
    speculative_num_draft_tokens: int = doc(
        "Draft tokens; used only by enable_rollout, which is not implemented.",
        status=IGNORED,
        default=4,
    )
    method: str = doc(
        "Speculative method name; used only by enable_rollout, which is not implemented.",
        status=IGNORED,
        default="mtp",
    )
    num_speculative_tokens: int = doc(
        "Tokens proposed per step; used only by enable_rollout, which is not implemented.",
        status=IGNORED,
        default=1,
    )


@dataclass
class MegatronLoRAConfig(BaseConfig):
    """LoRA adapters of a Megatron model (upstream's `model.lora` of ppo_megatron_trainer)."""

    type: str = doc("Adapter type.", default="lora")
    merge: bool = doc(
        "Merge the adapters into the weights for generation (with rank > 0).", optional=True, default=False
    )
    rank: int = doc(
        "LoRA rank; > 0 trains only low-rank adapters on the target layers (the reference policy is then "
        "the frozen base, the rollout gets the merged weights); 0 trains all weights.",
        default=0,
    )
    alpha: int = doc("LoRA alpha: the adapters' update is scaled by alpha / rank (with rank > 0).", default=32)
    dropout: float = doc("Adapter dropout (with rank > 0).", default=0.0)
    target_modules: list[str] = doc(
        "Megatron layers that get adapters (with rank > 0).",
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
    )
    exclude_modules: list[str] = doc("Layers that get no adapter (with rank > 0).", default_factory=lambda: [])
    dropout_position: str = doc(
        "Where dropout applies (with rank > 0): pre (on the adapter's input) or post (on its output).", default="pre"
    )
    lora_A_init_method: str = doc(
        "Initialisation of A (with rank > 0): xavier (normal), kaiming (uniform), normal (std 0.02) or zero.",
        default="xavier",
    )
    lora_B_init_method: str = doc("Initialisation of B (with rank > 0), as lora_A_init_method.", default="zero")
    a2a_experimental: bool = doc(
        "megatron-bridge's all-to-all in place of the sequence-parallel scatter of row-parallel adapters; only "
        "false here (true is refused: the result is the same without it).",
        default=False,
    )
    dtype: str | None = doc("Adapter dtype (with rank > 0).", default=None)
    adapter_path: str | None = doc("Pretrained adapter to load.", status=UNSUPPORTED, neutral=None, default=None)
    freeze_vision_model: bool = doc("Vision-language models only.", status=IGNORED, default=True)
    freeze_vision_projection: bool = doc("Vision-language models only.", status=IGNORED, default=True)
    freeze_language_model: bool = doc("Vision-language models only.", status=IGNORED, default=True)

    def __post_init__(self):
        self._check(key="model.lora")

    def _check(self, key: str) -> None:
        if self.rank < 0:
            raise ValueError(f"{key}.rank={self.rank} must be 0 (train all weights) or a positive LoRA rank")
        if self.rank > 0:
            from verl.utils.megatron.lora_config import lora_config_errors

            errors = lora_config_errors(self, key=key)
            if errors:
                raise ValueError("; ".join(errors))


@dataclass
class MegatronCriticLoRAConfig(MegatronLoRAConfig):
    """`critic.model.lora`: the same keys on a Megatron critic (the value head trains whole)."""

    merge: bool = doc(
        "No effect on a critic (nothing generates from it; its `hf_model` checkpoints hold the merged weights).",
        status=IGNORED,
        optional=True,
        default=False,
    )
    rank: int = doc(
        "LoRA rank of the critic; > 0 trains low-rank adapters on the target layers and the value head whole "
        "(the base weights stay frozen); 0 trains all weights.",
        default=0,
    )

    def __post_init__(self):
        self._check(key="critic.model.lora")


@dataclass
class HFModelConfig(BaseConfig):
    """The policy model (shared by actor, rollout and reference)."""

    path: str = doc(
        "HF-format model directory (or hub id); the demo's `${verl_asset:NAME}` names a bundled model.",
        default="~/models/deepseek-llm-7b-chat",
    )
    hf_config_path: str | None = doc(
        "Directory (or hub id) whose config.json (and generation_config.json, if any) replaces `path`'s for "
        "every loader of the policy (actor, reference, rollout engines); the weights stay `path`'s, the tokenizer "
        "`tokenizer_path`'s or `path`'s; null: `path`'s own.",
        default=None,
    )
    tokenizer_path: str | None = doc("Tokenizer directory when it differs from `path`; null uses `path`.", default=None)
    use_shm: bool = doc("Copy the model to shared memory before loading.", status=IGNORED, default=False)
    trust_remote_code: bool = doc("Allow the model repository's own Python code to run.", default=False)
    custom_chat_template: str | None = doc(
        "Jinja chat template replacing the tokenizer's own in the policy's workers (rollout, agent loops, actor), "
        "as upstream; the driver's dataset keeps the tokenizer's own, as upstream's.",
        default=None,
    )
    external_lib: str | None = doc(
        "Python module imported before loading the model (registers custom models).", default=None
    )
    override_config: dict = doc(
        "Values overriding the model's HF config (e.g. {attention_dropout: 0.0}).", default_factory=lambda: {}
    )
    enable_gradient_checkpointing: bool = doc(
        "Recompute activations in backward (saves memory, costs ~30% time).", default=True
    )
    enable_activation_offload: bool = doc(
        "Keep the activations each layer saves for the backward in host memory until the backward needs them "
        "(FSDP actor; verl.utils.activation_offload). Saves accelerator memory only: on a CPU device the hooks run "
        "and keep tensors in place.",
        default=False,
    )
    use_remove_padding: bool = doc("Pack sequences without padding (varlen attention); a speed knob.", default=True)
    lora_rank: int = doc(
        "LoRA rank r of the actor (peft): > 0 trains only low-rank adapters (the reference policy is the "
        "base model with adapters off); 0 trains all weights.",
        default=0,
    )
    lora_alpha: int = doc("LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank.", default=16)
    target_modules: str | list[str] = doc(
        "Layers that get adapters: `all-linear` (every linear layer but the output head) or a list of "
        "module names, e.g. [q_proj,k_proj,v_proj,o_proj].",
        default="all-linear",
    )
    exclude_modules: str | list[str] | None = doc(
        "Layers (names or a regex) that get no adapter; null: none.", default=None
    )
    lora_adapter_path: str | None = doc(
        "A trained LoRA adapter to start from instead of fresh adapters: a peft directory with "
        "adapter_config.json and adapter_model.safetensors (e.g. a checkpoint's actor/lora_adapter). It turns "
        "LoRA on, and its own rank, alpha and target modules replace lora_rank, lora_alpha and target_modules; "
        "the reference policy stays the base model without it. null: fresh adapters (with lora_rank > 0).",
        default=None,
    )
    use_liger: bool = doc("Use Liger kernels (GPU only; a speed knob).", status=IGNORED, default=False)
    use_fused_kernels: bool = doc(
        "Fused log-prob/entropy: the actor and reference take log-probs and entropy from the last hidden "
        "states and the LM head's weight chunk by chunk, never holding the [tokens, vocab] logits "
        "(verl.utils.experimental.torch_functional). Covers the padded and remove-padding forwards of the "
        "FSDP actor (micro-batches that take the shared-prompt forward compute their response logits unfused); "
        "refused with Ulysses sequence parallelism.",
        default=False,
    )
    fused_kernel_options: dict = doc(
        "Options of the fused kernels: impl_backend `torch` (implemented) or `triton` (refused when "
        "use_fused_kernels=true: not implemented here).",
        default_factory=lambda: {"impl_backend": "torch"},
    )
    tiled_mlp: TiledMLPConfig = doc("Tiled MLP.", default_factory=TiledMLPConfig)
    mtp: MtpConfig = doc("Multi-token prediction.", default_factory=MtpConfig)
    lora: MegatronLoRAConfig = doc(
        "LoRA of a Megatron model (strategy megatron; an FSDP actor's LoRA is lora_rank / lora_alpha / "
        "target_modules).",
        optional=True,
        default_factory=MegatronLoRAConfig,
    )

    def __post_init__(self):
        if self.lora_rank < 0:
            raise ValueError(f"model.lora_rank={self.lora_rank} must be 0 (train all weights) or a positive LoRA rank")
        if self.lora_rank == 0 or self.lora_adapter_path:
            return  # no LoRA, or the adapter's own rank, alpha and modules replace these keys
        if self.lora_alpha <= 0:
            raise ValueError(
                f"model.lora_alpha={self.lora_alpha} must be positive: the adapter's update is scaled by "
                "lora_alpha / lora_rank (16 or 2 x lora_rank are usual)"
            )
        if not self.target_modules:
            raise ValueError(
                "model.target_modules is empty, so LoRA would adapt nothing; use all-linear or a list of linear "
                "layer names"
            )
