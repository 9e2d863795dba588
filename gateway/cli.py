"""The `furnace-gateway` command: serve, worker, demo, bench.

Each command imports what it needs when it runs: the `worker` command loads the
worker SDK and the protocol only, so it runs in an engine's own environment
(vLLM's) where the gateway server's dependencies are not installed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from gateway import log_setup
from gateway.protocol.tls import ServerTLS
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from gateway.worker.engine import Engine

ENGINES = ("demo", "transformers", "vllm", "onnx")
#: The commands that run a gateway, whose access log writes a line per request.
GATEWAY_COMMANDS = ("serve", "demo")


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; `bench`'s options only when it is the command (they load
    the load generator)."""
    parser = argparse.ArgumentParser(
        prog="furnace-gateway",
        description="An OpenAI-compatible gateway in front of gRPC engine workers.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", required=True, help="the YAML config file")
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="gateway processes sharing the port (default: the config's `processes`)",
    )

    # No abbreviations: a vLLM option must never be taken for a prefix of ours.
    worker = commands.add_parser(
        "worker",
        help="run an engine as a gRPC worker",
        allow_abbrev=False,
        epilog="--engine vllm: any other option is vLLM's own engine option "
        "(--enforce-eager, --max-num-seqs N, --kv-cache-memory-bytes 4G, ...)",
    )
    worker.add_argument("--engine", choices=ENGINES, default="demo")
    worker.add_argument("--host", default="0.0.0.0")
    worker.add_argument("--port", type=int, default=50051)
    worker.add_argument("--model", help=f"the model name (demo: {DEMO_MODEL}; else the folder's)")
    _demo_options(worker)
    # The transformers engine (the `transformers` extra) and vLLM (installed on its own).
    worker.add_argument(
        "--model-path",
        help="transformers, vllm: a local model folder (not downloaded); onnx: an .onnx file",
    )
    worker.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    worker.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto"
    )
    worker.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="transformers, vllm: the format the model writes tool calls in, for tool_choice "
        "auto (the gateway's hermes or llama3_json; vllm: else a vLLM tool parser's name)",
    )
    worker.add_argument(
        "--lora-modules",
        nargs="+",
        type=_adapter,
        default=[],
        metavar="NAME=PATH",
        help="vllm: LoRA adapters served from the start, each under its name, from a local "
        "folder (with vLLM's --enable-lora; gateways load more at runtime)",
    )
    worker.add_argument(
        "--max-adapters",
        type=int,
        default=64,
        metavar="N",
        help="vllm: the most LoRA adapters the worker serves, from its start and loaded "
        "(vLLM's --max-loras of them run in one batch, --max-cpu-loras stay in memory)",
    )
    worker.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=5.0,
        metavar="SECONDS",
        help="after SIGTERM, seconds calls in flight get to finish while new ones are refused "
        "(keep it under the pod's grace period; the chart derives it from the pool's)",
    )
    worker.add_argument(
        "--log-format",
        choices=tuple(log_setup.FORMATTERS),
        default="text",
        help="each line as `time level logger message` (text) or as one JSON object (json), "
        "as the gateway's `log_format`",
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
    if command == "bench":
        from gateway.bench.command import add_arguments

        add_arguments(bench)
    return parser


def _seconds(text: str) -> float:
    """A non-negative, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}")
    return value


def _adapter(text: str) -> tuple[str, str]:
    """`NAME=PATH`: an adapter's name and its folder's absolute path."""
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"not NAME=PATH: {text!r}")
    return name, os.path.abspath(path)


def _demo_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-delay", type=float, default=0.0, help="seconds between tokens (a GPU's pace)"
    )
    parser.add_argument(
        "--max-context",
        type=int,
        help="tokens the model holds (demo: 4096; else the model's; vllm: --max-model-len)",
    )
    parser.add_argument(
        "--capacity", type=int, default=256, help="requests at once; more get RESOURCE_EXHAUSTED"
    )


def _worker_engine(args: argparse.Namespace, options: list[str]) -> Engine:
    if args.engine == "demo":
        return DemoEngine(
            args.model or DEMO_MODEL, args.max_context or 4096, args.token_delay, args.capacity
        )
    if not args.model_path:
        sys.exit(f"furnace-gateway: --engine {args.engine} needs --model-path")
    if args.engine == "vllm":
        # vLLM sizes its own batch (--max-num-seqs is the capacity) and device.
        try:
            from gateway.worker.vllm_engine import VllmEngine, engine_args
        except ImportError as error:
            sys.exit(
                f"furnace-gateway: --engine vllm runs in vLLM's own environment, with the "
                f"gateway installed there with --no-deps (docs: vLLM behind the gateway) ({error})"
            )

        if args.dtype != "auto":
            options = ["--dtype", args.dtype, *options]
        try:
            vllm_args = engine_args(args.model_path, options, max_context=args.max_context)
            return VllmEngine(
                vllm_args,
                args.model,
                tool_parser=args.tool_call_parser,
                adapters=dict(args.lora_modules),
                max_adapters=args.max_adapters,
            )
        except (FileNotFoundError, ValueError) as error:
            sys.exit(f"furnace-gateway: {error}")
    # Imported here so the gateway and the demo run without torch installed.
    try:
        from gateway.worker.transformers_engine import TransformersEngine
    except ImportError as error:
        sys.exit(f"furnace-gateway: --engine transformers needs the transformers extra ({error})")

    try:
        return TransformersEngine(
            args.model_path,
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_context=args.max_context,
            tool_call_parser=args.tool_call_parser,
        )
    except ValueError as error:  # a tool-call format the gateway has no parser of
        sys.exit(f"furnace-gateway: {error}")


def _tensor_worker(args: argparse.Namespace, tls: ServerTLS | None) -> None:
    """`--engine onnx`: a KServe v2 gRPC tensor worker over onnxruntime (the `tensor` extra)."""
    if not args.model_path:
        sys.exit("furnace-gateway: --engine onnx needs --model-path (an .onnx file)")
    try:
        from gateway.worker.tensor.onnx_engine import OnnxEngine
        from gateway.worker.tensor.server import serve_tensor_worker
    except ImportError as error:
        sys.exit(f"furnace-gateway: --engine onnx needs the tensor extra ({error})")
    from gateway.worker.serve import run_worker

    engine = OnnxEngine(args.model_path, args.model)
    run_worker(serve_tensor_worker(engine, args.host, args.port, tls, args.drain_timeout))


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
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv[0] if argv else None)
    args, options = parser.parse_known_args(argv)
    if options and not (args.command == "worker" and args.engine == "vllm"):
        parser.error(f"unrecognized arguments: {' '.join(options)}")
    if args.command == "worker" and args.engine != "vllm" and args.lora_modules:
        parser.error("--lora-modules: only --engine vllm serves LoRA adapters")
    log_setup.configure(logging.INFO, batched=args.command in GATEWAY_COMMANDS)
    try:
        if args.command == "worker":
            from gateway.worker.serve import run_worker, serve_worker

            log_setup.use_format(args.log_format)

            tls = _worker_tls(args)  # before a model loads
            if args.engine == "onnx":
                _tensor_worker(args, tls)
                return
            engine = _worker_engine(args, options)
            run_worker(serve_worker(engine, args.host, args.port, tls, args.drain_timeout))
        else:
            _gateway_command(args)
    except KeyboardInterrupt:
        pass


def _gateway_command(args: argparse.Namespace) -> None:
    """serve, demo and bench: the gateway's own environment."""
    from gateway.config import ConfigError, load_config, parse_config
    from gateway.lifecycle import run, serve_demo, serve_gateway

    try:
        if args.command == "serve":
            config = load_config(args.config)
            logging.getLogger().setLevel(config.log_level.upper())
            log_setup.use_format(config.log_format)
            processes = config.processes if args.workers is None else args.workers
            if processes < 1:
                sys.exit("furnace-gateway: --workers must be at least 1")
            if processes > 1:
                from gateway.lifecycle.processes import serve_processes

                sys.exit(serve_processes(config, processes, args.config))
            run(serve_gateway(config, args.config))
        elif args.command == "bench":
            from gateway.bench.command import main as bench_main

            sys.exit(run(bench_main(args)))
        else:
            config = parse_config({"host": args.host, "port": args.port})
            engine = DemoEngine(
                DEMO_MODEL, args.max_context or 4096, args.token_delay, args.capacity
            )
            run(serve_demo(config, engine))
    except ConfigError as error:
        sys.exit(f"furnace-gateway: invalid config: {error}")


__all__ = ["main"]
