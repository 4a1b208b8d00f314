"""`specdecode serve`: the same model and drafter flags as `generate`, plus where to listen, what to accept, how
many requests to batch, and (with Ray Serve) how many replicas to run behind one endpoint."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from specdecode.cli_args import add_model_args, decoder_kwargs, load_decoder
from specdecode.errors import SpecdecodeError
from specdecode.server.settings import ServerSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with metrics and a playground page")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --target)")
    p.add_argument("--max-running", type=int, default=16,
                   help="requests batched together (one target forward per step serves them all; default 16)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests allowed to wait for a place in the batch; more get 503 (default 64)")
    p.add_argument("--max-per-client", type=int, default=32,
                   help="requests one client address may hold, running and waiting; more get 429 (default 32)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0,
                   help="memory for the running requests' keys and values; a request reserves its prompt + "
                        "max_tokens (default 4)")
    p.add_argument("--max-body-bytes", type=int, default=1_000_000, help="larger request bodies get 413")
    p.add_argument("--replicas", type=int, default=1,
                   help="run N copies behind one endpoint on Ray Serve (needs: pip install 'specdecode[ray]')")
    p.add_argument("--ray-address", default=None,
                   help="join an existing Ray cluster (e.g. 'auto' on a node where `ray start` ran); implies Ray")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs per replica (default: this machine's cores split between the replicas)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: seconds the requests in flight may take to finish; new ones get 503 "
                        "(default 30; a second signal stops at once)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        raise SpecdecodeError(f"--replicas must be >= 1, got {args.replicas}")
    if not args.drain_timeout >= 0:
        raise SpecdecodeError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    settings = ServerSettings(model_name=args.served_model_name or args.target, api_key=args.api_key or None,
                              max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                              max_running=args.max_running, max_per_client=args.max_per_client,
                              kv_cache_gib=args.kv_cache_gib)
    if not settings.api_key and not _is_loopback(args.host):
        print(f"specdecode: warning: listening on {args.host} without --api-key: anyone who can reach this port "
              "can use the model", file=sys.stderr)
    if args.replicas > 1 or args.ray_address:
        from specdecode.server import ray_app

        return ray_app.serve_forever(decoder_kwargs(args), settings, args.replicas, args.host, args.port,
                                     args.ray_address, args.replica_cpus)

    from specdecode.compute import ComputeThread
    from specdecode.server.app import create_app
    from specdecode.server.run import serve

    compute = ComputeThread()  # loads the models and then runs the engine: OpenMP is fast from one thread only
    decoder = compute.run(load_decoder, args)
    app = create_app(decoder, settings, compute)
    url = f"http://{args.host}:{args.port}"
    print(f"specdecode: serving '{settings.model_name}' (method {decoder.method}) at {url}/v1 — playground: {url}/",
          file=sys.stderr)
    return serve(app, args.host, args.port, args.log_level, args.drain_timeout)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
