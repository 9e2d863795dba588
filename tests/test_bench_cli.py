"""`furnace-gateway bench` as a user runs it: a real process against a running demo
gateway, read back through its JSON report."""

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gateway.bench.workload import arrival_times
from tests.support.processes import free_port, running, wait_ready
from tests.support.waiting import HANG_GUARD

LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")


@pytest.fixture(scope="module")
def demo_url() -> Iterator[str]:
    """A demo gateway whose engine paces its tokens, so they stream one by one."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running("demo", "--port", str(port), "--token-delay", "0.001") as process:
        wait_ready(url, process)
        yield url


def bench(tmp_path, url: str, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Runs the command; returns its JSON report and the process."""
    path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "bench", "--base-url", url, "--json", str(path), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(path.read_text()), done


def assert_all_answered(report: dict, requests: int, max_tokens: int) -> None:
    assert report["requests"] == report["completed"] == requests
    assert report["failed"] == 0
    assert report["errors"] == {}
    assert report["output_tokens"] == report["requested_output_tokens"] == requests * max_tokens
    for name in LATENCIES:
        figures = report[name]
        assert set(figures) == {"mean", "p50", "p90", "p99"}, name
        assert 0 <= figures["p50"] <= figures["p90"] <= figures["p99"], name
    assert report["request_throughput"] > 0
    assert report["output_throughput"] > 0


def test_closed_loop_chat_streams(tmp_path, demo_url):
    report, done = bench(
        tmp_path,
        demo_url,
        *("--concurrency", "4", "--num-requests", "24"),
        *("--input-len", "20", "--output-len", "12"),
    )
    assert_all_answered(report, 24, 12)
    assert report["settings"]["model"] == "furnace-demo"  # the first of /v1/models
    assert report["settings"]["max_concurrency"] == 4
    assert report["input_tokens"] == 24 * 20  # the demo counts words
    # TPOT and ITL agree with the engine's pace: a millisecond or more per token
    assert report["tpot_ms"]["p50"] >= 0.9
    assert "Benchmark result" in done.stdout
    assert "24/24 requests" in done.stderr  # the progress line


def test_poisson_arrivals_on_completions(tmp_path, demo_url):
    report, _ = bench(
        tmp_path,
        demo_url,
        *("--endpoint", "completions", "--request-rate", "100", "--max-concurrency", "8"),
        *("--num-requests", "20", "--input-len", "16", "--output-len", "8", "--seed", "3"),
    )
    assert_all_answered(report, 20, 8)
    assert report["settings"]["request_rate"] == 100
    # the last request cannot start before its arrival time
    assert report["duration_s"] >= arrival_times(20, 100, seed=3)[-1]


def test_random_lengths_stay_in_range(tmp_path, demo_url):
    report, _ = bench(
        tmp_path,
        demo_url,
        *("--concurrency", "2", "--num-requests", "10", "--no-stream"),
        *("--input-len", "30", "--output-len", "10", "--range-ratio", "0.5"),
    )
    assert report["completed"] == 10
    assert 10 * 15 <= report["input_tokens"] <= 10 * 45
    assert report["output_tokens"] == report["requested_output_tokens"]
    assert report["ttft_ms"] is None  # not streamed: no first token to time
    assert report["e2e_ms"]["p50"] > 0


def test_errors_are_counted_by_kind(tmp_path, demo_url):
    report, done = bench(tmp_path, demo_url, "--model", "no-such-model", "--num-requests", "5")
    assert report["completed"] == 0
    assert report["failed"] == 5
    assert report["errors"] == {"http 404 model_not_found": 5}
    assert all(report[name] is None for name in LATENCIES)
    assert "http 404 model_not_found" in done.stdout

    nobody = f"http://127.0.0.1:{free_port()}"
    report, _ = bench(tmp_path, nobody, "--model", "m", "--num-requests", "3")
    assert report["errors"] == {"transport ConnectionRefusedError": 3}


def test_options_that_do_not_go_together():
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "bench", "--concurrency", "2", "--max-concurrency", "4"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert done.returncode == 2
    assert "--max-concurrency goes with --request-rate" in done.stderr
