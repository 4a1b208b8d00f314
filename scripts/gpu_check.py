"""The GPU checklist in one run: correctness on CUDA, and speed against the memory roofline.

Random weights in real shapes (speed does not depend on the values; exactness is checked between two ways of
computing the same model, so random values serve). Each section is timed and guarded: one that fails prints its
traceback and the next one runs. Results go to stdout and, as JSON, to --out.

    python scripts/gpu_check.py --out gpu.json                 # on a CUDA machine (H100-class: ~3 min)
    python scripts/gpu_check.py --small --device cpu           # the same code on toy shapes, to check the script

Sections:
- `machine`: GPU, read bandwidth (a sum over 4 GB) and copy bandwidth.
- `parity`: the native model against transformers on tiny random configs, float32 and bfloat16.
- `rows`: how often a bfloat16 (k+1)-row verify forward's argmax differs from one-token forwards', and at what
  top-2 logit margins (both attention paths: one attention call, and one call per row).
- `engine`: greedy output of every method against `none` through the engine, float32 and bfloat16, with the
  target as its own draft model (every guess should be accepted where rows agree): eager, and with the engine's
  CUDA graphs (`--modes eager,graphs,graphs-rows`).
- `speed`: a Llama-3-8B-shaped bfloat16 target: one-token decode against the roofline, eager and replayed as a
  CUDA graph; the verify cost curve M = 1..64; a free drafter right with probability 0.8 per token, at the
  forward level and through the engine; a 1B-shaped draft model's decode time.
- `engine_speed`: the 8B-shaped target through the engine in each of `--modes`: `none`, that drafter at 4, 8 and
  16 tokens, and a 1B-shaped draft model.
- `compiled`: the graphs' static forward as written and compiled by torch.compile, each replayed as a graph.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
import traceback
from pathlib import Path

import torch

from specdecode.config import ModelConfig, SamplingParams
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.models.masks import chain_mask
from specdecode.models.model import Transformer

LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                max_position_embeddings=8192, tie_word_embeddings=False)
LLAMA_1B = dict(LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                tie_word_embeddings=True)
SMOL = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
TOY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def random_model(shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Transformer:
    """A native model with N(0, 0.02) weights made on the device (an 8B model in seconds), unit norms."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(shape)).to(dtype)
    model = model.to_empty(device=device)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    from specdecode.models.rope import rope_inv_freq

    model.inv_freq = rope_inv_freq(model.config).to(device)
    return model.eval()


def read_bytes_per_token(model: Transformer) -> int:
    """Weight bytes one decode step reads: every parameter but the embedding table (one row of it is read),
    the LM head counted once even when tied."""
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or name == "model.embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def one_token(model, cache, token: torch.Tensor, decode: bool = True) -> torch.Tensor:
    n = cache.length
    logits, _ = model(token.view(1, 1), torch.tensor([[n]], device=token.device), cache,
                      chain_mask(n, 1, token.device), decode=decode)
    cache.truncate(n + 1)
    return logits[0, -1]


def prefill(model, cache, ids: torch.Tensor, every_row: bool = False) -> torch.Tensor:
    """The prompt `ids` into an emptied cache -> the last row's logits (every row's with `every_row`)."""
    cache.truncate(0)
    logits, _ = model(ids[None], torch.arange(ids.numel(), device=ids.device)[None], cache,
                      chain_mask(0, ids.numel(), ids.device), logits_from=0 if every_row else ids.numel() - 1)
    cache.truncate(ids.numel())
    return logits[0] if every_row else logits[0, -1]


# --- sections -----------------------------------------------------------------------------------------------


def machine(args, device) -> dict:
    out = {"torch": torch.__version__}
    if device.type != "cuda":
        return out
    props = torch.cuda.get_device_properties(device)
    out.update(gpu=props.name, sms=props.multi_processor_count, memory_gb=round(props.total_memory / 2**30, 1))
    x = torch.empty(2 * 2**30, dtype=torch.bfloat16, device=device).normal_()  # 4 GB
    y = torch.empty_like(x)
    # x and y are deleted only after the loop; not default arguments, so that `del x, y` frees them (F821 below)
    for name, fn, moved in [("read_gb_s", lambda: x.sum(), x.nbytes), ("copy_gb_s", lambda: y.copy_(x), 2 * x.nbytes)]:  # noqa: F821
        fn()
        sync(device)
        best = math.inf
        for _ in range(5):
            t = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - t)
        out[name] = round(moved / best / 1e9)
    del x, y
    torch.cuda.empty_cache()
    return out


def parity(args, device) -> dict:
    """Native vs transformers, same weights: max |logit difference| over a 24-token prefill and 8 decode steps."""
    import transformers

    out = {}
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    for kind, cls in classes.items():
        torch.manual_seed(0)
        extra = {"head_dim": 16} if kind == "qwen3" else {}
        cfg = cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, **extra)
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.data.normal_(0, 0.1)
        native = Transformer(ModelConfig.from_hf(hf.config.to_dict()))
        native.load_state_dict(hf.state_dict(), strict=False)
        for dtype in (torch.float32, torch.bfloat16):
            h, n = hf.to(device, dtype), native.to(device, dtype).eval()
            ids = torch.randint(0, 256, (32,), device=device)
            with torch.inference_mode():
                ref = h(ids[None]).logits[0].float()
                cache = n.new_cache(1, 64)
                got = [prefill(n, cache, ids[:24], every_row=True)]
                for t in ids[24:]:
                    got.append(one_token(n, cache, t)[None])
                got = torch.cat(got)
            out[f"{kind}/{str(dtype)[6:]}"] = float((got - ref).abs().max())
    return out


def rows(args, device) -> dict:
    """Teacher-forced: greedy tokens by one-token forwards, then the same positions as verify forwards of k+1
    rows; argmax agreement per row, and the reference top-2 margin where they differ."""
    shape = TOY if args.small else SMOL
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        model = random_model(shape, dtype, device, seed=1)
        vocab = model.config.vocab_size
        for prompt_seed in range(args.prompts):
            gen = torch.Generator().manual_seed(prompt_seed)
            ids = torch.randint(0, vocab, (64,), generator=gen).to(device)
            cache = model.new_cache(1, 64 + args.tokens + 32)
            with torch.inference_mode():
                last = prefill(model, cache, ids)
                ref_logits, tokens = [], []
                for _ in range(args.tokens):
                    tok = last.argmax()
                    tokens.append(tok)
                    last = one_token(model, cache, tok)
                    ref_logits.append(last)
                ref = torch.stack(ref_logits)  # ref[i]: after tokens[: i + 1]
                tokens = torch.stack(tokens)
                for decode in (True, False):
                    for k1 in (4,) if args.small else (4, 8, 16):
                        key = f"{str(dtype)[6:]}/{'per-row' if decode else 'one-call'}/M={k1}"
                        rec = out.setdefault(key, {"rows": 0, "argmax_differs": 0, "margins": [], "max_abs": 0.0})
                        for start in range(0, args.tokens - k1 + 1, k1):
                            cache.truncate(64 + start)
                            chunk = tokens[start : start + k1]
                            n = cache.length
                            logits, _ = model(chunk[None], torch.arange(n, n + k1, device=device)[None], cache,
                                              chain_mask(n, k1, device), decode=decode)
                            got, want = logits[0], ref[start : start + k1]
                            differs = (got.argmax(-1) != want.argmax(-1)).nonzero().flatten().tolist()
                            top = want.topk(2, dim=-1).values
                            rec["rows"] += k1
                            rec["argmax_differs"] += len(differs)
                            rec["margins"] += [round(float(top[i, 0] - top[i, 1]), 5) for i in differs]
                            rec["max_abs"] = max(rec["max_abs"], float((got - want).abs().max()))
        del model
    for rec in out.values():
        rec["margins"] = sorted(rec["margins"])[:20]
    return out


class Oracle(Drafter):
    """A drafter that knows the answer (the plain output) and is right with probability `p` per token; once the
    output leaves the known answer it guesses wrong. Costs nothing: only the verify forwards are timed."""

    name = "oracle"

    def __init__(self, prompt: list[int], answer: list[int], p: float, seed: int = 0) -> None:
        self.known, self.p, self.seed = prompt + answer, p, seed
        self.rng = torch.Generator().manual_seed(seed)

    def fork(self) -> Oracle:
        return Oracle([], self.known, self.p, self.seed)

    def reset(self) -> None:
        self.rng = torch.Generator().manual_seed(self.seed)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        n = len(ctx.tokens)
        on_track = ctx.tokens == self.known[:n]
        guesses = []
        for i in range(max_tokens):
            true = self.known[n + i] if on_track and n + i < len(self.known) else 0
            right = on_track and n + i < len(self.known) and torch.rand(1, generator=self.rng).item() < self.p
            guesses.append(true if right else (true + 1) % 1000)
        return Draft.chain(torch.tensor(guesses, dtype=torch.long))


def set_graphs(mode: str | bool, *models) -> None:
    """CUDA graphs on or off for engines built from now on (the engine turns them on by itself on a GPU); mode
    "graphs-rows": attention one row at a time in them (SPECDECODE_GRAPH_ROWS)."""
    on = mode not in (False, "eager")
    from specdecode import settings
    from specdecode.models.cuda_graphs import use_graphs

    settings.use(dataclasses.replace(settings.current(), cuda_graphs=on, graph_rows=mode == "graphs-rows"))
    for model in models:
        use_graphs(model, False)  # a fresh set of graphs in the mode asked
        use_graphs(model, on and model.device.type == "cuda", rows_apart=mode == "graphs-rows")


def engine(args, device) -> dict:
    """Greedy identity of every method against `none`, the target drafting for itself where a draft model runs:
    eager, and with the lone request's forwards replayed as CUDA graphs (cuda_graphs.py)."""
    from specdecode.engine.engine import Engine
    from specdecode.methods import build_drafter
    from specdecode.weights.loading import Models

    shape = TOY if args.small else SMOL
    out = {}
    methods = ["draft", "ngram", "recycle", "lookahead", "suffix", "hybrid"]
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        target = random_model(shape, dtype, device, seed=2)
        # A peaked head (untied, x20): random weights otherwise give near-uniform guesses a draft model won't make.
        target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach() * 20)
        vocab = target.config.vocab_size
        prompts = [torch.randint(0, vocab, (48,), generator=torch.Generator().manual_seed(s)).tolist()
                   for s in range(args.prompts)]
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
        models = Models(target, None, draft=target)

        def run(drafter, k, prompts=prompts, params=params):
            # target is not a default argument, so that the `del target` below frees it before the next dtype's is made
            eng = Engine(target, drafter, num_draft_tokens=k)  # noqa: B023, F821 - run only in this iteration
            answers, accepted, t0 = [], [], time.perf_counter()
            for p in prompts:
                answers.append([t for step in eng.generate(p, params) for t in step.tokens])
                accepted.append(eng.last.stats.mean_accepted_length)
            sync(device)
            return answers, accepted, time.perf_counter() - t0

        d = str(dtype)[6:]
        set_graphs(False, target)
        plain, _, plain_s = run(build_drafter("none", models), 4)
        out[f"{d}/eager/none"] = {"s": round(plain_s, 2)}
        for mode in args.modes.split(","):
            set_graphs(mode, target)
            for name in (["none"] if mode != "eager" else []) + methods:
                try:
                    answers, accepted, secs = run(build_drafter(name, models), 4)
                    same = sum(a == b for a, b in zip(answers, plain))
                    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                             for a, b in zip(answers, plain)]
                    out[f"{d}/{mode}/{name}"] = {"identical_to_eager_none": f"{same}/{len(plain)}",
                                                 "first_difference": first, "s": round(secs, 2),
                                                 "accepted_length": [round(a, 2) for a in accepted]}
                    if mode != "eager" and name == "none":
                        graphed_plain = answers
                    elif mode != "eager":
                        out[f"{d}/{mode}/{name}"]["identical_to_graphed_none"] = (
                            f"{sum(a == b for a, b in zip(answers, graphed_plain))}/{len(plain)}")
                except Exception as e:  # one method failing must not hide the others
                    out[f"{d}/{mode}/{name}"] = {"error": f"{type(e).__name__}: {e}",
                                                 "where": traceback.format_exc()[-600:]}
        if target.graphs is not None:
            out[f"{d}/graphs_captured"] = len(target.graphs.shapes)
        set_graphs(False, target)
        del target, models
    return out


def engine_speed(args, device) -> dict:
    """Through the engine, a Llama-3-8B-shaped bfloat16 target, eager and as CUDA graphs: `none`, a drafter that
    knows the answer and is right with p = 0.8 per token at fixed draft sizes, and a 1B-shaped draft model
    (random: its guesses are wrong, so this prices its drafting). tok/s of a second run (the first captures)."""
    from specdecode.drafters import NoDrafter
    from specdecode.engine.engine import Engine
    from specdecode.methods import build_drafter
    from specdecode.weights.loading import Models

    dtype = getattr(torch, args.speed_dtype)
    model = random_model(TOY if args.small else LLAMA_8B, dtype, device, seed=3)
    small = random_model(TOY if args.small else LLAMA_1B, dtype, device, seed=4)
    vocab, prompt_len = model.config.vocab_size, 128
    prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(9)).tolist()
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)

    def twice(eng):
        first = time.perf_counter()
        [t for step in eng.generate(prompt, params) for t in step.tokens]
        sync(device)
        first = time.perf_counter() - first
        t0 = time.perf_counter()
        got = [t for step in eng.generate(prompt, params) for t in step.tokens]
        sync(device)
        secs = time.perf_counter() - t0
        s = eng.last.stats
        return got, {"tok_s": round(len(got) / secs, 1), "first_run_s": round(first, 2),
                     "accepted_length": round(s.mean_accepted_length, 2),
                     "draft_ms_per_step": round(s.draft_s / max(s.target_forwards, 1) * 1000, 2),
                     "drafted_per_step": round(s.drafted_tokens / max(s.drafts, 1), 2)}

    out = {}
    for mode in args.modes.split(","):
        set_graphs(mode, model, small)
        try:
            answer, out[f"{mode}/none"] = twice(Engine(model, NoDrafter(), num_draft_tokens=1, max_len=1024))
            for k in (4, 8, 16):
                got, rec = twice(Engine(model, Oracle(prompt, answer, 0.8), num_draft_tokens=k, max_len=1024))
                out[f"{mode}/oracle k={k}"] = dict(rec, identical=got == answer)
            for k in (4,):
                drafter = build_drafter("draft", Models(model, None, draft=small), "chain")
                got, rec = twice(Engine(model, drafter, num_draft_tokens=k, max_len=1024))
                out[f"{mode}/draft-1b k={k}"] = dict(rec, identical=got == answer)
        except Exception as e:
            out[f"{mode}/error"] = {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-1200:]}
        if model.graphs is not None:
            out[f"{mode}/graphs_captured"] = {"target": len(model.graphs.shapes),
                                              "draft": len(small.graphs.shapes) if small.graphs else 0}
        if device.type == "cuda":
            out[f"{mode}/max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    set_graphs(False, model, small)
    out["vs_none_of_its_mode"] = {k: round(v["tok_s"] / out[k.split("/")[0] + "/none"]["tok_s"], 2)
                                  for k, v in out.items() if isinstance(v, dict) and "tok_s" in v}
    return out


def timed(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def as_graph(model, tokens, positions, cache, mask, warmups: int):
    """One forward (one attention call) captured as a CUDA graph after warm-ups on a side stream, as PyTorch asks
    -> (graph, its logits tensor, refilled at every replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            model(tokens, positions, cache, mask)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, _ = model(tokens, positions, cache, mask)
    return graph, logits


def speed(args, device) -> dict:
    shape = TOY if args.small else LLAMA_8B
    dtype = torch.bfloat16
    out = {}
    model = random_model(shape, dtype, device, seed=3)
    bytes_tok = read_bytes_per_token(model)
    out["bytes_per_token_gb"] = round(bytes_tok / 1e9, 3)
    vocab, prompt_len = model.config.vocab_size, 128
    cache = model.new_cache(1, 1024)
    ids = torch.randint(0, vocab, (prompt_len,), device=device)
    with torch.inference_mode():
        prefill(model, cache, ids)
        tok = torch.tensor(5, device=device)

        # Plain decoding as the engine runs it: one forward, then the argmax read back (one host sync a token).
        # (These closures read `model` from this scope, not as a default argument, so that the `del model` below
        # frees the 8B model before the 1B one is made: hence the F821 noqa on those lines.)
        def decode_n(n=args.tokens, decode=False):
            cache.truncate(prompt_len)
            t = tok
            for _ in range(n):
                t = one_token(model, cache, t, decode=decode).argmax()  # noqa: F821 - `del model` runs later
                t = torch.tensor(int(t), device=device)
        for decode in (False, True):
            s = timed(lambda decode=decode: decode_n(decode=decode), device, 3) / args.tokens
            out[f"decode_ms/{'per-row' if decode else 'one-call'}"] = round(s * 1000, 3)

        # The same one-token forward replayed as a CUDA graph (static position): what launch overhead costs.
        if device.type == "cuda":
            try:
                cache.truncate(prompt_len)
                static_tok = torch.zeros(1, 1, dtype=torch.long, device=device)
                pos = torch.tensor([[prompt_len]], device=device)
                mask = chain_mask(prompt_len, 1, device)
                graph, static_logits = as_graph(model, static_tok, pos, cache, mask, warmups=3)

                def replay(n=args.tokens):
                    for _ in range(n):
                        graph.replay()
                        static_tok.copy_(static_logits[0, -1].argmax().view(1, 1))
                        int(static_tok)  # the host sync a sampler needs
                s = timed(replay, device, 3) / args.tokens
                out["decode_ms/cuda-graph"] = round(s * 1000, 3)
            except Exception as e:
                out["decode_ms/cuda-graph"] = f"{type(e).__name__}: {e}"
        if "read_gb_s" in args.machine:
            floor = bytes_tok / (args.machine["read_gb_s"] * 1e9) * 1000
            out["roofline_ms_at_read_bw"] = round(floor, 3)
            for key in [k for k in out if k.startswith("decode_ms/")]:
                if isinstance(out[key], float):
                    out[f"roofline_share/{key[10:]}"] = round(floor / out[key], 3)

        # The verify cost curve: one forward over M chain tokens after the prompt.
        curve = {}
        for decode in (False, True):
            for m in (1, 4) if args.small else (1, 2, 4, 8, 16, 32, 64):
                chunk = torch.randint(0, vocab, (m,), device=device)

                def verify(chunk=chunk, m=m, decode=decode):
                    cache.truncate(prompt_len)
                    model(chunk[None], torch.arange(prompt_len, prompt_len + m, device=device)[None], cache,  # noqa: F821 - `del model` runs later
                          chain_mask(prompt_len, m, device), decode=decode)
                curve[f"{'per-row' if decode else 'one-call'}/M={m}"] = round(timed(verify, device, 5) * 1000, 3)
        out["verify_ms"] = curve

        # A free drafter right with probability p per token, at the forward level: one verify forward of k + 1
        # rows, the argmaxes read back once, the accepted count drawn as the drafter's luck would have it.
        p, rng = 0.8, torch.Generator().manual_seed(0)
        free = {}
        for decode in (False, True):
            for k in (2, 4) if args.small else (2, 3, 4, 6, 8, 12, 16):
                def spec(n=args.tokens, k=k, decode=decode):
                    cache.truncate(prompt_len)
                    made = 0
                    while made < n:
                        at = cache.length
                        chunk = torch.randint(0, vocab, (k + 1,), device=device)
                        logits, _ = model(chunk[None], torch.arange(at, at + k + 1, device=device)[None], cache,  # noqa: F821 - `del model` runs later
                                          chain_mask(at, k + 1, device), decode=decode)
                        logits[0].argmax(-1).tolist()
                        accepted = 0
                        while accepted < k and torch.rand(1, generator=rng).item() < p:
                            accepted += 1
                        cache.truncate(at + accepted + 1)
                        made += accepted + 1
                    return made
                t = timed(spec, device, 2)
                free[f"{'per-row' if decode else 'one-call'}/k={k}"] = round(args.tokens / t, 1)
        out["free_drafter_tok_s"] = free
        plain = 1000 / out["decode_ms/one-call"]
        out["plain_tok_s"] = round(plain, 1)
        out["free_drafter_best_speedup"] = round(max(free.values()) / plain, 2)
    del cache

    # Through the engine: the oracle at p = 0.8, fixed draft sizes, against `none` in the same engine.
    try:
        from specdecode.drafters import NoDrafter
        from specdecode.engine.engine import Engine

        prompt = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(9)).tolist()
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
        eng = Engine(model, NoDrafter(), num_draft_tokens=1, max_len=1024)
        t0 = time.perf_counter()
        answer = [t for step in eng.generate(prompt, params) for t in step.tokens]
        sync(device)
        t0 = time.perf_counter()
        answer = [t for step in eng.generate(prompt, params) for t in step.tokens]
        sync(device)
        runs = {"none": round(len(answer) / (time.perf_counter() - t0), 1)}
        for k in (4, 8):
            eng = Engine(model, Oracle(prompt, answer, 0.8), num_draft_tokens=k, max_len=1024)
            got = [t for step in eng.generate(prompt, params) for t in step.tokens]  # warm-up
            t0 = time.perf_counter()
            got = [t for step in eng.generate(prompt, params) for t in step.tokens]
            sync(device)
            secs = time.perf_counter() - t0
            runs[f"oracle k={k}"] = {"tok_s": round(len(got) / secs, 1), "identical": got == answer,
                                     "accepted_length": round(eng.last.stats.mean_accepted_length, 2)}
        out["engine"] = runs
    except Exception as e:
        out["engine"] = {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-800:]}
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # A 1B-shaped draft model's own decode step: what a real draft token costs beside the target's.
    small = random_model(TOY if args.small else LLAMA_1B, dtype, device, seed=4)
    cache = small.new_cache(1, 1024)
    with torch.inference_mode():
        prefill(small, cache, ids)

        def draft_n(n=args.tokens):
            cache.truncate(prompt_len)
            t = tok
            for _ in range(n):
                t = one_token(small, cache, t, decode=False).argmax()
        out["draft_1b_decode_ms"] = round(timed(draft_n, device, 3) / args.tokens * 1000, 3)
        out["draft_1b_bytes_gb"] = round(read_bytes_per_token(small) / 1e9, 3)
    return out


def graphs(args, device) -> dict:
    """The verify cost curve with launch overhead gone: one forward over M tokens (one attention call) captured
    as a CUDA graph at a fixed position and replayed; what a free drafter right with p = 0.8 per token would give
    at each draft size k by that curve: E[tokens a step] / (cost(k + 1) / cost(1))."""
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device"}
    model = random_model(TOY if args.small else LLAMA_8B, torch.bfloat16, device, seed=3)
    prompt_len, vocab = 128, model.config.vocab_size
    cache = model.new_cache(1, 512)
    out, ms = {}, {}
    with torch.inference_mode():
        prefill(model, cache, torch.randint(0, vocab, (prompt_len,), device=device))
        for m in (1, 2, 4, 8, 12, 16, 24, 32, 64):
            tokens = torch.randint(0, vocab, (1, m), device=device)
            pos = torch.arange(prompt_len, prompt_len + m, device=device)[None]
            mask = chain_mask(prompt_len, m, device)
            graph, _ = as_graph(model, tokens, pos, cache, mask, warmups=2)

            def replay(n=10):
                for _ in range(n):
                    graph.replay()  # noqa: B023, F821 - replayed at once by timed(), before `del graph`
            ms[m] = timed(replay, device, 5) / 10 * 1000
            del graph
    out["verify_ms"] = {f"M={m}": round(t, 3) for m, t in ms.items()}
    out["ratio_to_M1"] = {f"M={m}": round(t / ms[1], 3) for m, t in ms.items()}
    p = 0.8
    speedups = {f"k={m - 1}": round((1 - p ** m) / (1 - p) / (t / ms[1]), 2) for m, t in ms.items() if m > 1}
    out["free_drafter_speedup_p0.8"] = speedups
    return out


def compiled(args, device) -> dict:
    """What torch.compile would buy the graphs: the engine's static-buffer forward (Transformer.static_forward, what
    cuda_graphs.py captures) as written and compiled by torch.compile, each captured as a CUDA graph and replayed,
    at M rows (padded shapes: M = 1 and 8), attention over 256 cache slots. Compile seconds are reported too."""
    if device.type != "cuda" and not args.small:
        return {"skipped": "a CUDA device"}
    shape = TOY if args.small else dict(LLAMA_8B, num_hidden_layers=args.compile_layers)  # compile time: layers
    model = random_model(shape, torch.bfloat16, device, seed=3)
    prompt_len, vocab, slots = 128, model.config.vocab_size, 256
    cache = model.new_cache(1, 512)
    out = {"layers": model.config.num_layers, "bytes_per_token_gb": round(read_bytes_per_token(model) / 1e9, 3)}
    with torch.inference_mode():
        prefill(model, cache, torch.randint(0, vocab, (prompt_len,), device=device))
        compiled_fn = torch.compile(model.static_forward)
        for m in (1, 8):
            tokens = torch.randint(0, vocab, (m,), device=device)
            positions = torch.arange(prompt_len, prompt_len + m, device=device)
            write_pos = positions.clone()
            mask = torch.arange(slots, device=device)[None] <= positions[:, None]
            for name, fn in (("as written", model.static_forward), ("torch.compile", compiled_fn)):
                call = lambda fn=fn, tokens=tokens, positions=positions, write_pos=write_pos, mask=mask: fn(  # noqa: E731
                    tokens, positions, write_pos, mask, cache, None, ())
                began = time.perf_counter()
                call()
                sync(device)
                out[f"{name}/M={m}/first_call_s"] = round(time.perf_counter() - began, 2)
                if device.type != "cuda":
                    out[f"{name}/M={m}/ms"] = round(timed(call, device, 3) * 1000, 3)
                    continue
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        call()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call()

                def replay(n=10):
                    for _ in range(n):
                        graph.replay()  # noqa: B023, F821 - replayed at once by timed(), before `del graph`
                out[f"{name}/M={m}/graph_ms"] = round(timed(replay, device, 5) / 10 * 1000, 3)
                del graph
    return out


SECTIONS = {"graphs": graphs, "machine": machine, "parity": parity, "rows": rows, "engine": engine, "speed": speed,
            "engine_speed": engine_speed, "compiled": compiled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy shapes (a check of the script itself)")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per decode run")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--modes", default="eager,graphs", help="engine sections: eager, graphs, graphs-rows")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="engine section")
    ap.add_argument("--speed-dtype", default="bfloat16", help="engine_speed section")
    ap.add_argument("--compile-layers", type=int, default=8, help="compiled section: an 8B-shaped model's layers")
    args = ap.parse_args()
    device = torch.device(args.device)
    args.machine = {}
    results = {}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            results[name] = SECTIONS[name](args, device)
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-1500:]}
        if name == "machine":
            args.machine = results[name]
        print(f"== {name} ({time.perf_counter() - t0:.1f} s)\n{json.dumps(results[name], indent=1)}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
