"""`furnace-gateway bench`: the options, and a run from them to the report."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from gateway.bench import report, runner, stats, workload
from gateway.bench.client import OpenAIClient, Tally, v1_url
from gateway.bench.http import TransportError
from gateway.bench.progress import Progress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench command's options."""
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the OpenAI base URL: http:// or https://, /v1 added when it has no path",
    )
    target.add_argument("--model", help="the model (default: the first of GET /v1/models)")
    target.add_argument("--endpoint", choices=tuple(workload.ENDPOINTS), default="chat")
    target.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $OPENAI_API_KEY)",
    )
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")

    load = parser.add_argument_group("load")
    how = load.add_mutually_exclusive_group()
    how.add_argument(
        "--concurrency", type=int, help="a closed loop of N requests in flight (default 16)"
    )
    how.add_argument(
        "--request-rate",
        type=float,
        help="requests per second, Poisson arrivals; inf sends them all at once",
    )
    load.add_argument("--max-concurrency", type=int, help="with --request-rate: a cap in flight")
    load.add_argument("--num-requests", type=int, default=100)
    load.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    load.add_argument("--input-len", type=int, default=256, help="prompt length, in words")
    load.add_argument("--output-len", type=int, default=128, help="max_tokens of each request")
    load.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]; 0 keeps them fixed",
    )
    load.add_argument(
        "--ignore-eos", action="store_true", help="send vLLM's ignore_eos: max_tokens every time"
    )
    load.add_argument("--seed", type=int, default=0)
    load.add_argument(
        "--priorities",
        metavar="P:SHARE,...",
        help="mixed priorities: each request's x-furnace-priority drawn by share (e.g. "
        "10:1,0:3); the report adds figures per priority",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, if anything."""
    if args.concurrency is not None and args.concurrency < 1:
        return "--concurrency must be at least 1"
    if args.max_concurrency is not None:
        if args.request_rate is None:
            return "--max-concurrency goes with --request-rate (--concurrency is a closed loop)"
        if args.max_concurrency < 1:
            return "--max-concurrency must be at least 1"
    if args.request_rate is not None and not args.request_rate > 0:
        return "--request-rate must be positive (or inf)"
    if args.num_requests < 1 or args.input_len < 1 or args.output_len < 1:
        return "--num-requests, --input-len and --output-len must be at least 1"
    if not 0 <= args.range_ratio < 1:
        return "--range-ratio must be in [0, 1)"
    if args.priorities is not None:
        try:
            workload.parse_priorities(args.priorities)
        except ValueError:
            return "--priorities: expected PRIORITY:SHARE pairs, e.g. 10:1,0:3"
    return None


def _load(args: argparse.Namespace) -> tuple[float, int | None, str]:
    """The request rate, the cap in flight, and the two in words."""
    if args.request_rate is None:
        concurrency = args.concurrency or 16
        return math.inf, concurrency, f"concurrency {concurrency} (closed loop)"
    rate, cap = args.request_rate, args.max_concurrency
    words = "all at once" if math.isinf(rate) else f"Poisson, {rate:g} req/s"
    return rate, cap, words + (f", max concurrency {cap}" if cap else "")


async def main(args: argparse.Namespace) -> int:
    """Runs the benchmark the options describe; prints the report; 0 once it ran
    (failed requests are in the report), 1 when it could not start, 2 on bad options."""
    problem = _check(args)
    if problem:
        print(f"furnace-gateway bench: {problem}", file=sys.stderr)
        return 2
    try:
        client = OpenAIClient(args.base_url, args.api_key, args.timeout)
    except ValueError as error:
        print(f"furnace-gateway bench: {error}", file=sys.stderr)
        return 2
    try:
        model = args.model or await _first_model(client)
        rate, cap, load = _load(args)
        spec = workload.WorkloadSpec(
            model=model,
            endpoint=args.endpoint,
            num_requests=args.num_requests,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            stream=args.stream,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            priorities=workload.parse_priorities(args.priorities) if args.priorities else (),
        )
        requests = workload.requests(spec)
        arrivals = workload.arrival_times(len(requests), rate, args.seed)
        tally = Tally()
        progress = Progress(tally, len(requests)) if args.progress else None
        if progress is not None:
            progress.start()
        try:
            results = await runner.run(
                client, requests, arrivals, args.endpoint, args.stream, cap, tally
            )
        finally:
            if progress is not None:
                progress.stop()
    except (TransportError, RuntimeError, LookupError) as error:
        print(f"furnace-gateway bench: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    settings = _settings(args, model, rate, cap, load)
    summary = stats.summarize(requests, results)
    by_priority = stats.by_priority(requests, results)
    print(report.render(summary, settings, by_priority))
    if args.json:
        report.write_json(args.json, summary, settings, by_priority)
    return 0


async def _first_model(client: OpenAIClient) -> str:
    models = await client.models()
    if not models:
        raise LookupError("GET /v1/models lists no model; name one with --model")
    return models[0]


def _settings(
    args: argparse.Namespace, model: str, rate: float, cap: int | None, load: str
) -> dict[str, Any]:
    return {
        "base_url": v1_url(args.base_url),
        "endpoint": args.endpoint,
        "model": model,
        "load": load,
        "request_rate": None if math.isinf(rate) else rate,  # None: all at once
        "max_concurrency": cap,
        "num_requests": args.num_requests,
        "stream": args.stream,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "priorities": args.priorities,
    }
