"""Served side by side: `specdecode serve` and llama.cpp's `llama-server` on the same GGUF file and prompts.

    python scripts/vs_llama_server.py                # none, hybrid; llama-server plain and with its draft model
    python scripts/vs_llama_server.py --methods hybrid --clients 1,4,8,16 --json bench-results/vs-llama-server.json
    python scripts/vs_llama_server.py --load-prompts long/long-4k.jsonl --no-alone --llama-draft '' \
        --clients 1,4,8 --requests-per-client 1 --methods hybrid       # long prompts under load

`llama-server` comes from PATH, else from a build of the llama.cpp that the `llamacpp` extra (llama-cpp-python)
vendors: the source package of the installed version is downloaded from PyPI once, only the server target is
built (CPU, -march=native, as the extra's build), and the binary is cached under ~/.cache/specdecode/. Each system
runs in turn on a free loopback port with 2 threads, greedy, and answers:
1. one request at a time, whole answers, on prompts of mixed kinds (code, short QA, translation, math, a
   long-passage question, a rewrite): tokens/s end to end per kind; for our methods each prompt also runs through
   `SpecDecoder.generate` in this process just before (the path `specdecode generate` takes, what a served request
   should match), and the report gives served / in-process per prompt;
2. streaming load at each concurrency level, `ignore_eos`: aggregate tokens/s and TTFT / inter-token / end-to-end
   latency percentiles (the sweep of scripts/load_test.py).
llama-server runs plain and with the draft model of our default pair (`-md`, its own defaults for drafting),
`-np 1` for the first part and `-np` the largest level for the second (continuous batching).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
LLAMA_DRAFT = "llama-server + draft model"
CLOSE = {"Connection": "close"}
PASSAGE = (
    "The Harbor Line ferry runs between the old port and the island of Vell four times a day in summer and twice a "
    "day from October to April. The first summer crossing leaves the old port at 7:15 and takes 50 minutes; the "
    "last one leaves Vell at 19:40. Bicycles travel free on the morning crossings but cost 4 euros after noon. "
    "Cars must be booked a day ahead and are limited to twelve per crossing. In strong wind (above force 7) the "
    "afternoon crossings are cancelled and tickets are refunded at the kiosk, not online. Children under six travel "
    "free; students pay half fare with a valid card. The kiosk at the old port opens thirty minutes before each "
    "departure and sells tickets for the same day only; tickets for later days are sold online. Dogs are welcome "
    "on the open deck if they are on a lead, and the cafe on board serves hot food on the morning crossings only. "
    "In 2024 the line carried 310,000 passengers, a fifth of them in August."
)
PROMPTS = {  # kind -> a user message
    "code": "Write a Python class implementing an LRU cache with get and put in O(1), with a short docstring.",
    "qa": "What is the difference between TCP and UDP? Answer in a few sentences.",
    "translation": "Translate into German: 'The meeting has moved to Thursday afternoon because the client's "
                   "flight was delayed, so please bring the updated figures then.'",
    "math": "A bakery sells 14 trays of rolls a day, 24 rolls to a tray. On Saturday it sells twice as many. How "
            "many rolls does it sell in a week of six weekdays and one Saturday? Show the steps.",
    "rag": PASSAGE + "\n\nUsing only the text above: can I take my bicycle on the 15:00 crossing for free, and "
                     "where do I get a refund if the afternoon crossing is cancelled?",
    "rewrite": "Add type hints and a docstring to this function, and keep its behaviour:\n\n"
               "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
               "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
               "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
}


def load_test():
    spec = importlib.util.spec_from_file_location("load_test", HERE / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_server() -> Path:
    """The llama-server binary: on PATH, cached, or built from the vendored llama.cpp of llama-cpp-python."""
    if found := shutil.which("llama-server"):
        return Path(found)
    try:
        from importlib.metadata import version

        release = version("llama-cpp-python")
    except Exception:  # noqa: BLE001
        raise SystemExit("vs_llama_server: llama-server is not on PATH and llama-cpp-python is not installed: "
                         "pip install -e '.[llamacpp]' (or put llama-server on PATH)") from None
    from specdecode.weights.hub import cache_dir

    binary = cache_dir() / "llama-server" / release / "llama-server"
    if binary.is_file():
        return binary
    print(f"vs_llama_server: building llama-server from llama-cpp-python {release}'s llama.cpp (once, minutes)",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={release}", "--no-deps",
                        "--no-binary", ":all:", "-q", "-d", tmp], check=True)
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                       check=True)
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


def wait_up(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vs_llama_server: the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("vs_llama_server: the server did not come up")


def gguf_file(name: str) -> Path:
    from specdecode.weights import hub
    from specdecode.weights.files import resolve_source

    path = resolve_source(name)
    return path if path.is_file() else hub.pull(name)


def start(system: str, gguf: Path, target: str, slots: int, port: int, draft: Path | None = None,
          context: int = 4096) -> subprocess.Popen:
    """`context`: tokens one request may hold (llama-server splits -c among its slots)."""
    if system.startswith("llama-server"):
        cmd = [str(llama_server()), "-m", str(gguf), "-t", "2", "-tb", "2", "-np", str(slots), "-c",
               str(context * slots), "--host", "127.0.0.1", "--port", str(port), "--log-disable"]
        if system == LLAMA_DRAFT:  # their draft model with their defaults for it, on the same 2 threads
            cmd += ["-md", str(draft), "-td", "2", "-tbd", "2"]
    else:
        cmd = [sys.executable, "-m", "specdecode", "serve", "--target", target, "--method", system, "--port",
               str(port), "--log-level", "warning", "--max-len", str(max(context, 8192))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_up(proc, f"http://127.0.0.1:{port}")
    return proc


def one_at_a_time(url: str, model: str, max_tokens: int, beside=None) -> tuple[dict, dict]:
    """Each prompt alone, whole answers: kind -> tokens, seconds, answer. `beside`: a SpecDecoder of the served
    method in this process, run on each prompt just before the server (what `specdecode generate --chat` does),
    so the two are compared in the same spell of the machine -> (served, in process)."""
    from specdecode import SamplingParams
    served, local = {}, {}
    with httpx.Client(base_url=url, timeout=900) as http:
        http.post("/v1/chat/completions", json={"model": model, "max_tokens": 8, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Hi"}]})  # warm-up
        if beside is not None:
            beside.generate("Hi", SamplingParams(max_new_tokens=8), chat=True)
        for kind, prompt in PROMPTS.items():
            if beside is not None:
                began = time.perf_counter()
                result = beside.generate(prompt, SamplingParams(max_new_tokens=max_tokens), chat=True)
                local[kind] = {"tokens": len(result.token_ids), "seconds": time.perf_counter() - began,
                               "answer": result.text}
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0}
            began = time.perf_counter()
            reply = http.post("/v1/chat/completions", json=body).json()
            seconds = time.perf_counter() - began
            served[kind] = {"tokens": reply["usage"]["completion_tokens"], "seconds": seconds,
                            "answer": reply["choices"][0]["message"]["content"]}
    return served, local


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--methods", default="none,hybrid", help="specdecode methods to serve, comma-separated")
    p.add_argument("--llama-draft", default="qwen2.5-coder-0.5b-instruct",
                   help="also run llama-server with this draft model (-md); '' skips it")
    p.add_argument("--clients", default="1,4,8", help="concurrency levels of the load part ('' skips it)")
    p.add_argument("--requests", type=int, default=16, help="requests per load level")
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="requests per load level = this x its clients (instead of --requests)")
    p.add_argument("--load-prompts", default=None,
                   help="a JSONL file whose rows' \"prompt\" are the load part's user messages (e.g. scripts/"
                        "long_prompts.py's long-4k.jsonl), instead of the built-in mixed kinds")
    p.add_argument("--no-llama-server", dest="theirs", action="store_false",
                   help="our methods only (an A/B of ours; llama-server's figures from an earlier run)")
    p.add_argument("--no-alone", dest="alone", action="store_false",
                   help="skip the one-at-a-time part (whole answers per kind)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per answer, one at a time")
    p.add_argument("--load-max-tokens", type=int, default=64, help="tokens per answer under load")
    p.add_argument("--no-in-process", dest="in_process", action="store_false",
                   help="skip running each method in this process too (what `specdecode generate` does), each "
                        "prompt just before the server")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    gguf = gguf_file(args.target)
    draft = gguf_file(args.llama_draft) if args.llama_draft else None
    levels = [int(c) for c in args.clients.split(",") if c]
    lt = load_test()
    lt.PROMPTS[:] = list(PROMPTS.values())
    context = 4096
    if args.load_prompts:
        rows = [json.loads(line) for line in Path(args.load_prompts).read_text().splitlines() if line.strip()]
        lt.PROMPTS[:] = [row["prompt"] for row in rows]
        # each request's prompt (chat template included, where the file says) and its answer, with room to spare
        longest = max(row.get("context_tokens", len(row["prompt"]) // 2) for row in rows)
        context = -(-(longest + max(args.load_max_tokens, args.max_tokens) + 64) // 256) * 256
    systems = [*(["llama-server", *([LLAMA_DRAFT] if draft else [])] if args.theirs else []), *args.methods.split(",")]
    results: dict[str, dict] = {}
    for system in systems:
        # llama-server: one slot for the first part, then as many as the largest level; ours batches up to 16.
        theirs = system.startswith("llama-server")
        runs = [("alone", 1), ("load", max(levels))] if theirs and levels else [("both", 16)]
        if not args.alone:
            runs = [("load", max(levels) if theirs else 16)]
        beside = None
        if not theirs and args.in_process and args.alone:
            from specdecode import SpecDecoder
            beside = SpecDecoder.load(args.target, method=system)
        result = results[system] = {}
        for part, slots in runs:
            port = lt.free_port()
            print(f"vs_llama_server: {system}, {part}", file=sys.stderr)
            proc = start(system, gguf, args.target, slots, port, draft, context)
            url = f"http://127.0.0.1:{port}"
            try:
                model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                if part in ("alone", "both"):
                    result["alone"], local = one_at_a_time(url, model, args.max_tokens, beside)
                    if local:
                        results[f"{system}, in process"] = {"alone": local}
                if part in ("load", "both") and levels:
                    # A connection per request: llama-server drops idle keep-alive connections, which a client
                    # reusing them sees as errors that are not the server's speed.
                    per_level = lambda c: c * args.requests_per_client if args.requests_per_client else args.requests  # noqa: E731
                    result["load"] = [{k: v for k, v in asyncio.run(lt.level(url, model, c, per_level(c),
                                                                             args.load_max_tokens, 0.0,
                                                                             CLOSE)).items()
                                       if not k.startswith("_")} for c in levels]
            finally:
                proc.terminate()
                proc.wait(60)
        del beside
    print(report(results, levels))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"target": args.target, "results": results}, indent=1) + "\n")
    return 0


def report(results: dict[str, dict], levels: list[int]) -> str:
    kinds = list(PROMPTS)
    lines = ["One request at a time, whole answers, tokens/s end to end:", "",
             "| system | " + " | ".join(kinds) + " | all |", "|---|" + "---:|" * (len(kinds) + 1)]
    if not any("alone" in r for r in results.values()):
        lines = []
    for system, r in results.items():
        if "alone" not in r:
            continue
        alone = r["alone"]
        total = sum(a["tokens"] for a in alone.values()) / sum(a["seconds"] for a in alone.values())
        lines.append(f"| {system} | " + " | ".join(f"{alone[k]['tokens'] / alone[k]['seconds']:.1f}" for k in kinds)
                     + f" | {total:.1f} |")
    ours = [s for s in results if not s.startswith("llama-server") and not s.endswith("in process")
            and "alone" in results[s]]
    for system in ours:
        local = results.get(f"{system}, in process")
        if local:
            rate = lambda a: a["tokens"] / a["seconds"]  # noqa: E731
            ratios = [rate(results[system]["alone"][k]) / rate(local["alone"][k]) for k in kinds]
            lines.append(f"| {system}: served / in process | " + " | ".join(f"{r:.2f}x" for r in ratios)
                         + f" | median {sorted(ratios)[len(ratios) // 2]:.2f}x |")
    if len(ours) > 1:
        same = all(results[s]["alone"][k]["answer"] == results[ours[0]]["alone"][k]["answer"]
                   for s in ours for k in kinds)
        lines.append(f"\nGreedy answers identical across {', '.join(ours)}: {'yes' if same else 'NO'}")
    if levels:
        lines += ["", "Streaming load: aggregate tokens/s (TTFT p50 / p99 s; inter-token p50 / p99 ms, each request's mean "
                      "gap; end to end p50 s; a stream's longest gap, p50 / max s):", "",
                  "| system | " + " | ".join(f"{c} clients" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
        for system, r in results.items():
            if "load" not in r:
                continue
            cells = [f"{row['output_tokens_per_s']:.1f} ({row['ttft_p50_s']:.2f} / {row['ttft_p99_s']:.2f}; "
                     f"{row['itl_p50_s'] * 1000:.0f} / {row['itl_p99_s'] * 1000:.0f}; {row['e2e_p50_s']:.1f}; "
                     f"{row['longest_gap_p50_s']:.2f} / {row['longest_gap_max_s']:.2f}){' ' + str(row['errors']) + ' errors' if row['errors'] else ''}"
                     for row in r["load"]]
            lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
