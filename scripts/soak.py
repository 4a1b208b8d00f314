"""A soak run against `specdecode serve` on loopback: many streaming clients for minutes, some leaving mid-stream,
some sending malformed requests, then a SIGTERM while streams are open. Bounded: it stops by itself.

    python scripts/soak.py --serve "--target smollm2-135m-instruct --method ngram" --clients 64 --minutes 10
    python scripts/soak.py --serve "--method hybrid" --clients 16 --minutes 10

What it checks and reports (and exits non-zero if a check fails):
- every valid request completed (or got an error it could see), and none got a 5xx;
- every malformed request got its 4xx;
- the server's RSS after warm-up against its peak and its last reading (sampled every 5 s);
- every greedy answer given under load equals the same prompt served alone (asked after the soak);
- on SIGTERM with streams open, each of them ends with an error event or its end, then `[DONE]`, and the
  server exits 0 once drained;
- with `--idle-sockets N`: N connections that never send a byte, held open beside the clients the whole time
  (reopened as the server closes or refuses them), from `--idle-from` (another loopback address, so the
  per-address cap meets them as it would one hostile host); `/health` asked every second must answer 200 within
  `--health-deadline` seconds throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def load_test():
    spec = importlib.util.spec_from_file_location("load_test", HERE / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def stream(http: httpx.AsyncClient, body: dict, leave_after: int | None) -> dict:
    """One streaming request -> what its client saw."""
    events, text = [], []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"status": r.status_code}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                if line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        continue
                    if chunk["choices"] and (piece := chunk["choices"][0]["delta"].get("content")):
                        text.append(piece)
                if leave_after is not None and len(events) >= leave_after:
                    return {"status": "left"}
    except httpx.HTTPError as e:
        return {"status": type(e).__name__}
    ended = bool(events) and events[-1] == "data: [DONE]"
    errored = any('"error"' in e[:20] for e in events)
    return {"status": 200 if ended and not errored else "error-event" if ended else "cut", "text": "".join(text)}


async def client(url: str, model: str, lt, rng: random.Random, until: float, args, seen: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        while time.monotonic() < until:
            if rng.random() < args.malformed:
                seen.append({"kind": "malformed", **await lt.malformed_request(http, model, rng)})
                continue
            prompt = rng.choice(lt.PROMPTS)
            body = lt.request_body(model, prompt, args.max_tokens)
            leave = rng.randint(1, 4) if rng.random() < args.disconnect else None
            result = await stream(http, body, leave)
            seen.append({"kind": "left" if leave else "valid", "prompt": prompt, **result})


async def idle_socket(host: str, port: int, source: str, until: float, opened: Counter) -> None:
    """One connection that sends nothing, open until `until`: reopened whenever the server closes or refuses it."""
    while time.monotonic() < until:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            opened["failed"] += 1
            await asyncio.sleep(0.5)
            continue
        opened["opened"] += 1
        try:
            await asyncio.wait_for(reader.read(), max(0.1, until - time.monotonic()))  # b'' (or a refusal) when closed
            opened["closed_by_server"] += 1
        except (asyncio.TimeoutError, OSError):
            pass
        finally:
            writer.close()
        await asyncio.sleep(1.0)  # then again, as a client retrying each second would


async def probe_health(url: str, until: float, deadline: float, seen: list) -> None:
    """GET /health every second -> (status or error, seconds) each time."""
    async with httpx.AsyncClient(base_url=url, timeout=deadline) as http:
        while time.monotonic() < until:
            began = time.monotonic()
            try:
                status = (await http.get("/health")).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            seen.append((status, time.monotonic() - began))
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - began)))


async def soak(url: str, model: str, lt, args) -> tuple[list[dict], list, Counter]:
    seen: list[dict] = []
    health: list = []
    sockets: Counter = Counter()
    until = time.monotonic() + args.minutes * 60
    host, port = url.split("//")[1].rsplit(":", 1)
    idle = [idle_socket(host, int(port), args.idle_from, until, sockets) for _ in range(args.idle_sockets)]
    await asyncio.gather(*idle, probe_health(url, until, args.health_deadline, health),
                         *(client(url, model, lt, random.Random(i), until, args, seen) for i in range(args.clients)))
    return seen, health, sockets


async def final_wave(url: str, model: str, lt, args, proc) -> list[dict]:
    """Streams open when the SIGTERM comes: each must end visibly."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        bodies = [lt.request_body(model, lt.PROMPTS[i % len(lt.PROMPTS)], args.max_tokens * 8)
                  for i in range(min(args.clients, 16))]
        tasks = [asyncio.ensure_future(stream(http, body, None)) for body in bodies]
        await asyncio.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        return list(await asyncio.gather(*tasks))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", default="--target smollm2-135m-instruct --method ngram --dtype float32")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--disconnect", type=float, default=0.1, help="chance a request's client leaves mid-stream")
    p.add_argument("--malformed", type=float, default=0.05, help="chance a request is malformed")
    p.add_argument("--drain-timeout", type=float, default=5.0)
    p.add_argument("--idle-sockets", type=int, default=0, help="connections held open that never send a byte")
    p.add_argument("--idle-from", default="127.0.0.2", help="the loopback address the idle sockets come from")
    p.add_argument("--health-deadline", type=float, default=2.0, help="seconds /health may take to answer")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    lt = load_test()
    proc, url = lt.start_server(f"{args.serve} --drain-timeout {args.drain_timeout} --max-per-client 1000")
    samples: list[tuple[float, float]] = []
    began = time.monotonic()
    stop_sampling = False

    async def sample() -> None:
        while not stop_sampling:
            samples.append((time.monotonic() - began, rss_mib(proc.pid)))
            await asyncio.sleep(5)

    async def run() -> tuple[list[dict], dict[str, str], list[dict]]:
        nonlocal stop_sampling
        sampler = asyncio.ensure_future(sample())
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        seen, health, sockets = await soak(url, model, lt, args)
        alone = await lt.alone(url, model, args.max_tokens, {})
        stop_sampling = True
        await sampler
        wave = await final_wave(url, model, lt, args, proc)
        return seen, alone, wave, health, sockets

    # SIGTERM (a timeout around this script) as an exception: the server is stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        seen, alone, wave, health, sockets = asyncio.run(run())
        try:
            code = proc.wait(args.drain_timeout + 60)
        except subprocess.TimeoutExpired:
            code = f"still running {args.drain_timeout + 60:g} s after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    valid = [s for s in seen if s["kind"] == "valid"]
    statuses = Counter(str(s["status"]) for s in valid)
    differing = defaultdict(set)
    for s in valid:
        if s["status"] == 200 and s["text"] != alone[s["prompt"]]:
            differing[s["prompt"]].add(s["text"])
    warm = [rss for t, rss in samples if t >= 60] or [rss for _, rss in samples]
    report = {
        "serve": args.serve, "clients": args.clients, "minutes": args.minutes, "max_tokens": args.max_tokens,
        "valid_requests": len(valid), "valid_statuses": dict(statuses),
        "left_mid_stream": sum(s["kind"] == "left" for s in seen),
        "malformed": sum(s["kind"] == "malformed" for s in seen),
        "malformed_not_refused": [s for s in seen if s["kind"] == "malformed" and not s["ok"]],
        "answers_differing_from_alone": sum(len(v) for v in differing.values()),
        "rss_mib_after_warmup": round(warm[0], 1), "rss_mib_peak": round(max(warm), 1),
        "rss_mib_last": round(warm[-1], 1),
        "sigterm_streams": len(wave), "sigterm_endings": dict(Counter(str(w["status"]) for w in wave)),
        "exit_code": code,
        "idle_sockets": args.idle_sockets, "idle_socket_events": dict(sockets),
        "health_checks": len(health), "health_not_ok": sum(status != 200 for status, _ in health),
        "health_statuses": dict(Counter(str(status) for status, _ in health)),
        "health_p50_s": round(statistics.median(t for _, t in health), 3) if health else None,
        "health_p99_s": round(sorted(t for _, t in health)[int(0.99 * (len(health) - 1))], 3) if health else None,
        "health_max_s": round(max((t for _, t in health), default=0.0), 3),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    ok = (statuses.get("200", 0) == len(valid) and not report["malformed_not_refused"]
          and not report["answers_differing_from_alone"]
          and all(w["status"] in (200, "error-event") for w in wave) and code == 0
          and report["health_not_ok"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
