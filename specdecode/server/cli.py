"""`specdecode serve`: the same model and drafter flags as `generate`, plus where to listen, what to accept, how
many requests to batch, and (with Ray Serve) how many replicas to run behind one endpoint."""

from __future__ import annotations

import argparse
import ipaddress
import sys

from specdecode import settings
from specdecode.cli_args import add_model_args, decoder_kwargs, load_decoder
from specdecode.errors import SpecdecodeError, require
from specdecode.server.settings import ServerSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with metrics and a playground page")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=settings.current().api_key,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY, else none)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more accepted keys, one per line (# comments); fairness and limits then count per key")
    p.add_argument("--protect-metrics", action="store_true", help="/metrics needs an API key too")
    p.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                   help="Host headers to answer (others get 400: a web page under another name cannot reach the "
                        "server through DNS rebinding); default: localhost and the loopback addresses when "
                        "listening on loopback, else any")
    p.add_argument("--allowed-origins", default="", metavar="O1,O2",
                   help="web origins (https://app.example) whose pages may call the API from a browser (CORS); "
                        "default none")
    p.add_argument("--trust-forwarded-for", default="", metavar="IP1,IP2",
                   help="proxies whose X-Forwarded-For header names the client (fairness, per-client limits)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    p.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request not done this long after it arrived ends with 504 (default: none)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="connections served at once; requests on more get 503 at once, except /health and /ready "
                        "(default 256)")
    p.add_argument("--max-connections-per-address", type=int, default=64, metavar="N",
                   help="open connections one client address may hold; more are refused with 429 (default 64; "
                        "0: no cap; loopback and --trust-forwarded-for proxies are not capped)")
    p.add_argument("--idle-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a new connection that sends nothing this long is closed (default 10)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request's line and headers must all arrive this soon after their first byte, else 408 "
                        "(default 10)")
    p.add_argument("--max-header-bytes", type=int, default=64 * 1024, metavar="BYTES",
                   help="a request line and headers longer than this get 431 (default 65536)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --target)")
    p.add_argument("--max-running", type=int, default=16,
                   help="requests batched together (one target forward per step serves them all; default 16)")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests allowed to wait for a place in the batch; more get 503 (default 64)")
    p.add_argument("--max-per-client", type=int, default=32,
                   help="requests one client address may hold, running and waiting; more get 429 (default 32)")
    p.add_argument("--client-prompt-tokens-per-minute", type=int, default=None, metavar="N",
                   help="prompt tokens one client may send a minute (a long prompt may overdraw it once, then the "
                        "client waits); more get 429 with Retry-After (default: no budget)")
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
    require("fastapi", "server", "specdecode serve")
    from specdecode.server.access import read_key_file  # here: the web stack costs every other command 0.3 s
    from specdecode.server.connections import LOOPBACK, ConnectionLimits

    if args.replicas < 1:
        raise SpecdecodeError(f"--replicas must be >= 1, got {args.replicas}")
    if not args.drain_timeout >= 0:
        raise SpecdecodeError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    settings = ServerSettings(model_name=args.served_model_name or args.target, api_key=args.api_key or None,
                              api_keys=read_key_file(args.api_key_file) if args.api_key_file else (),
                              protect_metrics=args.protect_metrics, allowed_hosts=allowed_hosts(args),
                              allowed_origins=_split(args.allowed_origins),
                              trusted_proxies=_split(args.trust_forwarded_for),
                              max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
                              max_running=args.max_running, max_per_client=args.max_per_client,
                              client_prompt_tokens_per_minute=args.client_prompt_tokens_per_minute,
                              kv_cache_gib=args.kv_cache_gib, request_timeout_s=args.request_timeout)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise SpecdecodeError("--ssl-certfile and --ssl-keyfile go together")
    limits = ConnectionLimits(max_connections=args.max_connections, max_per_address=args.max_connections_per_address,
                              uncapped=(*LOOPBACK, *settings.trusted_proxies), idle_timeout_s=args.idle_timeout,
                              header_timeout_s=args.header_timeout, max_head_bytes=args.max_header_bytes)
    if not settings.keys and not _is_loopback(args.host):
        print(f"specdecode: warning: listening on {args.host} without --api-key: anyone who can reach this port "
              "can use the model", file=sys.stderr)
    if args.replicas > 1 or args.ray_address:
        if getattr(args, "suffix_pool", None):  # one file for several writers: the last one's pool wins
            raise SpecdecodeError("--suffix-pool keeps one process's pool; with --replicas or --ray-address each "
                                  "replica keeps its own in memory (leave --suffix-pool out)")
        from specdecode.server import ray_app

        return ray_app.serve_forever(decoder_kwargs(args), settings, args.replicas, args.host, args.port,
                                     args.ray_address, args.replica_cpus, args.drain_timeout)

    from specdecode.server.app import create_app
    from specdecode.server.compute import ComputeThread
    from specdecode.server.run import serve

    compute = ComputeThread()  # loads the models and then runs the engine: OpenMP is fast from one thread only
    decoder = compute.run(load_decoder, args)
    app = create_app(decoder, settings, compute)
    url = f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"
    print(f"specdecode: serving '{settings.model_name}' (method {decoder.method}) at {url}/v1 — playground: {url}/",
          file=sys.stderr)
    return serve(app, args.host, args.port, args.log_level, args.drain_timeout,
                 dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile), limits)


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """The Host headers to answer: as given, else this machine's loopback names when listening on loopback."""
    if args.allowed_hosts:
        return _split(args.allowed_hosts)
    return LOOPBACK_NAMES if _is_loopback(args.host) else ("*",)


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
