"""Rotary position embeddings: the frequencies of each rope a family uses (plain, linear, llama3, YaRN; the local
layers' own theta), partial rotary, and the cos / sin tables the model's forwards read."""

from __future__ import annotations

import math

import torch

from specdecode.config import ModelConfig


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """The rotary frequencies of the global layers, or (`local`) of the sliding-window layers (their own theta)."""
    dim = config.rotary_dim or config.head_dim  # partial rotary (Qwen3-Next): the dimensions that turn
    theta = config.rope_local_theta if local else config.rope_theta
    # On the CPU even while a model is built on the meta device: real values, and meta ops import torch's compiler
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = None if local else config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(inv_freq, scaling, theta, dim, config.max_position_embeddings)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, theta: float, dim: int, max_positions: int) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are slowed by `factor`,
    those turning more than beta_fast times kept, a linear ramp over the dimensions between."""
    factor = scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
    old_len = scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(turns: float) -> float:  # the dimension whose frequency turns `turns` times over old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency left as it was
    return (inv_freq / factor) * (1 - kept) + inv_freq * kept


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature; 1 for every other rope)."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def partial_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotary on each head's first rotary_dim dimensions only (cos, sin [B, 1, T, rotary_dim]), the rest passed
    through: q [B, T, H, hd], k [B, T, Hkv, hd] -> (q, k, and cos, sin [B, 1, T, hd] of no rotation, which leave
    every value as it is: x * 1 + y * 0 is x)."""
    rot = cos.shape[-1]
    c, s = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, T, 1, rot]: broadcast over the heads
    q = torch.cat((q[..., :rot] * c + rotate_half(q[..., :rot]) * s, q[..., rot:]), dim=-1)
    k = torch.cat((k[..., :rot] * c + rotate_half(k[..., :rot]) * s, k[..., rot:]), dim=-1)
    shape = (*cos.shape[:-1], head_dim)
    return q, k, cos.new_ones(shape), sin.new_zeros(shape)


ROTARY_BLOCK = 128  # positions a block of the rotary tables holds (each block computed in one tensor operation)


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The rotary angles [..., head_dim] at `positions` [...]: each frequency's, twice (the rotated halves)."""
    freqs = positions[..., None].float() * inv_freq  # [..., hd/2]
    return torch.cat((freqs, freqs), dim=-1)


def scaled_trig(values: torch.Tensor, scale: float) -> torch.Tensor:
    """cos or sin in float32 times the rope's attention factor, where it has one (YaRN's)."""
    return values if scale == 1.0 else values * scale


class RotaryTable:
    """cos and sin [positions, head_dim] of the rotary angles, grown by whole blocks of ROTARY_BLOCK positions,
    each computed alone: a position's bits never depend on when the table grew, and each block is one vectorized
    loop on one thread, as a forward's own angles were."""

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
        self.inv_freq, self.dtype, self.scale = inv_freq, dtype, scale  # scale: rope_attention_factor's
        self.cos = self.sin = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype)

    def upto(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables, covering at least positions [0, need): grown to a power of two when they do not."""
        have = self.cos.shape[0]
        if have < need:
            cos, sin = [self.cos], [self.sin]
            for first in range(have, 1 << max(need - 1, 255).bit_length(), ROTARY_BLOCK):
                angles = rotary_angles(torch.arange(first, first + ROTARY_BLOCK), self.inv_freq)  # [block, hd]
                cos.append(scaled_trig(angles.cos(), self.scale).to(self.dtype))
                sin.append(scaled_trig(angles.sin(), self.scale).to(self.dtype))
            self.cos, self.sin = torch.cat(cos), torch.cat(sin)
        return self.cos, self.sin
