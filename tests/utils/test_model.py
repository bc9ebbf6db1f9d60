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


def test_glm4_moe_value_model_is_the_generic_head_over_the_saved_body(tmp_path):
    """transformers has no `Glm4MoeForTokenClassification`: the critic is its generic head over
    `Glm4MoeModel`, values = last hidden state x score + bias, and it saves and loads back."""
    from tests.megatron_helpers import tiny_glm4moe_hf_model

    saved = tiny_glm4moe_hf_model()
    saved.save_pretrained(tmp_path / "causal")
    critic = load_valuehead_model(str(tmp_path / "causal"))
    assert type(critic).__name__ == "Glm4MoeForTokenClassification" and critic.dropout.p == 0.0
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], tensor), name
    ids = torch.tensor([[5, 9, 17, 3, 40]])
    with torch.no_grad():
        hidden = saved.model(ids).last_hidden_state.double()
        torch.nn.init.normal_(critic.score.bias)
        want = hidden @ critic.score.weight.double().T + critic.score.bias.double()
        torch.testing.assert_close(critic(ids).logits.double(), want, atol=1e-5, rtol=0)
    critic.save_pretrained(tmp_path / "critic")
    again = load_valuehead_model(str(tmp_path / "critic"))
    for name, tensor in critic.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_a_model_without_an_sdpa_path_loads_with_eager_attention_unless_one_is_asked_for(tmp_path):
    """transformers' gpt-oss has no sdpa attention (its sinks join the softmax): loading it with the
    default (sdpa on CPU) would fail, so the default falls back to eager; an explicit choice stays."""
    from verl.models.factory import make_tiny

    path = make_tiny("tiny-gptoss", str(tmp_path / "gptoss"))
    assert load_causal_lm(path).config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        load_causal_lm(path, attn_implementation="sdpa")


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


def test_create_random_mask_shapes_each_row_as_left_padding_then_valid_tokens():
    import numpy as np

    from verl.utils.model import create_random_mask

    input_ids = torch.zeros(64, 10, dtype=torch.long)
    np.random.seed(3)
    mask = create_random_mask(
        input_ids, max_ratio_of_valid_token=0.6, max_ratio_of_left_padding=0.3, min_ratio_of_valid_token=0.2
    )
    assert mask.dtype == torch.int64 and mask.shape == (64, 10)
    lefts, valids = [], []
    for row in mask.tolist():
        first = row.index(1)
        valid = sum(row)
        assert row == [0] * first + [1] * valid + [0] * (10 - first - valid)
        lefts.append(first)
        valids.append(valid)
    assert set(lefts) == {0, 1, 2, 3} and set(valids) == {2, 3, 4, 5, 6}  # every allowed value drawn
    np.random.seed(3)
    again = create_random_mask(
        input_ids, max_ratio_of_valid_token=0.6, max_ratio_of_left_padding=0.3, min_ratio_of_valid_token=0.2
    )
    assert torch.equal(mask, again)
    with pytest.raises(ValueError, match="cannot hold"):
        create_random_mask(input_ids, max_ratio_of_valid_token=0.9, max_ratio_of_left_padding=0.5)


def test_update_model_config_sets_nested_attributes():
    from types import SimpleNamespace

    from verl.utils.model import update_model_config

    config = SimpleNamespace(hidden_size=8, text_config=SimpleNamespace(rope_theta=1.0, vocab_size=10))
    update_model_config(config, {"hidden_size": 16, "text_config": {"rope_theta": 1e6}})
    assert config.hidden_size == 16 and config.text_config.rope_theta == 1e6 and config.text_config.vocab_size == 10
    with pytest.raises(AttributeError, match="no sub-config 'vision_config'"):
        update_model_config(config, {"vision_config": {"depth": 2}})


def test_extract_multi_modal_inputs_concatenates_or_keeps_lists():
    from tensordict.tensorclass import NonTensorData

    from verl.utils.model import extract_multi_modal_inputs

    a = {"pixel_values": torch.ones(2, 3), "image_grid_thw": torch.tensor([[1, 1, 2]])}
    b = {"pixel_values": torch.zeros(1, 3), "image_grid_thw": torch.tensor([[1, 1, 1]])}
    out = extract_multi_modal_inputs([a, None, NonTensorData(b)])
    assert out["pixel_values"].shape == (3, 3) and out["image_grid_thw"].tolist() == [[1, 1, 2], [1, 1, 1]]
    assert extract_multi_modal_inputs([a, b], indices=[1, 5])["pixel_values"].shape == (1, 3)
    bound = extract_multi_modal_inputs([{**a, "image_bound": torch.tensor([0])}, b])
    assert isinstance(bound["pixel_values"], list) and len(bound["pixel_values"]) == 2
