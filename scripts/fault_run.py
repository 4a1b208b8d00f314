"""A fault run against `specdecode serve` on loopback: faults injected where a server breaks, what each client saw,
and whether the endpoint recovered. Bounded: it stops by itself.

    python scripts/fault_run.py                       # all four parts, SmolLM2, a report at the end
    python scripts/fault_run.py --parts admit,step,loop --json bench-results/faults.json
    python scripts/fault_run.py --parts admit,step,loop --serve "--target DIR --method ngram" --settle 1   # quick

Parts (each beside four clients streaming ordinary requests the whole time):
- admit: a request whose admission raises (as a cache or a drafter fork failing would);
- step:  a request that makes an engine step raise mid-answer (as a forward failing would);
- loop:  a request that makes the engine loop itself raise (a bug outside any request): the server must fail
         every request visibly and exit non-zero; this script then restarts it as a supervisor would;
- build: the first-use kernel build SIGKILLed mid-way (with its compiler), then started again;
- ray:   `serve --replicas 2`, one replica SIGKILLed under load, then SIGTERM: what the clients saw, whether Ray
         brought the replica back, and whether any Ray process outlived the server.
Faults are injected by running the server through this script (`--child`), which wraps Engine.add, Engine.step
and the scheduler's loop to raise for requests asking an agreed number of tokens; the server itself has no hooks.
It exits non-zero if a check fails (`failed_checks`), and never leaves a server it started running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ADMIT, STEP, LOOP = 13, 17, 19  # max_tokens that trigger each injected fault
SERVE = "--target smollm2-135m-instruct --method ngram --dtype float32"
PROMPT = "Write a short poem about the sea, in four lines."


def inject_faults() -> None:
    """Wrap the engine and the scheduler (in the server's process) so that the agreed requests break them."""
    from specdecode.engine.engine import Engine
    from specdecode.server.scheduler import Scheduler

    add, step, drop = Engine.add, Engine.step, Scheduler._drop_cancelled

    def faulty_add(self, prompt_ids, params, *rest, **options):  # Engine.add's further arguments passed on as given
        if params.max_new_tokens == ADMIT:
            raise RuntimeError("injected fault: admission")
        return add(self, prompt_ids, params, *rest, **options)

    def faulty_step(self):
        if any(s.params.max_new_tokens == STEP and len(s.tokens) - s.stats.prompt_tokens >= 3 for s in self.running):
            raise RuntimeError("injected fault: engine step")
        return step(self)

    def faulty_drop(self):
        if any(j.params.max_new_tokens == LOOP for j in self._running):
            raise RuntimeError("injected fault: engine loop")
        return drop(self)

    Engine.add, Engine.step, Scheduler._drop_cancelled = faulty_add, faulty_step, faulty_drop


def body(model: str, tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "temperature": 0,
            "stream": stream, "ignore_eos": True}


async def streamed(http: httpx.AsyncClient, model: str, tokens: int) -> str:
    """One streaming request -> how it ended for its client."""
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body(model, tokens, True)) as r:
            if r.status_code != 200:
                await r.aread()
                return f"{r.status_code} {r.json().get('error', {}).get('message', '')[:60]}".strip()
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return f"cut ({type(e).__name__})"
    error = next((json.loads(x[6:])["error"]["message"][:60] for x in lines if x.startswith('data: {"error"')), None)
    done = bool(lines) and lines[-1] == "data: [DONE]"
    return (f"error event '{error}'" if error else "complete") + (", [DONE]" if done else ", no [DONE]")


async def whole(http: httpx.AsyncClient, model: str, tokens: int) -> str:
    try:
        r = await http.post("/v1/chat/completions", json=body(model, tokens, False))
    except httpx.HTTPError as e:
        return f"cut ({type(e).__name__})"
    if r.status_code == 200:
        return "200 complete"
    return f"{r.status_code} {r.json().get('error', {}).get('message', '')[:60]}"


class Background:
    """Four clients streaming ordinary requests until stopped: their endings, by when they ended."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.seen, self.stopped = url, model, [], False

    async def run(self) -> None:
        async def client() -> None:
            async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
                while not self.stopped:
                    ending = await streamed(http, self.model, 48)
                    self.seen.append((time.monotonic(), ending))
                    if not ending.startswith("complete"):
                        await asyncio.sleep(0.5)  # as a client backing off, not a loop of refused connections
        await asyncio.gather(*(client() for _ in range(4)))

    def since(self, t: float) -> dict:
        """Endings of the requests in flight at `t` or begun after it."""
        return dict(Counter(ending for ended, ending in self.seen if ended >= t))


class Children:
    """The servers this script started: each one still running at the end is stopped (SIGTERM, then SIGKILL), so
    a part that fails midway leaves no server behind."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Children:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def start_child(children: Children, serve: str, port: int) -> subprocess.Popen:
    return children.start([sys.executable, __file__, "--child", "serve", *shlex.split(serve), "--port", str(port),
                           "--log-level", "critical", "--drain-timeout", "5"])


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def wait_health(url: str, proc: subprocess.Popen, limit: float = 600) -> float:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if proc.poll() is not None:
            raise SystemExit(f"fault_run: the server exited with {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - began
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("fault_run: the server did not come up")


async def engine_faults(parts: list[str], port: int, serve: str, settle: float, children: Children) -> dict:
    url = f"http://127.0.0.1:{port}"
    proc = start_child(children, serve, port)
    wait_health(url, proc)
    model = served_model(url)
    report: dict = {}
    background = Background(url, model)
    runner = asyncio.ensure_future(background.run())
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            await asyncio.sleep(settle)
            for part, tokens in (("admit", ADMIT), ("step", STEP)):
                if part not in parts:
                    continue
                t = time.monotonic()
                faulty = await asyncio.gather(streamed(http, model, tokens), whole(http, model, tokens))
                await asyncio.sleep(settle)
                t_after = time.monotonic()
                after = await asyncio.gather(streamed(http, model, 32), whole(http, model, 32))
                report[part] = {"faulty request, streamed": faulty[0], "faulty request, whole": faulty[1],
                                f"other clients, in flight or begun in the next {settle:g} s":
                                    {k: v for k, v in Counter(e for ended, e in background.seen
                                                              if t <= ended < t_after).items()},
                                "a new request after, streamed / whole": list(after)}
            if "loop" in parts:
                t = time.monotonic()
                faulty = await streamed(http, model, LOOP)
                code = await asyncio.to_thread(proc.wait, 60)
                background.stopped = True
                await runner
                others = background.since(t)
                proc = start_child(children, serve, port)  # what systemd / Kubernetes / Ray do on a non-zero exit
                up = await asyncio.to_thread(wait_health, url, proc)
                report["loop"] = {"faulty request": faulty, "other clients meanwhile": others,
                                  "server exit status": code, "restarted and healthy after s": round(up, 1),
                                  "a new request after restart": await whole(http, model, 32)}
    finally:
        background.stopped = True
        if not runner.done():
            await runner
    proc.send_signal(signal.SIGTERM)
    report["exit status after SIGTERM"] = await asyncio.to_thread(proc.wait, 60)
    return report


def failed_checks(report: dict) -> list[str]:
    """What the report shows going wrong: a fault that did not reach its client, costs more than its own request
    (or, for the engine loop, did not stop the server with status 3), a server that did not recover, or a drain
    that did not exit 0."""
    failed = []
    for part in ("admit", "step"):
        if part in report:
            seen = report[part]
            if not (seen["faulty request, streamed"].startswith("error event") and seen["faulty request, streamed"]
                    .endswith("[DONE]") and seen["faulty request, whole"].startswith("500")):
                failed.append(f"{part}: the faulty request did not end with its error")
            if seen["a new request after, streamed / whole"] != ["complete, [DONE]", "200 complete"]:
                failed.append(f"{part}: a request after the fault did not complete")
            others = next(v for k, v in seen.items() if k.startswith("other clients"))
            # a failed step fails the requests in it (server.md); a failed admission, only its own
            if part == "admit" and set(others) - {"complete, [DONE]"} or any("no [DONE]" in e for e in others):
                failed.append(f"{part}: other clients saw {others}")
    if "loop" in report:
        seen = report["loop"]
        if seen["server exit status"] != 3 or seen["a new request after restart"] != "200 complete":
            failed.append(f"loop: exit status {seen['server exit status']}, after restart "
                          f"{seen['a new request after restart']}")
        if any("no [DONE]" in ending for ending in seen["other clients meanwhile"]):
            failed.append(f"loop: a stream ended without [DONE]: {seen['other clients meanwhile']}")
    if report.get("exit status after SIGTERM", 0) != 0:
        failed.append(f"the drain after SIGTERM exited {report['exit status after SIGTERM']}, not 0")
    return failed


def build_fault() -> dict:
    """Kill the first kernel build mid-way (its whole process group: compiler too), then build again."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SPECDECODE_CACHE": cache}
        code = "from specdecode.kernels import cpu_kernels; print(cpu_kernels() is not None)"
        first = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(20)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        left = sorted(p.name for p in Path(cache, "kernels").glob("*/*") if p.name in ("lock", "build.lock"))
        began = time.monotonic()
        try:
            second = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, timeout=900)
            outcome = "built and loaded" if second.stdout.strip() == "True" else f"fell back ({second.stdout.strip()})"
        except subprocess.TimeoutExpired:
            outcome = "hung (15 min)"
        return {"lock files left by the killed build": left, "second build": outcome,
                "second build s": round(time.monotonic() - began, 1)}


def ray_processes() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split(None, 1)[0]) for line in out.splitlines()
            if ("ray" in line.lower() and ("raylet" in line or "gcs_server" in line or "ray::" in line
                                           or "agent" in line or "default_worker" in line))}


def replica_pids() -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines() if "ServeReplica:specdecode" in line]


async def ray_fault(port: int, serve: str, children: Children) -> dict:
    url = f"http://127.0.0.1:{port}"
    before = ray_processes()
    proc = children.start([sys.executable, "-m", "specdecode", "serve", *shlex.split(serve), "--port", str(port),
                           "--replicas", "2", "--drain-timeout", "5", "--log-level", "critical"])
    wait_health(url, proc, 900)
    while len(replica_pids()) < 2:
        await asyncio.sleep(1)
    background = Background(url, served_model(url))
    runner = asyncio.ensure_future(background.run())
    await asyncio.sleep(5)
    victims = replica_pids()
    t = time.monotonic()
    os.kill(victims[0], signal.SIGKILL)
    back = None
    while time.monotonic() - t < 180:
        await asyncio.sleep(1)
        now = replica_pids()
        if len(now) >= 2 and victims[0] not in now:
            back = time.monotonic() - t
            break
    await asyncio.sleep(5)
    background.stopped = True
    await runner
    others = background.since(t)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        after = await whole(http, background.model, 32)
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.wait, 120)
    await asyncio.sleep(10)
    left = ray_processes() - before
    return {"clients after one replica was SIGKILLed": others, "replica back after s":
            round(back, 1) if back else "not within 180 s", "a new request after": after,
            "exit status after SIGTERM": code, "Ray processes left 10 s after the server exited": len(left)}


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        inject_faults()
        from specdecode.cli import main as cli

        return cli(sys.argv[2:])
    # SIGTERM (a timeout around this script) as an exception: the servers it started are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="admit,step,loop,build,ray")
    p.add_argument("--serve", default=SERVE, help="arguments of the `specdecode serve` this script starts")
    p.add_argument("--settle", type=float, default=3.0,
                   help="seconds of ordinary traffic before the first fault and after each (default 3)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    parts = args.parts.split(",")
    load_test = HERE / "load_test.py"
    sys.path.insert(0, str(load_test.parent))
    from load_test import free_port

    report: dict = {}
    with Children() as children:
        if {"admit", "step", "loop"} & set(parts):
            report.update(asyncio.run(engine_faults(parts, free_port(), args.serve, args.settle, children)))
        if "build" in parts:
            report["build"] = build_fault()
        if "ray" in parts:
            report["ray"] = asyncio.run(ray_fault(free_port(), args.serve, children))
    report["failed checks"] = failed_checks(report)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failed checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
