"""Simulated users (`multi_turn.interaction_config_path`) in the tool agent loop, on the bundled tiny model.

The model's turns are scripted; the expected token sequences are written out from the texts of the
turns and the chat template's rendering of the whole conversation, independently of the loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.experimental.agent_loop.conftest import ForcedRollout, encode
from tests.experimental.agent_loop.test_tool_agent_loop import assistant_turns, question_batch, rollout_config
from verl.experimental.agent_loop import AgentLoopRollout
from verl.interactions.gsm8k_interaction import CORRECT, INCORRECT, Gsm8kInteraction
from verl.interactions.utils.interaction_registry import initialize_interactions_from_config

pytestmark = pytest.mark.usefixtures("one_thread")

R = 160
YAML = """interaction:
  - name: gsm8k
    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
    config: {}
"""


def guessing_script(tokenizer, guesses):
    """The model's k-th turn answers `#### guesses[k-1]`."""

    def script(context):
        return encode(tokenizer, f"#### {guesses[assistant_turns(tokenizer, context) - 1]}") + [tokenizer.eos_token_id]

    return script


def batch_with_ground_truths(tokenizer, truths):
    batch = question_batch(tokenizer, [f"What is {t}?" for t in truths])
    extra = np.empty(len(truths), dtype=object)
    extra[:] = [{"interaction_kwargs": {"name": "gsm8k", "ground_truth": t}} for t in truths]
    batch.non_tensor_batch["extra_info"] = extra
    return batch


@pytest.fixture
def interaction_config(tmp_path):
    path = tmp_path / "interaction.yaml"
    path.write_text(YAML)
    return str(path)


def test_wrong_answer_gets_a_user_turn_and_a_right_one_ends_the_episode(tokenizer, tiny_model, interaction_config):
    forced = ForcedRollout(tiny_model, guessing_script(tokenizer, ["5", "42", "42"]))
    rollout = AgentLoopRollout(forced, rollout_config(R, interaction_config_path=interaction_config), tokenizer)
    out = rollout.generate_sequences(batch_with_ground_truths(tokenizer, ["42"]))
    eos = tokenizer.eos_token_id

    turn1 = encode(tokenizer, "#### 5") + [eos]
    user_turn = encode(tokenizer, f"<|user|>{INCORRECT}<|assistant|>")
    turn2 = encode(tokenizer, "#### 42") + [eos]
    expected = turn1 + user_turn + turn2
    n = len(expected)
    assert out.batch["responses"][0, :n].tolist() == expected
    assert out.batch["response_mask"][0].tolist() == [1] * len(turn1) + [0] * len(user_turn) + [1] * len(turn2) + [
        0
    ] * (R - n)
    conversation = [
        {"role": "user", "content": "What is 42?"},
        {"role": "assistant", "content": "#### 5"},
        {"role": "user", "content": INCORRECT},
        {"role": "assistant", "content": "#### 42"},
    ]
    rendered = encode(tokenizer, tokenizer.apply_chat_template(conversation, tokenize=False))
    assert out.batch["input_ids"][0][out.batch["attention_mask"][0].bool()].tolist() == rendered
    # the stopping reply ("correct") is not appended: the episode ends on the model's turn
    assert CORRECT not in tokenizer.decode(out.batch["responses"][0])
    assert out.non_tensor_batch["turn_scores"][0] == [0.0, 1.0]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [4]
    assert out.meta_info["metrics"]["agent_loop/tokenization_mismatch"] == 0.0


def test_turn_limit_ends_an_episode_the_user_never_accepts(tokenizer, tiny_model, interaction_config):
    forced = ForcedRollout(tiny_model, guessing_script(tokenizer, ["1", "2", "3", "4"]))
    # room for three turns and two replies (the tokenizer is character-level: a reply is ~80 tokens)
    config = rollout_config(400, interaction_config_path=interaction_config, max_assistant_turns=3)
    rollout = AgentLoopRollout(forced, config, tokenizer)
    out = rollout.generate_sequences(batch_with_ground_truths(tokenizer, ["42"]))
    text = tokenizer.decode(out.batch["responses"][0], skip_special_tokens=True)
    assert text.count(INCORRECT) == 2 and "#### 3" in text and "#### 4" not in text
    # the third turn is cut by the turn limit before the user scores it, as upstream
    assert out.non_tensor_batch["turn_scores"][0] == [0.0, 0.0]
    assert out.non_tensor_batch["__num_turns__"].tolist() == [1 + 3 + 2]
    # every episode's state was released
    (interaction,) = rollout.interactions.values()
    assert interaction._instance_dict == {}


def test_unknown_interaction_name_is_an_error_naming_the_configured_ones(tokenizer, tiny_model, interaction_config):
    forced = ForcedRollout(tiny_model, guessing_script(tokenizer, ["1"]))
    rollout = AgentLoopRollout(forced, rollout_config(R, interaction_config_path=interaction_config), tokenizer)
    batch = batch_with_ground_truths(tokenizer, ["42"])
    batch.non_tensor_batch["extra_info"][0]["interaction_kwargs"]["name"] = "chess"
    with pytest.raises(ValueError, match=r"'chess'.*\['gsm8k'\]"):
        rollout.generate_sequences(batch)


def test_registry_names_default_from_the_class_and_duplicates_fail(tmp_path):
    path = tmp_path / "i.yaml"
    path.write_text("interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n")
    ((name, interaction),) = initialize_interactions_from_config(str(path)).items()
    assert name == "gsm8k" and isinstance(interaction, Gsm8kInteraction) and interaction.name == "gsm8k"
    path.write_text(YAML + YAML.removeprefix("interaction:\n"))
    with pytest.raises(ValueError, match="Duplicate interaction name 'gsm8k'"):
        initialize_interactions_from_config(str(path))
    path.write_text("interaction: []\n")  # upstream: an empty list configures none
    assert initialize_interactions_from_config(str(path)) == {}
    path.write_text("other: 1\n")
    with pytest.raises(ValueError, match="has no `interaction:` list"):
        initialize_interactions_from_config(str(path))
    path.write_text("interaction:\n  - class_name: no_such_pkg.Thing\n")
    with pytest.raises(ModuleNotFoundError, match="full import path"):  # upstream's exception type
        initialize_interactions_from_config(str(path))
