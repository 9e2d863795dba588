"""Tool calls in a model's text (gateway/protocol/tool_calls): the hermes and
llama3_json formats and the forced (`required`, named) answers, fed whole and
split at every character, with several calls, bad JSON, unknown functions, no
calls; the schema that forces calls; the events one choice gives. Pure
functions: no server."""

from __future__ import annotations

import json
import re

import pytest

from gateway.config import TOOL_CALL_PARSERS, ConfigError, parse_config
from gateway.protocol import errors
from gateway.protocol.tool_calls import (
    MAX_CALL_CHARS,
    PARSERS,
    ChoiceToolCalls,
    Parsed,
    ToolCallParser,
    for_request,
    parser,
    required_schema,
)
from gateway.protocol.tool_calls.forced import NamedCallParser, RequiredCallsParser
from gateway.protocol.types import (
    FinishReason,
    GenerateRequest,
    Message,
    Text,
    TokenLogprob,
    Tool,
    ToolCallDelta,
)

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    json.dumps(
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        }
    ),
)
TIME = Tool("get_time", "The time now")
TOOLS = (WEATHER, TIME)
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def run(p: ToolCallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feeds `pieces`, then finishes: the text shown and the calls (name, arguments)
    as a client adds up the pieces, checking the pieces' shape on the way."""
    text: list[str] = []
    calls: dict[int, list[str]] = {}
    for parsed in [*(p.feed(piece) for piece in pieces), p.finish()]:
        assert isinstance(parsed, Parsed)
        text.append(parsed.text)
        for piece in parsed.calls:
            if piece.call_index not in calls:  # the first piece: id and name only
                assert piece.call_index == len(calls)
                assert CALL_ID.fullmatch(piece.id) and piece.name and piece.arguments == ""
                calls[piece.call_index] = [piece.name]
            else:
                assert piece.id == piece.name == ""
                calls[piece.call_index].append(piece.arguments)
    return "".join(text), [(c[0], "".join(c[1:])) for c in calls.values()]


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every boundary."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


HERMES_CASES = [
    ("no calls", "The sky is < blue > today.", "The sky is < blue > today.", []),
    (
        "one call",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", '{"city":"Paris"}')],
    ),
    (
        "text then two calls",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo",'
        ' "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
        "\n</tool_call>\n",
        "Let me check.\n",
        [("get_weather", '{"city":"Oslo","unit":"c"}'), ("get_time", "{}")],
    ),
    (
        "braces and markers inside strings",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "}{\\"</tool_call"}}</tool_call>',
        "",
        [("get_weather", '{"city":"}{\\"</tool_call"}')],
    ),
    (
        "bad JSON is text",
        '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> done',
        '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call> done',
        [],
    ),
    (
        "an unknown function is text",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "arguments that are no object are text",
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
        [],
    ),
    (
        "an unclosed call at the end is read to the end",
        '<tool_call>{"name": "get_time", "arguments": {}}',
        "",
        [("get_time", "{}")],
    ),
    ("a marker's start at the end is text", "see <tool_", "see <tool_", []),
    (
        "text after a call is shown",
        '<tool_call>{"name": "get_time"}</tool_call>\nAnything else?',
        "\nAnything else?",
        [("get_time", "{}")],
    ),
    (
        "non-ASCII arguments stay",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京"}}</tool_call>',
        "",
        [("get_weather", '{"city":"Zürich 東京"}')],
    ),
]


@pytest.mark.parametrize(("case", "output", "text", "calls"), HERMES_CASES)
def test_hermes_reads_the_same_calls_however_the_text_is_split(case, output, text, calls):
    for pieces in splits(output):
        assert run(parser("hermes", TOOLS), pieces) == (text, calls), (case, pieces)


def test_hermes_holds_back_only_what_may_begin_a_marker():
    p = parser("hermes", TOOLS)
    assert p.feed("Hello <tool") == Parsed("Hello ")
    assert p.feed("box> and <") == Parsed("<toolbox> and ")
    assert p.feed("b>") == Parsed("<b>")
    assert not p.called


LLAMA_CASES = [
    ("no calls", "It is sunny {mostly}.", "It is sunny {mostly}.", []),
    (
        "one call",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        "",
        [("get_weather", '{"city":"Rome"}')],
    ),
    (
        "the python tag and two calls",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "arguments": {}};',
        "",
        [("get_weather", '{"city":"Rome"}'), ("get_time", "{}")],
    ),
    (
        "leading whitespace",
        '\n {"name": "get_time", "parameters": {}}',
        "",
        [("get_time", "{}")],
    ),
    (
        "text first: all text",
        'Sure: {"name": "get_time", "parameters": {}}',
        'Sure: {"name": "get_time", "parameters": {}}',
        [],
    ),
    (
        "an unknown function is text",
        '{"name": "rm_rf", "parameters": {}}',
        '{"name": "rm_rf", "parameters": {}}',
        [],
    ),
    (
        "bad JSON is text",
        '{"name": "get_time", "parameters": {]}',
        '{"name": "get_time", "parameters": {]}',
        [],
    ),
    (
        "a call then text",
        '{"name": "get_time", "parameters": {}} and then',
        " and then",
        [("get_time", "{}")],
    ),
    (
        "a call then a bad one",
        '{"name": "get_time", "parameters": {}}; {"name": 1}',
        '; {"name": 1}',
        [("get_time", "{}")],
    ),
    ("an unclosed object is text", '{"name": "get_time"', '{"name": "get_time"', []),
]


@pytest.mark.parametrize(("case", "output", "text", "calls"), LLAMA_CASES)
def test_llama3_json_reads_the_same_calls_however_the_text_is_split(case, output, text, calls):
    for pieces in splits(output):
        assert run(parser("llama3_json", TOOLS), pieces) == (text, calls), (case, pieces)


def test_llama3_json_shows_text_at_once_once_it_is_no_call():
    p = parser("llama3_json", TOOLS)
    assert p.feed("  ") == Parsed("")
    assert p.feed("Hi") == Parsed("  Hi")
    assert p.feed(" there") == Parsed(" there")


REQUIRED_CASES = [
    (
        "one",
        '[{"name":"get_weather","parameters":{"city":"Lima"}}]',
        "",
        [("get_weather", '{"city":"Lima"}')],
    ),
    (
        "two, spaced",
        '[ {"name": "get_time", "parameters": {}} , {"name": "get_weather", '
        '"parameters": {"city": "a]b"}} ]',
        "",
        [("get_time", "{}"), ("get_weather", '{"city":"a]b"}')],
    ),
    (
        "an element that is no call is text from there",
        '[{"name":"get_time","parameters":{}},{"name":"nope","parameters":{}}]',
        '{"name":"nope","parameters":{}}]',
        [("get_time", "{}")],
    ),
    ("no array is text", "hello", "hello", []),
]


@pytest.mark.parametrize(("case", "output", "text", "calls"), REQUIRED_CASES)
def test_required_answers_are_read_as_the_forced_array(case, output, text, calls):
    for pieces in splits(output):
        assert run(RequiredCallsParser(TOOLS), pieces) == (text, calls), (case, pieces)


def test_a_named_call_streams_its_arguments_as_they_come():
    p = NamedCallParser(TOOLS, "get_weather")
    first = p.feed('{"ci')
    assert [c.name for c in first.calls] == ["get_weather", ""] and first.text == ""
    assert first.calls[1].arguments == '{"ci'
    assert p.feed('ty":"Lima"}').calls[0].arguments == 'ty":"Lima"}'
    assert p.finish() == Parsed("")
    for pieces in splits('{"city":"Lima"}'):
        assert run(NamedCallParser(TOOLS, "get_weather"), pieces) == (
            "",
            [("get_weather", '{"city":"Lima"}')],
        )


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "required"])
def test_a_call_larger_than_the_bound_is_an_error_not_memory(name):
    p = RequiredCallsParser(TOOLS) if name == "required" else parser(name, TOOLS)
    opening = {"hermes": "<tool_call>", "llama3_json": "", "required": "["}[name]
    p.feed(opening + '{"name": "get_weather", "parameters": {"city": "')
    chunk = "x" * 65536
    with pytest.raises(errors.Failed):
        for _ in range(MAX_CALL_CHARS // len(chunk) + 2):
            p.feed(chunk)


@pytest.mark.parametrize(
    ("name", "output"),
    [
        ("hermes", '<tool_call>{"name": "get_time"}</tool_call>' * 2),
        ("llama3_json", '{"name": "get_time"}; {"name": "get_time"}'),
    ],
)
def test_without_parallel_calls_only_the_first_call_counts(name, output):
    assert run(parser(name, TOOLS, single=True), [output]) == ("", [("get_time", "{}")])
    p = for_request(request(tools=TOOLS, parallel_tool_calls=False), name)
    assert p is not None and run(p, list(output)) == ("", [("get_time", "{}")])
    assert len(run(parser(name, TOOLS), [output])[1]) == 2


def test_unknown_format_names_the_known_ones():
    with pytest.raises(ValueError, match="hermes"):
        parser("pythonic", TOOLS)


def test_required_schema_is_vllms_array_of_name_and_parameters():
    schema = json.loads(required_schema(TOOLS, "required", None))
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"] for v in variants] == [
        {"type": "string", "enum": ["get_weather"]},
        {"type": "string", "enum": ["get_time"]},
    ]
    assert variants[0]["properties"]["parameters"] == json.loads(WEATHER.parameters)
    assert variants[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert all(v["required"] == ["name", "parameters"] for v in variants)
    assert json.loads(required_schema(TOOLS, "required", False))["maxItems"] == 1


def test_required_schema_of_a_named_function_is_its_parameters():
    assert json.loads(required_schema(TOOLS, "get_weather", None)) == json.loads(WEATHER.parameters)
    assert json.loads(required_schema(TOOLS, "get_time", None)) == {
        "type": "object",
        "properties": {},
    }
    with pytest.raises(errors.Invalid) as refused:
        required_schema(TOOLS, "get_stock", None)
    assert refused.value.param == "tool_choice"
    with pytest.raises(ValueError):
        required_schema(TOOLS, "auto", None)


def test_required_schema_gathers_defs_and_refuses_two_meanings():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    a = Tool(
        "a", "", json.dumps({"$defs": {"P": point}, "properties": {"p": {"$ref": "#/$defs/P"}}})
    )
    b = Tool("b", "", json.dumps({"$defs": {"P": point}}))
    schema = json.loads(required_schema((a, b), "required", None))
    assert schema["$defs"] == {"P": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    c = Tool("c", "", json.dumps({"$defs": {"P": {"type": "string"}}}))
    with pytest.raises(errors.Invalid) as refused:
        required_schema((a, c), "required", None)
    assert refused.value.param == "tools"


def request(**fields) -> GenerateRequest:
    return GenerateRequest("m", messages=(Message("user", "hi"),), **fields)


def test_for_request_picks_the_forced_parser_or_the_models_format():
    assert for_request(request(), "hermes") is None
    assert for_request(request(tools=TOOLS, tool_choice="none"), "hermes") is None
    assert isinstance(
        for_request(request(tools=TOOLS, tool_choice="required"), None), RequiredCallsParser
    )
    assert isinstance(
        for_request(request(tools=TOOLS, tool_choice="get_time"), None), NamedCallParser
    )
    assert isinstance(for_request(request(tools=TOOLS), "llama3_json"), ToolCallParser)
    with pytest.raises(errors.Invalid) as refused:
        for_request(request(tools=TOOLS, tool_choice="auto"), None)
    assert refused.value.param == "tools"


def test_a_choices_events_carry_every_token_and_end_in_tool_calls():
    lp = TokenLogprob("x", -1.0)
    choice = ChoiceToolCalls(parser("hermes", TOOLS), index=1)
    assert choice.feed("Hi ", 1, (lp,)) == [Text("Hi ", 1, 1, (lp,))]
    assert choice.feed("<tool_", 1, (lp,)) == []
    events = choice.feed('call>{"name": "get_time"}</tool_call>', 3, (lp, lp, lp))
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]
    assert events[0].tokens == 4 and events[0].index == 1 and events[0].name == "get_time"
    assert events[1] == ToolCallDelta(1, 0, "", "", "{}", 0)
    assert choice.feed("\n", 1, (lp,)) == []
    assert choice.finish() == [Text("", 1, 1, (lp,))]
    assert choice.finish_reason(FinishReason.STOP) is FinishReason.TOOL_CALLS
    assert choice.finish_reason(FinishReason.LENGTH) is FinishReason.LENGTH
    plain = ChoiceToolCalls(parser("hermes", TOOLS))
    assert plain.feed("no calls", 2) == [Text("no calls", 2, 0, None)]
    assert plain.feed("", 1) == []  # an end-of-sequence token: counted by Finished
    assert plain.finish() == [] and plain.finish_reason(FinishReason.STOP) is FinishReason.STOP


def test_without_tools_text_goes_straight_through():
    choice = ChoiceToolCalls(None, index=2)
    assert choice.feed("<tool_call>{}", 2) == [Text("<tool_call>{}", 2, 2, None)]
    assert choice.feed("", 1, (TokenLogprob("", -0.5),)) == []
    assert choice.finish() == [Text("", 1, 2, (TokenLogprob("", -0.5),))]
    assert choice.finish_reason(FinishReason.STOP) is FinishReason.STOP


def test_the_config_takes_exactly_the_formats_there_are(tmp_path):
    assert set(TOOL_CALL_PARSERS) == set(PARSERS)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the config checks them readable
        (tmp_path / name).write_text("{}")
    model = {"name": "m", "upstream": "vllm-grpc", "tokenizer": str(tmp_path), "workers": ["h:1"]}
    config = parse_config({"models": [{**model, "tool_call_parser": "llama3_json"}]}, env={})
    assert config.models[0].tool_call_parser == "llama3_json"
    assert parse_config({"models": [model]}, env={}).models[0].tool_call_parser is None
    for wrong in (
        {**model, "tool_call_parser": "pythonic"},
        {"name": "g", "workers": ["h:1"], "tool_call_parser": "hermes"},
    ):
        with pytest.raises(ConfigError, match=r"models\[0\]\.tool_call_parser"):
            parse_config({"models": [wrong]}, env={})
