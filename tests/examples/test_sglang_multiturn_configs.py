"""examples/sglang_multiturn/config: each trainer config composes and validates with our loader the way
upstream's launch scripts pass it (--config-path/--config-name plus the script's overrides), its values
are upstream's (the copies recorded under tests/trainer/config/upstream/configs), and the tool and
interaction configs name what the preprocessing scripts write into the data."""

from __future__ import annotations

import asyncio
import importlib
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from verl.trainer.config import ConfigWarning, load_ppo_config

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "examples" / "sglang_multiturn" / "config"
UPSTREAM = REPO / "tests" / "trainer" / "config" / "upstream"
TRAINER_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
# Where ours deliberately differ from upstream's recorded values (docs/multi_turn.md, "Upstream's preprocessing scripts and example configs").
DIFFERENCES = {
    "actor_rollout_ref.model.custom_chat_template",  # our own template (upstream's copy is a stand-in)
    "actor_rollout_ref.rollout.multi_turn.format",  # hermes: no parser named 'qwen' here or upstream
}


def _flat(node, prefix=""):
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def _script_sets():
    """(script, config name, overrides) of upstream's launch scripts that name one of our configs."""
    sets = []
    for entry in yaml.safe_load((UPSTREAM / "launch_scripts.yaml").read_text()):
        name = entry["config"].removeprefix("configs/")
        if name in TRAINER_CONFIGS:
            sets.append((entry["script"].split("examples/", 1)[-1], name, entry["overrides"]))
        elif entry["script"].endswith("sglang_multiturn/run_qwen3_4b_dapo_multiturn.sh"):
            sets.append((entry["script"].split("examples/", 1)[-1], "retool_multiturn_grpo", entry["overrides"]))
    return sets


SETS = _script_sets()


def _ours(path_key: str, value: str, stand_ins: dict) -> str:
    """A file an override names: ours when this folder has it, else a stand-in that exists."""
    if path_key.endswith(("tool_config_path", "interaction_config_path")):
        folder = "tool_config" if path_key.endswith("tool_config_path") else "interaction_config"
        ours = CONFIG_DIR / folder / Path(value).name
        return str(ours) if ours.exists() else stand_ins["tools"]
    return stand_ins["reward"]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("files")
    (tmp / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")  # fmt: skip
    (tmp / "tools.yaml").write_text("tools: []\n")
    return {"reward": str(tmp / "reward.py"), "tools": str(tmp / "tools.yaml")}


def test_every_config_is_used_by_a_launch_script_set():
    assert sorted({name for _, name, _ in SETS}) == TRAINER_CONFIGS


@pytest.mark.parametrize("script,name,overrides", SETS, ids=[s for s, _, _ in SETS])
def test_config_composes_and_validates_with_the_script_overrides(script, name, overrides, stand_ins):
    files = {}
    patched = []
    for text in overrides:
        key, _, value = text.partition("=")
        bare = key.lstrip("+~")
        if bare.endswith(
            ("tool_config_path", "interaction_config_path", "custom_reward_function.path", "custom_cls.path")
        ):
            files[bare] = value = _ours(bare, value, stand_ins)
        patched.append(f"{key}={value}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        cfg = load_ppo_config(patched, str(CONFIG_DIR), config_name=name)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.multi_turn.enable is True and cfg.data.return_raw_chat is True
    for key, path in files.items():  # the script's files, ours where we ship them
        node = cfg
        for part in key.split("."):
            node = node[part]
        assert node == path
    if "gsm8k" in name and "interaction" not in name:
        assert rollout.multi_turn.tool_config_path == str(CONFIG_DIR / "tool_config" / "gsm8k_tool_config.yaml")


@pytest.mark.parametrize("name", [n for n in TRAINER_CONFIGS if (UPSTREAM / "configs" / f"{n}.yaml").exists()])
def test_config_values_are_upstreams(name):
    ours = _flat(yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text()))
    theirs = _flat(yaml.safe_load((UPSTREAM / "configs" / f"{name}.yaml").read_text()))
    assert set(ours) == set(theirs)
    assert {k: v for k, v in ours.items() if k not in DIFFERENCES} == {
        k: v for k, v in theirs.items() if k not in DIFFERENCES
    }


def _tool(file: str) -> dict:
    (tool,) = yaml.safe_load((CONFIG_DIR / "tool_config" / file).read_text())["tools"]
    return tool


def _script_constant(script: str, name: str):
    sys.path.insert(0, str(REPO / "examples" / "data_preprocess"))
    try:
        module = importlib.import_module(script)
    finally:
        sys.path.pop(0)
    return getattr(module, name)


@pytest.mark.parametrize(
    "file,class_name,tool_name,parameter,script",
    [
        ("gsm8k_tool_config.yaml", "verl.tools.gsm8k_tool.Gsm8kTool", "calc_gsm8k_reward", "answer", "_gsm8k_multiturn"),
        ("geo3k_tool_config.yaml", "verl.tools.geo3k_tool.Geo3kTool", "calc_geo3k_reward", "answer", "geo3k_multiturn_w_tool"),
        ("search_tool_config.yaml", "verl.tools.search_tool.SearchTool", "search", "query_list", "preprocess_search_r1_dataset"),
        ("sandbox_fusion_tool_config.yaml", "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "code_interpreter", "code", "dapo_multiturn_w_tool"),
    ],
)  # fmt: skip
def test_tool_config_names_the_tool_the_data_asks_for(file, class_name, tool_name, parameter, script):
    tool = _tool(file)
    assert tool["class_name"] == class_name and tool["config"]["type"] == "native"
    function = tool["tool_schema"]["function"]
    assert function["name"] == tool_name == _script_constant(script, "TOOL_NAME")
    assert function["parameters"]["required"] == [parameter] and list(function["parameters"]["properties"]) == [
        parameter
    ]
    assert function["description"]


def test_interaction_config_builds_the_gsm8k_interaction():
    from verl.interactions.gsm8k_interaction import Gsm8kInteraction
    from verl.interactions.utils.interaction_registry import initialize_interactions_from_config

    interactions = initialize_interactions_from_config(
        str(CONFIG_DIR / "interaction_config" / "gsm8k_interaction_config.yaml")
    )
    assert list(interactions) == [_script_constant("gsm8k_multiturn_w_interaction", "INTERACTION_NAME")]
    assert isinstance(interactions["gsm8k"], Gsm8kInteraction)


@pytest.mark.parametrize(
    "config,script,example,right,wrong",
    [
        ("gsm8k_tool_config.yaml", "gsm8k_multiturn_w_tool", {"question": "2 cars at 12,000?", "answer": "x\n#### 24,000"}, "24000", "24"),
        ("geo3k_tool_config.yaml", "geo3k_multiturn_w_tool", {"problem": "Find x.", "answer": "60", "images": []}, "60", "30"),
    ],
)  # fmt: skip
def test_tool_built_from_the_config_scores_a_preprocessed_row(config, script, example, right, wrong):
    from verl.tools.utils.tool_registry import initialize_tools_from_config

    row = _script_constant(script, "make_row")(example, "train", 0)
    (tool,) = initialize_tools_from_config(str(CONFIG_DIR / "tool_config" / config))
    (name,) = row["extra_info"]["tools_kwargs"]
    assert tool.name == name

    async def answer(text):  # as the tool agent loop creates and calls a tool for a row
        instance, _ = await tool.create(create_kwargs=row["extra_info"]["tools_kwargs"][name]["create_kwargs"])
        await tool.execute(instance, {"answer": text})
        return await tool.calc_reward(instance)

    assert asyncio.run(answer(right)) == 1.0 and asyncio.run(answer(wrong)) == 0.0


def test_search_and_sandbox_tool_configs_build():
    from verl.tools.utils.tool_registry import initialize_tools_from_config

    for config, name in (
        ("search_tool_config.yaml", "search"),
        ("sandbox_fusion_tool_config.yaml", "code_interpreter"),
    ):
        (tool,) = initialize_tools_from_config(str(CONFIG_DIR / "tool_config" / config))
        assert tool.name == name


def test_geo3k_chat_template_renders_images_in_tool_answers():
    from verl.models.factory import build_tokenizer

    cfg = yaml.safe_load((CONFIG_DIR / "geo3k_multiturn_grpo.yaml").read_text())
    megatron = yaml.safe_load((CONFIG_DIR / "geo3k_multiturn_megatron_grpo.yaml").read_text())
    template = cfg["actor_rollout_ref"]["model"]["custom_chat_template"]
    assert megatron["actor_rollout_ref"]["model"]["custom_chat_template"] == template
    tokenizer = build_tokenizer("tiny")
    tokenizer.chat_template = template
    call = {"type": "function", "function": {"name": "calc_geo3k_reward", "arguments": {"answer": "3"}}}
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]},
        {"role": "assistant", "content": "x=3", "tool_calls": [call]},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "1.0"}]},
        {"role": "tool", "content": "done"},
    ]
    tools = [{"type": "function", "function": {"name": "calc_geo3k_reward"}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, add_vision_id=True
    )
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (
        "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "calc_geo3k_reward"}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\nPicture 1: {image}Find x.<|im_end|>\n"
        '<|im_start|>assistant\nx=3\n<tool_call>\n{"name": "calc_geo3k_reward", "arguments": {"answer": "3"}}\n'
        "</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\nPicture 2: {image}1.0\n</tool_response>\n<tool_response>\ndone\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # without tools: a default system turn only where the conversation has none
    plain = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert (
        plain
        == f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{image}Find x.<|im_end|>\n"
    )
