"""Preallocated key/value cache whose rollback is setting an absolute length.

Buffers are allocated once as [layers, batch, kv_heads, max_len, head_dim] (the layout attention reads without
a transpose). The model writes keys and values at explicit positions; the engine, never the model, decides how
many of them are valid by setting `length`. Rejected draft tokens are dropped by `truncate`, which moves no data:
the next forward simply overwrites them. Rows of a batch share one length for now; ragged batches would make
`length` per row.
"""

from __future__ import annotations

import torch

from specdecode.kernels import cpu_kernels

MAX_SLOT_COPIES = 8  # slots `keep` moves one by one; more go in one gather and scatter


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # number of valid positions, [0, length)
        self.cpu_native = native_cache(self.k)  # what the native decode layers take: asked once, not a forward
        self.cpu_contiguous = self.k.is_cpu  # what the native slot moves take (zeros: contiguous)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """An empty cache over existing buffers (a model's CUDA graphs lend theirs: graphs fix addresses)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.max_len, cache.length = k, v, k.shape[3], 0
        cache.cpu_native = native_cache(k)
        cache.cpu_contiguous = (k.is_cpu and v.is_cpu and k.is_contiguous() and v.is_contiguous()
                                and k.dtype == v.dtype and k.shape == v.shape)
        return cache

    def truncate(self, length: int) -> None:
        """Keep positions [0, length); everything after is garbage that the next write replaces."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cache length {length} outside [0, {self.max_len}]")
        self.length = length

    def keep(self, indices: list[int]) -> None:
        """Compact after a tree step: positions `indices` (ascending, absolute, all >= length) move to
        length, length+1, ... and become valid. A chain that keeps its prefix needs no call."""
        start = self.length
        moves = [(to, at) for to, at in enumerate(indices, start) if to != at]
        if moves and self.cpu_contiguous and (kernels := cpu_kernels()) is not None:
            # one native call: torch's index tensor and two copies per slot cost ~90 us on a step's flushed caches
            kernels.move_slots(self.k, self.v, [to for to, _ in moves], [at for _, at in moves])
        elif len(moves) <= MAX_SLOT_COPIES:  # a tree step moves a few slots: one copy each, no gather and scatter
            k, v = self.k.flatten(0, 2), self.v.flatten(0, 2)  # [layers * batch * heads, slots, head_dim] views
            for to, at in moves:
                k[:, to].copy_(k[:, at])
                v[:, to].copy_(v[:, at])
        else:
            source = torch.tensor(indices, device=self.k.device)
            dest = torch.arange(start, start + len(indices), device=self.k.device)
            self.k[:, :, :, dest] = self.k[:, :, :, source]
            self.v[:, :, :, dest] = self.v[:, :, :, source]
        self.length = start + len(indices)

    def grow(self, max_len: int) -> None:
        """Reallocate larger buffers, keeping the valid prefix (for caches sized lazily, like a drafter's)."""
        for name in ("k", "v"):
            old = getattr(self, name)
            # the same kind of tensor as before: grown inside a step (inference mode), a cache made outside it stays
            # writable outside it, where the next request that takes it (spare_cache.py) copies a prompt in
            with torch.inference_mode(old.is_inference()):
                new = old.new_zeros(*old.shape[:3], max_len, old.shape[4])
                new[:, :, :, : self.length] = old[:, :, :, : self.length]
            setattr(self, name, new)
        self.max_len = max_len

    def reset(self) -> None:
        self.length = 0


def bytes_per_token(model: torch.nn.Module) -> int | None:
    """Bytes of keys and values one token takes in `model`'s cache (None when its config does not say)."""
    try:
        config = model.config
        dtype = getattr(model, "cache_dtype", model.dtype)  # a model through transformers: its own dtype
        layers = len(getattr(config, "attention_layers", ())) or config.num_layers  # recurrent layers hold no keys
        return 2 * layers * config.num_kv_heads * config.head_dim * dtype.itemsize
    except AttributeError:
        return None


KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what --kv-dtype names
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16)  # caches the CPU kernels read and write


def native_cache(buffer: torch.Tensor) -> bool:
    return buffer.dtype in NATIVE_KV_DTYPES and buffer.device.type == "cpu"
