"""Command line: `specdecode generate | models` (more subcommands register in `build_parser`).

Errors a user can fix (SpecdecodeError) print as one line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET, DRAFT_SHAPES, default_shape
from specdecode.config import SamplingParams
from specdecode.drafters import DRAFTERS
from specdecode.errors import SpecdecodeError
from specdecode.vocab_subset import DEFAULT_HEAD_SIZE

ACCEPTED_COLOR, RESET = "\033[32m", "\033[0m"  # green: tokens the drafter guessed and the target accepted


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Model and drafter options shared by generate, serve and bench."""
    p.add_argument("--target", default=DEFAULT_TARGET, help="packaged name, HF hub id, HF folder or .gguf file")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for --method draft (same tokenizer)")
    p.add_argument("--method", default="draft", choices=list(DRAFTERS), help="how tokens are drafted")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="draft tokens verified per step (default: chosen each step from what a verify forward "
                        "costs on this machine, measured once and cached)")
    p.add_argument("--draft-shape", default=None, choices=list(DRAFT_SHAPES),
                   help="tree: several guesses per position, verified at once; chain: one guess per position "
                        "(default: chain for draft, tree for ngram)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_weight_args(p)
    p.add_argument("--max-len", type=int, default=8192, help="context window to allocate (tokens)")


def add_weight_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="auto", choices=["auto", "stored", "float"],
                   help="stored: run a GGUF file's quantized blocks as they are (CPU kernel); float: de-quantize "
                        "to --dtype (auto: stored for GGUF files on CPU)")
    p.add_argument("--quantize", default="none", choices=["none", "q8_0", "q4_k", "int8", "int4"],
                   help="write a float target's weights in blocks (int8 = q8_0, int4 = q4_k); the output is "
                        "exact for that target")
    p.add_argument("--draft-quantize", default="auto", choices=["auto", "none", "q8_0", "q4_k", "int8", "int4"],
                   help="blocks for a float draft model: changes speed only, never the output "
                        "(auto: a GGUF draft as stored, a float one in q8_0 on CPU)")
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


def load_decoder(args: argparse.Namespace):
    from specdecode.api import SpecDecoder

    return SpecDecoder.load(args.target, draft=args.draft, method=args.method,
                            num_draft_tokens=args.num_draft_tokens, dtype=args.dtype, device=args.device,
                            max_len=args.max_len, quantize=args.quantize, draft_quantize=args.draft_quantize,
                            weights=args.weights, draft_shape=args.draft_shape, draft_vocab=args.draft_vocab,
                            draft_vocab_corpus=args.draft_vocab_corpus)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, stop=list(getattr(args, "stop", None) or []))


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate before the slow model load
    decoder = load_decoder(args)
    if args.json:
        result = decoder.generate(args.prompt, params, chat=args.chat)
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "method": args.method, "stats": result.stats.to_dict()}
        print(json.dumps(out))
        return 0
    color = sys.stdout.isatty()
    for chunk in decoder.stream(args.prompt, params, chat=args.chat):
        for piece, drafted in zip(chunk.pieces, chunk.from_draft):
            sys.stdout.write(f"{ACCEPTED_COLOR}{piece}{RESET}" if color and drafted and piece else piece)
        sys.stdout.flush()
    s = decoder.stats
    shape = f" {args.draft_shape or default_shape(args.method)}" if args.method != "none" else ""
    print(f"\n\n[{args.method}{shape}] {s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.2f} tok/s), "
          f"mean accepted length {s.mean_accepted_length:.2f}, draft tokens verified per step "
          f"{s.nodes_per_step:.1f} ({s.draft_budget}), acceptance {s.acceptance_rate:.1%}, "
          f"TTFT {s.ttft_s * 1000:.0f} ms" + (" — green: accepted draft tokens" if color else ""),
          file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specdecode import hub

    if args.action == "pull":
        for name in args.names:
            print(hub.pull(name))
        return 0
    for info in hub.list_models():
        state = str(info.path) if info.pulled else "not pulled (specdecode models pull NAME)"
        print(f"{info.name:32s} {info.description}\n{'':32s} {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or pull the packaged models")
    models.add_argument("action", choices=["list", "pull"])
    models.add_argument("names", nargs="*")
    models.set_defaults(func=cmd_models)

    from specdecode.bench.cli import add_parser as add_bench_parser  # imported here: it imports this module

    add_bench_parser(sub)

    from specdecode.server.cli import add_parser as add_serve_parser  # imported here: it imports this module

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecdecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
