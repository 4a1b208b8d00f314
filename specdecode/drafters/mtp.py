"""A drafter from the multi-token-prediction (MTP) layers a checkpoint ships beside its model (Qwen3-Next,
Qwen3.5: the `mtp.*` tensors), drafting a tree exactly as an EAGLE head does (drafters/eagle.py).

The MTP module pairs the target's final hidden state at position i with the embedding of the token at i + 1 and
predicts the token at i + 2: both normalised (their own norms), concatenated and brought back to the hidden size
by one linear layer (`fc`), then one decoder layer of the target's own kind (full gated attention, the MoE MLP with
its shared expert), a final norm, and the target's LM head. Deeper than one token it feeds its own output hidden
state, as the layer is applied again for each further depth. The embedding and the LM head are the target's (never
copied); the module's own attention layer keeps its own one-layer KV cache over the committed context.

The weights are read from the checkpoint when the method is asked for, not at every load: an HF folder's `mtp.*`
tensors, or a Qwen3-Next GGUF's `nextn` block (llama.cpp's converter keeps it after the others; as stored, on the
integer kernels). A file without them (a converted or re-saved checkpoint, most GGUFs) is said in one line
(`MissingMtp`).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdecode.config import ModelConfig
from specdecode.drafters.eagle import EagleDrafter
from specdecode.errors import SpecdecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.models.model import Block, RMSNorm, Transformer
from specdecode.models.parts import Segment
from specdecode.planner.tuning import HEAD_MIN_CONFIDENCE

PREFIX = "mtp."  # the tensors' prefix in a Hugging Face checkpoint
MTP_FAMILIES = ("qwen3_next",)  # the native families whose released checkpoints carry MTP layers
GGUF_MTP_ARCHITECTURES = ("qwen3next",)  # the GGUF architectures whose `nextn` block is read (gguf_qwen3next.py)


class MissingMtp(SpecdecodeError):
    """The model asked to draft with its MTP layers has none."""


@dataclass(frozen=True, slots=True)
class MtpShape:
    """What the tree-growing drafter reads of its head (EagleConfig's fields of the same names)."""

    hidden_size: int
    num_kv_heads: int
    head_dim: int
    num_features: int = 1  # the target's final hidden state alone


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """The target's config for its MTP layer: one full-attention layer, with experts where the target's layers
    have them."""
    return dataclasses.replace(config, num_layers=1, linear_layers=(), local_layers=(),
                               moe_layers=(0,) if config.moe_layers else ())


class MtpHead(nn.Module):
    """The MTP module (parameter names as in the checkpoint, less `mtp.`), over the target's embedding and head."""

    def __init__(self, target: Transformer) -> None:
        super().__init__()
        config = target.config
        d, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_unit_offset
        self.pre_fc_norm_embedding = RMSNorm(d, eps, offset)
        self.pre_fc_norm_hidden = RMSNorm(d, eps, offset)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([Block(mtp_layer_config(config), 0)])
        self.norm = RMSNorm(d, eps, offset)
        self.config = MtpShape(d, config.num_kv_heads, config.head_dim)
        self.target = [target]  # in a list: not a submodule (its weights are not this module's)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [T, d (+ more)] -> its final hidden state [T, d], what the module reads."""
        return features[:, : self.config.hidden_size].float()

    def new_cache(self, max_len: int, device: torch.device | str = "cpu") -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_kv_heads, max_len, c.head_dim, torch.float32, device)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             mask: torch.Tensor) -> torch.Tensor:
        """T rows (token embeddings [T, d] and the hidden states they follow [T, d]) into `cache` at slots
        [cache.length, +T), attending under `mask` [T, S] -> the module's output hidden states [T, d], normalised
        (what its LM head reads, and what a deeper depth feeds on)."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeds.float().contiguous()),
                               self.pre_fc_norm_hidden(hidden.float().contiguous())), dim=-1))[None]  # [1, T, d]
        T = x.shape[1]
        cos, sin = self.target[0]._rotary(positions[None], x.dtype)
        write = torch.arange(cache.length, cache.length + T, device=x.device)
        segment = Segment(0, T, cache, write, mask[None, None], None)
        block = self.layers[0]
        x = x + block.self_attn(block.input_layernorm(x), cos, sin, 0, [segment])
        x = x + block.mlp(block.post_attention_layernorm(x))
        return self.norm(x)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, vocab] through the target's LM head."""
        return self.target[0].lm_head(hidden).float()


class MtpDrafter(EagleDrafter):
    name = "mtp"

    def __init__(self, head: MtpHead, target: torch.nn.Module, width: int = 4, expand: int = 2,
                 max_depth: int = 8, min_confidence: float = HEAD_MIN_CONFIDENCE, clock=None) -> None:
        super().__init__(head, target, (), width, expand, max_depth, min_confidence, clock)

    @classmethod
    def load(cls, source: str | Path, target: torch.nn.Module, **kwargs) -> MtpDrafter:
        return cls(load_mtp_head(source, target), target, **kwargs)

    @property
    def head_tokens(self) -> None:
        return None  # the target's own head: every token

    @property
    def trained_weights(self) -> None:
        return None  # the checkpoint's own weights: nothing of ours to save or move

    def fork(self) -> MtpDrafter:
        return MtpDrafter(self.model, self.target, self.width, self.expand, self.max_depth, self.min_confidence,
                          self.clock)


def load_mtp_head(source: str | Path, target: torch.nn.Module) -> MtpHead:
    """The MTP module of the checkpoint `source` the target was loaded from: a Hugging Face folder or hub id (its
    `mtp.*` tensors, float32, on the target's device) or a Qwen3-Next GGUF (its `nextn` block as stored, on the
    integer kernels); MissingMtp where it carries none."""
    from specdecode.weights.files import resolve_source

    if not isinstance(target, Transformer):
        raise MissingMtp("--method mtp runs on the native model; this architecture runs through transformers")
    path = resolve_source(str(source))
    floats, packed = gguf_mtp_tensors(path) if path.is_file() else (read_mtp_tensors(path), {})
    if not floats and not packed:
        raise MissingMtp(gguf_lacks_mtp(path) if path.is_file() else folder_lacks_mtp(source))
    with torch.device("meta"):  # no random init of weights replaced at once (an 80B model's layer has 512 experts)
        head = MtpHead(target)
    head.load_state_dict(floats, strict=False, assign=True)
    if packed:
        from specdecode.weights.quantize import apply_packed_

        apply_packed_(head, packed)  # its blocks on the integer kernels, as the target's
    if missing := [name for name, p in head.named_parameters() if p.is_meta]:
        raise MissingMtp(f"{source}'s multi-token-prediction layers lack {len(missing)} weights (first: "
                         f"{PREFIX}{missing[0]}): the checkpoint is incomplete")
    head = head.to(target.device)
    if target.device.type == "cpu" and not packed:
        from specdecode.weights.quantize import quantize_

        quantize_(head, "none")  # its linear layers on the CPU kernels, as the target's
    return head.eval()


def gguf_mtp_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """A GGUF's MTP block as the stored reader keeps it (weights/gguf_qwen3next.py): (float tensors, blocks), named
    as the module's parameters; empty where it has none."""
    if not gguf_reads_mtp(path):
        return {}, {}
    from specdecode.weights.gguf_stored import load_stored

    ckpt = load_stored(path)
    floats = {name[len(PREFIX) :]: t.float() for name, t in ckpt.floats.items() if name.startswith(PREFIX)}
    packed = {name[len(PREFIX) :]: w for name, w in ckpt.packed.items() if name.startswith(PREFIX)}
    return floats, packed


def check_mtp_source(source: str) -> None:
    """Before any model loads: MissingMtp where `source` is a local GGUF file or a local folder without MTP layers.
    A hub id or packaged name is checked once loaded (load_mtp_head)."""
    path = Path(source).expanduser()
    if path.is_file() and not gguf_reads_mtp(path):
        raise MissingMtp(gguf_lacks_mtp(path))
    if path.is_dir() and (path / "config.json").is_file() and not carries_mtp(path):
        raise MissingMtp(folder_lacks_mtp(source))


def gguf_reads_mtp(path: Path) -> bool:
    """Whether a GGUF's MTP block is one this version reads: Qwen3-Next's (llama.cpp keeps it as a `nextn` block
    after the others)."""
    from specdecode.weights.files import gguf_architecture

    # the header's architecture first: a file of another family is never parsed whole
    return gguf_architecture(path) in GGUF_MTP_ARCHITECTURES and gguf_nextn_layers(path) > 0


def gguf_lacks_mtp(path: Path) -> str:
    """Why a GGUF file gives no MTP drafter: it has no `nextn` block (most files), or one of a family not read."""
    if gguf_nextn_layers(path):
        return (f"{path.name} carries multi-token-prediction layers (`nextn` blocks) of a family whose MTP layers "
                f"specdecode does not read (it reads {', '.join(GGUF_MTP_ARCHITECTURES)}'s): pick another --method")
    return (f"{path.name} carries no multi-token-prediction layers (no `nextn` blocks: its family has none, or its "
            "conversion left them out): pick another --method")


def gguf_nextn_layers(path: Path) -> int:
    """The file's `<arch>.nextn_predict_layers`, 0 where it has none or cannot be read."""
    try:
        import gguf

        fields = gguf.GGUFReader(path).fields
    except Exception:  # not a GGUF the reader takes: the load says so, in its own words
        return 0
    field = next((f for name, f in fields.items() if name.endswith(".nextn_predict_layers")), None)
    return int(field.parts[field.data[0]][0]) if field is not None else 0


def folder_lacks_mtp(source: str | Path) -> str:
    return (f"{source} carries no multi-token-prediction layers (no `mtp.*` tensors; a converted or re-saved "
            "checkpoint may have dropped them): pick another --method")


def read_mtp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The `mtp.*` tensors of an HF folder, prefix removed, in float32; only the files that hold them are opened,
    and only those tensors read."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / f for name, f in json.loads(index.read_text())["weight_map"].items()
                        if name.startswith(PREFIX)})
    else:
        files = sorted(folder.glob("*.safetensors"))
    out = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    out[name[len(PREFIX) :]] = f.get_tensor(name).float()
    return out


def ships_mtp(target: str) -> bool | None:
    """True where `target` is a local HF folder or GGUF carrying MTP layers this version reads, False where its
    family ships them and it does not (converted or re-saved without), None otherwise (not a local file or folder, or
    a family without them). Reads names and headers only."""
    folder = Path(target).expanduser()
    if folder.is_file():
        from specdecode.weights.files import gguf_architecture

        try:
            if gguf_reads_mtp(folder):
                return True
            return False if gguf_architecture(folder) in GGUF_MTP_ARCHITECTURES else None
        except (OSError, ValueError, struct.error):  # not a GGUF: the load says so, in its own words
            return None
    if not (folder / "config.json").is_file():
        return None
    if carries_mtp(folder):
        return True
    family = json.loads((folder / "config.json").read_text()).get("model_type")
    return False if family in MTP_FAMILIES else None


def carries_mtp(folder: Path) -> bool:
    """Whether an HF folder's weights hold MTP layers (names only; nothing is read)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return any(name.startswith(PREFIX) for name in json.loads(index.read_text())["weight_map"])
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            if any(name.startswith(PREFIX) for name in f.keys()):
                return True
    return False


__all__ = ["MissingMtp", "MtpDrafter", "MtpHead", "carries_mtp", "check_mtp_source", "load_mtp_head", "ships_mtp"]
