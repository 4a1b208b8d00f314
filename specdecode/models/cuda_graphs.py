"""A lone sequence's decode and verify forwards replayed as CUDA graphs.

On a GPU an eager forward of a small batch spends most of its time launching kernels from Python: an 8B-shaped
target took 32 ms a token eager and 8.5 ms replayed as a CUDA graph on an H100 (BENCHMARKS.md). A graph fixes
every tensor's address and shape, so a forward is captured once per shape and replayed with its inputs copied
into static buffers:
- rows are padded to a power of two (1 ... 64): a draft of 5 nodes runs the 8-row graph;
- attention reads the cache up to a power of two of slots (256 ... the cache's length) under a mask, not up to
  the sequence's length, which changes every step;
- the cache is one of a few the model lends (`new_cache`), kept for the process, so a graph captured for one
  request serves the next.
The graphs are captured again if the model's weights move or a layer is replaced (their addresses are baked in).
Padded rows attend to slot 0 and write their keys past the sequence's valid slots, which the next step
overwrites. Forwards that do not fit (several sequences at once, a prompt, more than 64 rows, a cache not lent
by the model) run eagerly, as before.

`capture=False` runs the same static-buffer forwards without graphs: what a CPU-only test can check.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from specdecode.models.kv_cache import KVCache
from specdecode.models.native import module_edits
from specdecode.models.parts import row_slots, rows_mask

MAX_ROWS = 64  # rows of the largest graph; a forward of more runs eagerly
MIN_SLOTS = 256  # the narrowest attention window a graph reads
LENT_CACHES = 2  # caches a model lends at once: a lone request's, and its successor's while the first is freed
MAX_GRAPHS = 96  # captures per model; a shape beyond them runs eagerly
WARMUPS = 2  # eager runs on a side stream before a capture (cuBLAS and the allocator settle), as PyTorch asks


def use_graphs(model: torch.nn.Module, on: bool = True, capture: bool = True, cache_len: int | None = None,
               rows_apart: bool = False) -> None:
    """Replay a lone sequence's decode and verify forwards of a native `model` as CUDA graphs, over caches the
    model lends (`new_cache`, `cache_len` slots each: an engine's context window). `capture=False` runs the same
    static-buffer forwards eagerly (a check on the CPU). `rows_apart`: attention one row at a time in the graphs
    (a verify row's attention is then the one-token forward's wherever both read the same window)."""
    graphs = model.graphs
    if not on or model.config.linear_layers:  # recurrent states live outside the graphs' static caches: eager
        model.graphs = None
    elif capture and model.device.type != "cuda":
        raise ValueError(f"CUDA graphs need the model on a CUDA device, not {model.device}")
    elif (graphs is None or graphs.capture != capture or graphs.mask_rows != rows_apart
          or cache_len is not None and graphs.cache_len != min(cache_len, model.max_context)):
        module_edits.install()  # a replaced layer moves weights the graphs baked in: they are captured again
        model.graphs = GraphedForwards(model, capture, cache_len, rows_apart)


def bucket(n: int, low: int = 1) -> int:
    """The smallest power of two >= max(n, low)."""
    return 1 << (max(n, low) - 1).bit_length()


@dataclass
class Captured:
    """One shape's static inputs, its outputs (refilled at every replay) and its graph (None: run eagerly)."""

    tokens: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    start: torch.Tensor  # [1]: the cache's length, where row 0 writes
    mask: torch.Tensor  # [rows, slots] bool
    last: torch.Tensor  # [1]: the row whose logits a last-row graph computes
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    graph: object | None = None


class GraphedForwards:
    """The graphs of one model, and the caches they write into."""

    def __init__(self, model: torch.nn.Module, capture: bool = True, cache_len: int | None = None,
                 rows_apart: bool = False) -> None:
        self.model = model
        self.capture = capture
        self.mask_rows = rows_apart
        self.cache_len = min(cache_len or 8192, model.max_context)
        self.free: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.owned: set[int] = set()  # id() of the key buffer of every cache made here (a grown cache has new ones)
        self.shapes: dict[tuple, Captured] = {}
        self.weights: tuple = ()  # where the model's parameters were when the shapes were captured
        self.edits = -1  # module_edits.count then
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        if capture:
            with torch.cuda.device(model.device):
                self.stream = torch.cuda.Stream()

    # --- caches ----------------------------------------------------------------------------------------------

    def new_cache(self, max_len: int) -> KVCache | None:
        """A cache of `cache_len` slots whose buffers the graphs know, or None (too long, or all lent)."""
        if max_len > self.cache_len:
            return None
        if self.free:
            k, v = self.free.pop()
        elif len(self.owned) < LENT_CACHES:
            with torch.inference_mode(False):  # plain tensors: a buffer lent again may be written outside that mode
                fresh = self.model.new_cache(1, self.cache_len, lend=False)
            k, v = fresh.k, fresh.v
            self.owned.add(id(k))
        else:
            return None
        cache = KVCache.over(k, v)
        # Back to the free list when the cache object goes (its sequence or drafter ended).
        weakref.finalize(cache, self.free.append, (k, v))
        return cache

    def knows(self, cache: KVCache) -> bool:
        return id(cache.k) in self.owned

    # --- forwards --------------------------------------------------------------------------------------------

    def run(self, part, feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`part`'s forward through a graph -> (logits, hidden) as `forward_parts` gives them, or None where it
        must run eagerly."""
        count, cache = part.count, part.cache
        if not part.decode or count > MAX_ROWS or not self.knows(cache) or torch.is_grad_enabled():
            return None
        rows = bucket(count)
        start = cache.length
        if start + rows > cache.max_len:
            return None
        slots = min(bucket(start + rows, MIN_SLOTS), cache.max_len)
        last_only = count > 1 and part.logits_from == count - 1
        self._check_weights()
        key = (id(cache.k), rows, slots, last_only, tuple(feature_layers))
        shape = self.shapes.get(key)
        if shape is None:
            if len(self.shapes) >= MAX_GRAPHS:
                return None
            shape = self.shapes[key] = self._static(rows, slots)
        self._fill(shape, part, count, start)
        if shape.graph is not None:
            shape.graph.replay()
        elif self.capture:
            try:
                self._capture(shape, cache, last_only, feature_layers)
            except BaseException:
                del self.shapes[key]  # not left half-made: the next forward of this shape captures afresh
                raise
            shape.graph.replay()
        else:
            self._forward(shape, cache, last_only, feature_layers)
        # Copies: the next replay of this graph overwrites its outputs, and a sequence may keep its hidden states.
        logits = shape.logits if last_only else shape.logits[part.logits_from : count]
        return logits.clone(), shape.hidden[:count].clone()

    def _check_weights(self) -> None:
        """Drop every shape if the model's parameters moved (`.to()`, a layer replaced): a graph replays the
        addresses it was captured with. Compared in full only after a module was assigned somewhere or one of two
        sentinels moved, which is cheap to see."""

        sentinels = (self.model.lm_head.weight.data_ptr(), self.model.model.norm.weight.data_ptr())
        if self.edits == module_edits.count and self.weights[:2] == sentinels:
            return
        weights = sentinels + tuple(p.data_ptr() for p in self.model.parameters())
        if weights != self.weights:
            self.shapes.clear()
            self.weights = weights
        self.edits = module_edits.count

    def _static(self, rows: int, slots: int) -> Captured:
        device = self.model.device
        zeros = lambda *size: torch.zeros(*size, dtype=torch.long, device=device)  # noqa: E731
        with torch.inference_mode(False):  # plain tensors: filled in whatever mode the next forward runs
            return Captured(zeros(rows), zeros(rows), zeros(1),
                            torch.zeros(rows, slots, dtype=torch.bool, device=device), zeros(1))

    def _fill(self, shape: Captured, part, count: int, start: int) -> None:
        """The part's rows into the static inputs; padded rows keep stale tokens and positions (any are valid)."""
        shape.tokens[:count].copy_(part.tokens)
        shape.positions[:count].copy_(part.positions)
        shape.start.fill_(start)
        shape.last.fill_(count - 1)

        rows, slots = shape.mask.shape
        given = rows_mask(part.rows if part.rows is not None else row_slots(part.mask()))[0, 0]  # [count, <= slots]
        mask = torch.zeros(rows, slots, dtype=torch.bool)
        mask[:count, : given.shape[1]] = given
        mask[count:, 0] = True  # a padded row sees slot 0
        shape.mask.copy_(mask)

    def _forward(self, shape: Captured, cache: KVCache, last_only: bool,
                 feature_layers: tuple[int, ...]) -> None:
        """The forward over the static inputs; its outputs become the shape's (what a capture records)."""
        rows = shape.tokens.numel()
        write_pos = shape.start + torch.arange(rows, device=shape.start.device)
        shape.logits, shape.hidden = self.model.static_forward(
            shape.tokens, shape.positions, write_pos, shape.mask, cache, shape.last if last_only else None,
            feature_layers, self.mask_rows)

    def _capture(self, shape: Captured, cache: KVCache, last_only: bool,
                 feature_layers: tuple[int, ...]) -> None:
        with torch.cuda.device(self.model.device):
            # Warm-ups write the same keys and values the replay will: into slots past the valid ones.
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(WARMUPS):
                    self._forward(shape, cache, last_only, feature_layers)
            torch.cuda.current_stream().wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            # One pool for a model's graphs: they replay one at a time, and each replay's outputs are copied at once.
            with torch.cuda.graph(graph, pool=self.pool):
                self._forward(shape, cache, last_only, feature_layers)
        shape.graph = graph
