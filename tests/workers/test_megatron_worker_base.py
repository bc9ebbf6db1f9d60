"""Upstream's `MegatronWorker._init_hf_config_and_tf_config` on the bundled tiny model: tokenizer ids
and `model_config` overrides land in the HF config, the megatron config takes the dtype, the layout
and the transformer overrides, and bad overrides / LoRA / MTP on a model without it are refused."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")


def _worker(**model):
    from verl.workers.megatron_workers import MegatronWorker

    worker = MegatronWorker.__new__(MegatronWorker)  # no process group needed for the config step
    worker.config = OmegaConf.create({"model": {"custom_chat_template": "{{ messages }}", **model}})
    return worker


def _init(worker, **kwargs):
    from verl.models import bundled_model_path

    args = {
        "model_path": bundled_model_path(),
        "tokenizer_or_path": None,
        "dtype": torch.bfloat16,
        "override_model_config": {"model_config": {"rms_norm_eps": 1e-3}},
        "override_transformer_config": {"attention_dropout": 0.25},
        "megatron_config": OmegaConf.create({"tensor_model_parallel_size": 1, "use_mbridge": True}),
    }
    worker._init_hf_config_and_tf_config(**{**args, **kwargs})
    return worker


def test_init_sets_tokenizer_hf_config_and_megatron_config():
    worker = _init(_worker())
    assert worker.tokenizer.chat_template == "{{ messages }}" or worker.processor.chat_template == "{{ messages }}"
    assert worker.hf_config.rms_norm_eps == 1e-3
    assert worker.hf_config.pad_token_id == worker.tokenizer.pad_token_id
    assert worker.tf_config.params_dtype is torch.bfloat16 and worker.tf_config.bf16
    assert (
        worker.tf_config.attention_dropout == 0.25 and worker.tf_config.num_layers == worker.hf_config.num_hidden_layers
    )
    assert worker.bridge is None and worker.provider is None and worker.peft_cls is None
    assert worker.share_embeddings_and_output_weights == worker.hf_config.tie_word_embeddings


def test_init_refuses_unknown_transformer_keys_lora_and_mtp_without_layers():
    with pytest.raises(ValueError, match="has no field 'no_such_field'"):
        _init(_worker(), override_transformer_config={"no_such_field": 1})
    with pytest.raises(NotImplementedError, match="lora.rank=0"):
        _init(_worker(lora={"rank": 4}))
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        _init(_worker(), enable_mtp=True)
