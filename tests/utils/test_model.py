import json

import pytest
import torch

from tests.distributed_helpers import make_tiny_causal_lm, one_thread
from verl.utils.model import (
    compute_position_id_with_mask,
    enable_gradient_checkpointing,
    load_causal_lm,
    load_valuehead_model,
)

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def test_position_ids_count_real_tokens_for_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0]])
    assert compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 2]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = make_tiny_causal_lm(dtype=torch.float32)
    model.save_pretrained(path)
    return path, model


def test_causal_lm_and_value_model_load_the_saved_backbone(checkpoint):
    path, saved = checkpoint
    model = load_causal_lm(str(path))
    assert model.config._attn_implementation == "sdpa"
    for name, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    critic = load_valuehead_model(str(path))
    assert type(critic).__name__ == "Qwen2ForTokenClassification"
    assert critic.score.weight.shape == (1, saved.config.hidden_size)
    assert critic.dropout.p == 0.0
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], tensor), name


def test_missing_path_and_non_language_model_are_clear_errors(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match=r"model.path"):
        load_causal_lm(str(tmp_path / "does-not-exist"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match="no causal-LM class"):
        load_causal_lm(str(tmp_path))


def test_gradient_checkpointing_is_switched_on():
    model = make_tiny_causal_lm()
    enable_gradient_checkpointing(model)
    flag = (
        "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    )
    assert getattr(model, flag)
