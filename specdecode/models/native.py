"""The native decode stack applied to a model from outside (`apply_native(model)`): once every decoder layer's linear
layers are on the CPU kernels (weights/quantize.py), a decode or verify forward runs the embedding lookup, every
layer and the final norm in one native call (kernels/layer_cpu.h, DecoderStack), the same operations as the
model's Python loop. The model asks `stack(segments)` each forward and falls back to that loop where it answers None.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.kernels import cpu_kernels
from specdecode.models.parts import Segment, ids_and_positions


class ModuleEdits:
    """Counts module assignments anywhere in the process (torch's global registration hook: setattr, ModuleList
    items, register_module). A decode forward checks its native layers against the linear modules only after
    one: looking the 168 modules up every forward cost 50-90 us, the caches cold after the weights streamed by.
    The hook is installed when the first model takes the native stack, not at import."""

    def __init__(self) -> None:
        self.count = 0
        self.installed = False

    def install(self) -> None:
        if not self.installed:
            torch.nn.modules.module.register_module_module_registration_hook(self._saw)
            self.installed = True

    def _saw(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        self.count += 1


module_edits = ModuleEdits()


def apply_native(model: nn.Module) -> nn.Module:
    """Give a native model (models/model.py) the native decode stack, in place; other models are left as they are."""
    if hasattr(model, "native") and model.native is None:
        module_edits.install()
        model.native = NativeDecode(model)
    return model


class NativeDecode:
    """One model's native decode stack, built from its linear layers and rebuilt if one is replaced."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._built: tuple[tuple, object | None] = ((), None)  # (the linear modules it was built from, the stack)
        self._edits = -1  # module_edits.count when the linear modules were last compared
        self._embed: tuple[torch.Tensor, object | None, int] | None = None  # (a float embedding's weight, its
        # native lookup, the weight's storage), for embedding

    @property
    def built(self):
        """The stack as last built (None: the Python loop runs)."""
        return self._built[1]

    def forward(self, native, tokens: torch.Tensor | list[int], positions: torch.Tensor | list[int],
                segments: list[Segment], feature_layers: tuple[int, ...]) -> torch.Tensor:
        """Decode rows tokens, positions [N] (tensors or lists) through the embedding, every layer and the final
        norm in one native call (the same operations as the loop in _layers) -> hidden [N, d (+ features)]."""
        # every position is below its cache's length after the forward: no max over the positions (a host read)
        bound = max(s.cache.length + s.end - s.begin for s in segments)
        rows = cpu_kernels().DecodeRows(
            [s.begin for s in segments], [s.end for s in segments], [s.cache.length for s in segments],
            [s.rows.spans for s in segments], [s.rows.extras for s in segments],
            [s.cache.k for s in segments], [s.cache.v for s in segments])  # fmt: skip
        embed = self.model.model.embed_tokens
        if (looked_up := self.embedding(embed)) is not None:  # the lookups in the same call
            cos, sin = self.model.rotary_tables(torch.float32, bound)
            forward = native.forward_id_lists if isinstance(tokens, list) else native.forward_ids
            return forward(tokens, positions, looked_up, cos, sin, rows, list(feature_layers))
        if isinstance(tokens, list):
            tokens, positions = ids_and_positions(tokens, positions, "cpu")
        x = embed.forward(tokens)  # [N, d] (as the head: no module call)
        cos, sin = self.model.rotary_rows(positions, x.dtype, bound)  # [N, hd] each
        return native.forward(x, cos, sin, rows, list(feature_layers))

    def embedding(self, embed: nn.Module):
        """`embed` as the native stack looks rows up (kernels.TokenEmbedding), the same bits as its own forward,
        or None where the stack cannot: a weight in blocks on the kernel (quantize.QuantEmbedding.native) or a
        float32 nn.Embedding on the CPU. Made once per embedding and weight."""
        if (native := getattr(embed, "native", None)) is not None:
            return native
        if type(embed) is not nn.Embedding:
            return None
        weight = embed.weight
        made = self._embed
        if made is not None and made[0] is weight and made[2] == weight.data_ptr():  # .to() swaps a weight's data
            return made[1]
        usable = (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
                  and embed.padding_idx is None and embed.max_norm is None)
        looked_up = cpu_kernels().TokenEmbedding(1, [weight.detach()], []) if usable else None
        self._embed = (weight, looked_up, weight.data_ptr())
        return looked_up

    def stack(self, segments: list[Segment]):
        """The decoder layers and the final norm as one native decode step (kernels/layer_cpu.h, DecoderStack), or
        None where the Python loop must run:
        a prefill segment, a cache neither float32 nor bfloat16 on the CPU (caches are made in the model's dtype and device: the
        model's own attributes cost ~20 us a forward to read on flushed caches; the cache says once), or a linear
        layer that is not on a kernel (a LoRA adapter, for one). Built once and rebuilt if a layer is replaced."""
        for s in segments:
            if s.rows is None or not s.cache.cpu_native:
                return None
        if self._edits != module_edits.count:  # a module was assigned somewhere since the last check
            linears = self._linear_modules()
            if linears != self._built[0]:
                self._built = (linears, self._build_native(linears))
            self._edits = module_edits.count
        return self._built[1]

    def _linear_modules(self) -> tuple[nn.Module, ...]:
        """Every decoder layer's seven linear modules, in order (dictionary lookups: this runs after module edits)."""
        found: list[nn.Module] = []
        for block in self.model.model.layers._modules.values():
            mixer = block._modules.get("self_attn", block._modules.get("linear_attn"))  # gated DeltaNet: no q_proj
            attn, mlp = mixer._modules, block._modules["mlp"]._modules
            # an experts layer (models/experts.py) has none of the three: None, and the stack is not built
            found += (attn.get("q_proj"), attn.get("k_proj"), attn.get("v_proj"), attn.get("o_proj"),
                      mlp.get("gate_proj"), mlp.get("up_proj"), mlp.get("down_proj"))  # fmt: skip
        return tuple(found)

    def _build_native(self, linears: tuple[nn.Module, ...]):
        kernels, c = cpu_kernels(), self.model.config
        if kernels is None or c.hidden_size % 8 or c.head_dim % 8 or c.intermediate_size % 8:
            return None
        if not c.llama_layers:  # the stack implements the llama layer only (Gemma's run the Python loop)
            return None
        ops = [getattr(linear, "op", None) for linear in linears]
        norms = [p for name, p in self.model.model.layers.named_parameters() if name.endswith("norm.weight")]
        if any(op is None for op in ops) or any(p.dtype != torch.float32 for p in norms):
            return None
        none = torch.empty(0)
        layers = []
        for i, block in enumerate(self.model.model.layers):
            attn = block.self_attn
            q_norm, k_norm = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if attn.qk_norm else (none, none)
            layers.append(kernels.DecoderLayer(
                i, attn.num_heads, attn.num_kv_heads, attn.head_dim, block.input_layernorm.eps,
                block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach(), q_norm, k_norm,
                *ops[7 * i : 7 * i + 7]))  # fmt: skip
        norm = self.model.model.norm
        if norm.weight.dtype != torch.float32:
            return None
        return kernels.DecoderStack(layers, norm.weight.detach(), norm.eps)
