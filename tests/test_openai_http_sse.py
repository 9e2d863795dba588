"""`openai_http.sse._Stream`'s ways through a read (one template event whole, a read
that begins with several, the lines) against the lines alone, every one parsed whole:
random streams of vLLM-shaped chunks (a reasoning model's too), with the odd malformed or
differently shaped line, cut at random and at their events' ends. The same events, errors
and counts."""

import random

import orjson
import pytest

from gateway.protocol import errors
from gateway.upstreams.openai_http.sse import _Stream


class WholeStream(_Stream):
    """Parses every line whole: no template."""

    __slots__ = ()

    def _learn(self, line: bytes, payload: dict) -> bool:
        return False


TEXTS = ["a", " world", "é", '"q"', "back\\slash", "\\", "line\nbreak", "", "🙂", "},", '","']
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


def _reads(r: random.Random, chat: bool, n: int) -> list[bytes]:
    events = [_line(r, chat, n) + b"\n\n" for _ in range(r.randint(1, 40))]
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
        reads = _reads(r, chat, n)
        assert _read(_Stream(chat, n), reads) == _read(WholeStream(chat, n), reads), seed


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
