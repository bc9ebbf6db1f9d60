"""The hermes tool-call parser on hand-written model outputs, well-formed and malformed."""

from __future__ import annotations

import pytest

from verl.experimental.agent_loop.tool_parser import HermesToolParser, ToolCall, get_tool_parser

parse = HermesToolParser().parse


def test_text_without_tool_calls_is_a_final_answer():
    turn = parse("The answer is 182.")
    assert turn.content == "The answer is 182." and turn.tool_calls == [] and turn.errors == []
    assert not turn.wants_tools


def test_one_call_with_surrounding_text_and_whitespace():
    turn = parse(
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+34*5"}}\n</tool_call>'
    )
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "12+34*5"})]
    assert turn.content == "Let me compute." and turn.errors == [] and turn.wants_tools


def test_several_calls_keep_their_order():
    text = '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    turn = parse(text)
    assert [c.name for c in turn.tool_calls] == ["a", "b"]
    assert turn.tool_calls[0].arguments == {"x": 1}
    assert turn.content == "and"


def test_arguments_given_as_a_json_string_or_omitted_are_accepted():
    turn = parse(
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call><tool_call>{"name": "g"}</tool_call>'
    )
    assert turn.tool_calls == [ToolCall("f", {"x": 2}), ToolCall("g", {})]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "f", "arguments": {"x": 1}', "not valid JSON"),
        ('["f", {"x": 1}]', "must be a JSON object"),
        ('{"arguments": {"x": 1}}', 'no "name" string'),
        ('{"name": "", "arguments": {}}', 'no "name" string'),
        ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object, got [1, 2]"),
        ('{"name": "f", "arguments": "x=1"}', "not a JSON object"),
    ],
)
def test_malformed_calls_become_errors_and_keep_well_formed_ones(body, message):
    turn = parse(f'<tool_call>{body}</tool_call><tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>')
    assert turn.tool_calls == [ToolCall("ok", {})]
    assert len(turn.errors) == 1 and message in turn.errors[0]
    assert turn.wants_tools


def test_an_unclosed_call_is_an_error_and_is_not_part_of_the_content():
    turn = parse('Sure. <tool_call>{"name": "calculator", "arguments": {"expression": "1+')
    assert turn.tool_calls == []
    assert turn.errors == ["<tool_call> without a closing </tool_call>"]
    assert turn.content == "Sure."


def test_unknown_format_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"multi_turn.format='json'.*\['gpt-oss', 'hermes'\]"):
        get_tool_parser("json")


# ------------------------------------------------------------------------------------- gpt-oss

HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json"
    '<|message|>{"expression": "12+34*5"}<|call|>'
)


def test_gpt_oss_call_on_the_commentary_channel():
    parser = get_tool_parser("gpt-oss")
    assert parser.keep_special_tokens  # its markers are special tokens
    turn = parser.parse(HARMONY_CALL)
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "12+34*5"})] and turn.errors == []


def test_gpt_oss_call_cut_at_its_stop_token_and_reasoning_dropped():
    """The engine stops at <|call|> (the loop hands the text without it); a call inside the analysis
    channel is reasoning, not a call."""
    reasoning = '<|channel|>analysis<|message|>maybe to=functions.calculator <|message|>{"expression": "1"}<|end|>'
    turn = get_tool_parser("gpt-oss").parse(reasoning + HARMONY_CALL.removesuffix("<|call|>"))
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "12+34*5"})]


def test_gpt_oss_final_answer_and_malformed_arguments():
    parser = get_tool_parser("gpt-oss")
    final = parser.parse("<|start|>assistant<|channel|>final<|message|>It is 182.<|return|>")
    assert final.content == "It is 182." and not final.wants_tools
    bad = parser.parse("<|channel|>commentary to=functions.calculator <|message|>{not json<|call|>")
    assert bad.tool_calls == [] and len(bad.errors) == 1 and "not a JSON object" in bad.errors[0]


# ---- upstream's interface: token ids in, decoded with the parser's tokenizer, (content, [FunctionCall]) out


def _ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # the bundled tokenizer spells every character of these texts
    return ids


def test_extract_tool_calls_reads_hermes_ids_into_upstreams_function_calls(tokenizer, caplog):
    import asyncio
    import json
    import logging

    from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

    parser = ToolParser.get_tool_parser("hermes", tokenizer)
    assert type(parser) is HermesToolParser and parser.tokenizer is tokenizer
    text = (
        'Let me compute.<tool_call>{"name": "calculator", "arguments": {"expression": "12+34*5"}}</tool_call>\n'
        '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
        '<tool_call>{"name": 3}</tool_call>'
    )
    ids = _ids(tokenizer, text) + [tokenizer.eos_token_id]
    with caplog.at_level(logging.WARNING, logger="verl.experimental.agent_loop.tool_parser"):
        content, calls = asyncio.run(parser.extract_tool_calls(ids))
    # worked by hand: the three blocks cut out of the text, special tokens kept (upstream decodes with them)
    assert content == "Let me compute.\n<eos>"
    assert calls == [
        FunctionCall(name="calculator", arguments='{"expression": "12+34*5"}'),
        FunctionCall(name="weather", arguments='{"city": "Paris", "days": 2}'),
    ]
    assert json.loads(calls[1].arguments) == {"city": "Paris", "days": 2}
    assert [r.getMessage() for r in caplog.records] == [
        'HermesToolParser: left out a malformed tool call: the tool call has no "name" string: {"name": 3}'
    ]
    assert asyncio.run(parser.extract_tool_calls(_ids(tokenizer, "It is 182."))) == ("It is 182.", [])


def test_extract_tool_calls_reads_gpt_oss_ids_without_the_padding(tokenizer):
    import asyncio

    from verl.experimental.agent_loop.tool_parser import FunctionCall, GptOssToolParser, ToolParser

    parser = ToolParser.get_tool_parser("gpt-oss", tokenizer)
    assert type(parser) is GptOssToolParser
    text = '<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "1+2"}<|call|>'
    ids = _ids(tokenizer, text) + [tokenizer.pad_token_id] * 2
    assert asyncio.run(parser.extract_tool_calls(ids)) == (
        "",
        [FunctionCall(name="calculator", arguments='{"expression": "1+2"}')],
    )


def test_parsers_are_registered_by_upstreams_names_and_an_unknown_name_lists_them(tokenizer):
    import asyncio

    from verl.experimental.agent_loop.tool_parser import TOOL_PARSERS, ToolParser

    with pytest.raises(
        ValueError, match=r"unknown tool parser 'qwen'; the registered parsers are \['gpt-oss', 'hermes'\]"
    ):
        ToolParser.get_tool_parser("qwen", tokenizer)

    @ToolParser.register("shout")
    class ShoutParser(HermesToolParser):
        def parse(self, text):
            turn = super().parse(text)
            turn.content = turn.content.upper()
            return turn

    try:
        parser = ToolParser.get_tool_parser("shout", tokenizer)
        assert type(parser) is ShoutParser and type(get_tool_parser("shout")) is ShoutParser
        assert asyncio.run(parser.extract_tool_calls(_ids(tokenizer, "done"))) == ("DONE", [])
    finally:
        del TOOL_PARSERS["shout"]
    with pytest.raises(
        ValueError, match=r"has no tokenizer; build it with ToolParser.get_tool_parser\(name, tokenizer\)"
    ):
        asyncio.run(HermesToolParser().extract_tool_calls([1, 2]))
