"""Native model parity with transformers on tiny random configs; cached, masked and tree forwards."""

import pytest
import torch
from tiny import hf_model, native_from_hf

from specdecode.models.masks import chain_mask, depths, tree_mask, tree_row_slots

FAMILIES = ["qwen2", "llama", "qwen3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    hf = hf_model(family)
    model = native_from_hf(hf)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 32), chain_mask(0, 12))
    assert torch.allclose(out, ref, atol=1e-5)


def test_tied_embeddings_and_llama3_rope_scaling():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    hf = hf_model("llama", tie_word_embeddings=True, rope_scaling=scaling)
    model = native_from_hf(hf)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, _ = model(ids, torch.arange(40)[None], model.new_cache(1, 64), chain_mask(0, 40))
        assert torch.allclose(out, hf(ids).logits, atol=1e-5)


@torch.no_grad()
def test_cached_forward_equals_uncached():
    model = native_from_hf(hf_model("qwen2"))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(2))
    full, _ = model(ids, torch.arange(16)[None], model.new_cache(1, 32), chain_mask(0, 16))
    cache = model.new_cache(1, 32)
    pieces = []
    for start, end in [(0, 5), (5, 6), (6, 11), (11, 16)]:
        out, _ = model(ids[:, start:end], torch.arange(start, end)[None], cache, chain_mask(start, end - start))
        cache.truncate(end)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


@torch.no_grad()
def test_rotary_tables_give_each_position_one_value_in_any_forward():
    model = native_from_hf(hf_model("qwen2"))
    alone = [model._rotary(torch.tensor([[p]]), torch.float32) for p in (0, 7, 255)]
    together = model._rotary(torch.tensor([[0, 7, 255], [3, 4, 5]]), torch.float32)
    assert together[0].shape == (2, 1, 3, model.config.head_dim)
    for i, (cos, sin) in enumerate(alone):  # bit for bit: a row's angles never depend on the rows beside it
        assert torch.equal(together[0][0, 0, i], cos[0, 0, 0]) and torch.equal(together[1][0, 0, i], sin[0, 0, 0])
    grown = model._rotary(torch.tensor([[7, 1000]]), torch.float32)  # past the first table: a longer one
    assert torch.equal(grown[0][0, 0, 0], alone[1][0][0, 0, 0])
    freqs = torch.tensor([[7.0, 1000.0]])[..., None] * model.inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    assert torch.equal(grown[0], angles.cos()) and torch.equal(grown[1], angles.sin())  # what a forward computed


@torch.no_grad()
def test_tree_masked_forward_equals_each_path_alone():
    model = native_from_hf(hf_model("qwen2"))
    prefix = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    root, nodes = 7, torch.tensor([10, 11, 12, 13, 14])
    parents = torch.tensor([-1, -1, 0, 0, 2])  # root -> {0, 1}; 0 -> {2, 3}; 2 -> 4
    cache = model.new_cache(1, 32)
    model(prefix, torch.arange(6)[None], cache, chain_mask(0, 6))
    cache.truncate(6)
    ids = torch.cat((torch.tensor([root]), nodes))[None]
    positions = (6 + torch.cat((torch.zeros(1, dtype=torch.long), depths(parents))))[None]
    tree_logits, _ = model(ids, positions, cache, tree_mask(6, parents))
    for node, path in {4: [0, 2, 4], 3: [0, 3], 1: [1]}.items():
        seq = torch.cat((prefix[0], torch.tensor([root]), nodes[path]))[None]
        solo, _ = model(seq, torch.arange(seq.shape[1])[None], model.new_cache(1, 32), chain_mask(0, seq.shape[1]))
        assert torch.allclose(tree_logits[0, node + 1], solo[0, -1], atol=1e-5)


def test_tree_mask_is_the_ancestor_relation():
    gen = torch.Generator().manual_seed(4)
    for n in (1, 2, 5, 17):
        parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, n)])
        mask = tree_mask(3, parents)[0, 0]
        assert mask.shape == (n + 1, n + 4) and mask[:, :3].all()
        for i in range(n):
            expect = {i}
            j = int(parents[i])
            while j >= 0:
                expect.add(j)
                j = int(parents[j])
            got = {j for j in range(n) if mask[i + 1, 4 + j]}
            assert got == expect and mask[i + 1, 3]
    chain = torch.arange(-1, 4)
    assert torch.equal(tree_mask(2, chain), chain_mask(2, 6))


def test_tree_row_slots_are_what_the_mask_shows():
    """A verify forward's tree rows, worked out on lists, are the slots row_slots reads off the tree's mask, and
    give that mask back; depths count a node's ancestors and itself."""
    from specdecode.models.parts import RowSlots, row_slots, rows_mask

    gen = torch.Generator().manual_seed(5)
    for n in (0, 1, 2, 5, 9, 17):
        for chain in (False, True):
            drawn = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
            parents = list(range(-1, n - 1)) if chain else drawn
            for prefix in (0, 1, 7):
                mask = tree_mask(prefix, torch.tensor(parents, dtype=torch.long))
                expected = row_slots(mask)
                assert tree_row_slots(prefix, parents) == (expected.spans, expected.extras)
                assert torch.equal(rows_mask(RowSlots(*tree_row_slots(prefix, parents))), mask)
                ancestry = mask[0, 0, 1:, prefix + 1 :]  # node to node, itself included
                assert torch.equal(depths(torch.tensor(parents, dtype=torch.long)), ancestry.sum(-1))
