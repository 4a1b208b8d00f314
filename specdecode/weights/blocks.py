"""Quantized weight blocks: GGUF's block types as the integer kernel (`kernels/quant_cpu.cpp`) reads them.

Every supported type is one formula over small integer codes in superblocks along the input dimension:
    w = d * scale * code - dmin * min
with float16 `d`/`dmin` per superblock of `superblock` weights and, for the k-quants, int8 `scale`/`min` per
sub-block of `group` weights. The file's bytes are unpacked once into that layout (codes as nibbles plus a plane
of high bits); nothing is rounded, so the weights are exactly the file's, at about the file's size.

  type   bits  superblock  group  per superblock                      as the formula
  Q4_0   4     32          -      d                                   d * code - (8 d)
  Q4_1   4     32          -      d, m                                d * code - (-m)
  Q5_0   5     32          -      d                                   d * code - (16 d)
  Q5_1   5     32          -      d, m                                d * code - (-m)
  Q8_0   8     32          -      d                                   d * code (signed codes)
  Q4_K   4     256         32     d, dmin, 6-bit scale and min        d * scale * code - dmin * min
  Q5_K   5     256         32     d, dmin, 6-bit scale and min        d * scale * code - dmin * min
  Q6_K   6     256         16     d, int8 scale                       d * scale * code - (32 d) * scale

  MXFP4  4     32          -      d (2^(e - 128))                     d * MXFP4_CODES[nibble] - (16 d)

MXFP4 (gpt-oss's experts: 32 e2m1 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with a sign, under a power-of-two scale
2^(e - 127)): twice each value is an integer in -12..12, so its nibble indexes the unsigned code 16 + 2v, and the
block is Q5_0's formula over codes kept in 4 bits (the kernels turn nibbles into codes with one byte shuffle). A
layer whose outputs are not a multiple of 16 (no 16-channel kernel) holds the same codes as Q5_0 blocks, 5.5 bits
a weight; a scale float16 cannot hold (below 2^-24 or above 2^11) leaves the tensor de-quantized.

`quantize_float` writes a float tensor in Q8_0, Q4_0 or Q4_K, so `--quantize` of a float checkpoint runs on the
same kernels (and a draft model's wider blocks can be written again in fewer bits: `narrowed`).
`PackedWeight.dequantize` is the plain reference every kernel path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockFormat:
    name: str
    bits: int  # code width: 4, 5, 6, or 8 (signed)
    superblock: int  # weights per d/dmin along the input dimension
    group: int  # weights per int8 scale/min; == superblock when there are none
    sub_scales: bool
    has_min: bool
    block_bytes: int  # bytes of one superblock in a GGUF file

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / self.superblock


FORMATS = {
    "q4_0": BlockFormat("q4_0", 4, 32, 32, False, True, 18),
    "q4_1": BlockFormat("q4_1", 4, 32, 32, False, True, 20),
    "q5_0": BlockFormat("q5_0", 5, 32, 32, False, True, 22),
    "q5_1": BlockFormat("q5_1", 5, 32, 32, False, True, 24),
    "q8_0": BlockFormat("q8_0", 8, 32, 32, False, False, 34),
    "q4_k": BlockFormat("q4_k", 4, 256, 32, True, True, 144),
    "q5_k": BlockFormat("q5_k", 5, 256, 32, True, True, 176),
    "q6_k": BlockFormat("q6_k", 6, 256, 16, True, True, 210),
    "mxfp4": BlockFormat("mxfp4", 4, 32, 32, False, True, 17),
}
EMPTY_U8 = torch.empty(0, dtype=torch.uint8)


@dataclass
class PackedWeight:
    """A [out, in] weight in the kernel's layout (see the kernel's header); unused parts are empty tensors."""

    format: BlockFormat
    qs: Tensor  # uint8 [out, in / 2] nibbles, or int8 [out, in] signed codes (8 bits)
    qh: Tensor  # uint8 bit planes of the high bits: [out, in / 8] (5 bits), [out, 2, in / 8] as [out, in / 4] (6)
    scales: Tensor  # int8 [out, in / group]
    mins: Tensor  # int8 [out, in / group]
    d: Tensor  # float16 [out, in / superblock]
    dmin: Tensor  # float16 [out, in / superblock]

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * self.format.superblock

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[Tensor, ...]:
        return self.qs, self.qh, self.scales, self.mins, self.d, self.dmin

    def rows(self, index: Tensor) -> PackedWeight:
        """The weight rows `index` (an embedding lookup), still packed."""
        pick = [t.index_select(0, index) if t.numel() else t for t in self.tensors()]
        return PackedWeight(self.format, *pick)

    def codes(self) -> Tensor:
        """[out, in] int32 codes, unpacked from qs/qh."""
        f, (out, inp) = self.format, self.shape
        if f.bits == 8:
            return self.qs.view(torch.int8).int()
        span = nibble_span(f)
        groups = self.qs.view(out, inp // span, span // 2).int()
        codes = torch.cat((groups & 15, groups >> 4), dim=-1).reshape(out, inp)  # [out, spans, span]
        if f.name == "mxfp4":  # nibbles index the codes
            return torch.from_numpy(MXFP4_CODES.astype(np.int32))[codes]
        for plane in range(f.bits - 4 if f.bits in (5, 6) else 0):  # bit k of a plane: bit 4 + plane of code k
            planes = self.qh.view(out, -1, inp // 8)[:, plane].int()  # [out, in / 8]
            bits = (planes[..., None] >> torch.arange(8)) & 1  # [out, in / 8, 8]
            codes |= bits.reshape(out, inp) << (4 + plane)
        return codes

    def dequantize(self) -> Tensor:
        """[out, in] float32, by the formula in the module docstring: the reference for the kernel."""
        f = self.format
        d = self.d.float().repeat_interleave(f.superblock, dim=1)  # [out, in]
        dmin = self.dmin.float().repeat_interleave(f.superblock, dim=1) if f.has_min else None
        scale = self.scales.float().repeat_interleave(f.group, dim=1) if f.sub_scales else 1.0
        low = self.mins.float().repeat_interleave(f.group, dim=1) if f.sub_scales else 1.0
        w = d * scale * self.codes().float()
        return w - dmin * low if dmin is not None else w


def nibble_span(fmt: BlockFormat) -> int:
    """Codes per run of nibble bytes: byte j of a run holds code j (low nibble) and code j + span / 2 (high).
    32 for the 32-weight blocks; 128 for the k-quants, so one 64-byte load holds 128 codes (two AVX-512 steps)."""
    return 128 if fmt.superblock == 256 else 32


def pack(fmt: BlockFormat, codes: np.ndarray, d: np.ndarray, dmin: np.ndarray | None = None,
         scales: np.ndarray | None = None, mins: np.ndarray | None = None) -> PackedWeight:
    """codes [out, in] (uint8 0..2^bits-1, or int8 for 8 bits), d/dmin float16 [out, in / superblock],
    scales/mins int8 [out, in / group] -> the kernel's layout."""
    out, inp = codes.shape
    qh = EMPTY_U8
    if fmt.bits == 8:
        qs = torch.from_numpy(np.ascontiguousarray(codes.astype(np.int8)).view(np.uint8))
    else:
        span = nibble_span(fmt)
        groups = codes.astype(np.uint8).reshape(out, inp // span, span)
        half = span // 2
        qs = torch.from_numpy(((groups[..., :half] & 15) | ((groups[..., half:] & 15) << 4)).reshape(out, inp // 2))
        if fmt.bits in (5, 6):  # one bit plane per high bit, in the codes' order along the row
            planes = [np.packbits((codes.astype(np.uint8) >> (4 + p)) & 1, axis=-1, bitorder="little")
                      for p in range(fmt.bits - 4)]  # each [out, in / 8]
            qh = torch.from_numpy(np.ascontiguousarray(np.stack(planes, axis=1)).reshape(out, -1))

    def tensor(a: np.ndarray | None, dtype: np.dtype) -> Tensor:
        return EMPTY_U8 if a is None else torch.from_numpy(np.ascontiguousarray(a.astype(dtype)))

    return PackedWeight(fmt, qs.contiguous(), qh.contiguous(), tensor(scales, np.int8).view(torch.int8),
                        tensor(mins, np.int8).view(torch.int8), tensor(d, np.float16).view(torch.float16),
                        tensor(dmin, np.float16).view(torch.float16))  # fmt: skip


# GGUF blocks -> codes and scales. Each function takes the raw bytes [out, blocks, block_bytes] of one tensor.

def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0]  # [out, blocks]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes of a 32-block (byte j = code j | code j + 16 << 4) -> [..., 32] codes."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a little-endian uint32 -> [..., 32] its bits, bit i at i."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _legacy(fmt: BlockFormat, raw: np.ndarray) -> PackedWeight:
    out, blocks, _ = raw.shape
    d = _f16(raw, 0)
    if fmt.name == "q8_0":
        return pack(fmt, raw[..., 2:34].view(np.int8).reshape(out, -1), d)
    with_min = fmt.name in ("q4_1", "q5_1")
    start = 4 if with_min else 2
    codes = _nibbles(raw[..., start + 4 * (fmt.bits == 5) :])  # [out, blocks, 32]
    if fmt.bits == 5:
        codes |= _bits32(raw[..., start : start + 4]) << 4
    dmin = -_f16(raw, 2) if with_min else d * np.float16(1 << (fmt.bits - 1))  # the centre of the code range
    return pack(fmt, codes.reshape(out, -1), d, dmin)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> ([..., 8], [..., 8])."""
    s = packed.astype(np.uint8)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate((low_sc, high_sc), -1), np.concatenate((low_m, high_m), -1)


def _q45_k(fmt: BlockFormat, raw: np.ndarray) -> PackedWeight:
    out, blocks, _ = raw.shape
    scales, mins = _k_scales(raw[..., 4:16])
    ql = raw[..., -128:].reshape(out, blocks, 4, 32)  # per 64 weights: low nibbles first, then high
    codes = np.stack((ql & 15, ql >> 4), axis=3)  # [out, blocks, 4, 2, 32]
    if fmt.bits == 5:
        qh = raw[..., 16:48]  # [out, blocks, 32]: bit j of byte l is the high bit of weight 32 j + l
        codes |= (((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4).reshape(codes.shape)
    return pack(fmt, codes.reshape(out, -1), _f16(raw, 0), _f16(raw, 2), scales.reshape(out, -1),
                mins.reshape(out, -1))  # fmt: skip


def _q6_k(fmt: BlockFormat, raw: np.ndarray) -> PackedWeight:
    out, blocks, _ = raw.shape
    ql = raw[..., 0:128].reshape(out, blocks, 2, 2, 32)  # [half, which 32 bytes, l]
    qh = raw[..., 128:192].reshape(out, blocks, 2, 1, 32)
    low = np.stack((ql[:, :, :, 0] & 15, ql[:, :, :, 1] & 15, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4), axis=3)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [out, blocks, half, 4, 32]
    codes = (low | (high << 4)).reshape(out, -1)  # weight 128 half + 32 k + l
    scales = raw[..., 192:208].view(np.int8).reshape(out, -1)
    d = _f16(raw, 208)
    return pack(fmt, codes, d, d * np.float16(32), scales, scales)


MXFP4_BLOCK_BYTES = 17  # the exponent byte, then 16 bytes of nibbles (byte j: code j | code j + 16 << 4)
# nibble -> 16 + twice its e2m1 value (the kernels' shuffle table, quant_c16_legacy_cpu.cpp)
MXFP4_CODES = np.array([16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4], dtype=np.uint8)


def _mxfp4(raw: np.ndarray) -> PackedWeight:
    """MXFP4 bytes [out, blocks, 17] -> its nibbles under d = 2^(e - 128) (MXFP4 blocks), or where `out` is not a
    multiple of 16, the same weights as Q5_0 blocks; ValueError where a block's scale is not a float16."""
    out, blocks, _ = raw.shape
    exponent = raw[..., 0].astype(np.int32) - 128  # d = 2^(e - 128): half the block's scale, times the doubled values
    if exponent.size and (exponent.min() < -24 or exponent.max() > 11):  # 16 d must stay a float16 too
        raise ValueError("an MXFP4 scale outside float16's range")
    d = np.ldexp(np.float32(1), exponent).astype(np.float16)
    nibbles = _nibbles(raw[..., 1:17]).reshape(out, -1)
    if out % 16:
        return pack(FORMATS["q5_0"], MXFP4_CODES[nibbles], d, d * np.float16(16))
    return pack(FORMATS["mxfp4"], nibbles, d, d * np.float16(16))


_UNPACK = {"q4_0": _legacy, "q4_1": _legacy, "q5_0": _legacy, "q5_1": _legacy, "q8_0": _legacy,
           "q4_k": _q45_k, "q5_k": _q45_k, "q6_k": _q6_k}  # fmt: skip


def mxfp4_as_q5_0(packed: PackedWeight) -> PackedWeight:
    """MXFP4 blocks as the Q5_0 blocks holding the same weights, for a reader without MXFP4's code table (the
    embedding's row lookup)."""
    codes = packed.codes().numpy().astype(np.uint8)
    return pack(FORMATS["q5_0"], codes, packed.d.numpy(), packed.dmin.numpy())


UNPACKED_TYPES = tuple(FORMATS)  # GGUF block types (lower case) the kernels run


def from_gguf(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> PackedWeight:
    """A GGUF tensor's bytes [out, row_bytes] of block type `type_name` (e.g. 'Q4_K') -> PackedWeight."""
    out, inp = shape
    if type_name.lower() == "mxfp4":
        return _mxfp4(np.asarray(raw).reshape(out, inp // 32, MXFP4_BLOCK_BYTES))
    fmt = FORMATS[type_name.lower()]
    return _UNPACK[fmt.name](fmt, np.asarray(raw).reshape(out, inp // fmt.superblock, fmt.block_bytes))


def quantize_float(w: Tensor, name: str) -> PackedWeight:
    """A float [out, in] weight written in Q8_0, Q4_0 or Q4_K (in % superblock == 0), for `--quantize`."""
    fmt = FORMATS[name]
    out, inp = w.shape
    w = w.detach().float().numpy()
    if name == "q8_0":
        groups = w.reshape(out, inp // 32, 32)
        d = (np.abs(groups).max(-1) / 127).astype(np.float16)
        inv = np.where(d > 0, 1 / np.maximum(d.astype(np.float32), 1e-30), 0)
        return pack(fmt, np.clip(np.rint(groups * inv[..., None]), -127, 127).reshape(out, inp), d)
    if name == "q4_0":
        # symmetric, as llama.cpp writes it: the value of largest magnitude lands on code 0 (-8 d), so the grid
        # spends its one extra step on that value's side
        groups = w.reshape(out, inp // 32, 32)
        extreme = np.take_along_axis(groups, np.abs(groups).argmax(-1)[..., None], -1)[..., 0]  # [out, blocks]
        d = (extreme / -8).astype(np.float16)
        d32 = d.astype(np.float32)
        inv = np.divide(1, d32, out=np.zeros_like(d32), where=d32 != 0)
        codes = np.clip(np.floor(groups * inv[..., None] + 8.5), 0, 15)
        return pack(fmt, codes.reshape(out, inp), d, d * np.float16(8))
    if name != "q4_k":
        raise ValueError(f"quantize_float writes q8_0, q4_0 or q4_k, not {name}")
    groups = w.reshape(out, inp // 256, 8, 32)
    low = np.minimum(groups.min(-1), 0)  # Q4_K's min is subtracted: the grid starts at or below zero
    step, floor = (groups.max(-1) - low) / 15, -low  # [out, blocks, 8]
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = (floor.max(-1) / 63).astype(np.float16)
    scales = np.clip(np.rint(step / np.maximum(d[..., None].astype(np.float32), 1e-30)), 0, 63)
    mins = np.clip(np.rint(floor / np.maximum(dmin[..., None].astype(np.float32), 1e-30)), 0, 63)
    unit = d[..., None].astype(np.float32) * scales  # [out, blocks, 8] the grid step each group got
    offset = dmin[..., None].astype(np.float32) * mins
    codes = np.rint((groups + offset[..., None]) / np.maximum(unit, 1e-30)[..., None])
    codes = np.clip(np.where(unit[..., None] > 0, codes, 0), 0, 15)
    return pack(fmt, codes.reshape(out, inp), d, dmin, scales.reshape(out, -1), mins.reshape(out, -1))


def narrowed(packed: PackedWeight, name: str) -> PackedWeight:
    """`packed` written again in `name`'s blocks where it is stored in more bits per weight and its input dimension
    is a whole number of `name`'s superblocks; else `packed` itself. For a draft model: fewer bytes per guess."""
    fmt = FORMATS[name]
    if packed.format.bits_per_weight <= fmt.bits_per_weight or packed.shape[1] % fmt.superblock:
        return packed
    return quantize_float(packed.dequantize(), name)


def with_rows(packed: PackedWeight, order: Tensor) -> PackedWeight:
    """The same weight with its output rows reordered (GGUF's llama Q/K row permutation undone)."""
    return replace(packed, **{name: getattr(packed, name)[order] if getattr(packed, name).numel() else
                              getattr(packed, name) for name in ("qs", "qh", "scales", "mins", "d", "dmin")})
