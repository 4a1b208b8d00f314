"""Command-line arguments shared by `generate`, `serve` and `bench`, and what they build (a decoder, sampling
settings). Its own module so every subcommand's CLI imports it, and `cli.py` imports the subcommands, without an
import cycle."""

from __future__ import annotations

import argparse
import dataclasses

from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.config import SamplingParams
from specdecode.drafters.suffix_pool import DEFAULT_POOL_MB
from specdecode.errors import SpecdecodeError
from specdecode.methods import DEFAULT_METHOD, METHODS, SHAPES
from specdecode.models.prompt_cache import DEFAULT_PROMPT_CACHE_MB
from specdecode.weights.vocab_subset import DEFAULT_HEAD_SIZE


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model and drafter options shared by generate, serve and bench."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="packaged name, HF hub id, HF folder or .gguf file")
    p.add_argument("--draft", default=None,
                   help=f"--method draft or hybrid: the draft model (default {DEFAULT_DRAFT}; one with another "
                        "tokenizer drafts text, mapped to the target's tokens); --method eagle, hybrid-eagle or "
                        "medusa: the folder `specdecode train` wrote")
    p.add_argument("--draft-adapter", default=None, metavar="DIR",
                   help="a LoRA adapter for the draft model (`specdecode train draft`)")
    p.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS),
                   help="how tokens are drafted: " + "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()))
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft tokens verified per step (default: chosen each step from what a verify forward "
                        "costs on this machine, measured once and cached)")
    p.add_argument("--draft-shape", default=None, choices=list(SHAPES),
                   help="tree: several guesses per position, verified at once; chain: one guess per position "
                        "(default: " + ", ".join(f"{m.name} {m.default_shape}" for m in METHODS.values()
                                                 if m.drafts) + ")")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_weight_args(p)
    p.add_argument("--max-len", type=int, default=8192, help="context window to allocate (tokens)")
    p.add_argument("--suffix-pool-mb", type=float, default=DEFAULT_POOL_MB, metavar="MB",
                   help="--method suffix or hybrid: memory for earlier answers they copy from (oldest leave first)")
    p.add_argument("--prompt-cache-mb", type=float, default=DEFAULT_PROMPT_CACHE_MB, metavar="MB",
                   help="memory for recent prompts' keys and values: a request that starts like one of them (a system "
                        "prompt, a chat's earlier turns) computes only the rest (0: off)")
    p.add_argument("--suffix-pool", default=None, metavar="PATH",
                   help="--method suffix or hybrid: keep the earlier answers in this file across runs (read at start, "
                        "written atomically while serving and at exit)")


def add_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="auto", choices=["auto", "stored", "float"],
                   help="stored: run the checkpoint's weights as they are on the CPU kernels (a GGUF file's "
                        "blocks, a GGUF's or an HF folder's bfloat16/float16 matrices; float32 activations); float: "
                        "the weights in --dtype (auto: stored on CPU where the native model runs the architecture)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the KV caches' dtype: bfloat16 halves what attention reads over long prompts (on AMX "
                        "CPUs, attention in tiles); output stays identical to plain decoding with the same cache "
                        "dtype (auto: bfloat16 for weights as stored on CPU, else the activations' dtype)")
    p.add_argument("--quantize", default="none", choices=["none", "q8_0", "q4_0", "q4_k", "int8", "int4"],
                   help="write a float target's weights in blocks (int8 = q8_0, int4 = q4_k); the output is "
                        "exact for that target")
    p.add_argument("--draft-quantize", default="auto", choices=["auto", "none", "q8_0", "q4_0", "q4_k", "int8", "int4"],
                   help="blocks for the draft model: changes speed only, never the output. A float draft is "
                        "written in them; a GGUF draft's layers stored in more bits per weight are written again "
                        "in them, once, cached (auto: q4_0 for a GGUF draft, q8_0 for a float one, on CPU; none: "
                        "a GGUF draft as stored)")
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_HEAD_SIZE, metavar="N",
                   help="the draft model's LM head scores only the N most frequent tokens (cheaper drafts, same "
                        "output); 0 = the whole vocabulary")
    p.add_argument("--draft-vocab-corpus", action="append", metavar="FILE",
                   help="jsonl text of your domain to count token frequencies on (repeatable; default: the "
                        "instruction data shipped for the draft's vocabulary)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from tokens already in the output")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per time a token is in the output")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides the logits of tokens seen in the prompt or output (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest one")
    p.add_argument("--min-tokens", type=int, default=0, help="no end of text before this many new tokens")
    p.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit (repeatable)")


def logit_bias(items: list[str]) -> dict[int, float]:
    out = {}
    for item in items:
        token, _, bias = item.partition("=")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise SpecdecodeError(f"--logit-bias {item}: write it as TOKEN_ID=BIAS, e.g. 13=-100") from None
    return out


def decoder_kwargs(args: argparse.Namespace) -> dict:
    """The model flags as SpecDecoder.load's arguments: the target and LoadOptions' fields."""
    from specdecode.api import LoadOptions

    return {"target": args.target} | {f.name: getattr(args, f.name) for f in dataclasses.fields(LoadOptions)
                                      if hasattr(args, f.name)}


def load_decoder(args: argparse.Namespace):
    from specdecode.api import SpecDecoder

    return SpecDecoder.load(**decoder_kwargs(args))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=list(getattr(args, "stop", None) or []),
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty, min_p=args.min_p, min_tokens=args.min_tokens,
                          logit_bias=logit_bias(args.logit_bias), logprobs=getattr(args, "logprobs", None))
