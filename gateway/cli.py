"""The `furnace-gateway` command: serve, worker, demo, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gateway.bench.command import add_arguments as add_bench_arguments
from gateway.bench.command import main as bench_main
from gateway.config import Config, ConfigError, load_config, parse_config
from gateway.lifecycle import run, serve_demo, serve_gateway, serve_worker
from gateway.protocol.tls import ServerTLS
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from gateway.worker.engine import Engine

ENGINES = ("demo", "transformers")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="furnace-gateway",
        description="An OpenAI-compatible gateway in front of gRPC engine workers.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", required=True, help="the YAML config file")

    worker = commands.add_parser("worker", help="run an engine as a gRPC worker")
    worker.add_argument("--engine", choices=ENGINES, default="demo")
    worker.add_argument("--host", default="0.0.0.0")
    worker.add_argument("--port", type=int, default=50051)
    worker.add_argument("--model", help=f"the model name (demo: {DEMO_MODEL}; else the folder's)")
    _demo_options(worker)
    # The transformers engine (needs the `transformers` extra: torch and transformers).
    worker.add_argument("--model-path", help="transformers: a local model folder (not downloaded)")
    worker.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    worker.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto"
    )
    worker.add_argument("--tls-cert", help="serve TLS with this PEM certificate (chain)")
    worker.add_argument("--tls-key", help="the PEM private key of --tls-cert")
    worker.add_argument(
        "--tls-client-ca", help="mutual TLS: accept only clients with a certificate this CA signed"
    )

    demo = commands.add_parser("demo", help="run the gateway with an embedded demo worker")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=8000)
    _demo_options(demo)

    bench = commands.add_parser("bench", help="load-test an OpenAI-compatible endpoint")
    add_bench_arguments(bench)
    return parser


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-delay", type=float, default=0.0, help="seconds between tokens (a GPU's pace)"
    )
    parser.add_argument(
        "--max-context", type=int, help="tokens the model holds (demo: 4096; else the model's)"
    )
    parser.add_argument(
        "--capacity", type=int, default=256, help="requests at once; more get RESOURCE_EXHAUSTED"
    )


def _worker_engine(args: argparse.Namespace) -> Engine:
    if args.engine == "demo":
        return DemoEngine(
            args.model or DEMO_MODEL, args.max_context or 4096, args.token_delay, args.capacity
        )
    if not args.model_path:
        sys.exit("furnace-gateway: --engine transformers needs --model-path")
    # Imported here so the gateway and the demo run without torch installed.
    from gateway.worker.transformers_engine import TransformersEngine

    return TransformersEngine(
        args.model_path,
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_context=args.max_context,
    )


def _worker_tls(args: argparse.Namespace) -> ServerTLS | None:
    """The worker's TLS from --tls-cert, --tls-key and --tls-client-ca."""
    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            sys.exit("furnace-gateway: --tls-client-ca needs --tls-cert and --tls-key")
        return None
    if args.tls_cert is None or args.tls_key is None:
        sys.exit("furnace-gateway: --tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key, args.tls_client_ca):
        if path is not None and not os.access(path, os.R_OK):
            sys.exit(f"furnace-gateway: cannot read {path}")
    return ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)


def main(argv: list[str] | None = None) -> None:
    """Parses the command line and runs the command until interrupted."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if args.command == "serve":
            config = load_config(args.config)
            logging.getLogger().setLevel(config.log_level.upper())
            run(serve_gateway(config))
        elif args.command == "bench":
            sys.exit(run(bench_main(args)))
        elif args.command == "worker":
            tls = _worker_tls(args)  # before a model loads
            run(serve_worker(_worker_engine(args), args.host, args.port, tls))
        else:
            config = parse_config({"host": args.host, "port": args.port})
            engine = DemoEngine(
                DEMO_MODEL, args.max_context or 4096, args.token_delay, args.capacity
            )
            run(serve_demo(config, engine))
    except ConfigError as error:
        sys.exit(f"furnace-gateway: invalid config: {error}")
    except KeyboardInterrupt:
        pass


__all__ = ["Config", "main"]
