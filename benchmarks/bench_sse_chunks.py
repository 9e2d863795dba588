"""CPU a chunk of the `upstream: openai` stream's parser (`openai_http.sse._Stream`), by
the kind of chunk: a reasoning model's thought (the delta's `reasoning`, or
`reasoning_content` before vLLM 0.11) against its answer's text (`content`).

Run: `.venv/bin/python -m benchmarks.bench_sse_chunks` (a few seconds).

20,000 one-token chunks of each kind, spelled as vLLM's server spells them, fed one a
read (an engine that sends a token a step, its reader keeping up) and eight a read (one
that sends them faster than they are read); process CPU time a chunk, the best of five
rounds. The parser alone: no loop, no sockets.
"""

from __future__ import annotations

import time

from gateway.upstreams.openai_http.sse import _Stream

CHUNKS = 20_000
_CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk",'
    b'"created":1764900000,"model":"m","choices":[{"index":0,"delta":{%b:"%b"},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)


def per_chunk(key: bytes, together: int) -> float:
    """Microseconds of CPU a chunk whose delta holds `key`, `together` chunks a read."""
    chunks = [_CHUNK % (key, b" tok%d" % (i % 97)) for i in range(CHUNKS)]
    reads = [b"".join(chunks[i : i + together]) for i in range(0, CHUNKS, together)]
    best = float("inf")
    for _ in range(5):
        stream = _Stream(True, 1)
        ready = stream.ready
        start = time.process_time()
        for data in reads:
            stream.feed(data)
            ready.clear()  # the reader takes them
        best = min(best, time.process_time() - start)
    return best / CHUNKS * 1e6


def main() -> None:
    print("| delta | µs a chunk, one a read | eight a read |")
    print("| --- | ---: | ---: |")
    for key in (b'"content"', b'"reasoning"', b'"reasoning_content"'):
        print(f"| `{key.decode()}` | {per_chunk(key, 1):.2f} | {per_chunk(key, 8):.2f} |")


if __name__ == "__main__":
    main()
