"""Bounded load runs against the server on loopback: a sweep of concurrent streaming clients, then a report.

    python scripts/load_test.py                                   # starts `specdecode serve` (SmolLM2, ngram)
    python scripts/load_test.py --serve "--method none" --clients 1,2,4,8,16 --check-alone
    python scripts/load_test.py --url http://127.0.0.1:8000       # a running server (loopback only)

For each concurrency level C, C clients stream /v1/chat/completions, one request after another, until the level
has made --requests requests (`ignore_eos`, so each generates exactly --max-tokens tokens, greedy). Reported per
level: requests, errors by status, aggregate output tokens/s, p50/p95 of time to first token, inter-token latency
(a request's mean gap after its first token) and end-to-end latency, and the mean accepted length. With
--check-alone every prompt is then sent once more with nothing else running, and each answer it got under load
must equal that one. --malformed P mixes a malformed request (bad JSON, wrong types, unknown fields, a window
overflow...) before each valid one with probability P: each must get its 4xx and the valid ones still complete.
It stops by itself after the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from urllib.parse import urlparse

import httpx
import numpy as np

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Give three tips for writing clear commit messages.",
    "Write a Python class for a stack with push, pop and peek.",
    "What does the `with` statement do in Python? Show an example.",
    "Write a function that merges two sorted lists into one sorted list.",
    "Summarize what a hash table is in two sentences.",
]

MALFORMED = [  # (body as bytes or JSON, why it must be refused)
    (b"{not json", "bad JSON"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no model"),
    ({"model": "@", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "wrong type"),
    ({"model": "@", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "unknown field"),
    ({"model": "@", "messages": [], "max_tokens": 4}, "no messages"),
    ({"model": "@", "messages": [{"role": "robot", "content": "hi"}]}, "unknown role"),
    ({"model": "@", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "window overflow"),
    ({"model": "@", "messages": [{"role": "user", "content": "hi"}], "n": 0}, "n below 1"),
    ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, "unknown model"),
]


class Open:
    """Streams open right now, and the most seen at once."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)


async def one_request(http: httpx.AsyncClient, body: dict, streams: Open) -> dict:
    start = time.perf_counter()
    first, tokens, text, usage, last, gap = None, 0, [], {}, None, 0.0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
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
                        usage = chunk["usage"]
                        tokens = usage["completion_tokens"]
                    elif chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                        now = time.perf_counter()
                        first = first or now
                        gap = max(gap, now - (last or now))  # the longest wait between two pieces of the stream
                        last = now
                        text.append(piece)
            finally:
                streams.now -= 1
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}
    end = time.perf_counter()
    ttft = (first or end) - start
    return {"status": 200, "e2e_s": end - start, "ttft_s": ttft, "tokens": tokens, "text": "".join(text),
            "itl_s": (end - start - ttft) / max(tokens - 1, 1), "gap_s": gap, "prompt": body["messages"][0]["content"],
            "accepted_length": usage.get("speculative", {}).get("mean_accepted_length", 0.0)}


async def malformed_request(http: httpx.AsyncClient, model: str, rng: random.Random) -> dict:
    body, why = rng.choice(MALFORMED)
    if isinstance(body, dict):
        # a few tokens unless it says otherwise: one that the server comes to accept ends soon, and is reported
        body = {"max_tokens": 4, **body}
        body = json.dumps({**body, "model": model} if body.get("model") == "@" else body).encode()
    try:
        r = await http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                            timeout=60)
    except httpx.HTTPError as e:
        return {"why": why, "status": type(e).__name__, "ok": False}
    return {"why": why, "status": r.status_code, "ok": 400 <= r.status_code < 500}


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def client(http, streams: Open, index: int, count: int, clients: int, model: str, max_tokens: int,
                 malformed: float, refused: list) -> list[dict]:
    rng = random.Random(index)
    out = []
    for j in range(count):
        if malformed and rng.random() < malformed:
            refused.append(await malformed_request(http, model, rng))
        prompt = PROMPTS[(index + j * clients) % len(PROMPTS)]
        out.append(await one_request(http, request_body(model, prompt, max_tokens), streams))
    return out


async def level(url: str, model: str, clients: int, requests: int, max_tokens: int, malformed: float,
                headers: dict) -> dict:
    limits = httpx.Limits(max_connections=clients + 4)
    counts = [requests // clients + (i < requests % clients) for i in range(clients)]
    refused: list[dict] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=900) as http:
        streams, start = Open(), time.perf_counter()
        results = await asyncio.gather(*(client(http, streams, i, counts[i], clients, model, max_tokens, malformed,
                                                refused) for i in range(clients) if counts[i]))
        wall = time.perf_counter() - start
    flat = [r for per_client in results for r in per_client]
    ok = [r for r in flat if r["status"] == 200]
    pct = lambda key, q: float(np.percentile([r[key] for r in ok], q)) if ok else float("nan")
    return {
        "clients": clients, "streams_open_at_once": streams.peak, "requests": len(flat), "max_tokens": max_tokens,
        "errors": len(flat) - len(ok),
        "errors_by_status": dict(Counter(str(r["status"]) for r in flat if r["status"] != 200)),
        "malformed_sent": len(refused), "malformed_not_refused": [r for r in refused if not r["ok"]],
        "output_tokens_per_s": sum(r["tokens"] for r in ok) / wall, "wall_s": wall,
        "ttft_p50_s": pct("ttft_s", 50), "ttft_p95_s": pct("ttft_s", 95), "ttft_p99_s": pct("ttft_s", 99),
        "itl_p50_s": pct("itl_s", 50), "itl_p95_s": pct("itl_s", 95), "itl_p99_s": pct("itl_s", 99),
        "e2e_p50_s": pct("e2e_s", 50), "e2e_p95_s": pct("e2e_s", 95),
        "longest_gap_p50_s": pct("gap_s", 50), "longest_gap_max_s": pct("gap_s", 100),
        "mean_accepted_length": float(np.mean([r["accepted_length"] for r in ok])) if ok else 0.0,
        "_answers": [(r["prompt"], r["text"]) for r in ok],
    }


async def alone(url: str, model: str, max_tokens: int, headers: dict) -> dict[str, str]:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=900) as http:
        answers = {}
        for prompt in PROMPTS:
            r = await one_request(http, request_body(model, prompt, max_tokens), Open())
            answers[prompt] = r.get("text")
        return answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "specdecode", "serve", "--port", str(port), "--log-level", "warning",
           *shlex.split(serve_args)]
    print("load_test: starting", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"load_test: the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("load_test: the server did not come up")


def markdown(rows: list[dict]) -> str:
    head = ("| clients | requests | errors | output tok/s | vs 1 client | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) "
            "| e2e p50 / p95 (s) | mean accepted length |\n|---|---|---|---|---|---|---|---|---|")
    base = rows[0]["output_tokens_per_s"] if rows and rows[0]["clients"] == 1 else None
    lines = [head]
    for r in rows:
        ratio = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['output_tokens_per_s']:.1f} | {ratio} "
                     f"| {r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['itl_p50_s'] * 1000:.0f} / "
                     f"{r['itl_p95_s'] * 1000:.0f} | {r['e2e_p50_s']:.1f} / {r['e2e_p95_s']:.1f} "
                     f"| {r['mean_accepted_length']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server on loopback (default: start one)")
    p.add_argument("--serve", default="--target smollm2-135m-instruct --method ngram --dtype float32",
                   help="arguments of the `specdecode serve` this script starts")
    p.add_argument("--model", default=None, help="the served model name (default: asked from /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("SPECDECODE_API_KEY"))
    p.add_argument("--clients", default="1,2,4,8,16", help="concurrency levels, comma-separated")
    p.add_argument("--requests", type=int, default=16, help="requests per level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--malformed", type=float, default=0.0, help="chance of a malformed request before each")
    p.add_argument("--check-alone", action="store_true", help="every answer must equal the prompt served alone")
    p.add_argument("--dataset", action="append", metavar="FILE",
                   help="take the prompts (each row's first turn, sent as a user message) from a benchmark JSONL "
                        "(repeatable; default: eight built-in questions)")
    p.add_argument("--limit", type=int, default=8, help="rows per dataset")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    if args.dataset:
        from specdecode.bench.data import load_prompts

        PROMPTS[:] = [row.turns[0] for row in load_prompts(args.dataset, args.limit)]
    proc = None
    if args.url:
        if (urlparse(args.url).hostname or "") not in ("127.0.0.1", "localhost", "::1"):
            print("load_test: refusing a non-loopback URL: this script only loads servers on loopback",
                  file=sys.stderr)
            return 2
        url = args.url
    else:
        proc, url = start_server(args.serve)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        rows = []
        for clients in (int(c) for c in args.clients.split(",")):
            row = asyncio.run(level(url, model, clients, args.requests, args.max_tokens, args.malformed, headers))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}), flush=True)
        mismatches = 0
        if args.check_alone:
            reference = asyncio.run(alone(url, model, args.max_tokens, headers))
            seen = defaultdict(set)
            for row in rows:
                for prompt, text in row["_answers"]:
                    seen[prompt].add(text)
            mismatches = sum(text != reference[prompt] for prompt, texts in seen.items() for text in texts)
            print(json.dumps({"check_alone": {"prompts": len(seen), "answers_differing_from_alone": mismatches}}))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"serve": None if args.url else args.serve, "datasets": args.dataset, "levels": [
                {k: v for k, v in r.items() if not k.startswith("_")} for r in rows], "mismatches": mismatches}, f)
    bad = sum(r["errors"] + len(r["malformed_not_refused"]) for r in rows) + mismatches
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
