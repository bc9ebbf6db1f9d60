"""Vision-language rows through the driver (docs/multimodal.md): every op that repeats, reorders,
splits, pads, replays or checkpoints rows keeps each row's images, processor inputs and (B, 4, L)
position ids with its tokens.

The prompt rows are built as the dataset builds them (the tiny-vl preset's real processor over real
images); the rollout worker group is a stand-in that answers each row with a token chosen from that
row's own `pixel_values` (the real engine needs Ray and a model: the main_ppo run covers it). After
each op, every row is checked against independent references: its images run through the image
processor again must give its `pixel_values`, its image tokens must match its `image_grid_thw`, its
position ids must equal `vl_position_ids` of that row alone, and its response must be the one its
own image asks for.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from verl.trainer.ppo.async_rollout import _prompt_rows
from verl.trainer.ppo.balance import balance_batch
from verl.trainer.ppo.generation import generation_input, with_generation
from verl.trainer.ppo.rollout_skip import ReplayingGenerator, RolloutDump
from verl.trainer.ppo.rollout_source import (
    PromptStream,
    RewardScorer,
    RolloutGenerator,
    StepState,
    vision_placeholder_ids,
)
from verl.trainer.ppo.step_records import dump_rollouts
from verl.utils.checkpoint.safe_load import from_plain, to_plain, torch_load
from verl.utils.vision import vl_position_ids

# (width, height, colour) of each prompt's images; a row without images is text-only
IMAGES = [
    [(56, 56, (200, 20, 20))],
    [],
    [(28, 28, (20, 200, 20)), (56, 84, (20, 20, 200))],
    [(84, 56, (120, 120, 20))],
]
PROMPT_LEN = 40
N = 2


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import AutoConfig

    from verl.models.factory import make_tiny
    from verl.utils.tokenizer import hf_processor

    path = make_tiny("tiny-vl", str(tmp_path_factory.mktemp("tiny-vl")))
    return SimpleNamespace(path=path, processor=hf_processor(path), config=AutoConfig.from_pretrained(path))


def _images(specs):
    from PIL import Image

    return [Image.new("RGB", (w, h), colour) for w, h, colour in specs]


def prompt_batch(vl) -> dict:
    """What the dataset's collate_fn hands the driver: left-padded expanded ids, (B, 4, P) positions,
    unexpanded raw_prompt_ids, the PIL images and the processor's inputs, one entry per row."""
    proc, tok = vl.processor, vl.processor.tokenizer
    rows = {k: [] for k in ("input_ids", "attention_mask", "position_ids")}
    raw_ids, mm_data, mm_inputs, truths = [], [], [], []
    for i, specs in enumerate(IMAGES):
        content = [{"type": "image"} for _ in specs] + [{"type": "text", "text": f"Colour {i}?"}]
        text = proc.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        images = _images(specs)
        out = proc(text=[text], images=images or None, return_tensors="pt")
        ids = out["input_ids"][0]
        pad = PROMPT_LEN - len(ids)
        input_ids = torch.cat([torch.full((pad,), tok.pad_token_id), ids])
        mask = torch.cat([torch.zeros(pad, dtype=torch.long), torch.ones(len(ids), dtype=torch.long)])
        grid = out.get("image_grid_thw")
        rows["input_ids"].append(input_ids)
        rows["attention_mask"].append(mask)
        rows["position_ids"].append(vl_position_ids(vl.config, input_ids[None], mask[None], grid)[0])
        raw_ids.append(tok(text, add_special_tokens=False)["input_ids"])
        mm_data.append({"images": images} if images else {})
        inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
        mm_inputs.append(inputs)
        truths.append(_answer(inputs))
    batch = {k: torch.stack(v) for k, v in rows.items()}
    for key, values in (
        ("raw_prompt_ids", raw_ids),
        ("multi_modal_data", mm_data),
        ("multi_modal_inputs", mm_inputs),
        ("ground_truth", truths),
        ("data_source", ["colours"] * len(IMAGES)),
    ):
        column = np.empty(len(values), dtype=object)  # element by element: lists stay lists
        for i, value in enumerate(values):
            column[i] = value
        batch[key] = column
    return batch


def _answer(mm_inputs: dict) -> int:
    """The token a row's own images ask for: 10 + the number of image patches (3 without images)."""
    pixels = mm_inputs.get("pixel_values")
    return 3 if pixels is None else 10 + int(pixels.shape[0])


class ImageReadingRollout:
    """Stands in for the rollout worker group: answers each row with `_answer` of its own processor
    inputs (two tokens: the answer, then EOS), and returns the contract's output: prompt + response
    ids and their (B, 4, P + R) position ids, text continuing every position row by one."""

    def __init__(self, config, eos: int):
        self.config, self.eos, self.calls = config, eos, []

    def generate_sequences(self, gen: DataProto) -> DataProto:
        self.calls.append(gen)
        assert gen.batch["position_ids"].shape[1:] == (4, PROMPT_LEN)
        responses = torch.tensor([[_answer(x), self.eos] for x in gen.non_tensor_batch["multi_modal_inputs"]])
        prompts = gen.batch["input_ids"]
        mask = torch.cat([gen.batch["attention_mask"], torch.ones_like(responses)], dim=1)
        prompt_pos = gen.batch["position_ids"]
        step = torch.arange(1, responses.shape[1] + 1)
        response_pos = prompt_pos.max(-1, keepdim=True).values + step  # each row continues by +1 per token
        return DataProto.from_dict(
            tensors={
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], dim=1),
                "attention_mask": mask,
                "position_ids": torch.cat([prompt_pos, response_pos], dim=-1),
                "response_mask": torch.ones_like(responses),
            }
        )


def exact_answer(batch: DataProto, return_dict: bool = False):
    scores = torch.tensor(
        [float(r == g) for r, g in zip(batch.batch["responses"][:, 0].tolist(), batch.non_tensor_batch["ground_truth"])]
    )
    return {"reward_tensor": scores.unsqueeze(1), "reward_extra_info": {"acc": scores.tolist()}}


def assert_rows_aligned(vl, batch: DataProto) -> None:
    """Every row's images, processor inputs, tokens, positions and (if any) response belong together."""
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    image_token = vl.config.image_token_id
    for i in range(len(batch)):
        data, inputs = batch.non_tensor_batch["multi_modal_data"][i], batch.non_tensor_batch["multi_modal_inputs"][i]
        grid = inputs.get("image_grid_thw")
        images = data.get("images", [])
        assert len(images) == (0 if grid is None else len(grid))
        if images:  # the row's own images give its pixel values
            again = vl.processor.image_processor(images=images, return_tensors="pt")
            torch.testing.assert_close(again["pixel_values"], inputs["pixel_values"], rtol=0, atol=0)
            assert again["image_grid_thw"].tolist() == grid.tolist()
        num_tokens = 0 if grid is None else int(grid.prod(-1).sum()) // 4  # 2x2 patches merge into one token
        assert int((ids[i][mask[i].bool()] == image_token).sum()) == num_tokens
        expected = vl_position_ids(vl.config, ids[i : i + 1], mask[i : i + 1], grid)[0]
        if "responses" in batch.batch:  # the rollout's positions: the response continues the prompt's
            prompt_len = batch.batch["prompts"].shape[1]
            torch.testing.assert_close(batch.batch["position_ids"][i, :, :prompt_len], expected[:, :prompt_len])
            assert batch.batch["responses"][i, 0].item() == _answer(inputs)
        else:
            torch.testing.assert_close(batch.batch["position_ids"][i], expected)


def _generate(vl, rollout=None):
    rollout = rollout or ImageReadingRollout(vl.config, vl.processor.tokenizer.eos_token_id)
    prompts = PromptStream([prompt_batch(vl)], current_step=lambda: 1)
    generator = RolloutGenerator(rollout, vl.processor.tokenizer, N, multi_turn=False, current_step=lambda: 1)
    state = StepState()
    batch = RewardScorer(exact_answer)(generator(prompts(), state), state)
    return batch, rollout


def test_prompt_rows_are_built_like_the_processors_own_output(vl):
    batch = DataProto.from_single_dict(prompt_batch(vl))
    assert batch.batch["position_ids"].shape == (len(IMAGES), 4, PROMPT_LEN)
    assert_rows_aligned(vl, batch)
    # raw_prompt_ids holds one <|image_pad|> per image (vLLM expands them itself)
    pad = vl.config.image_token_id
    assert [ids.count(pad) for ids in batch.non_tensor_batch["raw_prompt_ids"]] == [1, 0, 2, 1]


def test_generation_input_sends_images_and_four_row_positions_to_the_rollout(vl):
    batch = DataProto.from_single_dict(prompt_batch(vl))
    gen = generation_input(batch, vl.processor.tokenizer, global_steps=3, multi_turn=False)
    assert set(gen.non_tensor_batch) == {"raw_prompt_ids", "multi_modal_data", "multi_modal_inputs"}
    assert gen.batch["position_ids"].shape == (len(IMAGES), 4, PROMPT_LEN)
    assert_rows_aligned(vl, gen.repeat(repeat_times=3, interleave=True))


def test_rollout_samples_keep_their_prompts_images_and_score_against_them(vl):
    batch, rollout = _generate(vl)
    sent = rollout.calls[0]
    assert len(sent) == len(IMAGES) * N
    assert_rows_aligned(vl, sent)
    assert_rows_aligned(vl, batch)
    assert batch.batch["position_ids"].shape == (len(IMAGES) * N, 4, PROMPT_LEN + 2)
    assert batch.batch["token_level_scores"].sum().item() == len(IMAGES) * N  # each row scored against its own image
    assert batch.non_tensor_batch["uid"].tolist() == [f"1_{i}" for i in range(len(IMAGES)) for _ in range(N)]


def test_balance_reorder_split_pad_and_concat_keep_rows_aligned(vl):
    batch, _ = _generate(vl)
    before = {
        uid: len(batch.non_tensor_batch["multi_modal_data"][i].get("images", []))
        for i, uid in enumerate(batch.non_tensor_batch["uid"])
    }
    balance_batch(batch, world_size=2)
    assert_rows_aligned(vl, batch)
    after = {
        uid: len(batch.non_tensor_batch["multi_modal_data"][i].get("images", []))
        for i, uid in enumerate(batch.non_tensor_batch["uid"])
    }
    assert after == before
    # what DP_COMPUTE_PROTO does: pad to the ranks, chunk, compute per rank, concatenate, unpad
    padded, pad = pad_dataproto_to_divisor(batch[:7], 4)
    assert pad == 1
    parts = padded.chunk(4)
    for part in parts:
        assert_rows_aligned(vl, part)
    whole = unpad_dataproto(DataProto.concat(parts), pad)
    assert_rows_aligned(vl, whole)
    assert whole.non_tensor_batch["uid"].tolist() == batch.non_tensor_batch["uid"][:7].tolist()
    picked = batch.select_idxs(np.array([5, 0, 3]))
    assert_rows_aligned(vl, picked)


def test_validation_merge_replaces_prompt_tensors_with_the_rollouts(vl):
    prompts = DataProto.from_single_dict(prompt_batch(vl))
    rollout = ImageReadingRollout(vl.config, vl.processor.tokenizer.eos_token_id)
    gen = generation_input(prompts, vl.processor.tokenizer, 0, False, validate=True).repeat(2, interleave=True)
    merged = with_generation(prompts.repeat(2, interleave=True), rollout.generate_sequences(gen))
    assert merged.batch["position_ids"].shape == (len(IMAGES) * 2, 4, PROMPT_LEN + 2)
    assert_rows_aligned(vl, merged)


def test_rollout_dump_replays_images_and_processor_inputs(vl, tmp_path):
    """`rollout.skip_rollout`: the dump is written with torch.save and read with weights_only=True."""
    dump = RolloutDump(tmp_path / "dump")
    rollout = ImageReadingRollout(vl.config, vl.processor.tokenizer.eos_token_id)
    generator = RolloutGenerator(rollout, vl.processor.tokenizer, N, multi_turn=False, current_step=lambda: 1)
    replaying = ReplayingGenerator(generator, dump)
    first = replaying(DataProto.from_single_dict(prompt_batch(vl)), StepState())
    state = StepState()
    replayed = replaying(DataProto.from_single_dict(prompt_batch(vl)), state)
    assert state.metrics["rollout/replayed"] == 1.0 and len(rollout.calls) == 1
    assert_rows_aligned(vl, replayed)
    torch.testing.assert_close(replayed.batch["position_ids"], first.batch["position_ids"])
    images = [im for d in replayed.non_tensor_batch["multi_modal_data"] for im in d.get("images", [])]
    assert [im.size for im in images] == [(56, 56)] * 2 + [(28, 28), (56, 84)] * 2 + [(84, 56)] * 2


def test_driver_state_with_image_rows_loads_weights_only(vl, tmp_path):
    """The async source's queued rows go into the checkpoint's data.pt as plain data."""
    batch, _ = _generate(vl)
    torch.save({"async_rollout": to_plain({"ready": [batch]})}, tmp_path / "data.pt")
    loaded = from_plain(torch_load(str(tmp_path / "data.pt"), "data.pt")["async_rollout"])["ready"][0]
    assert_rows_aligned(vl, loaded)
    # regenerating a dropped group starts from its prompt rows: the (B, 4, L) positions are cut to the prompt
    prompt_side = _prompt_rows(loaded)
    assert prompt_side.batch["position_ids"].shape == (len(loaded), 4, PROMPT_LEN)
    assert_rows_aligned(vl, prompt_side)


def test_rollout_data_dir_lines_count_each_samples_images(vl, tmp_path):
    import json

    batch, _ = _generate(vl)
    balance_batch(batch, world_size=2)
    dump_rollouts(batch, vl.processor.tokenizer, str(tmp_path), step=1)
    lines = [json.loads(line) for line in (tmp_path / "1.jsonl").read_text().splitlines()]
    by_uid = {line["uid"]: line["num_images"] for line in lines}
    assert by_uid == {f"1_{i}": len(specs) for i, specs in enumerate(IMAGES)}
    assert all(line["score"] == 1.0 for line in lines)


def test_a_sampled_vision_placeholder_token_stops_the_step_with_its_cause(vl):
    """A policy far from a trained one can sample <|image_pad|>; the actor would then count an image
    token without image features. The generator names it instead of the model's deep error."""
    c = vl.config
    ids = vision_placeholder_ids(vl.processor)
    assert sorted(ids) == sorted([c.image_token_id, c.video_token_id])
    assert vision_placeholder_ids(None) == ()

    class SamplesAnImageToken(ImageReadingRollout):
        def generate_sequences(self, gen):
            out = super().generate_sequences(gen)
            out.batch["responses"][3, 0] = c.image_token_id
            return out

    rollout = SamplesAnImageToken(c, vl.processor.tokenizer.eos_token_id)
    generator = RolloutGenerator(
        rollout, vl.processor.tokenizer, N, multi_turn=False, current_step=lambda: 7, vision_token_ids=ids
    )
    prompts = PromptStream([prompt_batch(vl)], current_step=lambda: 7)
    with pytest.raises(
        RuntimeError,
        match=rf"^step 7: the rollout sampled a vision placeholder token \(ids \[{c.image_token_id}\]\) into 1 response\(s\) \(rows \[3\]\)",
    ):
        generator(prompts(), StepState())
    # the same rollout for a text policy (no placeholder ids): nothing to check
    text = RolloutGenerator(rollout, vl.processor.tokenizer, N, multi_turn=False, current_step=lambda: 7)
    assert len(text(PromptStream([prompt_batch(vl)], current_step=lambda: 7)(), StepState())) == len(IMAGES) * N
