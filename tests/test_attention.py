"""Decode attention: the kernel's per-row attention equals the stock one, and the decode path (kernel or the
per-row fallback) computes every row, chain or tree, exactly as a one-token forward of its path."""

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_native

from specdecode.kernels import cpu_kernels
from specdecode.models import model as model_module
from specdecode.models.masks import chain_mask, depths, tree_mask
from specdecode.weights.quantize import quantize_

kernels = cpu_kernels()


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 16), (14, 2, 64), (12, 1, 128), (2, 2, 40),
                                                    (10, 2, 48)])
def test_kernel_attention_matches_sdpa(dtype, heads, kv_heads, dim):
    """Query heads per KV head odd and even, fewer and more than one group of the kernel's (three pairs of heads
    for the scores, six heads for the values): the 0.5B draft's 14 / 2 heads of 64, the 1.5B's 12 / 2 of 128; one
    head a KV head, and head sizes with an eight-lane tail."""
    torch.manual_seed(0)
    slots = 40
    q = torch.randn(1, heads, 4, dim)
    k, v = torch.randn(1, kv_heads, slots, dim).to(dtype), torch.randn(1, kv_heads, slots, dim).to(dtype)
    spans = [21, 22, 23, 24]  # a prefix of 20 cached slots, then a chain of 4 new tokens
    out = kernels.decode_attention(q, k, v, spans)
    for t, span in enumerate(spans):
        ref = F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, :span].float(), v[:, :, :span].float(),
                                             enable_gqa=True)
        assert torch.allclose(out[:, :, t : t + 1], ref, atol=1e-5)
    with pytest.raises(RuntimeError, match="span"):
        kernels.decode_attention(q, k, v, [0, 1, 2, 3])


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
def test_rope_store_rounds_into_a_bfloat16_cache_as_torch_does():
    """The glue writes rotated keys and values into a bfloat16 cache rounded to nearest even, as torch's
    conversion of the float32 cache's rows; the rotated queries it returns are the same."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 5, 6, 16), torch.randn(1, 5, 2, 16) * 1e3, torch.randn(1, 5, 2, 16)
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    wide = [torch.zeros(1, 2, 12, 16), torch.zeros(1, 2, 12, 16)]
    narrow = [torch.zeros(1, 2, 12, 16, dtype=torch.bfloat16), torch.zeros(1, 2, 12, 16, dtype=torch.bfloat16)]
    q_wide = kernels.rope_store(q, k, v, cos, sin, *wide, torch.tensor([4]))
    q_narrow = kernels.rope_store(q, k, v, cos, sin, *narrow, torch.tensor([4]))
    assert torch.equal(q_wide, q_narrow)
    assert torch.equal(wide[0].bfloat16(), narrow[0]) and torch.equal(wide[1].bfloat16(), narrow[1])
    # a bfloat16 cache attends as a float32 cache holding the same values
    out = kernels.decode_attention(q_narrow, *narrow, [5, 6, 7, 8, 9])
    assert torch.equal(out, kernels.decode_attention(q_narrow, narrow[0].float(), narrow[1].float(), [5, 6, 7, 8, 9]))


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("use_kernel", [True, False])
def test_decode_rows_equal_one_token_forwards(monkeypatch, use_kernel, kv_dtype):
    if use_kernel and kernels is None:
        pytest.skip("no native CPU kernel here")
    if not use_kernel:  # the path CUDA and CPUs without AVX2 take: one stock attention call per row
        monkeypatch.setattr(model_module, "cpu_kernels", lambda: None)
    model = tiny_native("llama", seed=3)
    model.kv_dtype = kv_dtype
    if use_kernel:
        model = quantize_(model, "none")  # linear layers on the kernel too: only there are they batch-invariant
    tokens = torch.tensor([[7, 3, 9, 1, 4, 4, 2, 8]])
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        model(tokens[:, :3], torch.arange(3)[None], cache, chain_mask(0, 3))
        cache.truncate(3)
        batch, _ = model(tokens[:, 3:], torch.arange(3, 8)[None], cache, chain_mask(3, 5), decode=True)
        for j in range(5):
            cache.truncate(3 + j)
            one, _ = model(tokens[:, 3 + j : 4 + j], torch.tensor([[3 + j]]), cache, chain_mask(3 + j, 1),
                           decode=True)
            if use_kernel:
                assert torch.equal(batch[0, j], one[0, 0])
            else:
                assert torch.allclose(batch[0, j], one[0, 0], atol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_tree_rows_equal_one_token_forwards_of_their_paths(monkeypatch, use_kernel):
    """Each tree node attends over the prefix and then its ancestors, scattered in the cache, exactly as a
    one-token forward of its path does over contiguous slots; after `keep` the cache is the path's."""
    if use_kernel and kernels is None:
        pytest.skip("no native CPU kernel here")
    if not use_kernel:
        monkeypatch.setattr(model_module, "cpu_kernels", lambda: None)
    model = tiny_native("qwen2", seed=5)
    if use_kernel:
        model = quantize_(model, "none")
    same = torch.equal if use_kernel else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    prefix, root = [7, 3, 9], 1
    parents = torch.tensor([-1, -1, 0, 1, 2, 0])
    tokens = torch.tensor([4, 5, 6, 2, 8, 11])
    with torch.inference_mode():
        cache = model.new_cache(1, 32)
        model(torch.tensor([prefix]), torch.arange(3)[None], cache, chain_mask(0, 3))
        cache.truncate(3)
        ids = torch.cat((torch.tensor([root]), tokens))[None]
        positions = (3 + torch.cat((torch.zeros(1, dtype=torch.long), depths(parents))))[None]
        tree, _ = model(ids, positions, cache, tree_mask(3, parents), decode=True)
        for node in range(len(tokens)):
            path = [node]
            while parents[path[-1]] >= 0:
                path.append(int(parents[path[-1]]))
            chain = [root] + tokens[path[::-1]].tolist()
            plain = model.new_cache(1, 32)
            model(torch.tensor([prefix]), torch.arange(3)[None], plain, chain_mask(0, 3))
            plain.truncate(3)
            for j, token in enumerate(chain):  # one-token forwards, as plain decoding runs them
                one, _ = model(torch.tensor([[token]]), torch.tensor([[3 + j]]), plain, chain_mask(3 + j, 1),
                               decode=True)
                plain.truncate(4 + j)
            assert same(tree[0, node + 1], one[0, 0])
        # Keep the path root -> 1 -> 3: its rows move behind the prefix, as a plain decode would have written them.
        cache.truncate(4)
        cache.keep([5, 7])
        assert cache.length == 6
        ref = model.new_cache(1, 32)
        model(torch.tensor([prefix]), torch.arange(3)[None], ref, chain_mask(0, 3))
        ref.truncate(3)
        for j, token in enumerate([root, 5, 2]):
            model(torch.tensor([[token]]), torch.tensor([[3 + j]]), ref, chain_mask(3 + j, 1), decode=True)
            ref.truncate(4 + j)
        assert same(cache.k[:, :, :, :6], ref.k[:, :, :, :6]) and same(cache.v[:, :, :, :6], ref.v[:, :, :, :6])


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
def test_kernel_attention_extra_slots_match_gathered_sdpa():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 2, 8)
    k, v = torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8)
    out = kernels.decode_attention(q, k, v, [10, 12], [[14, 20], []])
    for t, slots in enumerate([list(range(10)) + [14, 20], list(range(12))]):
        ref = F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, slots], v[:, :, slots], enable_gqa=True)
        assert torch.allclose(out[:, :, t : t + 1], ref, atol=1e-5)
    with pytest.raises(RuntimeError, match="extra slot"):
        kernels.decode_attention(q, k, v, [10, 12], [[5], []])  # inside the prefix: a slot seen twice


def chain_tree_and_batch(model, feature_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Decode forwards of every shape after a 4-token prompt: a chain of 5 (with `feature_layers`' inputs), a tree
    of a root and four nodes (rows with extra slots), and a ragged batch of two sequences -> logits and hidden."""
    from specdecode.models.parts import Part

    tokens, parents = torch.tensor([4, 5, 6, 2, 8]), torch.tensor([-1, 0, 0, 1])
    out = []
    with torch.inference_mode():
        caches = [model.new_cache(1, 32) for _ in range(2)]
        for cache in caches:
            model(torch.tensor([[7, 3, 9, 1]]), torch.arange(4)[None], cache, chain_mask(0, 4))
            cache.truncate(4)
        out += model(tokens[None], torch.arange(4, 9)[None], caches[0], chain_mask(4, 5), decode=True,
                     feature_layers=feature_layers)
        positions = (4 + torch.cat((torch.zeros(1, dtype=torch.long), depths(parents))))[None]
        ids = torch.cat((torch.tensor([1]), tokens[:4]))[None]
        out += model(ids, positions, caches[1], tree_mask(4, parents), decode=True)
        parts = [Part(tokens[:2], torch.arange(4, 6), caches[0], chain_mask(4, 2)),
                 Part(tokens[2:], torch.arange(4, 7), caches[1], chain_mask(4, 3))]  # fmt: skip
        for logits, hidden in model.forward_parts(parts):
            out += [logits, hidden]
    return out


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize(("model_type", "mode", "overrides"), [
    ("qwen2", "none", {}),  # biases on q, k, v; float32 weights on the float kernel
    ("qwen2", "q8_0", {}),  # biases, 32-weight blocks: q, k, v and gate, up each in one parallel region
    ("qwen2", "q4_k", dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)),
    ("qwen3", "q8_0", {}),  # q and k norms
    ("llama", "q4_k", dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)),
])  # fmt: skip
def test_native_decoder_layers_equal_the_python_loop(monkeypatch, model_type, mode, overrides):
    """Decode forwards run each layer as one native call (kernels/layer_cpu.cpp): the same operations as the
    Python loop, so chains, trees and ragged batches of sequences give the same bits either way."""
    from specdecode.models.native import NativeDecode

    model = quantize_(tiny_native(model_type, seed=2, **overrides), mode)
    def run():
        return chain_tree_and_batch(model)

    native = run()
    assert model.native.built is not None, "the native layers did not run"
    monkeypatch.setattr(NativeDecode, "stack", lambda self, segments: None)
    python = run()
    assert all(torch.equal(a, b) for a, b in zip(native, python, strict=True))


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("embedding", ["float", "q8_0", "q4_k"])
def test_a_native_forward_looks_up_its_token_ids_and_positions_as_python_does(monkeypatch, embedding):
    """A decode forward's embedding rows (a float table, or blocks as a GGUF file stores them) and rotary rows are
    looked up inside the native call (DecoderStack.forward_ids): the same bits as the embedding module's and the
    rotary table's rows handed to it, and as the Python loop."""
    from specdecode.models.native import NativeDecode
    from specdecode.weights.blocks import quantize_float
    from specdecode.weights.quantize import QuantEmbedding

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    model = quantize_(tiny_native("qwen2", seed=8, **shape), "q4_k")
    if embedding != "float":
        weight = model.model.embed_tokens.weight.detach()
        model.model.embed_tokens = QuantEmbedding(quantize_float(weight, embedding), torch.float32)
    assert model.native.embedding(model.model.embed_tokens) is not None
    in_call = chain_tree_and_batch(model)
    assert model.native.built is not None, "the native layers did not run"
    monkeypatch.setattr(NativeDecode, "embedding", lambda self, embed: None)
    handed = chain_tree_and_batch(model)
    monkeypatch.setattr(NativeDecode, "stack", lambda self, segments: None)
    python = chain_tree_and_batch(model)
    assert all(torch.equal(a, b) for a, b in zip(in_call, handed, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(in_call, python, strict=True))
    table = kernels.TokenEmbedding(1, [torch.randn(6, 8)], [])
    with pytest.raises(RuntimeError, match="outside"):
        table.rows(torch.tensor([2, 6]))


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
def test_parts_made_of_lists_give_the_bits_of_parts_made_of_tensors():
    """A step's parts carry their ids and positions as lists, which the native layers take as they are
    (DecoderStack.forward_id_lists): a chain, a tree's nodes and a two-part batch give the same bits as the same
    parts made of tensors (the tensors' path is the one checked against the Python loop above)."""
    from specdecode.models.masks import tree_row_slots
    from specdecode.models.parts import Part, RowSlots, chain_part

    model = quantize_(tiny_native("qwen2", seed=9, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                  num_key_value_heads=2), "q4_k")

    def forwards(as_list: bool) -> list[torch.Tensor]:
        make = (lambda ids: ids) if as_list else (lambda ids: torch.tensor(ids))
        caches = [model.new_cache(1, 32) for _ in range(2)]
        out = []
        with torch.inference_mode():
            for cache in caches:
                model.forward_parts([chain_part(make([7, 3, 9, 1]), cache, 3)])
                cache.truncate(4)
            # a chain of three; then a tree of two siblings under the root, at depth 1, beside a chain of two
            chain = chain_part(make([4, 5, 6]), caches[0])
            tree = Part(make([1, 8, 2]), make([4, 5, 5]), caches[1], None, rows=RowSlots(*tree_row_slots(4, [-1, -1])))
            for part_list in ([chain], [tree, chain_part(make([2, 3]), caches[0], start=4)]):
                for logits, hidden in model.forward_parts(part_list):
                    out += [logits, hidden]
        return out

    assert all(torch.equal(a, b) for a, b in zip(forwards(True), forwards(False), strict=True))


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_linears_run_together_equal_each_alone(rows):
    """q, k, v (and gate, up) share one parallel region and one quantized input, whatever their block formats:
    every output is bit-identical to its layer's own call."""
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    layers = [quantize_(tiny_native("qwen2", seed=4, **shape), mode).model.layers[0] for mode in ("q4_k", "q8_0", "none")]
    ops = [layers[0].self_attn.q_proj.op, layers[1].self_attn.k_proj.op, layers[2].self_attn.v_proj.op,
           layers[0].mlp.gate_proj.op, layers[1].mlp.up_proj.op]  # k-quant, 32-weight blocks, float; with biases
    x = torch.randn(rows, 256)
    together = kernels.run_linears(x, ops)
    assert all(torch.equal(a, op(x)) for a, op in zip(together, ops, strict=True))


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize(("dim", "dtype", "heads"), [(64, torch.float32, 6), (128, torch.float32, 6),
                                                    (24, torch.bfloat16, 6), (64, torch.float32, 14),
                                                    (128, torch.float32, 12), (64, torch.float32, 28),
                                                    (40, torch.bfloat16, 2), (48, torch.bfloat16, 4),
                                                    (128, torch.bfloat16, 10), (72, torch.float32, 16)])
def test_kernel_attention_rows_together_equal_each_alone(dim, dtype, heads):
    """Rows attended together read the cache once for all of them (in chunks of rows): each row's output is
    bit-identical to a call with that row alone, for chain rows, tree rows and long prefixes; with 1 to 14 query
    heads a KV head (the kernels' head groups, whole and split) and head sizes that are and are not a multiple of
    16 (the values' 16-lane passes, then eight-lane ones)."""
    torch.manual_seed(1)
    kv_heads, slots = 2, 300
    k, v = torch.randn(1, kv_heads, slots, dim).to(dtype), torch.randn(1, kv_heads, slots, dim).to(dtype)
    cases = [
        ([250 + t for t in range(19)], []),  # a chain of 19 rows after 250 cached slots: three chunks
        ([201, 201, 201, 201, 201], [[], [205], [205, 207], [206], [205, 207, 210]]),  # a tree's rows
        ([3, 130, 7, 131], [[9], [], [130, 140], []]),  # spans far apart
    ]
    for spans, extras in cases:
        q = torch.randn(1, heads, len(spans), dim)
        together = kernels.decode_attention(q, k, v, spans, extras)
        for t, span in enumerate(spans):
            alone = kernels.decode_attention(q[:, :, t : t + 1].contiguous(), k, v, [span],
                                             [extras[t]] if extras else [])
            assert torch.equal(together[:, :, t : t + 1], alone)


def test_a_chain_part_carries_the_slots_its_mask_gives():
    from specdecode.models.kv_cache import KVCache
    from specdecode.models.parts import chain_part, row_slots

    cache = KVCache(1, 1, 1, 32, 8, torch.float32, "cpu")
    cache.truncate(5)
    part = chain_part(torch.tensor([3, 4, 5]), cache)
    assert part.positions.tolist() == [5, 6, 7]
    assert part.attn_mask is None  # built only where a forward reads it
    assert torch.equal(part.mask(), chain_mask(5, 3)) and part.rows == row_slots(part.mask())
    assert chain_part(torch.tensor([1, 2]), cache, start=9).rows == row_slots(chain_mask(9, 2))


def test_draft_nodes_carry_the_slots_their_mask_gives():
    """A draft forward's nodes (a depth of a tree, fed after earlier depths) know their rows' slots: the same as
    reading them off their mask."""
    from specdecode.drafters.tree_growth import GrowsTrees, Node
    from specdecode.models.parts import row_slots, rows_mask

    def node(parent, depth, slot=-1):
        return Node(7, parent, depth, 0.5, 0.5, 0, [], slot)

    # a chain fed at 10, 11 after a 10-token prefix, then a tree whose ancestors were fed at 10 and 13
    chain = [node(-1, 1, 10), node(0, 2, 11), node(1, 3)]
    tree = [node(-1, 1, 10), node(-1, 1, 12), node(0, 2, 13), node(2, 3), node(1, 2)]
    for nodes, expand, start in ((chain, [2], 12), (tree, [3, 4], 14)):
        _, _, rows = GrowsTrees._place(None, expand, nodes, start, 10)
        mask = torch.zeros(len(expand), start + len(expand), dtype=torch.bool)  # the prefix, ancestors, itself
        mask[:, :10] = True
        for row, i in enumerate(expand):
            j = i
            while j >= 0:
                mask[row, nodes[j].slot] = True
                j = nodes[j].parent
        assert rows == row_slots(mask[None, None])
        assert torch.equal(rows_mask(rows), mask[None, None])  # the mask a forward builds from the rows


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
def test_native_layers_give_the_same_bits_with_guided_or_fixed_thread_shares(mode, switch_both_ways):
    """Two threads share each group of linear layers (q, k, v; gate, up) in guided chunks or fixed halves
    (kernels.h, run_units): the forward's logits and hidden states are the same bits either way."""
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    model = quantize_(tiny_native("qwen2", seed=6, **shape), mode)

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            cache = model.new_cache(1, 32)
            model(torch.tensor([[7, 3, 9, 1]]), torch.arange(4)[None], cache, chain_mask(0, 4))
            cache.truncate(4)
            logits, hidden = model(torch.tensor([[4, 5, 6, 2, 8]]), torch.arange(4, 9)[None], cache,
                                   chain_mask(4, 5), decode=True)
        return [logits, hidden]

    kernels.set_team(False)  # the groups of linear layers in their own regions, shared by run_units
    try:
        fixed, guided = switch_both_ways("guided_units", run)
    finally:
        kernels.set_team(True)
    assert model.native.built is not None, "the native layers did not run"
    assert all(torch.equal(a, b) for a, b in zip(fixed, guided, strict=True))


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
def test_a_forward_in_one_team_region_gives_the_bits_of_a_region_per_layer_group(mode, switch_both_ways, monkeypatch):
    """On two threads a decode forward runs its layers in one parallel region: the second thread reads the next
    weights ahead and computes units from the back (team_cpu.h). Chains, trees, ragged batches and an EAGLE head's
    features give the same bits as one region per group of linear layers, and as model.py's loop."""
    from specdecode.models.native import NativeDecode

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    model = quantize_(tiny_native("qwen2", seed=7, num_hidden_layers=3, **shape), mode)
    def run() -> list[torch.Tensor]:
        return chain_tree_and_batch(model, feature_layers=(0, 2))

    regions, team = switch_both_ways("team", run)
    assert model.native.built is not None, "the native layers did not run"
    assert all(torch.equal(a, b) for a, b in zip(regions, team, strict=True))
    monkeypatch.setattr(NativeDecode, "stack", lambda self, segments: None)
    python, _ = switch_both_ways("team", run)
    assert all(torch.equal(a, b) for a, b in zip(python, team, strict=True))


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kept", [[5, 7], [4, 6, 9, 11, 12, 13, 15, 17, 18, 20, 22]])
def test_cache_keep_moves_the_slots_torch_moves(monkeypatch, dtype, kept):
    """The native slot moves (one call, lists in) leave the cache torch's gather and scatter leaves: every layer,
    head and slot, the bits untouched past the new length too."""
    from specdecode.models import kv_cache as kv_module
    from specdecode.models.kv_cache import KVCache

    def filled() -> KVCache:
        cache = KVCache(3, 1, 2, 32, 8, dtype)
        cache.k.copy_(torch.randn(cache.k.shape))
        cache.v.copy_(torch.randn(cache.v.shape))
        cache.truncate(4)
        return cache

    native, plain = filled(), filled()
    plain.k.copy_(native.k), plain.v.copy_(native.v)
    calls = []

    class Spy:  # the native call is the one that ran
        def move_slots(self, *args):
            calls.append(args)
            kernels.move_slots(*args)

    monkeypatch.setattr(kv_module, "cpu_kernels", Spy)
    native.keep(kept)
    assert len(calls) == 1
    monkeypatch.setattr(kv_module, "cpu_kernels", lambda: None)
    plain.keep(kept)
    assert native.length == plain.length == 4 + len(kept)
    assert torch.equal(native.k, plain.k) and torch.equal(native.v, plain.v)


@pytest.fixture(params=[True, False], ids=["bf16-dots", "float-path"])
def bf16_dots(request):
    """Attention over a bfloat16 cache with its AVX-512 BF16 dot products on (where the CPU has them and AMX does
    not run) and off."""
    kernels.set_bf16_dots(request.param)
    yield request.param
    kernels.set_bf16_dots(True)


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 2, 128), (14, 2, 64), (6, 1, 64)])
def test_long_rows_over_a_bfloat16_cache_equal_themselves_alone(heads, kv_heads, dim, bf16_dots):
    """Rows over a bfloat16 cache of up to 300 slots (past 64, a row's whole tiles of 32 run on AMX tiles or in
    BF16 dot products where the CPU has them): each row of a call equals the row alone; a tree row whose ancestors
    sit at scattered slots equals its path laid out in order; attention agrees with torch's to bfloat16's
    precision."""
    torch.manual_seed(0)
    k, v = torch.randn(1, kv_heads, 400, dim).bfloat16(), torch.randn(1, kv_heads, 400, dim).bfloat16()
    q = torch.randn(1, heads, 8, dim)
    spans = [40, 95, 96, 97, 127, 128, 200, 300]  # around the tiles' edges
    out = kernels.decode_attention(q, k, v, spans)
    for t, span in enumerate(spans):
        one = kernels.decode_attention(q[:, :, t : t + 1].contiguous(), k, v, [span])
        assert torch.equal(out[:, :, t], one[:, :, 0]), span
        ref = F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, :span].float(), v[:, :, :span].float(),
                                             enable_gqa=True)
        assert torch.allclose(one, ref, atol=3e-2, rtol=3e-2), span
    # tree rows: 90 slots of prefix and ten ancestors at 200.. (its tiles gather them), 120 and four at 150..
    trees = [(90, list(range(200, 210))), (120, [150, 151, 160, 170]), (64, [300])]
    spans, extras = [s for s, _ in trees], [e for _, e in trees]
    out = kernels.decode_attention(q[:, :, :3].contiguous(), k, v, spans, extras)
    for t, (span, ancestors) in enumerate(trees):
        k_path, v_path = k.clone(), v.clone()
        k_path[:, :, span : span + len(ancestors)] = k[:, :, ancestors]
        v_path[:, :, span : span + len(ancestors)] = v[:, :, ancestors]
        path = kernels.decode_attention(q[:, :, t : t + 1].contiguous(), k_path, v_path, [span + len(ancestors)])
        assert torch.equal(out[:, :, t], path[:, :, 0]), span
