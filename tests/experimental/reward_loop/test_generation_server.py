"""The generation server (SGLang's /generate, OpenAI's chat and completions) over the built-in engine, on the
bundled model, in this process: its greedy answers equal transformers' own greedy generation."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.experimental.reward_loop.greedy_reference import hf_greedy, stop_ids
from verl.experimental.reward_loop.generation_server import ServerThread, build_engine_server, serving_rollout_config
from verl.models import bundled_model_path


@pytest.fixture(scope="module")
def served():
    server = build_engine_server(bundled_model_path(), serving_rollout_config({"name": "hf"}), "judge")
    thread = ServerThread(server).start()
    yield server, thread.address, stop_ids()  # the model's generation config's, as transformers reads them
    thread.stop()


def _post(address: str, endpoint: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{address}{endpoint}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _prompt_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_generate_and_chat_answer_what_transformers_generates_greedily(served):
    server, address, stops = served
    tok = server.tokenizer
    questions = ["What is 12+34?", "What is 7+58?", "What is 90+9?"]
    prompts = [_prompt_ids(tok, q) for q in questions]
    expected = [hf_greedy(p, 8) for p in prompts]

    status, one = _post(
        address, "/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    )
    assert status == 200 and one["output_ids"] == expected[0]
    assert one["text"] == tok.decode(expected[0], skip_special_tokens=True)
    assert one["meta_info"]["prompt_tokens"] == len(prompts[0])
    assert one["meta_info"]["completion_tokens"] == len(expected[0])
    assert one["meta_info"]["finish_reason"]["type"] == ("stop" if expected[0][-1] in stops else "length")

    status, batch = _post(
        address, "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    )
    assert status == 200 and [r["output_ids"] for r in batch] == expected  # batched rows: the same answers

    status, chat = _post(
        address,
        "/v1/chat/completions",
        {"model": "judge", "messages": [{"role": "user", "content": questions[1]}], "temperature": 0, "max_tokens": 8},
    )
    assert status == 200 and chat["object"] == "chat.completion" and chat["model"] == "judge"
    content_ids = expected[1][:-1] if expected[1][-1] in stops else expected[1]
    assert chat["choices"][0]["message"] == {
        "role": "assistant",
        "content": tok.decode(content_ids, skip_special_tokens=True),
    }
    assert chat["usage"] == {
        "prompt_tokens": len(prompts[1]),
        "completion_tokens": len(expected[1]),
        "total_tokens": len(prompts[1]) + len(expected[1]),
    }

    status, comp = _post(address, "/v1/completions", {"prompt": prompts[2], "max_tokens": 8, "temperature": 0, "n": 2})
    assert status == 200 and len(comp["choices"]) == 2
    assert {c["text"] for c in comp["choices"]} == {tok.decode(expected[2], skip_special_tokens=True)}


def test_sampled_requests_return_ids_within_the_budget(served):
    _, address, _ = served
    status, out = _post(
        address,
        "/generate",
        {
            "input_ids": [[2, 5, 60], [2, 5, 61]],
            "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "top_p": 0.9},
        },
    )
    assert status == 200 and all(1 <= len(r["output_ids"]) <= 3 for r in out)


@pytest.mark.parametrize(
    "endpoint, body, message",
    [
        ("/generate", {"sampling_params": {}}, "exactly one of input_ids"),
        ("/generate", {"input_ids": [1, -2]}, "non-negative integers"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**6}},
            "exceeds the model's context of 2048",
        ),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"min_p": 0.1}}, "keys ['min_p'] are not supported"),
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "must be >= 0"),
        ("/v1/chat/completions", {"messages": []}, "non-empty list"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream=true"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n=0 must be a positive integer"),
        ("/generate", b"not json", "must be a JSON object"),
    ],
)
def test_requests_it_cannot_serve_get_400_naming_the_problem(served, endpoint, body, message):
    _, address, _ = served
    status, reply = _post(address, endpoint, body)
    assert status == 400 and message in reply["error"]["message"], reply
