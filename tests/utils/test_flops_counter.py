"""The analytic FLOPs count against torch's own operator-level count of a real forward + backward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.distributed_helpers import run_distributed
from verl.utils.flops_counter import FlopsCounter, FlopsTally, mfu_over_ranks


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        attn_implementation="eager",  # attention as plain matmuls, which the operator count sees
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def test_training_flops_match_torch_operator_count():
    model = _tiny_qwen2()
    seqlens = [7, 19]
    with FlopCounterMode(display=False) as counter:
        for length in seqlens:  # one unpadded sequence at a time: no padding FLOPs in the reference
            ids = torch.randint(0, 300, (1, length))
            model(input_ids=ids).logits.float().sum().backward()
    measured = counter.get_total_flops()
    assert FlopsCounter(model.config).training_flops(seqlens) == pytest.approx(measured, rel=0.01)


def test_matmul_params_equal_the_models_projection_weights():
    model = _tiny_qwen2()
    projections = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)
    assert FlopsCounter(model.config).matmul_params == projections


def test_mfu_needs_a_known_peak(monkeypatch):
    monkeypatch.delenv("VERL_PEAK_FLOPS", raising=False)
    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert mfu_over_ranks(1e9, seconds=1.0, dp_size=1) is None  # CPU: no published peak
    monkeypatch.setenv("VERL_PEAK_FLOPS", "1e9")
    assert mfu_over_ranks(3e9, seconds=2.0, dp_size=1) == pytest.approx(3e9 / 2.0 / 1e9)
    monkeypatch.setenv("VERL_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="VERL_PEAK_FLOPS"):
        mfu_over_ranks(1e9, seconds=1.0, dp_size=1)


def _check_mfu_over_ranks(rank, world_size):
    import os

    os.environ["VERL_PEAK_FLOPS"] = "1e9"
    # data parallel: each rank ran its own rows; the slower rank's time counts for both
    flops, seconds = [(2e9, 1.0), (4e9, 2.0)][rank]
    assert mfu_over_ranks(flops, seconds, dp_size=2) == pytest.approx((2e9 + 4e9) / 2.0 / (2 * 1e9))
    # one replica over both ranks (tensor parallel): both counted the same rows, which count once
    assert mfu_over_ranks(3e9, 1.5, dp_size=1) == pytest.approx(3e9 / 1.5 / (2 * 1e9))


def test_mfu_sums_replicas_and_takes_the_slowest_rank():
    run_distributed(_check_mfu_over_ranks, 2)


def test_rows_training_flops_of_whole_rows_with_the_head_everywhere_is_training_flops():
    counter = FlopsCounter(_tiny_qwen2().config)
    prompt, response = torch.tensor([3, 5]), torch.tensor([4, 1])
    whole = counter.rows_training_flops(prompt, response)
    # the head only where a response token is predicted: 5 of the 13 positions
    head_elsewhere = 3 * counter.forward_flops(0, 0, (3 + 5 + 4 + 1) - 5)
    assert float(whole) + head_elsewhere == pytest.approx(counter.training_flops([7, 6]), rel=1e-12)
    # frozen weights (LoRA): no weight gradients, the backward costs one forward
    assert float(counter.rows_training_flops(prompt, response, passes=2)) == pytest.approx(2 / 3 * float(whole))


def test_rows_training_flops_of_shared_prompts_by_hand():
    """Two groups: prompt 4 with responses 3 and 1, prompt 2 with response 5. Prompts run once;
    each response's inputs (all but its last token) run on top of its prompt."""
    counter = FlopsCounter(_tiny_qwen2().config)
    prompt, response = torch.tensor([4, 4, 2]), torch.tensor([3, 1, 5])
    first_rows, inverse = torch.tensor([0, 2]), torch.tensor([0, 0, 1])
    tokens = (4 + 2) + (2 + 0 + 4)
    attended = (16 + 4) + (2 * (4 + 2) + 0 + 4 * (2 + 4))
    head = 2 + (2 + 0 + 4)
    got = counter.rows_training_flops(prompt, response, (first_rows, inverse))
    assert float(got) == pytest.approx(3 * counter.forward_flops(tokens, attended, head), rel=1e-12)


def test_value_head_counts_one_output_and_a_tally_sums_micro_batches():
    config = _tiny_qwen2().config
    lm, value = FlopsCounter(config), FlopsCounter(config, head_outputs=1)
    assert lm.matmul_params - value.matmul_params == config.hidden_size * (config.vocab_size - 1)
    tally = FlopsTally(value)
    assert tally.total() == 0.0
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])  # 3 prompt columns, 3 response columns
    tally.add(mask, response_length=3)
    tally.add(mask[1:], response_length=3)
    expected = value.rows_training_flops(torch.tensor([2, 3, 3]), torch.tensor([2, 3, 3]))
    assert tally.total() == pytest.approx(float(expected), rel=1e-12)
    tally.reset()
    assert tally.total() == 0.0
    assert FlopsTally(None).total() is None
    assert FlopsCounter.for_model(None) is None
    assert FlopsCounter.for_model(object()) is None  # no transformer shape: no MFU


def test_estimate_flops_is_training_flops_per_second_against_the_peak(monkeypatch):
    counter = FlopsCounter(_tiny_qwen2().config)
    seqlens = [7, 12, 3]
    h, layers, heads, d, v, inter, kv = 64, 3, 4, 16, 300, 176, 2
    layer_params = layers * (h * (heads * d + 2 * kv * d) + heads * d * h + 3 * h * inter)
    expected = 3 * (2 * layer_params * 22 + 4 * heads * d * layers * (49 + 144 + 9) + 2 * h * v * 22)
    monkeypatch.setenv("VERL_PEAK_FLOPS", "2e12")
    achieved, peak = counter.estimate_flops(seqlens, delta_time=0.5)
    assert achieved == pytest.approx(expected / 0.5 / 1e12, rel=1e-12) and peak == 2.0
    monkeypatch.delenv("VERL_PEAK_FLOPS")
    monkeypatch.setattr("verl.utils.flops_counter.peak_flops_per_device", lambda dtype=None: None)
    assert counter.estimate_flops(seqlens, delta_time=1.0)[1] == float("inf")
    with pytest.raises(TypeError, match="images_seqlens"):
        counter.estimate_flops(seqlens, 1.0, images_seqlens=[4])
