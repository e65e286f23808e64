"""Deterministic synthetic checkpoints shaped like Kimi K3 (and, so nothing gets hard-wired to
one family, like gpt-oss and Kimi-K2/DeepSeek-V3 FP8).

A synthetic checkpoint has the real config structure, the real tensor names, dtypes and shard
naming; its MXFP4 experts are quantized from seeded random weights with compressed-tensors'
MXFP4 rule (the one that made K3's experts; see ``quantize_mxfp4``), and
each expert's six tensors are adjacent in one shard. Every tensor's data depends only on the
seed and its name, so shards can be written in parallel and any one tensor can be regenerated.

``headers_only`` writes real headers followed by a hole (``ftruncate``): the ``k3-full`` preset
is the real K3 inventory - 93 layers, 896 experts, 96 shards, ~497k tensors, ~1.56 TB apparent -
at almost no disk cost, so every metadata path can be exercised at true scale. Holes read as
zeros, which is valid MXFP4 (code 0, scale 2**-127).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import SynthError
from ..format.header import TensorSpec, build_header
from ..utils import atomic_output, write_atomic

Maker = Callable[[], np.ndarray]


@dataclass(frozen=True)
class SynthSpec:
    """Shape of a synthetic checkpoint. Defaults are Kimi K3's (k3-checkpoint.md)."""

    family: str = "kimi_k3"  # kimi_k3 | gpt_oss | kimi_k2
    num_layers: int = 93
    hidden_size: int = 7168
    intermediate_size: int = 33792  # dense MLP of the first_k_dense layers
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584  # K3 latent MoE width; 0 = experts run at hidden_size
    num_experts: int = 896
    experts_per_token: int = 16
    num_shared_experts: int = 2
    first_k_dense: int = 1
    vocab_size: int = 163840
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    full_attn_every: int = 4  # 1-based layers k*every are MLA, plus the last layer
    vision_layers: int = 27
    vision_hidden_size: int = 1152
    vision_intermediate_size: int = 4304
    vision_patch_size: int = 14
    num_shards: int = 0  # 0: one shard per layer plus embed / head / vision shards (K3's layout)
    seed: int = 0
    headers_only: bool = False

    @property
    def expert_width(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def validate(self) -> None:
        if self.num_layers < 1 or self.hidden_size < 1:
            raise SynthError("layers and hidden size must be positive")
        if self.family in ("kimi_k3", "gpt_oss"):
            for what, n in (("expert width", self.expert_width), ("moe_intermediate_size", self.moe_intermediate_size)):
                if n % 32:
                    raise SynthError(f"{what} {n} is not a multiple of the MXFP4 block size 32")
        if self.experts_per_token > self.num_experts:
            raise SynthError(
                f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}"
            )
        if self.num_shards < 0:
            raise SynthError("num_shards must be >= 0")


PRESETS: dict[str, SynthSpec] = {
    "k3-full": SynthSpec(headers_only=True),
    "k3-small": SynthSpec(
        num_layers=9, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        routed_expert_hidden_size=512, num_experts=256, experts_per_token=8, num_shared_experts=1,
        vocab_size=32768, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, kda_num_heads=8, kda_head_dim=128,
        vision_layers=2, vision_hidden_size=256, vision_intermediate_size=512,
    ),
    "k3-tiny": SynthSpec(
        num_layers=5, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        routed_expert_hidden_size=128, num_experts=16, experts_per_token=4, num_shared_experts=1,
        vocab_size=1024, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kda_num_heads=4, kda_head_dim=32,
        vision_layers=1, vision_hidden_size=64, vision_intermediate_size=128,
    ),
    "gptoss-tiny": SynthSpec(
        family="gpt_oss", num_layers=4, hidden_size=256, intermediate_size=0, moe_intermediate_size=256,
        routed_expert_hidden_size=0, num_experts=8, experts_per_token=2, num_shared_experts=0,
        first_k_dense=0, vocab_size=1024, num_attention_heads=4, kda_head_dim=64, vision_layers=0,
        num_shards=3,
    ),
    "k2-tiny": SynthSpec(
        family="kimi_k2", num_layers=4, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        routed_expert_hidden_size=0, num_experts=8, experts_per_token=2, num_shared_experts=1,
        vocab_size=1024, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vision_layers=0, num_shards=3,
    ),
}


# ---------------------------------------------------------------------------------------------
# Tensor plans


@dataclass
class PlannedTensor:
    spec: TensorSpec
    make: Maker | None  # None: headers-only


@dataclass
class Unit:
    """Tensors that must stay adjacent in one shard (an expert; a layer's other tensors)."""

    group: str  # "embed", "layer.N", "head", "vision", "projector"
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.spec.nbytes for t in self.tensors)


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


class Planner:
    """Builds the ordered units of a checkpoint; each tensor gets a lazy data maker."""

    def __init__(self, spec: SynthSpec) -> None:
        self.spec = spec

    def _t(self, name: str, dtype: str, shape: tuple[int, ...], kind: str = "linear") -> PlannedTensor:
        ts = TensorSpec(name, dtype, tuple(int(d) for d in shape))
        if self.spec.headers_only:
            return PlannedTensor(ts, None)
        seed = self.spec.seed

        def make() -> np.ndarray:
            rng = tensor_rng(seed, name)
            if kind == "norm":
                x = 1.0 + 0.01 * rng.standard_normal(ts.shape, dtype=np.float32)
            elif kind == "alog":
                x = np.log(rng.uniform(1.0, 16.0, ts.shape)).astype(np.float32)
            elif kind == "zeros_bias":
                x = 0.01 * rng.standard_normal(ts.shape, dtype=np.float32)
            else:
                fan_in = ts.shape[-1] if len(ts.shape) > 1 else 1
                x = rng.standard_normal(ts.shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(fan_in))
            return _cast(x, dtype)

        return PlannedTensor(ts, make)

    def _mxfp4_pair(self, prefix: str, out: int, inn: int) -> list[PlannedTensor]:
        """``prefix.weight_packed`` [out, in/2] + ``prefix.weight_scale`` [out, in/32] (compressed-tensors)."""
        packed = TensorSpec(prefix + ".weight_packed", "U8", (out, inn // 2))
        scale = TensorSpec(prefix + ".weight_scale", "U8", (out, inn // 32))
        if self.spec.headers_only:
            return [PlannedTensor(packed, None), PlannedTensor(scale, None)]
        pair = _LazyQuantized(self.spec.seed, prefix, (out, inn))
        return [PlannedTensor(packed, lambda: pair.get(0)), PlannedTensor(scale, lambda: pair.get(1))]

    def _fp8_pair(self, prefix: str, out: int, inn: int) -> list[PlannedTensor]:
        """``prefix.weight`` F8_E4M3 + ``prefix.weight_scale_inv`` F32 per 128x128 block (DeepSeek-V3)."""
        w = TensorSpec(prefix + ".weight", "F8_E4M3", (out, inn))
        s = TensorSpec(prefix + ".weight_scale_inv", "F32", (-(-out // 128), -(-inn // 128)))
        if self.spec.headers_only:
            return [PlannedTensor(w, None), PlannedTensor(s, None)]
        pair = _LazyFP8(self.spec.seed, prefix, (out, inn))
        return [PlannedTensor(w, lambda: pair.get(0)), PlannedTensor(s, lambda: pair.get(1))]

    # -- K3 ---------------------------------------------------------------------------------

    def k3_units(self) -> Iterator[Unit]:
        s = self.spec
        lm = "language_model.model."
        yield Unit("embed", [self._t(lm + "embed_tokens.weight", "BF16", (s.vocab_size, s.hidden_size))])
        for layer in range(s.num_layers):
            yield from self._k3_layer(layer)
        yield Unit("head", [
            self._t(lm + "norm.weight", "BF16", (s.hidden_size,), "norm"),
            self._t("language_model.lm_head.weight", "BF16", (s.vocab_size, s.hidden_size)),
        ])
        yield from self._vision_units()

    def k3_full_attn_layers(self) -> list[int]:
        """1-based MLA layers: every ``full_attn_every``-th and the last."""
        s = self.spec
        full = [i for i in range(1, s.num_layers + 1) if s.full_attn_every and i % s.full_attn_every == 0]
        if s.num_layers not in full:
            full.append(s.num_layers)
        return full

    def _k3_layer(self, layer: int) -> Iterator[Unit]:
        s = self.spec
        h = s.hidden_size
        p = f"language_model.model.layers.{layer}."
        t = self._t
        ts = [
            t(p + "input_layernorm.weight", "BF16", (h,), "norm"),
            t(p + "post_attention_layernorm.weight", "BF16", (h,), "norm"),
            t(p + "self_attention_res_norm.weight", "BF16", (h,), "norm"),
            t(p + "self_attention_res_proj.weight", "BF16", (1, h)),
            t(p + "mlp_res_norm.weight", "BF16", (h,), "norm"),
            t(p + "mlp_res_proj.weight", "BF16", (1, h)),
        ]
        a = p + "self_attn."
        if (layer + 1) in self.k3_full_attn_layers():
            nh, qk = s.num_attention_heads, s.qk_nope_head_dim + s.qk_rope_head_dim
            ts += [
                t(a + "q_a_proj.weight", "BF16", (s.q_lora_rank, h)),
                t(a + "q_a_layernorm.weight", "BF16", (s.q_lora_rank,), "norm"),
                t(a + "q_b_proj.weight", "BF16", (nh * qk, s.q_lora_rank)),
                t(a + "kv_a_proj_with_mqa.weight", "BF16", (s.kv_lora_rank + s.qk_rope_head_dim, h)),
                t(a + "kv_a_layernorm.weight", "BF16", (s.kv_lora_rank,), "norm"),
                t(a + "kv_b_proj.weight", "BF16", (nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)),
                t(a + "g_proj.weight", "BF16", (nh * s.v_head_dim, h)),
                t(a + "o_proj.weight", "BF16", (h, nh * s.v_head_dim)),
            ]
        else:
            kh, kd = s.kda_num_heads, s.kda_head_dim
            w = kh * kd
            ts += [
                t(a + "q_proj.weight", "BF16", (w, h)),
                t(a + "k_proj.weight", "BF16", (w, h)),
                t(a + "v_proj.weight", "BF16", (w, h)),
                t(a + "q_conv1d.weight", "F32", (w, 1, s.short_conv_kernel_size)),
                t(a + "k_conv1d.weight", "F32", (w, 1, s.short_conv_kernel_size)),
                t(a + "v_conv1d.weight", "F32", (w, 1, s.short_conv_kernel_size)),
                t(a + "f_a_proj.weight", "BF16", (kd, h)),
                t(a + "f_b_proj.weight", "BF16", (w, kd)),
                t(a + "b_proj.weight", "BF16", (kh, h)),
                t(a + "g_proj.weight", "BF16", (w, h)),
                t(a + "A_log", "F32", (kd,), "alog"),
                t(a + "dt_bias", "F32", (w,), "zeros_bias"),
                t(a + "o_norm.weight", "F32", (kd,), "norm"),
                t(a + "o_proj.weight", "BF16", (h, w)),
            ]
        group = f"layer.{layer}"
        if layer < s.first_k_dense:
            m = p + "mlp."
            ts += [
                t(m + "gate_proj.weight", "BF16", (s.intermediate_size, h)),
                t(m + "up_proj.weight", "BF16", (s.intermediate_size, h)),
                t(m + "down_proj.weight", "BF16", (h, s.intermediate_size)),
            ]
            yield Unit(group, _dtype_ordered(ts))
            return
        m = p + "block_sparse_moe."
        e, x, inter = s.num_experts, s.expert_width, s.moe_intermediate_size
        shared = inter * s.num_shared_experts
        ts += [
            t(m + "gate.weight", "BF16", (e, h)),
            t(m + "gate.e_score_correction_bias", "F32", (e,), "zeros_bias"),
        ]
        if s.routed_expert_hidden_size:
            ts += [
                t(m + "routed_expert_down_proj.weight", "BF16", (x, h)),
                t(m + "routed_expert_up_proj.weight", "BF16", (h, x)),
                t(m + "routed_expert_norm.weight", "BF16", (x,), "norm"),
            ]
        if shared:
            ts += [
                t(m + "shared_experts.gate_proj.weight", "BF16", (shared, h)),
                t(m + "shared_experts.up_proj.weight", "BF16", (shared, h)),
                t(m + "shared_experts.down_proj.weight", "BF16", (h, shared)),
            ]
        yield Unit(group, _dtype_ordered(ts))
        for ex in range(e):
            q = f"{m}experts.{ex}."
            yield Unit(group, [
                *self._mxfp4_pair(q + "w1", inter, x),
                *self._mxfp4_pair(q + "w2", x, inter),
                *self._mxfp4_pair(q + "w3", inter, x),
            ])

    def _vision_units(self) -> Iterator[Unit]:
        s = self.spec
        if not s.vision_layers:
            return
        v, vi, t = s.vision_hidden_size, s.vision_intermediate_size, self._t
        ts = [
            t("vision_tower.patch_embed.proj.weight", "BF16", (v, 3, s.vision_patch_size, s.vision_patch_size)),
            t("vision_tower.patch_embed.proj.bias", "BF16", (v,), "zeros_bias"),
            t("vision_tower.patch_embed.pos_emb.weight", "BF16", (64, 64, v)),
        ]
        for b in range(s.vision_layers):
            q = f"vision_tower.encoder.blocks.{b}."
            ts += [
                t(q + "norm0.weight", "BF16", (v,), "norm"), t(q + "norm0.bias", "BF16", (v,), "zeros_bias"),
                t(q + "norm1.weight", "BF16", (v,), "norm"), t(q + "norm1.bias", "BF16", (v,), "zeros_bias"),
                t(q + "wqkv.weight", "BF16", (3 * v, v)), t(q + "wqkv.bias", "BF16", (3 * v,), "zeros_bias"),
                t(q + "wo.weight", "BF16", (v, v)), t(q + "wo.bias", "BF16", (v,), "zeros_bias"),
                t(q + "mlp.fc0.weight", "BF16", (vi, v)), t(q + "mlp.fc0.bias", "BF16", (vi,), "zeros_bias"),
                t(q + "mlp.fc1.weight", "BF16", (v, vi)), t(q + "mlp.fc1.bias", "BF16", (v,), "zeros_bias"),
            ]
        ts += [
            t("vision_tower.encoder.final_layernorm.weight", "BF16", (v,), "norm"),
            t("vision_tower.encoder.final_layernorm.bias", "BF16", (v,), "zeros_bias"),
        ]
        yield Unit("vision", ts)
        h = s.hidden_size
        yield Unit("projector", [
            t("mm_projector.pre_norm.weight", "BF16", (v,), "norm"),
            t("mm_projector.pre_norm.bias", "BF16", (v,), "zeros_bias"),
            t("mm_projector.proj.0.weight", "BF16", (h, 4 * v)),
            t("mm_projector.proj.0.bias", "BF16", (h,), "zeros_bias"),
            t("mm_projector.proj.2.weight", "BF16", (h, h)),
            t("mm_projector.proj.2.bias", "BF16", (h,), "zeros_bias"),
        ])

    # -- gpt-oss ----------------------------------------------------------------------------

    def gptoss_units(self) -> Iterator[Unit]:
        s = self.spec
        h, e, inter, t = s.hidden_size, s.num_experts, s.moe_intermediate_size, self._t
        nh, hd = s.num_attention_heads, s.kda_head_dim
        kvh = max(1, nh // 4)
        yield Unit("embed", [t("model.embed_tokens.weight", "BF16", (s.vocab_size, h))])
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}."
            a = p + "self_attn."
            ts = [
                t(p + "input_layernorm.weight", "BF16", (h,), "norm"),
                t(p + "post_attention_layernorm.weight", "BF16", (h,), "norm"),
                t(a + "q_proj.weight", "BF16", (nh * hd, h)), t(a + "q_proj.bias", "BF16", (nh * hd,), "zeros_bias"),
                t(a + "k_proj.weight", "BF16", (kvh * hd, h)), t(a + "k_proj.bias", "BF16", (kvh * hd,), "zeros_bias"),
                t(a + "v_proj.weight", "BF16", (kvh * hd, h)), t(a + "v_proj.bias", "BF16", (kvh * hd,), "zeros_bias"),
                t(a + "o_proj.weight", "BF16", (h, nh * hd)), t(a + "o_proj.bias", "BF16", (h,), "zeros_bias"),
                t(a + "sinks", "BF16", (nh,), "zeros_bias"),
                t(p + "mlp.router.weight", "BF16", (e, h)), t(p + "mlp.router.bias", "BF16", (e,), "zeros_bias"),
            ]
            x = p + "mlp.experts."
            ts += [t(x + "gate_up_proj_bias", "BF16", (e, 2 * inter), "zeros_bias"),
                   t(x + "down_proj_bias", "BF16", (e, h), "zeros_bias")]
            ts += self._gptoss_blocks(x + "gate_up_proj", e, 2 * inter, h)
            ts += self._gptoss_blocks(x + "down_proj", e, h, inter)
            yield Unit(f"layer.{layer}", _dtype_ordered(ts))
        yield Unit("head", [t("model.norm.weight", "BF16", (h,), "norm"), t("lm_head.weight", "BF16", (s.vocab_size, h))])

    def _gptoss_blocks(self, prefix: str, e: int, out: int, inn: int) -> list[PlannedTensor]:
        blocks = TensorSpec(prefix + "_blocks", "U8", (e, out, inn // 32, 16))
        scales = TensorSpec(prefix + "_scales", "U8", (e, out, inn // 32))
        if self.spec.headers_only:
            return [PlannedTensor(blocks, None), PlannedTensor(scales, None)]
        pair = _LazyQuantized(self.spec.seed, prefix, (e, out, inn))
        return [
            PlannedTensor(blocks, lambda: pair.get(0).reshape(blocks.shape)),
            PlannedTensor(scales, lambda: pair.get(1)),
        ]

    # -- Kimi-K2 / DeepSeek-V3 FP8 ------------------------------------------------------------

    def k2_units(self) -> Iterator[Unit]:
        s = self.spec
        h, t = s.hidden_size, self._t
        nh = s.num_attention_heads
        yield Unit("embed", [t("model.embed_tokens.weight", "BF16", (s.vocab_size, h))])
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}."
            a = p + "self_attn."
            ts = [
                t(p + "input_layernorm.weight", "BF16", (h,), "norm"),
                t(p + "post_attention_layernorm.weight", "BF16", (h,), "norm"),
                *self._fp8_pair(a + "q_a_proj", s.q_lora_rank, h),
                t(a + "q_a_layernorm.weight", "BF16", (s.q_lora_rank,), "norm"),
                *self._fp8_pair(a + "q_b_proj", nh * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.q_lora_rank),
                *self._fp8_pair(a + "kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h),
                t(a + "kv_a_layernorm.weight", "BF16", (s.kv_lora_rank,), "norm"),
                *self._fp8_pair(a + "kv_b_proj", nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
                *self._fp8_pair(a + "o_proj", h, nh * s.v_head_dim),
            ]
            group = f"layer.{layer}"
            m = p + "mlp."
            if layer < s.first_k_dense:
                ts += [*self._fp8_pair(m + "gate_proj", s.intermediate_size, h),
                       *self._fp8_pair(m + "up_proj", s.intermediate_size, h),
                       *self._fp8_pair(m + "down_proj", h, s.intermediate_size)]
                yield Unit(group, _dtype_ordered(ts))
                continue
            inter, shared = s.moe_intermediate_size, s.moe_intermediate_size * s.num_shared_experts
            ts += [t(m + "gate.weight", "BF16", (s.num_experts, h)),
                   t(m + "gate.e_score_correction_bias", "F32", (s.num_experts,), "zeros_bias")]
            if shared:
                ts += [*self._fp8_pair(m + "shared_experts.gate_proj", shared, h),
                       *self._fp8_pair(m + "shared_experts.up_proj", shared, h),
                       *self._fp8_pair(m + "shared_experts.down_proj", h, shared)]
            yield Unit(group, _dtype_ordered(ts))
            for ex in range(s.num_experts):
                q = f"{m}experts.{ex}."
                yield Unit(group, [*self._fp8_pair(q + "gate_proj", inter, h),
                                   *self._fp8_pair(q + "down_proj", h, inter),
                                   *self._fp8_pair(q + "up_proj", inter, h)])
        yield Unit("head", [t("model.norm.weight", "BF16", (h,), "norm"), t("lm_head.weight", "BF16", (s.vocab_size, h))])

    def units(self) -> list[Unit]:
        gen = {"kimi_k3": self.k3_units, "gpt_oss": self.gptoss_units, "kimi_k2": self.k2_units}.get(self.spec.family)
        if gen is None:
            raise SynthError(f"unknown family {self.spec.family!r}; choose kimi_k3, gpt_oss or kimi_k2")
        return list(gen())


_ALIGN_ORDER = {"F64": 0, "I64": 0, "U64": 0, "C64": 0, "F32": 1, "I32": 1, "U32": 1, "BF16": 2, "F16": 2}


def _dtype_ordered(ts: list[PlannedTensor]) -> list[PlannedTensor]:
    # Wider dtypes first so every tensor starts at a multiple of its element size.
    return sorted(ts, key=lambda t: _ALIGN_ORDER.get(t.spec.dtype, 3))


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    np_dtype = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16}[dtype]
    return x.astype(np_dtype)


class _LazyQuantized:
    """Quantizes one seeded random weight matrix once and hands out packed data then scales."""

    def __init__(self, seed: int, name: str, shape: tuple[int, ...]) -> None:
        self.seed, self.name, self.shape = seed, name, shape
        self._pair: tuple[np.ndarray, np.ndarray] | None = None

    def get(self, i: int) -> np.ndarray:
        from ..mx.codec import quantize_mxfp4

        if self._pair is None:
            w = tensor_rng(self.seed, self.name).standard_normal(self.shape, dtype=np.float32)
            w *= np.float32(1.0 / math.sqrt(self.shape[-1]))
            self._pair = quantize_mxfp4(w)
        out = self._pair[i]
        if i == 1:
            self._pair = None  # scales come last: free the pair
        return out


class _LazyFP8:
    """DeepSeek-V3 block FP8: ``weight`` e4m3 and ``weight_scale_inv`` = amax/448 per 128x128 block."""

    def __init__(self, seed: int, name: str, shape: tuple[int, int]) -> None:
        self.seed, self.name, self.shape = seed, name, shape
        self._pair: tuple[np.ndarray, np.ndarray] | None = None

    def get(self, i: int) -> np.ndarray:
        if self._pair is None:
            out, inn = self.shape
            w = tensor_rng(self.seed, self.name).standard_normal(self.shape, dtype=np.float32) / np.float32(math.sqrt(inn))
            bo, bi = -(-out // 128), -(-inn // 128)
            padded = np.zeros((bo * 128, bi * 128), np.float32)
            padded[:out, :inn] = w
            blocks = padded.reshape(bo, 128, bi, 128)
            amax = np.abs(blocks).max(axis=(1, 3))
            scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
            q = (blocks / scale[:, None, :, None]).reshape(bo * 128, bi * 128)[:out, :inn]
            self._pair = (q.astype(ml_dtypes.float8_e4m3fn), scale)
        out_arr = self._pair[i]
        if i == 1:
            self._pair = None
        return out_arr


# ---------------------------------------------------------------------------------------------
# Sharding, config, writing


def shard_name(family: str, i: int, n: int) -> str:
    """File name of shard ``i`` (0-based) of ``n``, in the family's own style."""
    if family == "kimi_k3":
        return f"model-{i + 1:05d}-of-{n:06d}.safetensors"
    if family == "gpt_oss":
        return f"model-{i:05d}-of-{n - 1:05d}.safetensors"
    return f"model-{i + 1}-of-{n}.safetensors"  # Kimi-K2-Instruct style, unpadded


def assign_shards(units: list[Unit], num_shards: int) -> list[list[Unit]]:
    """Group units into shards. ``0``: one shard per group (K3's layout: embed with layer 0, one
    layer per shard, head, vision, projector). Otherwise pack contiguously by size."""
    if num_shards == 0:
        shards: list[list[Unit]] = []
        last = None
        for u in units:
            if u.group != last and not (last == "embed" and u.group == "layer.0"):
                shards.append([])
            shards[-1].append(u)
            last = u.group
        return shards
    total = sum(u.nbytes for u in units)
    target = total / num_shards
    if num_shards > len(units):
        raise SynthError(f"{num_shards} shards requested but only {len(units)} units to place")
    shards = [[]]
    acc = 0
    for k, u in enumerate(units):
        remaining_units = len(units) - k
        remaining_shards = num_shards - len(shards)
        if shards[-1] and (acc >= target * len(shards) or remaining_units <= remaining_shards):
            shards.append([])
        shards[-1].append(u)
        acc += u.nbytes
    return shards


def make_config(spec: SynthSpec) -> dict:
    """A config.json with the real structure of the family."""
    s = spec
    if s.family == "gpt_oss":
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "intermediate_size": s.moe_intermediate_size, "num_local_experts": s.num_experts,
            "num_experts_per_tok": s.experts_per_token, "experts_per_token": s.experts_per_token,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": max(1, s.num_attention_heads // 4),
            "head_dim": s.kda_head_dim, "vocab_size": s.vocab_size, "tie_word_embeddings": False,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.num_layers)],
            "sliding_window": 128, "rope_theta": 150000, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
        }
    if s.family == "kimi_k2":
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
            "n_routed_experts": s.num_experts, "num_experts_per_tok": s.experts_per_token,
            "n_shared_experts": s.num_shared_experts, "first_k_dense_replace": s.first_k_dense,
            "moe_layer_freq": 1, "num_attention_heads": s.num_attention_heads,
            "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
            "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
            "v_head_dim": s.v_head_dim, "vocab_size": s.vocab_size, "tie_word_embeddings": False,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]},
        }
    full = Planner(s).k3_full_attn_layers()
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "kimi_linear",
            "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "vocab_size": s.vocab_size,
            "tie_word_embeddings": False, "max_position_embeddings": 1048576,
            "num_experts": s.num_experts, "num_experts_per_token": s.experts_per_token,
            "num_shared_experts": s.num_shared_experts, "moe_intermediate_size": s.moe_intermediate_size,
            "routed_expert_hidden_size": s.routed_expert_hidden_size, "first_k_dense_replace": s.first_k_dense,
            "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
            "num_attention_heads": s.num_attention_heads, "q_lora_rank": s.q_lora_rank,
            "kv_lora_rank": s.kv_lora_rank, "qk_nope_head_dim": s.qk_nope_head_dim,
            "qk_rope_head_dim": s.qk_rope_head_dim, "v_head_dim": s.v_head_dim,
            "linear_attn_config": {
                "num_heads": s.kda_num_heads, "head_dim": s.kda_head_dim,
                "short_conv_kernel_size": s.short_conv_kernel_size,
                "kda_layers": [i for i in range(1, s.num_layers + 1) if i not in full],
                "full_attn_layers": full,
            },
        },
        "vision_config": {"model_type": "moonvit", "hidden_size": s.vision_hidden_size,
                          "num_hidden_layers": s.vision_layers, "intermediate_size": s.vision_intermediate_size,
                          "patch_size": s.vision_patch_size} if s.vision_layers else None,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "scale_dtype": "uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*block_sparse_moe\\.gate$",
                       "re:.*routed_expert_(down|up)_proj$", "re:.*mlp\\.(gate|up|down)_proj$",
                       "re:vision_tower.*", "re:mm_projector.*", "language_model.lm_head"],
        },
    }


_LICENSE_K3 = """Modified MIT License

Copyright (c) 2026 Moonshot AI (synthetic fixture generated by k3ckpt; not the real weights)

Permission is hereby granted, free of charge, to any person obtaining a copy of this software
and associated documentation files (the "Software"), to deal in the Software without
restriction, subject to the conditions of the MIT License and to the following modification:
a product or service using the Software with more than 100 million monthly active users or
more than 20 million US dollars of monthly revenue shall prominently display "Kimi K3" on its
user interface.
"""


_TOKENIZATION_KIMI = '''"""Tokenizer shim of the synthetic fixture (k3ckpt synth): the file layout of Kimi's
tiktoken tokenizer (tokenization_kimi.py + tiktoken.model), not its code."""
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
'''


def _tiktoken_model() -> str:
    """A tiktoken BPE file (``base64(token) rank`` per line) of the 256 byte-level tokens."""
    import base64

    return "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))


def _tokenizer_json() -> str:
    """A byte-level BPE ``tokenizer.json`` (the tokenizers library's format) of 256 tokens."""
    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                                             "trim_offsets": True, "use_regex": True},
                       "post_processor": None, "decoder": {"type": "ByteLevel"},
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": True,
                                 "vocab": vocab, "merges": []}}, indent=2) + "\n"


def _tokenizer_files(spec: SynthSpec) -> dict[str, str]:
    """The tokenizer each family ships: Kimi (K3, K2) a tiktoken tokenizer as remote code, gpt-oss
    a tokenizers ``tokenizer.json`` (what :mod:`k3ckpt.format.loadable` requires)."""
    if spec.family == "gpt_oss":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}
        return {"tokenizer_config.json": json.dumps(config, indent=2) + "\n", "tokenizer.json": _tokenizer_json()}
    config = {"tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    return {"tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "tokenization_kimi.py": _TOKENIZATION_KIMI, "tiktoken.model": _tiktoken_model()}


def _side_files(spec: SynthSpec) -> dict[str, str]:
    files = {
        "generation_config.json": json.dumps({"max_length": 1048576, "eos_token_id": 163586}, indent=2) + "\n",
        **_tokenizer_files(spec),
        "special_tokens_map.json": json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]"}, indent=2) + "\n",
    }
    if spec.family == "kimi_k3":
        files["LICENSE"] = _LICENSE_K3
        files["configuration_kimi_k3.py"] = (
            "# Remote-code config shim of the synthetic fixture (k3ckpt synth).\n"
            "from transformers import PretrainedConfig\n\n\n"
            "class KimiK3Config(PretrainedConfig):\n    model_type = \"kimi_k3\"\n"
        )
    else:
        files["LICENSE"] = "Apache License\nVersion 2.0, January 2004\n(synthetic fixture generated by k3ckpt)\n"
    return files


@dataclass
class SynthResult:
    path: Path
    shards: int
    tensors: int
    total_bytes: int
    spec: SynthSpec

    def to_json(self) -> dict:
        return {"path": str(self.path), "shards": self.shards, "tensors": self.tensors,
                "total_bytes": self.total_bytes, "spec": asdict(self.spec)}


def render_synth(res: SynthResult) -> str:
    """What ``k3ckpt synth`` prints: what was written, in one line."""
    from ..utils import human_bytes

    return (f"wrote {res.path}: {res.shards} shards, {res.tensors:,} tensors, "
            f"{human_bytes(res.total_bytes)}{' (sparse, headers only)' if res.spec.headers_only else ''}")


def synthesize(spec: SynthSpec, dest: str | os.PathLike[str], *, jobs: int = 1, force: bool = False,
               progress: Callable[[int], None] | None = None,
               on_plan: Callable[[int], None] | None = None) -> SynthResult:
    """Write the checkpoint described by ``spec`` into ``dest``.

    Args:
        jobs: shards written in parallel (processes; quantization is CPU-bound).
        force: replace an earlier synthetic checkpoint in ``dest`` (never anything else).
        progress, on_plan: called with the tensor bytes to write, then with each shard's tensor
            bytes once it is written (``synth``'s progress bar).

    Raises:
        SynthError: bad spec, or ``dest`` holds a synthetic checkpoint already, without ``force``.
        OutputNotOwnedError: ``dest`` holds files synth did not write (``force`` included).
    """
    spec.validate()
    out = Path(dest)
    if out.exists() and not out.is_dir():
        raise SynthError(f"{out}: exists and is not a directory")
    units = Planner(spec).units()
    shards = assign_shards(units, spec.num_shards)
    n = len(shards)
    names = [shard_name(spec.family, i, n) for i in range(n)]
    if out.is_dir() and any(out.iterdir()):
        _replaceable(out, force)
        for old in out.glob("*.safetensors"):  # an earlier synthetic checkpoint's shards (checked above)
            if old.name not in names:
                old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    total = sum(t.spec.nbytes for u in units for t in u.tensors)
    shard_bytes = [sum(t.spec.nbytes for u in su for t in u.tensors) for su in shards]
    tick = progress or (lambda n: None)
    if on_plan is not None:
        on_plan(total)
    if jobs > 1 and n > 1 and not spec.headers_only:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            jobs_args = [(spec, str(out / nm), i) for i, nm in enumerate(names)]
            for i, _ in enumerate(ex.map(_write_shard_job, jobs_args)):  # in shard order
                tick(shard_bytes[i])
    else:
        for nm, shard_units, size in zip(names, shards, shard_bytes):
            _write_shard(out / nm, shard_units)
            tick(size)

    weight_map = {t.spec.name: nm for nm, su in zip(names, shards) for u in su for t in u.tensors}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(out / "model.safetensors.index.json", json.dumps(index, indent=2).encode() + b"\n")
    write_atomic(out / "config.json", json.dumps(make_config(spec), indent=2).encode() + b"\n")
    for fn, text in _side_files(spec).items():
        write_atomic(out / fn, text.encode())
    return SynthResult(out, n, len(weight_map), sum((out / nm).stat().st_size for nm in names), spec)


#: What every synthetic checkpoint's LICENSE says: synth's ownership mark (the checkpoint's bytes
#: are pinned by fixture manifests, so synth adds no record file of its own).
SYNTH_MARK = "(synthetic fixture generated by k3ckpt"


def _replaceable(out: Path, force: bool) -> None:
    """A non-empty ``out`` is written only when it is an earlier synthetic checkpoint (its
    LICENSE carries :data:`SYNTH_MARK`) holding nothing but synth's files, and with ``force``.

    Raises:
        OutputNotOwnedError: a file synth did not write (``force`` included).
        SynthError: synth's own earlier output, without ``force``.
    """
    from ..errors import OutputNotOwnedError

    try:
        ours = SYNTH_MARK in (out / "LICENSE").read_text(errors="replace")
    except OSError:
        ours = False
    names = sorted(os.listdir(out))
    # what synth writes for any preset: an earlier run may have been of another family
    side = {"config.json", "model.safetensors.index.json"} | {n for sp in PRESETS.values() for n in _side_files(sp)}
    foreign = names if not ours else [
        nm for nm in names if nm not in side and not (nm.startswith("model") and nm.endswith(".safetensors"))]
    if foreign:
        raise OutputNotOwnedError(f"{out}: holds files k3ckpt did not write ({out / foreign[0]}); "
                                  "choose a new or empty directory")
    if not force:
        raise SynthError(f"{out}: holds a synthetic checkpoint already (use --force to replace it)")


def _write_shard_job(args: tuple[SynthSpec, str, int]) -> None:
    spec, path, i = args
    shards = assign_shards(Planner(spec).units(), spec.num_shards)
    _write_shard(Path(path), shards[i])


def _write_shard(path: Path, units: list[Unit]) -> None:
    tensors = [t for u in units for t in u.tensors]
    prefix, offsets = build_header([t.spec for t in tensors], {"format": "pt"})
    # the file object flushes on leaving; then atomic_output syncs and renames
    with atomic_output(path) as fd, open(fd, "wb", closefd=False) as f:
        f.write(prefix)
        data_len = offsets[-1][1] if offsets else 0
        if tensors and tensors[0].make is None:
            f.truncate(len(prefix) + data_len)  # a hole: real header, no data blocks
        else:
            for t in tensors:
                assert t.make is not None  # make is None only with headers_only, for every tensor
                arr = t.make()
                buf = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
                if buf.size != t.spec.nbytes:
                    raise SynthError(f"{t.spec.name}: generated {buf.size} bytes, header says {t.spec.nbytes}")
                f.write(buf.data)


def spec_from_preset(preset: str, **overrides: object) -> SynthSpec:
    """The preset's spec with ``overrides`` (``None`` values ignored) applied."""
    if preset not in PRESETS:
        raise SynthError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    bad = set(changes) - set(SynthSpec.__dataclass_fields__)
    if bad:
        raise SynthError(f"unknown synth option(s): {', '.join(sorted(bad))}")
    # The values are whatever the caller passed (names checked above): mypy cannot match them to the fields.
    return replace(PRESETS[preset], **changes)  # type: ignore[arg-type]
