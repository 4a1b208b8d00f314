"""CPU linear layers on specdecode's kernels, applied from outside the model (`quantize_(model, "q4_k")`).

Decoding is memory-bound: every token reads every weight, so fewer bytes per weight is more tokens per second.
On CPU every linear layer runs on a native kernel:
  float weights (`none`): kernels/linear_cpu.cpp, the model's own float32 or bfloat16, no copy;
  block-quantized weights: GGUF's block types (blocks.py) against activations quantized per row to int8, integer
    dot products: kernels/quant_c16_*.cpp with 16 output channels per vector (repacked at load; one AVX-512
    VNNI register or two AVX2 halves), or kernels/quant_cpu.cpp one weight row at a time where the outputs are
    not a multiple of 16. A GGUF file's blocks run as
    stored (`apply_packed_`); a float checkpoint is written in Q8_0, Q4_0 or Q4_K by `--quantize` (`int8`, `int4`
    are older names for Q8_0 and Q4_K; Q4_0's 32-weight blocks fit input widths Q4_K's 256 do not, e.g. 896).
Every kernel keeps a verify forward over k + 1 tokens cheaper than k + 1 one-token forwards and computes every
row exactly as a one-token forward would, so speculation is lossless relative to the target as run.
Without the kernels (CUDA, CPUs without AVX2) `none` keeps PyTorch's nn.Linear and quantization is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.models.native import apply_native
from specdecode.weights.blocks import PackedWeight, mxfp4_as_q5_0, quantize_float

MODES = ("none", "q8_0", "q4_0", "q4_k")
SUPERBLOCK = {"q8_0": 32, "q4_0": 32, "q4_k": 256}  # the input dimension must be a whole number of these
ALIASES = {"int8": "q8_0", "int4": "q4_k"}
# w = d (code - offset) (MXFP4: its nibbles turned into codes first, blocks.py); Q4_1 and Q5_1 keep a min instead
LEGACY_OFFSETS = {"q4_0": 8, "q5_0": 16, "q8_0": 128, "mxfp4": 16}
# kernels.LinearOp kinds (kernels/layer_cpu.h)
OP_C16, OP_C16_LEGACY, OP_ROWS, OP_FP32, OP_BF16, OP_BF16_TILES, OP_F16 = range(7)
FLOAT_OPS = {torch.float32: OP_FP32, torch.bfloat16: OP_BF16, torch.float16: OP_F16}


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 matrix [N, K] in AMX tile layout [N / 16, K / 32, 16, 16, 2]: [u, t, p, c, j] = W[16 u + c,
    32 t + 2 p + j] (kernels/linear_bf16_tiles_cpu.cpp). The same values, moved."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def bf16_rows(tiles: torch.Tensor) -> torch.Tensor:
    """bf16_tiles' inverse: the matrix [N, K] again."""
    units, depth = tiles.shape[:2]
    return tiles.permute(0, 3, 1, 2, 4).reshape(units * 16, depth * 32)


class KernelLinear(nn.Module):
    """nn.Linear with float32, bfloat16 or float16 weights on the float kernels; float32 accumulation. A bfloat16
    matrix whose shape fits runs on AMX tiles where the CPU has them (kernels/linear_bf16_tiles_cpu.cpp): repacked
    once here, its row layout kept only where another module reads it (`shared`: a tied embedding), else given
    back as `weight` when asked for (rarely: cutting a head)."""

    def __init__(self, linear: nn.Linear, kernels, shared: bool = False) -> None:
        super().__init__()
        self.bias = linear.bias
        weight = linear.weight
        n, k = self.out_features, self.in_features = weight.shape
        self.tiles = None
        if weight.dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0 and kernels.bf16_tiles_on():
            self.tiles = bf16_tiles(weight)
            bias32 = self.bias.detach().float().contiguous() if self.bias is not None else torch.empty(0)
            self.op = kernels.LinearOp(OP_BF16_TILES, [self.tiles], bias32, [])
        else:
            linears = {OP_FP32: kernels.linear_fp32, OP_BF16: kernels.linear_bf16, OP_F16: kernels.linear_f16}
            self.linear = linears[FLOAT_OPS[weight.dtype]]
            # the native decoder layer's handle on this layer (model.py); it adds the bias as forward does
            self.op = kernels.LinearOp(FLOAT_OPS[weight.dtype], [weight.detach()], _bias_or_empty(self.bias), [])
        if self.tiles is None or shared:  # the same Parameter: tied embeddings stay tied, nothing is copied
            self._parameters["weight"] = weight

    @property
    def weight(self) -> torch.Tensor:
        kept = self._parameters.get("weight")
        return kept if kept is not None else bf16_rows(self.tiles)

    @property
    def weight_bytes(self) -> int:  # what a forward reads (without unpacking tiles to count them)
        read = self.tiles if self.tiles is not None else self._parameters["weight"]
        return read.numel() * read.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float().contiguous()
        if self.tiles is not None:  # the bias is added by the kernel, one float add per output as below
            return self.op(x2).view(*x.shape[:-1], -1).to(x.dtype)
        out = self.linear(x2, self.weight)  # [M, out] float32
        out = out.view(*x.shape[:-1], -1).to(x.dtype)
        return out + self.bias if self.bias is not None else out

    def forward_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As QuantLinear.forward_argmax (the bias in, as the kernel adds it)."""
        out, argmax = self.op.with_argmax(x.float().contiguous())
        return out, argmax


class HalfEmbedding(nn.Module):
    """Token embeddings kept in bfloat16 or float16 under float32 activations: the rows looked up are widened (exact),
    so the table costs half the memory of float32 and no bytes a token. `native`: the same lookup in a native decode
    forward."""

    def __init__(self, embedding: nn.Embedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = embedding.weight  # the same Parameter: a head tied to it stays tied
        self.dtype = dtype
        kernels = cpu_kernels() if self.weight.device.type == "cpu" else None
        usable = kernels is not None and dtype == torch.float32 and self.weight.shape[1] % 8 == 0
        self.native = kernels.TokenEmbedding(1, [self.weight.detach()], []) if usable else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.weight).to(self.dtype)


def widen_embedding_(model: nn.Module) -> nn.Module:
    """A native model's 16-bit embedding under float32 activations -> HalfEmbedding (in place)."""
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if type(embed) is nn.Embedding and embed.weight.dtype != model.dtype and embed.weight.dtype in FLOAT_OPS:
        inner.embed_tokens = HalfEmbedding(embed, model.dtype)
    return model


class QuantLinear(nn.Module):
    """A linear layer whose weight is a PackedWeight, on the integer kernels. Where the outputs are a multiple of
    16 the blocks are repacked once, at load, to 16 output channels per vector (kernels/quant_c16_*.cpp): fewer
    instructions per weight for one token, and a low cost for every further token in a forward. The row layout
    is then dropped unless `keep_rows` (a tied embedding still looks rows up in it)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, kernels, keep_rows: bool = False) -> None:
        super().__init__()
        f = self.format = packed.format
        self.bias = bias
        bias32 = bias.detach().float().contiguous() if bias is not None else torch.empty(0)
        self.out_features, self.in_features = packed.shape
        out_features = self.out_features
        c16 = out_features % 16 == 0  # the 16-channel kernels run wherever the kernels build
        if c16 and f.superblock == 256:
            self.tensors = tuple(kernels.repack_c16(*packed.tensors(), f.bits, f.group))
            kind, ints = OP_C16, [f.bits, f.group]
        elif c16:  # 32-weight blocks: w = d (code - offset), or d code - dmin for Q4_1 / Q5_1 (offset 0)
            offset = LEGACY_OFFSETS.get(f.name, 0)
            self.tensors = tuple(kernels.repack_c16_legacy(packed.qs, packed.qh, packed.d, packed.dmin, f.bits,
                                                           offset == 0))
            kind, ints = OP_C16_LEGACY, [f.bits, offset]
        else:
            if f.name == "mxfp4":  # blocks.py writes it so only where the outputs fill 16-channel vectors
                raise ValueError("MXFP4 blocks run on the 16-channel kernels only: outputs must be a multiple of 16")
            self.tensors = packed.tensors()
            kind, ints = OP_ROWS, [f.bits, f.superblock, f.group]
        self.op = kernels.LinearOp(kind, list(self.tensors), bias32, ints)  # the kernel and its arguments
        self.packed = packed if keep_rows or not c16 else None

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The fast path of a decode step: no conversions when x is already contiguous float32 rows (each tensor
        # call costs ~10 us on the caches a forward flushed).
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self.op(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        out = self.op(x2).view(*x.shape[:-1], -1)  # bias added by the kernel
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def forward_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, in] -> (outputs [M, out] float32, each row's argmax [M]: the first index of its largest output,
        found as the kernel writes them; [0] where a row holds a NaN)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.float().contiguous()
        out, argmax = self.op.with_argmax(x)
        return out, argmax


def _bias_or_empty(bias: torch.Tensor | None) -> torch.Tensor:
    return bias.detach() if bias is not None else torch.empty(0)


class QuantEmbedding(nn.Module):
    """Token embeddings kept in blocks: only the looked-up rows are de-quantized. On the CPU kernels that is one
    native call (kernels/embedding_cpu.cpp). Elsewhere the rows of the tokens of decode steps are kept (a few
    thousand, the most recent): de-quantizing one row takes ~20 small tensor operations, 50-300 us, a per-forward
    cost a small draft model felt, and text repeats its common tokens. A row is the same however it is computed:
    neither the kernel nor the cache changes a bit."""

    CACHED_ROWS = 2048  # ~7 MB for a 896-wide draft model, ~12 MB for a 1536-wide target
    FEW = 64  # lookups of at most this many rows use and fill the cache (a prompt's chunk does not)

    def __init__(self, packed: PackedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if packed.format.name == "mxfp4":  # the row lookup reads codes, not MXFP4's nibble table
            packed = mxfp4_as_q5_0(packed)
        self.packed = packed
        self.dtype = dtype
        self._rows: dict[int, torch.Tensor] = {}  # token -> its row, oldest first
        kernels = cpu_kernels() if packed.d.device.type == "cpu" else None
        self._native = None if kernels is None else kernels.embedding_rows
        # the same lookup inside a native decode forward (model.py), for rows in float32
        f = packed.format
        self.native = None if kernels is None or dtype != torch.float32 else kernels.TokenEmbedding(
            0, [packed.qs, packed.qh, packed.scales, packed.mins, packed.d, packed.dmin],
            [f.bits, f.superblock, f.group, int(f.sub_scales), int(f.has_min)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._native is not None and tokens.device.type == "cpu":
            p, f = self.packed, self.packed.format
            flat = tokens if tokens.dim() == 1 else tokens.reshape(-1)  # a decode forward's [N]: no call to reshape
            if flat.dtype != torch.long or not flat.is_contiguous():
                flat = flat.long().contiguous()
            rows = self._native(flat, p.qs, p.qh, p.scales, p.mins, p.d, p.dmin, f.bits, f.superblock, f.group,
                                f.sub_scales, f.has_min)
            if tokens.dim() != 1:
                rows = rows.view(*tokens.shape, -1)
            return rows if self.dtype == torch.float32 else rows.to(self.dtype)
        flat = tokens.reshape(-1)
        if flat.numel() > self.FEW:
            rows = self.packed.rows(flat).dequantize()  # [B * T, d]
            return rows.view(*tokens.shape, -1).to(self.dtype)
        ids = flat.tolist()
        cached = self._rows
        found = {t: cached.get(t) for t in ids}
        missing = [t for t, row in found.items() if row is None]
        if missing:
            fresh = self.packed.rows(torch.tensor(missing, device=flat.device)).dequantize().to(self.dtype)
            for token, row in zip(missing, fresh):
                found[token] = row = row.clone()  # its own storage: evicting it frees it
                if len(cached) >= self.CACHED_ROWS:
                    del cached[next(iter(cached))]
                cached[token] = row
        return torch.stack([found[t] for t in ids]).view(*tokens.shape, -1)


def resolve_mode(mode: str) -> str:
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        choices = ", ".join(MODES + tuple(ALIASES))
        raise SpecdecodeError(f"unknown quantization '{mode}': choose one of {choices}")
    return mode


def quantize_(model: nn.Module, mode: str) -> nn.Module:
    """Put every nn.Linear of a CPU `model` on a native kernel, in `mode`'s weight format, in place."""
    mode = resolve_mode(mode)
    kernels = _kernels_for(model, mode)
    if kernels is None:
        return model
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, HalfEmbedding))}
    # The parents only, not the layers: a list holding every nn.Linear would keep each float matrix alive beside
    # its repacked copy until the end (twice the model's memory at load).
    parents = [m for m in model.modules() if any(isinstance(c, nn.Linear) for c in m.children())]
    for parent in parents:
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            in_features = child.weight.shape[1]
            # a layer marked keep_float (a mixture of experts' router: its top-k choice) is never written in blocks
            if mode != "none" and in_features % SUPERBLOCK[mode] == 0 and not getattr(child, "keep_float", False):
                packed = quantize_float(child.weight, mode)
                setattr(parent, name, QuantLinear(packed, child.bias, kernels))
            elif child.weight.dtype in FLOAT_OPS and in_features % 8 == 0:  # odd shapes stay float
                setattr(parent, name, KernelLinear(child, kernels, shared=id(child.weight) in embeddings))
    return apply_native(model)  # its decode forwards in one native call where every layer is on a kernel


def apply_packed_(model: nn.Module, packed: dict[str, PackedWeight]) -> nn.Module:
    """Replace the linear layers and embedding named in `packed` (HF parameter names, '.weight' included)
    by their block-quantized forms; every other linear goes on the float kernel. In place. `packed` is emptied
    as it goes, so a layer's row layout can be freed as soon as it is repacked (peak memory: one copy, not two)."""
    kernels = _kernels_for(model, "stored")
    modules = dict(model.named_modules())
    shared = {id(w) for w in packed.values() if sum(other is w for other in packed.values()) > 1}
    while packed:
        name, weight = packed.popitem()
        owner = name.rpartition(".")[0]
        parent_name, _, child_name = owner.rpartition(".")
        module = modules[owner]
        if isinstance(module, nn.Embedding):
            replacement: nn.Module = QuantEmbedding(weight, model.dtype)
        else:  # a tied output matrix shares the embedding's blocks: keep their row layout for the lookups
            replacement = QuantLinear(weight, module.bias, kernels, keep_rows=id(weight) in shared)
        setattr(modules[parent_name] if parent_name else model, child_name, replacement)
    return quantize_(model, "none")


def _kernels_for(model: nn.Module, mode: str):
    on_cpu = not any(p.is_cuda for p in model.parameters())
    kernels = cpu_kernels() if on_cpu else None
    if kernels is None and mode != "none":
        where = "this CPU (it needs AVX2, FMA and a C++ compiler)" if on_cpu else "CUDA"
        raise SpecdecodeError(f"{mode} weights run on specdecode's CPU kernel, which is not available on {where}")
    return kernels
