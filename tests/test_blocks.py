"""GGUF block formats on the integer kernel: unpacked exactly as gguf-py reads them, multiplied right (against a
plain integer reference and against de-quantized float math), and every row computed as if it were alone."""

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from specdecode.kernels import cpu_kernels
from specdecode.weights.blocks import FORMATS, PackedWeight, from_gguf, narrowed, quantize_float
from specdecode.weights.quantize import QuantLinear

kernels = cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
TYPES = [name.upper() for name in FORMATS]
# Where each block type keeps its float16 fields (byte offsets): random bytes there could be NaN or huge.
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(type_name: str, out: int, inp: int, seed: int = 0) -> np.ndarray:
    """Random valid GGUF bytes [out, row_bytes] of `type_name`: random codes and scales, sane float16 fields."""
    rng = np.random.default_rng(seed)
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(out, inp // block, block_bytes), dtype=np.uint8)
    if type_name == "MXFP4":  # an exponent byte: scales 2^-17 .. 2^-3
        raw[..., 0] = rng.integers(110, 125, size=(out, inp // block))
    for at in HALF_FIELDS.get(type_name, ()):
        halves = rng.uniform(0.001, 0.02, size=(out, inp // block)).astype(np.float16)
        raw[..., at : at + 2] = halves[..., None].view(np.uint8).reshape(out, inp // block, 2)
    return raw.reshape(out, -1)


def packed(type_name: str, out: int = 24, inp: int = 512, seed: int = 0) -> PackedWeight:
    return from_gguf(type_name, random_blocks(type_name, out, inp, seed), (out, inp))


@pytest.mark.parametrize("type_name", TYPES)
def test_unpacked_blocks_decode_to_what_gguf_reads(type_name):
    raw = random_blocks(type_name, 6, 512)
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(6, 512)
    ours = from_gguf(type_name, raw, (6, 512)).dequantize().numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())


def integer_reference(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The kernel's arithmetic, plainly: activations rounded to int8 per superblock, exact integer sums, float64."""
    f, (_, inp) = w.format, w.shape
    xs = x.double().view(x.shape[0], inp // f.superblock, f.superblock)
    xd = (xs.float().abs().amax(-1) / 127).double()  # [M, superblocks], float32 like the kernel
    xq = torch.round(xs / torch.where(xd > 0, xd, 1)[..., None]).clamp(-127, 127)
    x_rounded = (xq * xd[..., None]).view(x.shape[0], inp)
    return x_rounded @ w.dequantize().double().T


# 37 rows: the row kernel, with a ragged last block of weight rows; 48: 16 channels per vector
# (kernels/quant_c16_cpu.cpp, quant_c16_legacy_cpu.cpp).
SHAPES = [37, 48]


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("out", SHAPES)
def test_kernel_matches_the_integer_reference_and_float_math(type_name, out):
    torch.manual_seed(0)
    w = packed(type_name, out=out, inp=512)
    layer = QuantLinear(w, None, kernels)
    x = torch.randn(11, 512)
    out = layer(x).double()
    ref = integer_reference(x, w)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    exact = x.double() @ w.dequantize().double().T  # what the weights mean, activations unrounded
    assert (out - exact).abs().max() / exact.abs().max() < 0.02  # int8 activations: about 1% off


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("out", SHAPES)
def test_every_row_is_computed_as_if_alone(type_name, out):
    """Batch invariance, bit for bit: the property that makes a verify forward equal one-token forwards."""
    torch.manual_seed(1)
    layer = QuantLinear(packed(type_name, out=out, inp=512, seed=1), torch.randn(out), kernels)
    x = torch.randn(70, 512)
    singles = torch.cat([layer(x[j : j + 1]) for j in range(70)])
    # every tile width and a remainder; up to 4 rows, AVX2 runs both channel halves in one pass; from 48 rows
    # Q4_K and Q6_K, from 32 rows Q4_0, run on AMX tile products where the CPU has them (16-row tiles in pairs and
    # alone, the rest on the VNNI tile)
    for rows in (2, 3, 4, 5, 8, 9, 16, 19, 32, 37, 48, 50, 70):
        assert torch.equal(layer(x[:rows]), singles[:rows])


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("out", [37, 16 * 300])
def test_argmax_found_as_the_outputs_are_written_is_torchs(type_name, out):
    """An LM head finds each row's argmax while its logits are in cache (greedy verification reads nothing else
    of them): the same outputs as its plain call and torch's argmax of them, the first index on ties (across the
    short runs and the threads' shares), and no indices where a row holds a NaN."""
    from specdecode.weights.blocks import with_rows

    torch.manual_seed(3)
    w = packed(type_name, out=out, inp=512, seed=3)
    layer = QuantLinear(w, torch.randn(out), kernels)
    x = torch.randn(9, 512)
    for rows in (1, 2, 5, 9):
        y, argmax = layer.forward_argmax(x[:rows])
        assert torch.equal(y, layer(x[:rows])) and torch.equal(argmax, y.argmax(-1))
    # every output the same: index 0, whichever run or thread reached the value first
    same = QuantLinear(with_rows(w, torch.zeros(out, dtype=torch.long)), None, kernels)
    assert same.forward_argmax(x[:3])[1].tolist() == [0, 0, 0]
    # the largest in the last column (the last short run of the last share), then tied with the first
    bias = torch.randn(out)
    bias[-1] = 1e30  # a dot product of ~100 vanishes beside it: float32 steps are ~1e23 there
    assert QuantLinear(w, bias, kernels).forward_argmax(x[:2])[1].tolist() == [out - 1] * 2
    bias[0] = 1e30
    assert QuantLinear(w, bias, kernels).forward_argmax(x[:2])[1].tolist() == [0, 0]
    x[1, :] = float("nan")
    y, argmax = layer.forward_argmax(x[:3])
    assert argmax.numel() == 0 and torch.equal(y[0], layer(x[:1])[0])


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_units_shared_guided_or_fixed_give_the_same_bits(type_name, switch_both_ways):
    """The thread team takes a layer's 16-channel units in guided chunks (kernels.h, run_units) or in one fixed
    share per thread: a unit's outputs never depend on which thread ran it, nor on the chunks around it."""
    torch.manual_seed(2)
    layer = QuantLinear(packed(type_name, out=16 * 37, inp=512, seed=2), torch.randn(16 * 37), kernels)
    x = torch.randn(9, 512)
    fixed, guided = switch_both_ways("guided_units", lambda: [layer(x[:rows]) for rows in (1, 4, 9)])
    assert all(torch.equal(a, b) for a, b in zip(fixed, guided, strict=True))


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("fill", [0xFF, 0x80, 0x77])
def test_the_largest_codes_and_activations_do_not_overflow(type_name, fill):
    """Every code, scale and min byte at one extreme and every activation at +-127: the integer sums kernels keep in
    16 bits between widenings (AVX2's vpmaddubsw pairs) must still be exact (0x77: MXFP4's largest code, 28)."""
    raw = random_blocks(type_name, 48, 512).reshape(48, 512 // GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][0], -1)
    halves = {at: raw[..., at : at + 2].copy() for at in HALF_FIELDS.get(type_name, ())}
    if type_name == "MXFP4":  # its exponent byte
        halves = {0: raw[..., 0:1].copy()}
    raw[:] = fill
    for at, kept in halves.items():
        raw[..., at : at + kept.shape[-1]] = kept
    w = from_gguf(type_name, raw.reshape(48, -1), (48, 512))
    layer = QuantLinear(w, None, kernels)
    signs = torch.tensor([1.0, -1.0]).repeat(256)
    x = torch.stack([torch.ones(512), -torch.ones(512), signs, -signs]).repeat(16, 1)  # 64 rows: AMX's tiles too
    ref = integer_reference(x, w)
    assert torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k"])
def test_float_weights_written_in_blocks_stay_close(name):
    torch.manual_seed(0)
    w = torch.randn(16, 512) * 0.05
    back = quantize_float(w, name).dequantize()
    assert (back - w).abs().max() < {"q8_0": 0.002, "q4_0": 0.025, "q4_k": 0.02}[name]


def test_q4_0_is_written_as_gguf_reads_it():
    """Our Q4_0 blocks, packed back into GGUF's bytes, decode to the same weights with gguf-py."""
    torch.manual_seed(0)
    w = quantize_float(torch.randn(4, 128) * 0.05, "q4_0")
    codes, d = w.codes().numpy().reshape(4, 4, 32).astype(np.uint8), w.d.numpy().reshape(4, 4, 1)
    raw = np.concatenate((d.view(np.uint8), codes[..., :16] | codes[..., 16:] << 4), axis=-1)  # [4, blocks, 18]
    np.testing.assert_array_equal(dequantize(raw.reshape(4, -1), GGMLQuantizationType.Q4_0).reshape(4, 128),
                                  w.dequantize().numpy())


@pytest.mark.parametrize("type_name", TYPES)
def test_narrowing_rewrites_only_wider_blocks(type_name):
    w = packed(type_name, out=16, inp=256)
    narrow = narrowed(w, "q4_0")
    if w.format.bits_per_weight > FORMATS["q4_0"].bits_per_weight:
        assert narrow.format.name == "q4_0" and narrow.shape == w.shape
    else:
        assert narrow is w  # Q4_0 and Q4_K are already 4.5 bits a weight
    odd = packed("Q8_0", out=16, inp=96)
    assert narrowed(odd, "q4_k") is odd  # 96 inputs are no whole Q4_K superblock


def test_embedding_rows_decode_as_the_whole_matrix():
    w = packed("Q6_K", out=10, inp=256)
    rows = torch.tensor([7, 0, 7, 3])
    assert torch.equal(w.rows(rows).dequantize(), w.dequantize()[rows])


@needs_kernel
@pytest.mark.parametrize("type_name", TYPES)
def test_native_embedding_rows_are_the_reference_bits(type_name):
    """A decode step's embedding rows come from one native call: bit for bit what de-quantizing them gives, for
    a few rows (on the calling thread) and a prompt's many (in parallel), repeats included."""
    from specdecode.weights.quantize import QuantEmbedding

    w = packed(type_name, out=80, inp=512)
    embedding = QuantEmbedding(w, torch.float32)
    for ids in ([[7]], [[3, 7, 3, 79, 0]], [list(range(80)) + [5, 5]]):
        tokens = torch.tensor(ids)
        expected = w.rows(tokens.reshape(-1)).dequantize().view(*tokens.shape, -1)
        assert torch.equal(embedding(tokens), expected)
    with pytest.raises(RuntimeError, match="outside"):
        embedding(torch.tensor([[80]]))


def test_the_kernels_build_wherever_they_can():
    """A build error must fail here, not turn every kernel test into a skip."""
    import shutil

    from specdecode.kernels import cpu_flags

    if {"avx2", "fma"} <= set(cpu_flags()) and (shutil.which("c++") or shutil.which("g++")):
        assert kernels is not None


@needs_kernel
def test_amx_runs_where_the_cpu_has_it():
    """On a CPU with AMX the row tests above run its tile products: a build or a system that silently fell back
    to the VNNI tile would leave that path untested."""
    import os

    from specdecode.kernels import cpu_flags

    if {"amx_tile", "amx_int8"} <= set(cpu_flags()) and os.environ.get("SPECDECODE_AMX") != "0":
        assert kernels.amx_min_rows() > 0
    else:
        assert kernels.amx_min_rows() == 0


def test_a_build_killed_midway_does_not_block_the_next(tmp_path):
    """torch's lock file, left by a build that was killed, is removed under our lock; the lock excludes others."""
    import fcntl

    from specdecode.kernels.build import build_lock

    (tmp_path / "lock").write_text("")  # what a killed build leaves behind
    with build_lock(tmp_path, "a test build"):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "build.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process's build waits for this one
    with open(tmp_path / "build.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the build ends


def test_the_prefetch_hint_follows_the_cpu_maker_and_can_be_chosen(monkeypatch):
    """Non-temporal on AMD (and unknown makers), into L2 on Intel; SPECDECODE_PREFETCH overrides it, and a wrong
    value is one clear error, not a build failure."""
    import specdecode.kernels as k
    from specdecode.errors import SpecdecodeError

    monkeypatch.delenv("SPECDECODE_PREFETCH", raising=False)
    maker = {"vendor_id": "AuthenticAMD"}
    monkeypatch.setattr(k, "cpuinfo_field", lambda name: maker.get(name, ""))
    assert k.prefetch_hint() == "nta"
    maker["vendor_id"] = "GenuineIntel"
    assert k.prefetch_hint() == "t1"
    maker["vendor_id"] = ""
    assert k.prefetch_hint() == "nta"
    monkeypatch.setenv("SPECDECODE_PREFETCH", "t0")
    assert k.prefetch_hint() == "t0"
    monkeypatch.setenv("SPECDECODE_PREFETCH", "l1")
    with pytest.raises(SpecdecodeError, match="SPECDECODE_PREFETCH"):
        k.prefetch_hint()


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_K", "Q4_0"])
def test_big_weights_get_2mb_pages_of_their_own_and_the_same_outputs(type_name):
    """A repacked weight of 2 MB or more sits in a mapping of its own that starts on a 2 MB boundary (so that the
    system can back it with huge pages) and is unmapped with the layer; the outputs are those of 4 KB pages."""
    w = packed(type_name, out=4096, inp=1024)  # 2 MB of codes after the repack
    try:
        kernels.set_huge_pages(False)
        plain = QuantLinear(w, None, kernels)
        kernels.set_huge_pages(True)
        layer = QuantLinear(w, None, kernels)
    finally:
        kernels.set_huge_pages(True)
    codes = layer.tensors[0]
    assert codes.nbytes >= 2 << 20 and codes.data_ptr() % (2 << 20) == 0
    x = torch.randn(3, 1024)
    assert torch.equal(layer(x), plain(x))
    start = f"{codes.data_ptr():x}-"
    assert any(line.startswith(start) for line in open("/proc/self/maps"))
    del layer, codes
    assert not any(line.startswith(start) for line in open("/proc/self/maps"))  # unmapped with its last reference
