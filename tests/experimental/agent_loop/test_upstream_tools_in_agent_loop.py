"""Upstream's Gsm8kTool inside the tool agent loop: the sample's `tools_kwargs.create_kwargs.ground_truth`
reaches the tool, the model reads upstream's response text, and each episode's step rewards reach the reward
function's extra_info as upstream's `tool_extra_fields` do (the reward rules are tested on the tool itself in
tests/tools/test_answer_reward_tools.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.experimental.agent_loop.conftest import ForcedRollout, encode
from tests.experimental.agent_loop.test_tool_agent_loop import assistant_turns, question_batch, rollout_config
from verl.experimental.agent_loop import AgentLoopRollout
from verl.tools.gsm8k_tool import Gsm8kTool

pytestmark = pytest.mark.usefixtures("one_thread")


def submit(answer: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calc_gsm8k_reward", "arguments": {"answer": answer}}) + "</tool_call>"


def test_gsm8k_tool_scores_each_samples_answer_against_its_own_ground_truth(tokenizer, tiny_model):
    eos = tokenizer.eos_token_id

    def script(context):
        text = tokenizer.decode(context)
        if assistant_turns(tokenizer, context) == 1:
            return encode(tokenizer, submit("72")) + [eos]
        return encode(tokenizer, re.findall(r"<tool_response>(.*?)</tool_response>", text, re.DOTALL)[-1]) + [eos]

    rollout = AgentLoopRollout(
        ForcedRollout(tiny_model, script), rollout_config(response_length=768), tokenizer, tools=[Gsm8kTool({}, None)]
    )
    batch = question_batch(tokenizer, ["What is 8*9?", "What is 2+3?", "What is 1+1?"])
    tools_kwargs = np.empty(3, dtype=object)
    tools_kwargs[:] = [
        {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
        {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}},
        {},  # no ground truth in the data: the model is told what is missing
    ]
    batch.non_tensor_batch["tools_kwargs"] = tools_kwargs
    out = rollout.generate_sequences(batch)

    responses = [tokenizer.decode(row) for row in out.batch["responses"]]
    assert "<tool_response>Current parsed answer='72' reward=1.0</tool_response>" in responses[0]
    assert "<tool_response>Current parsed answer='72' reward=0.0</tool_response>" in responses[1]
    assert "extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth" in responses[2]
    assert out.meta_info["metrics"]["agent_loop/tool_errors"] == pytest.approx(1 / 3)
    # upstream's tool_extra_fields: the first sample improved on its best score (step reward 0.0), the second
    # did not (-0.05), the third's call failed (no step reward); the naive manager hands them to the function
    fields = out.non_tensor_batch["tool_extra_fields"]
    assert [f["tool_rewards"] for f in fields] == [[0.0], [-0.05], []]
    assert all(f["turn_scores"] == [] for f in fields)
    from verl.workers.reward_manager.naive import NaiveRewardManager

    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 0.0

    out.non_tensor_batch["reward_model"] = np.array([{"ground_truth": "72"}] * 3, dtype=object)
    out.non_tensor_batch["data_source"] = np.array(["openai/gsm8k"] * 3, dtype=object)
    NaiveRewardManager(tokenizer, 0, compute_score=compute_score)(out)
    assert [info["tool_rewards"] for info in seen] == [[0.0], [-0.05], []]
    assert all(info["num_turns"] == 4 for info in seen)


def test_an_mcp_search_tool_answers_from_a_real_mcp_server(tmp_path, tokenizer, tiny_model, monkeypatch):
    """Upstream's MCP tool config (`config.type: mcp`, a servers file) loaded by the rollout itself: the model's
    call reaches the stdio MCP server of tests/tools/mcp, and the next turn reads its result list."""
    pytest.importorskip("fastmcp")
    import sys
    from pathlib import Path

    from verl.tools.utils.mcp_clients import McpClientManager

    monkeypatch.setattr(McpClientManager, "ClientManager", McpClientManager.MCPClientManager())
    server = Path(__file__).parents[2] / "tools" / "mcp" / "fixture_server.py"
    (tmp_path / "mcp_server.json").write_text(
        json.dumps({"mcpServers": {"fixture": {"command": sys.executable, "args": [str(server)]}}})
    )
    (tmp_path / "mcp_tool_config.yaml").write_text(
        "tools:\n"
        "  - class_name: verl.tools.mcp_search_tool.MCPSearchTool\n"
        "    config: {rate_limit: 120, timeout: 120, type: mcp}\n"
        "    mcp: {mcp_servers_config_path: ./mcp_server.json, tool_selected_list: [search]}\n"
    )
    eos = tokenizer.eos_token_id

    def script(context):
        text = tokenizer.decode(context)
        if assistant_turns(tokenizer, context) == 1:
            topic = re.findall(r"Tell me about (\w+)", text)[-1]
            call = {"name": "search", "arguments": {"query": topic, "top_k": 1}}
            return encode(tokenizer, "<tool_call>" + json.dumps(call) + "</tool_call>") + [eos]
        return encode(tokenizer, re.findall(r"<tool_response>(.*?)</tool_response>", text, re.DOTALL)[-1]) + [eos]

    monkeypatch.chdir(tmp_path)  # upstream's example names the servers file relative to the working directory
    config = rollout_config(response_length=512, tool_config_path=str(tmp_path / "mcp_tool_config.yaml"))
    rollout = AgentLoopRollout(ForcedRollout(tiny_model, script), config, tokenizer)
    assert [tool.name for tool in rollout.tools] == ["search"]
    out = rollout.generate_sequences(question_batch(tokenizer, ["Tell me about cats", "Tell me about owls"]))

    for topic, row in zip(["cats", "owls"], out.batch["responses"], strict=True):
        hit = {"title": f"{topic} #0", "url": "https://example.org/0", "tags": [topic, "0"]}
        response = tokenizer.decode(row)
        # the search tool keeps the server's result list; the model's last turn repeats it
        assert response.count(json.dumps([hit])) == 2, response
    assert out.meta_info["metrics"]["agent_loop/tool_errors"] == 0
