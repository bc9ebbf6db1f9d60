"""The multimodal contract end to end, without Ray: parquet rows with images -> `RLHFDataset` with
the model's processor -> GRPO repeat -> `HFRollout` (sampling, rollout log-probs) -> the FSDP actor's
`compute_log_prob` (`DataParallelPPOActor`) on the rollout's output.

The rollout gets the batch through the driver's own glue (`generation_input` / `with_generation`).
The actor recomputes each sampled token's log-prob from the batch alone (its (B, 4, P+R) positions
and `multi_modal_inputs`); it must equal what the rollout sampled with, within float32 tolerance,
and differ without the images: so the dataset, the rollout and the actor agree on every row's
images, ids and positions.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tests.config_helpers import engine_config
from tests.workers.rollout.vl_helpers import random_image, tiny_vl_dir

TEMPERATURE = 1.0


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _parquet(tmp_path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(content, images, index):
        return {
            "data_source": "vl_test",
            "prompt": [{"role": "user", "content": content}],
            "images": [{"bytes": _png(image)} for image in images],
            "reward_model": {"style": "rule", "ground_truth": "red"},
            "extra_info": {"split": "train", "index": index},
        }

    rows = [
        row("<image>What color?", [random_image(56, 56, seed=1)], 0),
        row("Hi 2+3", [], 1),
        row("<image>and<image>same?", [random_image(28, 56, seed=2), random_image(84, 28, seed=3)], 2),
    ]
    path = tmp_path / "vl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("preset", ["tiny-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_actor_log_probs_of_the_rollouts_samples_equal_the_rollouts(tmp_path, preset):
    from transformers import AutoModelForImageTextToText

    from tests.workers.actor.test_dp_actor_vision import actor_config
    from verl.protocol import DataProto
    from verl.trainer.ppo.generation import generation_input, with_generation
    from verl.utils.dataset.rl_dataset import collate_fn, create_rl_dataset
    from verl.utils.tokenizer import hf_processor
    from verl.workers.actor import DataParallelPPOActor
    from verl.workers.rollout.hf_rollout import HFRollout

    path = tiny_vl_dir(str(tmp_path / "model"), preset=preset)
    processor = hf_processor(path)
    dataset = create_rl_dataset(
        _parquet(tmp_path), {"max_prompt_length": 48, "filter_overlong_prompts": False}, processor.tokenizer, processor
    )
    prompts = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    prompts = prompts.repeat(2, interleave=True)
    # the driver's glue: what it sends to the rollout (no multi_modal_inputs today: the rollout makes them
    # from multi_modal_data) and how it merges the answer (a union: they must equal the dataset's)
    gen = generation_input(prompts, processor.tokenizer, global_steps=1, multi_turn=False)
    gen.meta_info["eos_token_id"] = []  # every response runs to the end: more tokens compared

    rollout = HFRollout(path, engine_config(response_length=6, calculate_log_probs=True, temperature=TEMPERATURE))
    torch.manual_seed(0)
    out = with_generation(prompts, rollout.generate_sequences(gen))
    assert out.batch["position_ids"].shape[1] == 4

    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    actor = DataParallelPPOActor(actor_config(), model)
    out.meta_info.update(micro_batch_size=2, temperature=TEMPERATURE, use_dynamic_bsz=False)
    with torch.no_grad():
        log_probs, _ = actor.compute_log_prob(out)
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(log_probs[mask], out.batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)
    # the images matter to that agreement
    blind = np.empty(len(out), dtype=object)
    blind[:] = [{} for _ in range(len(out))]
    out.non_tensor_batch["multi_modal_inputs"] = blind
    with torch.no_grad():
        blind_log_probs, _ = actor.compute_log_prob(out)
    assert (blind_log_probs[mask] - log_probs[mask]).abs().max() > 1e-2
