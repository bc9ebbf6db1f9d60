"""The FSDP actor applies the model section's `tiled_mlp` and `enable_activation_offload` (upstream's keys):
the PPO update equals the one without them (float64), and the options really are on."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from tests.distributed_helpers import one_thread, tiny_qwen2_config
from tests.workers.actor.test_dp_actor import actor_config, assert_same_delta, param_delta, training_batch
from verl.models.transformers.tiled_mlp import remove_tiled_mlp_monkey_patch
from verl.workers.actor import DataParallelPPOActor
from verl.workers.config import HFModelConfig, TiledMLPConfig

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


@pytest.fixture(autouse=True)
def _untiled_afterwards():
    yield
    remove_tiled_mlp_monkey_patch()


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_qwen2_config()
    config.num_hidden_layers = 3  # activation offload needs 3 layers (upstream's rule)
    config.layer_types = [config.layer_types[0]] * 3
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()


def _update(data, model_config=None, checkpointing=False):
    model = _model()
    if checkpointing:
        from verl.utils.model import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    before = copy.deepcopy(model)
    actor = DataParallelPPOActor(
        actor_config(share_prompt_forward=False),
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        model_config=model_config,
    )
    actor.update_policy(data)
    return actor, param_delta(before, model)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_update_with_tiled_mlp_and_activation_offload_equals_the_plain_update(checkpointing):
    data = training_batch(seed=4)
    plain_actor, plain = _update(data, checkpointing=checkpointing)
    assert plain_actor.activation_offload is None
    section = HFModelConfig(
        path="unused",
        enable_activation_offload=True,
        enable_gradient_checkpointing=checkpointing,
        tiled_mlp=TiledMLPConfig(enabled=True, num_shards=3),
    )
    actor, with_options = _update(data, section, checkpointing=checkpointing)
    assert "_verl_untiled_forward" in Qwen2MLP.__dict__
    handler = actor.activation_offload
    assert handler is not None and handler.enable_ckpt == checkpointing
    assert handler.stats.kept_on_host > 0  # the hooks ran (CPU: the activations already are on the host)
    assert_same_delta(with_options, plain, atol=1e-12)
