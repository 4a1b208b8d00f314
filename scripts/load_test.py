"""A short, bounded load run against the server on loopback: N streaming clients x M requests each, then a report.

    python scripts/load_test.py --clients 16 --requests 3            # starts its own server (SmolLM2 + ngram)
    python scripts/load_test.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct   # a running one

Each request streams /v1/completions with ignore_eos, so every request does the same work (max_tokens tokens).
Reported: clients held at once, requests, errors by status, latency p50/p95 (end to end and time to first
token), output tokens/s. Loopback only, and it stops by itself after clients x requests requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from urllib.parse import urlparse

import httpx
import numpy as np

WORDS = "cat dog river mountain city piano garden ocean robot castle forest bridge library volcano desert island"


class Open:
    """Streams open right now, and the most seen at once."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)


async def one_request(http: httpx.AsyncClient, body: dict, streams: Open) -> dict:
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"status": r.status_code}
            streams.enter()
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return {"status": "stream-error"}
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    elif first is None:
                        first = time.perf_counter()
            finally:
                streams.now -= 1
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}
    end = time.perf_counter()
    return {"status": 200, "e2e_s": end - start, "ttft_s": (first or end) - start, "tokens": tokens}


async def client(http: httpx.AsyncClient, streams: Open, index: int, requests: int, model: str,
                 max_tokens: int) -> list[dict]:
    words = WORDS.split()
    out = []
    for j in range(requests):
        body = {"model": model, "prompt": f"A short story about a {words[(index + j) % len(words)]}:",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        out.append(await one_request(http, body, streams))
    return out


async def run(url: str, model: str, clients: int, requests: int, max_tokens: int, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=600) as http:
        streams, start = Open(), time.perf_counter()
        results = await asyncio.gather(*(client(http, streams, i, requests, model, max_tokens)
                                         for i in range(clients)))
        wall = time.perf_counter() - start
    flat = [r for per_client in results for r in per_client]
    ok = [r for r in flat if r["status"] == 200]
    pct = lambda key, q: float(np.percentile([r[key] for r in ok], q)) if ok else float("nan")
    return {
        "clients": clients, "streams_open_at_once": streams.peak, "requests": len(flat), "max_tokens": max_tokens,
        "errors": len(flat) - len(ok), "errors_by_status": dict(Counter(str(r["status"]) for r in flat
                                                                          if r["status"] != 200)),
        "e2e_p50_s": pct("e2e_s", 50), "e2e_p95_s": pct("e2e_s", 95),
        "ttft_p50_s": pct("ttft_s", 50), "ttft_p95_s": pct("ttft_s", 95),
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall, "wall_s": wall,
    }


def start_server(model: str, method: str, max_waiting: int):
    import torch

    from specdecode.api import SpecDecoder
    from specdecode.server.app import create_app
    from specdecode.server.background import BackgroundServer
    from specdecode.server.settings import ServerSettings

    torch.set_num_threads(1)  # one core for the engine; the other for the clients and the event loop
    decoder = SpecDecoder.load(model, method=method, dtype="float32")
    server = BackgroundServer(create_app(decoder, ServerSettings(model_name=model, max_waiting=max_waiting)))
    server.start()
    return server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server on loopback (default: start one in this process)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--method", default="ngram", help="drafting method of the server this script starts")
    p.add_argument("--max-waiting", type=int, default=64, help="queue limit of the server this script starts")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=3, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    server = None
    if args.url:
        host = urlparse(args.url).hostname or ""
        if host not in ("127.0.0.1", "localhost", "::1"):
            print(f"load_test: refusing {host}: this script only loads servers on loopback", file=sys.stderr)
            return 2
        url = args.url
    else:
        server = start_server(args.model, args.method, args.max_waiting)
        url = server.url
    try:
        report = asyncio.run(run(url, args.model, args.clients, args.requests, args.max_tokens, args.api_key))
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
