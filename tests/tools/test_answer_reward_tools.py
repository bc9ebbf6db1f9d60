"""Upstream's demo reward tools (Gsm8kTool, Geo3kTool): scoring, the step penalty, loading from a tool config."""

from __future__ import annotations

import asyncio

import pytest

from verl.tools.geo3k_tool import Geo3kTool
from verl.tools.gsm8k_tool import Gsm8kTool
from verl.tools.utils.tool_registry import initialize_tools_from_config


def run(coro):
    return asyncio.run(coro)


async def _submit_all(tool, ground_truth, answers):
    instance_id, _ = await tool.create(create_kwargs={"ground_truth": ground_truth})
    results = []
    for answer in answers:
        response, step_reward, metrics = await tool.execute(instance_id, {"answer": answer})
        results.append((response.text, step_reward, await tool.calc_reward(instance_id), metrics))
    await tool.release(instance_id)
    assert instance_id not in tool._instance_dict
    return results


def test_gsm8k_tool_scores_answers_and_penalises_submissions_that_do_not_improve():
    tool = Gsm8kTool({}, None)
    # wrong (0.0, no improvement on 0.0: penalty), right (1.0: improvement), right again (no improvement: penalty)
    results = run(_submit_all(tool, "1,000", ["999", "1000", "#### $1,000.00"]))
    assert results == [
        ("Current parsed answer='999' reward=0.0", -0.05, 0.0, {}),
        ("Current parsed answer='1000' reward=1.0", 0.0, 1.0, {}),
        ("Current parsed answer='#### $1,000.00' reward=1.0", -0.05, 1.0, {}),
    ]


def test_gsm8k_tool_reads_the_last_number_and_accepts_non_string_answers():
    tool = Gsm8kTool({}, None)
    results = run(_submit_all(tool, "72", ["She sold 48 then 24, so 72", 72, "no number"]))
    assert [(r[1], r[2]) for r in results] == [(0.0, 1.0), (-0.05, 1.0), (-0.05, 0.0)]
    assert results[1][0] == "Current parsed answer='72' reward=1.0"


def test_geo3k_tool_compares_the_whole_answer_without_format_reward():
    tool = Geo3kTool({}, None)
    results = run(_submit_all(tool, "2\\sqrt{3}", ["3", "2 \\sqrt{3}", "2\\sqrt3"]))
    assert [(r[1], r[2]) for r in results] == [(-0.05, 0.0), (0.0, 1.0), (-0.05, 1.0)]
    assert results[0][0] == "Current parsed answer='3' reward=0.0"


def test_ground_truth_given_directly_to_create_wins_over_create_kwargs():
    async def go():
        tool = Gsm8kTool({}, None)
        instance_id, _ = await tool.create("id-1", ground_truth="5", create_kwargs={"ground_truth": "6"})
        response, _, _ = await tool.execute(instance_id, {"answer": "5"})
        return instance_id, response.text

    assert run(go()) == ("id-1", "Current parsed answer='5' reward=1.0")


@pytest.mark.parametrize("tool_cls", [Gsm8kTool, Geo3kTool])
def test_a_missing_ground_truth_is_an_error_naming_the_data_field(tool_cls):
    tool = tool_cls({}, None)
    with pytest.raises(ValueError, match=rf"extra_info\.tools_kwargs\.{tool.name}\.create_kwargs\.ground_truth"):
        run(tool.create(create_kwargs={}))


def test_both_tools_load_from_upstreams_tool_config_layout(tmp_path):
    schema = """\
    tool_schema:
      type: "function"
      function:
        name: "{name}"
        description: "A tool for calculating the reward of {name}."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer, must be a digits"
          required: ["answer"]
"""
    entries = [
        ("verl.tools.gsm8k_tool.Gsm8kTool", "calc_gsm8k_reward"),
        ("verl.tools.geo3k_tool.Geo3kTool", "calc_geo3k_reward"),
    ]
    body = "tools:\n" + "".join(
        f'  - class_name: "{cls}"\n    config:\n      type: native\n' + schema.format(name=name)
        for cls, name in entries
    )
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    gsm8k_tool, geo3k_tool = initialize_tools_from_config(str(path))
    assert (type(gsm8k_tool), gsm8k_tool.name) == (Gsm8kTool, "calc_gsm8k_reward")
    assert (type(geo3k_tool), geo3k_tool.name) == (Geo3kTool, "calc_geo3k_reward")
    assert gsm8k_tool.schema_dict()["function"]["parameters"]["required"] == ["answer"]
    assert gsm8k_tool.config == {"type": "native"}
    results = run(_submit_all(gsm8k_tool, "18", ["18"]))
    assert results[0][:3] == ("Current parsed answer='18' reward=1.0", 0.0, 1.0)


def test_without_a_schema_in_the_config_the_tools_use_upstreams_default_names():
    assert Gsm8kTool({}, None).name == "calc_gsm8k_reward"
    assert Geo3kTool({}, None).name == "calc_geo3k_reward"
