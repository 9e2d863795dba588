"""Pictures of the Grafana dashboard's main panels for the docs, made the way Grafana would
draw them: a real Prometheus server (Debian's `prometheus`, `bash deploy/install-tools.sh`)
scrapes a real gateway under load, and each panel's own PromQL, read from
deploy/grafana/furnace-gateway.json, is asked of Prometheus's range API and plotted with
matplotlib. No Grafana server can run here; this proves the queries return what the panels
promise, and can be retaken after a change to the dashboard or the metrics.

    .venv/bin/python -m benchmarks.dashboard_pictures [--seconds 40]

writes docs/images/dashboard.png (the Traffic, Latency, Errors, Slots and Workers rows). The
load, on two demo workers (20 ms a token) behind a gateway of 16 slots and a queue of 8 for
0.3 s: streamed and whole chat requests from 24 clients, a burst of 48 more in the middle (queue
waits, then 503s), a few prompts too long for the model (400), clients that leave mid-answer
(499), and one worker killed at 70 % of the run (answers cut short, retries, an ejection).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from tests.support.processes import free_port, wait_listening, wait_ready

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "furnace-gateway.json"
OUTPUT = ROOT / "docs" / "images" / "dashboard.png"
#: The dashboard's rows drawn, in order.
ROWS = ("Traffic", "Latency", "Errors", "Slots and queue", "Workers")
#: Prometheus scrapes every second; Grafana's `$__rate_interval` is at least 4 scrapes.
SCRAPE = 1
RATE_INTERVAL = "10s"
MODEL = "furnace-demo"


def panels(rows: tuple[str, ...] = ROWS) -> list[dict[str, Any]]:
    """The dashboard's panels under `rows`, in the dashboard's order."""
    chosen, row = [], None
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
        elif row in rows:
            chosen.append(panel)
    return chosen


@contextmanager
def process(args: list[str], **kwargs: Any) -> Iterator[subprocess.Popen[str]]:
    """A process for the block's length, then SIGTERM (and SIGKILL after 10 s)."""
    proc = subprocess.Popen(args, text=True, **kwargs)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def client(
    http: httpx.AsyncClient, stop: float, rng: random.Random, counts: dict[str, int]
) -> None:
    """One client: a chat request after another until `stop`, sometimes too long, sometimes
    leaving mid-answer."""
    while time.monotonic() < stop:
        roll = rng.random()
        words = 20_000 if roll < 0.03 else rng.randint(4, 24)
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
            "max_tokens": rng.randint(8, 32),
            "stream": roll > 0.3,
        }
        try:
            if body["stream"]:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    seen = 0
                    async for _ in response.aiter_lines():
                        seen += 1
                        if roll > 0.95 and seen > 3:
                            break  # the client leaves: 499, the worker's call cancelled
                    counts[str(response.status_code)] = counts.get(str(response.status_code), 0) + 1
            else:
                response = await http.post("/v1/chat/completions", json=body)
                counts[str(response.status_code)] = counts.get(str(response.status_code), 0) + 1
        except httpx.HTTPError as error:
            counts[type(error).__name__] = counts.get(type(error).__name__, 0) + 1
        await asyncio.sleep(rng.uniform(0, 0.05))


async def load(url: str, seconds: float) -> dict[str, int]:
    """24 clients for `seconds`, and 48 more for the middle fifth of it."""
    counts: dict[str, int] = {}
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        start = time.monotonic()
        steady = [client(http, start + seconds, rng, counts) for _ in range(24)]

        async def burst() -> None:
            await asyncio.sleep(seconds * 0.4)
            end = time.monotonic() + seconds * 0.2
            await asyncio.gather(*(client(http, end, rng, counts) for _ in range(48)))

        await asyncio.gather(*steady, burst())
    return counts


def grafana_vars(expr: str) -> str:
    """`expr` with Grafana's variables as the dashboard's defaults set them: the rate
    interval, and every namespace and job (All)."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    return expr.replace("$namespace", ".*").replace("$job", ".*")


def query_range(prometheus: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    """The panel's query over the run, at a 1 s step."""
    response = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={
            "query": grafana_vars(expr),
            "start": start,
            "end": end,
            "step": SCRAPE,
        },
        timeout=30,
    )
    response.raise_for_status()
    result: list[dict[str, Any]] = response.json()["data"]["result"]
    return result


def label(series: dict[str, Any], legend: str) -> str:
    """Grafana's legend format: `{{name}}` replaced by the series' label."""
    return re.sub(
        r"\{\{\s*(\w+)\s*\}\}", lambda m: series["metric"].get(m.group(1), ""), legend
    ) or ", ".join(f"{k}={v}" for k, v in series["metric"].items())


def draw(prometheus: str, start: float, end: float) -> list[str]:
    """Plots every chosen panel into one picture; returns the panels that came back empty."""
    chosen = panels()
    columns = 4
    rows = math.ceil(len(chosen) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 2.9 * rows), squeeze=False)
    empty = []
    for ax, panel in zip(axes.flat, chosen, strict=False):
        drawn = 0
        for target in panel["targets"]:
            for series in query_range(prometheus, target["expr"], start, end):
                points = [(float(t) - start, float(v)) for t, v in series["values"]]
                points = [(t, v) for t, v in points if math.isfinite(v)]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, linewidth=1.2, label=label(series, target.get("legendFormat", "")))
                drawn += 1
        if not drawn:
            empty.append(panel["title"])
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel("seconds", fontsize=7)
        ax.set_ylabel(
            {"reqps": "req/s", "s": "seconds", "percentunit": "ratio"}.get(unit, ""), fontsize=7
        )
        ax.tick_params(labelsize=7)
        if drawn:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(chosen) :]:
        ax.axis("off")
    fig.suptitle(
        "furnace-gateway dashboard: each panel's PromQL against a real Prometheus "
        "(benchmarks/dashboard_pictures.py)",
        fontsize=11,
    )
    fig.tight_layout()
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUTPUT, dpi=90)
    plt.close(fig)
    return empty


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40)
    args = parser.parse_args(argv)
    prometheus_binary = shutil.which("prometheus")
    if prometheus_binary is None:
        sys.exit("prometheus is missing: run `bash deploy/install-tools.sh` first")
    ports = {name: free_port() for name in ("gateway", "prometheus", "w1", "w2")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = work / "gateway.yaml"
        config.write_text(
            f"host: 127.0.0.1\nport: {ports['gateway']}\nlog_level: warning\n"
            "max_concurrent_requests: 16\nqueue: {max_wait: 0.3, max_depth: 8}\n"
            f"models:\n  - name: {MODEL}\n    workers: "
            f"['127.0.0.1:{ports['w1']}', '127.0.0.1:{ports['w2']}']\n"
        )
        (work / "prometheus.yml").write_text(
            f"global: {{scrape_interval: {SCRAPE}s, evaluation_interval: {SCRAPE}s}}\n"
            "scrape_configs:\n  - job_name: furnace-gateway\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{ports['gateway']}']}}]\n"
        )
        gateway = [sys.executable, "-m", "gateway"]
        worker = [*gateway, "worker", "--host", "127.0.0.1", "--token-delay", "0.02"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
        with (
            process([*worker, "--port", str(ports["w1"])], **quiet) as w1,
            process([*worker, "--port", str(ports["w2"])], **quiet) as w2,
            process(
                [*gateway, "serve", "--config", str(config)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            ) as served,
            process(
                [
                    prometheus_binary,
                    f"--config.file={work / 'prometheus.yml'}",
                    f"--storage.tsdb.path={work / 'data'}",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                ],
                **quiet,
            ) as prom,
        ):
            wait_listening(ports["w1"], w1)
            wait_listening(ports["w2"], w2)
            url = f"http://127.0.0.1:{ports['gateway']}"
            wait_ready(url, served)
            wait_listening(ports["prometheus"], prom)
            time.sleep(3 * SCRAPE)
            start = time.time()
            killer = threading.Timer(args.seconds * 0.7, w2.kill)
            killer.start()
            counts = asyncio.run(load(url, args.seconds))
            killer.cancel()
            time.sleep(5 * SCRAPE)  # the last scrapes after the load
            end = time.time()
            print("answers by status:", dict(sorted(counts.items())))
            empty = draw(f"http://127.0.0.1:{ports['prometheus']}", start, end)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    if empty:
        print("panels with no data:", ", ".join(empty))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
