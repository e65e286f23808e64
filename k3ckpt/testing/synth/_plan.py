"""Tensor plans: which tensors a :class:`SynthSpec` has, in which order and adjacency groups
(:class:`Unit`), and how each tensor's bytes are made (seeded by its name: :func:`tensor_rng`),
lazily, so a shard is generated only when it is written.

MXFP4 experts are quantized from seeded random weights with compressed-tensors' MXFP4 rule
(``quantize_mxfp4``); Kimi-K2 weights are DeepSeek-V3 block FP8; the engine families
(``deepseek_v3``, ``qwen3_moe``) are plain BF16 or F32 drawn with :data:`ENGINE_STD`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ...errors import SynthError
from ...format.header import TensorSpec
from ._spec import SynthSpec

Maker = Callable[[], np.ndarray]

#: The standard deviation of the engine families' weights and embeddings. Large enough that the
#: tiny random model's logits have clear winners, so greedy tokens do not flip on float rounding:
#: with it fp32 vLLM equals transformers token for token (#26).
ENGINE_STD = 0.08


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
            elif kind == "engine":
                x = rng.standard_normal(ts.shape, dtype=np.float32) * np.float32(ENGINE_STD)
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

    # -- the engine families: DeepSeek-V3 / Kimi-K2 and Qwen3-MoE, BF16 or F32 ------------------

    def _w(self, name: str, shape: tuple[int, ...], kind: str = "engine") -> PlannedTensor:
        return self._t(name, self.spec.dtype, shape, kind)

    def _engine_mlp(self, prefix: str, inter: int) -> list[PlannedTensor]:
        h = self.spec.hidden_size
        return [self._w(prefix + "gate_proj.weight", (inter, h)), self._w(prefix + "up_proj.weight", (inter, h)),
                self._w(prefix + "down_proj.weight", (h, inter))]

    def deepseek_units(self) -> Iterator[Unit]:
        """Names of vLLM's ``DeepseekV2Model.load_weights`` (``deepseek_v2.py``) and of the
        published Kimi-K2 / DeepSeek-V3, whose FP8 ``weight_scale_inv`` tensors are absent here."""
        s, w = self.spec, self._w
        h, nh = s.hidden_size, s.num_attention_heads
        yield Unit("embed", [w("model.embed_tokens.weight", (s.vocab_size, h))])
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}."
            a = p + "self_attn."
            ts = [
                w(p + "input_layernorm.weight", (h,), "norm"),
                w(p + "post_attention_layernorm.weight", (h,), "norm"),
                w(a + "q_a_proj.weight", (s.q_lora_rank, h)),
                w(a + "q_a_layernorm.weight", (s.q_lora_rank,), "norm"),
                w(a + "q_b_proj.weight", (nh * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.q_lora_rank)),
                w(a + "kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_head_dim, h)),
                w(a + "kv_a_layernorm.weight", (s.kv_lora_rank,), "norm"),
                w(a + "kv_b_proj.weight", (nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)),
                w(a + "o_proj.weight", (h, nh * s.v_head_dim)),
            ]
            group, m = f"layer.{layer}", p + "mlp."
            if layer < s.first_k_dense:
                yield Unit(group, _dtype_ordered(ts + self._engine_mlp(m, s.intermediate_size)))
                continue
            # The gate's correction bias is F32 in the published checkpoints (and in vLLM's module).
            ts += [w(m + "gate.weight", (s.num_experts, h)),
                   self._t(m + "gate.e_score_correction_bias", "F32", (s.num_experts,), "zeros_bias")]
            if s.num_shared_experts:
                ts += self._engine_mlp(m + "shared_experts.", s.moe_intermediate_size * s.num_shared_experts)
            yield Unit(group, _dtype_ordered(ts))
            for ex in range(s.num_experts):
                yield Unit(group, self._engine_mlp(f"{m}experts.{ex}.", s.moe_intermediate_size))
        yield Unit("head", [w("model.norm.weight", (h,), "norm"), w("lm_head.weight", (s.vocab_size, h))])

    def qwen3moe_units(self) -> Iterator[Unit]:
        """Names of vLLM's ``Qwen3MoeModel.load_weights`` (``qwen3_moe.py``) and of the published
        Qwen3-MoE checkpoints: q/k/v/o projections, per-head ``q_norm``/``k_norm``, ``mlp.gate``
        and ``mlp.experts.E.{gate,up,down}_proj``."""
        s, w = self.spec, self._w
        h, nh, hd = s.hidden_size, s.num_attention_heads, s.kda_head_dim
        kvh = max(1, nh // 4)
        yield Unit("embed", [w("model.embed_tokens.weight", (s.vocab_size, h))])
        for layer in range(s.num_layers):
            p = f"model.layers.{layer}."
            a, m = p + "self_attn.", p + "mlp."
            yield Unit(f"layer.{layer}", [
                w(p + "input_layernorm.weight", (h,), "norm"),
                w(p + "post_attention_layernorm.weight", (h,), "norm"),
                w(a + "q_proj.weight", (nh * hd, h)), w(a + "k_proj.weight", (kvh * hd, h)),
                w(a + "v_proj.weight", (kvh * hd, h)), w(a + "o_proj.weight", (h, nh * hd)),
                w(a + "q_norm.weight", (hd,), "norm"), w(a + "k_norm.weight", (hd,), "norm"),
                w(m + "gate.weight", (s.num_experts, h)),
            ])
            for ex in range(s.num_experts):
                yield Unit(f"layer.{layer}", self._engine_mlp(f"{m}experts.{ex}.", s.moe_intermediate_size))
        yield Unit("head", [w("model.norm.weight", (h,), "norm"), w("lm_head.weight", (s.vocab_size, h))])

    def units(self) -> list[Unit]:
        gen = {"kimi_k3": self.k3_units, "gpt_oss": self.gptoss_units, "kimi_k2": self.k2_units,
               "deepseek_v3": self.deepseek_units, "qwen3_moe": self.qwen3moe_units}.get(self.spec.family)
        if gen is None:
            raise SynthError(f"unknown family {self.spec.family!r}; choose kimi_k3, gpt_oss, kimi_k2, deepseek_v3 "
                             "or qwen3_moe")
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
        from ...mx.codec import quantize_mxfp4

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
