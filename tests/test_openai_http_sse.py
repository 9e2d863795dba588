"""`openai_http.sse._Stream`'s ways through a read (one template event whole, a read
that begins with several, the lines) against the lines alone, every one parsed whole:
random streams of vLLM-shaped chunks (a reasoning model's too, thinking then answering,
its template a thought's chunk then a text's), with the odd malformed or differently
shaped line, cut at random and at their events' ends. The same events, errors and
counts."""

import json
import random

import orjson
import pytest

from gateway.protocol import errors
from gateway.protocol.types import Reasoning, Text
from gateway.upstreams.openai_http.sse import _Stream


class WholeStream(_Stream):
    """Parses every line whole: no template."""

    __slots__ = ()

    def _learn(self, *args: object) -> bool:
        return False


TEXTS = ["a", " world", "é", '"q"', "back\\slash", "\\", "line\nbreak", "", "🙂", "},", '","']
TWO_LOGPROBS = '{"content":[{"token":"a","logprob":-1.0},{"token":"b","logprob":-2.0}]}'
EMPTY = ["null", '""']  # an answer's text beside a thought that holds none
# What a thought holds besides: escapes orjson writes (\t, \u0001), a key's spelling.
THOUGHTS = [*TEXTS, "tab\there", "\x01", "\u2028", '"reasoning":', "reasoning_content"]
# Between a template's quotes, what is not one JSON string (or is several).
MALFORMED = ['a","b', "a\\", '"', 'x" ,"y', 'a\\"', '\\"},"x":"', "\\u00"]


# vLLM's first chunk of a chat: the role, and no text.
ROLE = (
    b'data: {"id":"x","model":"m","choices":[{"index":0,"delta":{"role":"assistant",'
    b'"content":""},"logprobs":null,"finish_reason":null}]}'
)


def _line(r: random.Random, chat: bool, n: int) -> bytes:
    index = r.randrange(n) if r.random() < 0.2 else 0
    text = orjson.dumps("".join(r.choices(TEXTS, k=r.randint(0, 2)))).decode()
    kind = r.random()
    if kind < 0.74:  # the plain text chunk, or one with what is not one string in its place
        string = text if kind < 0.7 else f'"{r.choice(MALFORMED)}"'
        rest = ',"logprobs":null,"finish_reason":null'
    elif kind < 0.76 or (kind < 0.78 and not chat):
        string, rest = text, ',"finish_reason":null'  # another shape
    elif kind < 0.78:  # a reasoning model's: reasoning, under either name, and text maybe
        name = r.choice(["reasoning", "reasoning_content"])
        delta = {name: "".join(r.choices(TEXTS, k=r.randint(0, 2)))}
        if r.random() < 0.3:
            delta["content"] = "".join(r.choices(TEXTS, k=r.randint(0, 2)))
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return b'data: {"id":"x","choices":' + orjson.dumps([choice]) + b"}"
    elif kind < 0.84:
        string, rest = '""', f',"finish_reason":"{r.choice(["stop", "length"])}"'
    elif kind < 0.88:
        usage = f'{{"prompt_tokens":3,"completion_tokens":{r.randint(0, 9)}}}'
        return f'data: {{"id":"x","choices":[],"usage":{usage}}}'.encode()
    elif kind < 0.9:
        return b": ping"
    elif kind < 0.93:  # vLLM's first of a chat (the role, no text), in either stream
        return ROLE
    else:
        string, rest = '"z"', ',"logprobs":null,"finish_reason":null'
    content = f'"delta":{{"content":{string}}}' if chat else f'"text":{string}'
    choice = f'{{"index":{index},{content}{rest}}}'
    if kind >= 0.93:
        choice = choice.replace('":', '": ')  # spelled otherwise
    kind_name = "chat.completion.chunk" if chat else "text_completion"
    return f'data: {{"id":"x","object":"{kind_name}","model":"m","choices":[{choice}]}}'.encode()


def _thought(r: random.Random, n: int, names: list[str], counted: bool) -> bytes:
    """A reasoning model's chunk as it thinks, as vLLM spells it (its text chunk with the
    delta's `reasoning`, or `reasoning_content`); now and then what is not one string
    between the quotes, a string spelled otherwise (\\u escapes), logprobs, both names
    (as the vLLMs that sent both: the same string, or not), the answer's text beside it
    (the thought's end), an empty or null text, another server's spacing or fields, the
    other choice beside it; each with its usage where the stream is `counted` (vLLM's
    `continuous_usage_stats`)."""
    index = r.randrange(n) if r.random() < 0.1 else 0
    name = r.choice(names)
    piece = "".join(r.choices(THOUGHTS, k=r.randint(0, 3)))
    string = orjson.dumps(piece).decode()
    other = orjson.dumps(r.choice(["", "a", "é"])).decode()  # a few: lines alike but for it
    kind = r.random()
    rest, more = ',"logprobs":null,"finish_reason":null', ""
    if kind < 0.7:
        delta = f'"{name}":{string}'
    elif kind < 0.74:
        delta = f'"{name}":"{r.choice(MALFORMED)}"'
    elif kind < 0.78:
        delta = f'"{name}":{json.dumps(piece)}'  # ASCII only
    elif kind < 0.82:
        delta = f'"reasoning":{string},"reasoning_content":{string}'
    elif kind < 0.84:
        delta = f'"reasoning":{string},"reasoning_content":{other}'
    elif kind < 0.88:
        delta = f'"{name}":{string},"content":{other}'
    elif kind < 0.91:
        delta = f'"content":{r.choice(EMPTY)},"{name}":{string}'
    elif kind < 0.94:
        delta, rest = f'"{name}": {string}', ', "logprobs": null, "finish_reason": null'
    elif kind < 0.95:
        delta, rest = f'"{name}":{string}', ',"finish_reason":null'
    elif kind < 0.96:  # with its tokens' logprobs: two tokens
        delta, rest = f'"{name}":{string}', f',"logprobs":{TWO_LOGPROBS},"finish_reason":null'
    elif kind < 0.98:  # a thought with the finish: cut at max_tokens
        delta, rest = f'"{name}":{string}', ',"logprobs":null,"finish_reason":"length"'
    elif kind < 0.99 and n == 2:  # with the other choice's text
        index, delta = 0, f'"{name}":{string}'
        more = f',{{"index":1,"delta":{{"content":{other}}}{rest}}}'
    else:
        return _line(r, True, n)
    choice = f'{{"index":{index},"delta":{{{delta}}}{rest}}}'
    head = '{"id":"x","object":"chat.completion.chunk","model":"m","choices":'
    usage = f',"usage":{{"completion_tokens":{r.randint(1, 2)}}}' if counted else ""
    return f"data: {head}[{choice}{more}]{usage}}}".encode()


def _answer(r: random.Random, n: int) -> bytes:
    """A chunk of the answer after a thought: `_line`'s, or now and then a text with its
    logprobs (which the template's next text must not join)."""
    if r.random() < 0.9:
        return _line(r, True, n)
    choice = f'{{"index":0,"delta":{{"content":"a"}},"logprobs":{TWO_LOGPROBS}}}'
    return f'data: {{"id":"x","choices":[{choice}]}}'.encode()


def _thinking(r: random.Random, n: int) -> list[bytes]:
    """A reasoning model's stream: its role, long thoughts and shorter answers in turns
    (most once, thinking then answering; now and then back and forth), under one name
    of the thought's or both; the thoughts with their usage now and then."""
    names = r.choice([["reasoning"], ["reasoning_content"], ["reasoning", "reasoning_content"]])
    counted = r.random() < 0.2
    lines = [ROLE] if r.random() < 0.8 else []
    for _ in range(r.choice([1, 1, 1, 2, 3])):
        lines += [_thought(r, n, names, counted) for _ in range(r.randint(0, 60))]
        lines += [_answer(r, n) for _ in range(r.randint(0, 15))]
    return lines


def _reads(r: random.Random, lines: list[bytes]) -> list[bytes]:
    events = [line + b"\n\n" for line in lines]
    events.append(b"data: [DONE]\n\n")
    if r.random() < 0.5:  # at events' ends, a few together: as an engine's writes come
        reads, i = [], 0
        while i < len(events):
            k = r.randint(1, 12)
            reads.append(b"".join(events[i : i + k]))
            i += k
        return reads
    data = b"".join(events)
    cuts = sorted(r.sample(range(1, len(data)), min(len(data) - 1, r.randint(1, 30))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def _read(stream: _Stream, reads: list[bytes]) -> list:
    seen: list = []
    for data in reads:
        try:
            stream.feed(data)
        except errors.GatewayError as error:
            return [*seen, *stream.ready, type(error), str(error)]
        if len(data) % 2:
            seen += stream.ready  # the reader takes them now and then
            stream.ready.clear()
        if stream.done:
            break
    return [*seen, *stream.ready, stream.done, stream._counted]


@pytest.mark.parametrize("chat", [True, False])
def test_random_streams_read_as_their_lines_parsed_whole(chat):
    for seed in range(300):
        r = random.Random(seed)
        n = r.choice([1, 1, 2])
        reads = _reads(r, [_line(r, chat, n) for _ in range(r.randint(1, 40))])
        assert _read(_Stream(chat, n), reads) == _read(WholeStream(chat, n), reads), seed


def test_random_thoughts_read_as_their_lines_parsed_whole():
    for seed in range(600):
        r = random.Random(seed)
        n = r.choice([1, 1, 2])
        reads = _reads(r, _thinking(r, n))
        assert _read(_Stream(True, n), reads) == _read(WholeStream(True, n), reads), seed


class CountedStream(_Stream):
    """Counts the lines it parses whole."""

    parsed = 0

    def _chunk(self, payload: dict, line: bytes) -> bool:
        self.parsed += 1
        return super()._chunk(payload, line)


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
@pytest.mark.parametrize("together", [1, 5])
def test_a_thought_and_its_answer_each_parse_their_first_chunk_only(name, together):
    # vLLM's chunks (as its server spells them) with its thought, a token a chunk: the
    # first thought's chunk is the template, the answer's first text chunk the next one
    def chunk(key: str, text: str, reason: str = "null") -> bytes:
        return (
            b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
            b'"model":"m","choices":[{"index":0,"delta":{%b:%b},"logprobs":null,'
            b'"finish_reason":%b}]}\n\n' % (orjson.dumps(key), orjson.dumps(text), reason.encode())
        )

    thought = ["Hm", ", ", '"hi"', " \\ ", "\n", "é🙂", "\t", "", "ok"] * 3
    answer = ["Hello", "", ' "there"', "\n"] * 3
    events = [ROLE + b"\n\n", *(chunk(name, t) for t in thought)]
    events += [chunk("content", t) for t in answer]
    events += [chunk("content", "", '"stop"'), b"data: [DONE]\n\n"]
    reads = [b"".join(events[i : i + together]) for i in range(0, len(events), together)]
    stream = CountedStream(True, 1)
    got = _read(stream, reads)
    assert got == _read(WholeStream(True, 1), reads)
    assert stream.parsed == 4  # the role, the first of each kind, the finish
    assert stream._head.endswith(b'"content":"')
    thoughts = [e for e in got if type(e) is Reasoning]
    texts = [e for e in got if type(e) is Text]
    assert "".join(e.text for e in thoughts) == "".join(thought)
    assert "".join(e.text for e in texts) == "".join(answer)
    assert got.index(thoughts[-1]) < got.index(texts[0])
    # a token a chunk, but for the empty ones (no event, no token, as parsed whole)
    assert sum(e.tokens for e in thoughts + texts) == len(thought) + len(answer) - 6


def test_a_read_that_begins_with_template_events_takes_them_then_its_lines():
    head = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":'
    tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
    first = head + b'"a"' + tail
    run = b"".join(head + orjson.dumps(t) + tail for t in ["b", "", "c\n"])
    end = b'data: {"id":"x","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    ping = b": ping\n\n" + head + b'"e"' + tail
    for rest in [b"", end + b"data: [DONE]\n\n", head + b'"d', ping]:
        templated, whole = _Stream(True, 1), WholeStream(True, 1)
        for stream in (templated, whole):
            stream.feed(first)
            stream.feed(run + rest)
        assert templated._head and list(templated.ready) == list(whole.ready), rest
        assert templated._counted == whole._counted and templated._parts == whole._parts


@pytest.mark.parametrize("chat", [True, False])
def test_vllm_first_chunk_takes_nothing(chat):
    # its role and an empty text: no event, no token, not a template
    key = '"delta":{"content":"a"}' if chat else '"text":"a"'
    text = f'data: {{"id":"x","choices":[{{"index":0,{key},"finish_reason":null}}]}}'.encode()
    end = b'data: {"id":"x","choices":[{"index":0,"text":"","finish_reason":"stop"}]}'
    events = [text, text, end, b"data: [DONE]"]
    streams = _Stream(chat, 1), _Stream(chat, 1)
    for stream, lines in zip(streams, ([ROLE, *events], events), strict=True):
        stream.feed(b"".join(line + b"\n\n" for line in lines))
    assert list(streams[0].ready) == list(streams[1].ready)
    assert streams[0]._counted == streams[1]._counted == [2]
    assert streams[0]._head == streams[1]._head
