"""The load generator's figures, from hand-made results: the definitions of vLLM's
`bench serve`, and the SSE reading they rest on."""

import itertools
import random

import pytest

from gateway.bench.client import Recorder, Result, Tally
from gateway.bench.stats import percentile, summarize
from gateway.bench.workload import Request, arrival_times, lengths


def result(sent: float, ttft: float, chunks: list[float], end: float, tokens: int) -> Result:
    """A streamed request sent at `sent`, with content at the times `chunks`."""
    gaps = [b - a for a, b in itertools.pairwise(chunks)]
    return Result(sent, end, ttft, gaps, len(chunks), len(chunks), 10, tokens, "x")


def test_percentiles_interpolate_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_ttft_itl_tpot_e2e_and_throughputs():
    requests = [Request(b"{}", 10, 5), Request(b"{}", 10, 5), Request(b"{}", 10, 5)]
    results = [
        # sent at 0, first chunk at 0.1, four more 0.1 apart; usage says 5 tokens
        result(0.0, 0.1, [0.1, 0.2, 0.3, 0.4, 0.5], 0.5, 5),
        # sent at 1, first chunk at 1.3; one chunk carrying 5 tokens at 1.3, the end at 1.7
        result(1.0, 0.3, [1.3], 1.7, 5),
        Result(0.5, 2.0, None, [], 0, 0, None, None, "", error="http 503 server_busy"),
    ]
    summary = summarize(requests, results)
    assert (summary.completed, summary.failed) == (2, 1)
    assert summary.errors == {"http 503 server_busy": 1}
    assert summary.duration_s == 2.0  # first sent to last over
    assert summary.output_tokens == summary.requested_output_tokens == 10
    assert summary.input_tokens == 20
    assert summary.request_throughput == 1.0
    assert summary.output_throughput == 5.0
    assert summary.total_token_throughput == 15.0
    assert summary.ttft_ms is not None and summary.ttft_ms.mean == pytest.approx(200)
    assert summary.itl_ms is not None and summary.itl_ms.p50 == pytest.approx(100)
    # TPOT = (e2e - TTFT) / (tokens - 1): (0.5 - 0.1) / 4 and (0.7 - 0.3) / 4
    assert summary.tpot_ms is not None and summary.tpot_ms.p99 == pytest.approx(100)
    assert summary.e2e_ms is not None and summary.e2e_ms.p50 == pytest.approx(600)


def test_a_stream_is_read_across_reads_and_line_endings():
    tally = Tally()
    recorder = Recorder(stream=True, tally=tally)
    recorder.start(200)
    events = (
        b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\r\n\r\n'
        b": keep-alive\n\n"
        b'data: {"choices":[{"delta":{"content":"one"}}]}\n\n'
        b'data: {"choices":[{"delta":{"content":" two"}}]}\n\n'
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
        b"data: [DONE]\n\n"
    )
    for i in range(0, len(events), 7):  # split anywhere, even inside \r\n
        recorder.feed(events[i : i + 7])
    done = recorder.result()
    assert done.ok
    assert done.text == "one two"
    assert (done.chunks, done.prompt_tokens, done.output_tokens) == (2, 3, 2)
    assert done.ttft is not None and len(done.itl) == 1
    assert (tally.chunks, tally.done, tally.failed) == (2, 1, 0)


def test_failures_are_named_by_kind():
    refused = Recorder(stream=True)
    refused.start(400)
    refused.feed(b'{"error": {"message": "no", "type": "invalid_request_error", "code": null}}')
    assert refused.result().error == "http 400 invalid_request_error"

    broken = Recorder(stream=True)
    broken.start(200)
    broken.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    broken.feed(b'data: {"error": {"message": "boom", "code": "engine_error"}}\n\ndata: [DONE]\n\n')
    assert broken.result().error == "stream engine_error"

    cut = Recorder(stream=True)
    cut.start(200)
    cut.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n')
    assert cut.result().error == "stream incomplete"


def test_lengths_and_arrivals():
    rng = random.Random(0)
    drawn = lengths(1000, 100, 0.25, rng)
    assert min(drawn) >= 75 and max(drawn) <= 125 and len(set(drawn)) > 40
    assert lengths(3, 7, 0.0, rng) == [7, 7, 7]
    assert arrival_times(4, float("inf")) == [0.0] * 4
    poisson = arrival_times(5000, 100.0, seed=1)
    assert poisson == arrival_times(5000, 100.0, seed=1)  # a seed replays a run
    assert poisson[-1] / 5000 == pytest.approx(0.01, rel=0.1)  # mean gap 1 / rate
