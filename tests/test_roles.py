"""Role classification of tensor names across K3, Kimi-K2/DeepSeek-V3 and gpt-oss, with the
tensor-parallel rule of rank-layout.md, and logical parameter counting."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.header import TensorInfo
from k3ckpt.format.roles import TP, UNKNOWN_ROLE, Kind, Role, classify, logical_params, logical_params_of

C, R, V, P, E = TP.COLUMN, TP.ROW, TP.VOCAB, TP.REPLICATED, TP.EXPERT

K3 = "language_model.model."
K3L = "language_model.model.layers.{n}."
ALT = "language_model.layers.{n}."  # the alternate spelling some loaders use

# (suffix under the layer prefix, kind, tp, proj, part) for every per-layer K3 tensor.
K3_LAYER_TENSORS = [
    ("input_layernorm.weight", Kind.NORM, P, "input_layernorm", "weight"),
    ("post_attention_layernorm.weight", Kind.NORM, P, "post_attention_layernorm", "weight"),
    # attention residuals
    ("self_attention_res_norm.weight", Kind.RESIDUAL, P, "self_attention_res_norm", "weight"),
    ("self_attention_res_proj.weight", Kind.RESIDUAL, P, "self_attention_res_proj", "weight"),
    ("mlp_res_norm.weight", Kind.RESIDUAL, P, "mlp_res_norm", "weight"),
    ("mlp_res_proj.weight", Kind.RESIDUAL, P, "mlp_res_proj", "weight"),
    ("mlp_res_proj", Kind.RESIDUAL, P, "mlp_res_proj", "weight"),
    # KDA
    ("self_attn.q_proj.weight", Kind.ATTENTION, C, "q_proj", "weight"),
    ("self_attn.k_proj.weight", Kind.ATTENTION, C, "k_proj", "weight"),
    ("self_attn.v_proj.weight", Kind.ATTENTION, C, "v_proj", "weight"),
    ("self_attn.q_conv1d.weight", Kind.ATTENTION, P, "q_conv1d", "weight"),
    ("self_attn.k_conv1d.weight", Kind.ATTENTION, P, "k_conv1d", "weight"),
    ("self_attn.v_conv1d.weight", Kind.ATTENTION, P, "v_conv1d", "weight"),
    ("self_attn.f_a_proj.weight", Kind.ATTENTION, P, "f_a_proj", "weight"),
    ("self_attn.f_b_proj.weight", Kind.ATTENTION, C, "f_b_proj", "weight"),
    ("self_attn.b_proj.weight", Kind.ATTENTION, C, "b_proj", "weight"),
    ("self_attn.g_proj.weight", Kind.ATTENTION, C, "g_proj", "weight"),
    ("self_attn.A_log", Kind.ATTENTION, P, "A_log", "weight"),
    ("self_attn.dt_bias", Kind.ATTENTION, P, "dt_bias", "weight"),
    ("self_attn.o_norm.weight", Kind.NORM, P, "o_norm", "weight"),
    ("self_attn.o_proj.weight", Kind.ATTENTION, R, "o_proj", "weight"),
    # MLA
    ("self_attn.q_a_proj.weight", Kind.ATTENTION, P, "q_a_proj", "weight"),
    ("self_attn.q_a_layernorm.weight", Kind.NORM, P, "q_a_layernorm", "weight"),
    ("self_attn.q_b_proj.weight", Kind.ATTENTION, C, "q_b_proj", "weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", Kind.ATTENTION, P, "kv_a_proj_with_mqa", "weight"),
    ("self_attn.kv_a_layernorm.weight", Kind.NORM, P, "kv_a_layernorm", "weight"),
    ("self_attn.kv_b_proj.weight", Kind.ATTENTION, C, "kv_b_proj", "weight"),
    # dense MLP (layer 0)
    ("mlp.gate_proj.weight", Kind.DENSE_MLP, C, "gate", "weight"),
    ("mlp.up_proj.weight", Kind.DENSE_MLP, C, "up", "weight"),
    ("mlp.down_proj.weight", Kind.DENSE_MLP, R, "down", "weight"),
    # MoE: router, latent projections, shared experts
    ("block_sparse_moe.gate.weight", Kind.ROUTER, P, "gate", "weight"),
    ("block_sparse_moe.gate.e_score_correction_bias", Kind.ROUTER_BIAS, P, "gate", "weight"),
    ("block_sparse_moe.routed_expert_down_proj.weight", Kind.LATENT_PROJ, P, "down_proj", "weight"),
    ("block_sparse_moe.routed_expert_up_proj.weight", Kind.LATENT_PROJ, P, "up_proj", "weight"),
    ("block_sparse_moe.routed_expert_norm.weight", Kind.NORM, P, "routed_expert_norm", "weight"),
    ("block_sparse_moe.shared_experts.gate_proj.weight", Kind.SHARED_EXPERT, C, "gate", "weight"),
    ("block_sparse_moe.shared_experts.up_proj.weight", Kind.SHARED_EXPERT, C, "up", "weight"),
    ("block_sparse_moe.shared_experts.down_proj.weight", Kind.SHARED_EXPERT, R, "down", "weight"),
]


@pytest.mark.parametrize("prefix", [K3L, ALT], ids=["language_model.model.layers", "language_model.layers"])
@pytest.mark.parametrize("layer", [0, 7, 92])
@pytest.mark.parametrize("suffix, kind, tp, proj, part", K3_LAYER_TENSORS, ids=[t[0] for t in K3_LAYER_TENSORS])
def test_k3_layer_tensors(prefix: str, layer: int, suffix: str, kind: str, tp: str, proj: str, part: str) -> None:
    role = classify(prefix.format(n=layer) + suffix)
    assert role == Role(kind, tp, layer, None, proj, part)


@pytest.mark.parametrize("prefix", [K3L, ALT], ids=["language_model.model.layers", "language_model.layers"])
@pytest.mark.parametrize("w, proj", [("w1", "gate"), ("w2", "down"), ("w3", "up")])
@pytest.mark.parametrize("part", ["weight_packed", "weight_scale"])
@pytest.mark.parametrize("layer, expert", [(1, 0), (1, 895), (92, 17), (45, 448)])
def test_k3_routed_experts(prefix: str, w: str, proj: str, part: str, layer: int, expert: int) -> None:
    name = prefix.format(n=layer) + f"block_sparse_moe.experts.{expert}.{w}.{part}"
    role = classify(name)
    assert role == Role(Kind.ROUTED_EXPERT, E, layer, expert, proj, part)
    assert role.is_quant_scale == (part == "weight_scale")


def test_routed_expert_ids_are_per_name_not_cached_per_template() -> None:
    a = classify("language_model.model.layers.3.block_sparse_moe.experts.5.w1.weight_packed")
    b = classify("language_model.model.layers.4.block_sparse_moe.experts.6.w1.weight_packed")
    c = classify("language_model.model.layers.3.block_sparse_moe.experts.7.w1.weight_packed")
    assert (a.layer, a.expert, b.layer, b.expert, c.layer, c.expert) == (3, 5, 4, 6, 3, 7)


@pytest.mark.parametrize("name, role", [
    (K3 + "embed_tokens.weight", Role(Kind.EMBEDDING, V, None, None, "embed_tokens", "weight")),
    ("language_model.embed_tokens.weight", Role(Kind.EMBEDDING, V, None, None, "embed_tokens", "weight")),
    (K3 + "norm.weight", Role(Kind.NORM, P, None, None, "norm", "weight")),
    ("language_model.lm_head.weight", Role(Kind.LM_HEAD, V, None, None, "lm_head", "weight")),
    ("vision_tower.patch_embed.proj.weight", Role(Kind.VISION, P)),
    ("vision_tower.encoder.blocks.0.wqkv.weight", Role(Kind.VISION, P)),
    ("vision_tower.encoder.blocks.26.mlp.fc1.weight", Role(Kind.VISION, P)),
    ("vision_tower.encoder.final_layernorm.weight", Role(Kind.VISION, P)),
    ("mm_projector.pre_norm.weight", Role(Kind.PROJECTOR, P)),
    ("mm_projector.proj.0.weight", Role(Kind.PROJECTOR, P)),
    ("mm_projector.proj.2.weight", Role(Kind.PROJECTOR, P)),
])
def test_k3_top_level_vision_projector(name: str, role: Role) -> None:
    got = classify(name)
    assert (got.kind, got.tp, got.layer, got.expert) == (role.kind, role.tp, role.layer, role.expert)
    if role.proj is not None:
        assert got == role


# Kimi-K2 / DeepSeek-V3: per-expert FP8 weights with 128x128 block scales (weight_scale_inv).
K2_NAMES = [
    ("model.embed_tokens.weight", Role(Kind.EMBEDDING, V, None, None, "embed_tokens", "weight")),
    ("model.norm.weight", Role(Kind.NORM, P, None, None, "norm", "weight")),
    ("lm_head.weight", Role(Kind.LM_HEAD, V, None, None, "lm_head", "weight")),
    ("model.layers.0.mlp.gate_proj.weight", Role(Kind.DENSE_MLP, C, 0, None, "gate", "weight")),
    ("model.layers.0.mlp.gate_proj.weight_scale_inv", Role(Kind.DENSE_MLP, C, 0, None, "gate", "weight_scale_inv")),
    ("model.layers.0.mlp.down_proj.weight_scale_inv", Role(Kind.DENSE_MLP, R, 0, None, "down", "weight_scale_inv")),
    ("model.layers.2.self_attn.q_a_proj.weight", Role(Kind.ATTENTION, P, 2, None, "q_a_proj", "weight")),
    ("model.layers.2.self_attn.q_a_proj.weight_scale_inv",
     Role(Kind.ATTENTION, P, 2, None, "q_a_proj", "weight_scale_inv")),
    ("model.layers.2.self_attn.q_b_proj.weight_scale_inv",
     Role(Kind.ATTENTION, C, 2, None, "q_b_proj", "weight_scale_inv")),
    ("model.layers.2.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
     Role(Kind.ATTENTION, P, 2, None, "kv_a_proj_with_mqa", "weight_scale_inv")),
    ("model.layers.2.self_attn.kv_b_proj.weight", Role(Kind.ATTENTION, C, 2, None, "kv_b_proj", "weight")),
    ("model.layers.2.self_attn.o_proj.weight_scale_inv", Role(Kind.ATTENTION, R, 2, None, "o_proj", "weight_scale_inv")),
    ("model.layers.2.self_attn.kv_a_layernorm.weight", Role(Kind.NORM, P, 2, None, "kv_a_layernorm", "weight")),
    ("model.layers.60.mlp.gate.weight", Role(Kind.ROUTER, P, 60, None, "gate", "weight")),
    ("model.layers.60.mlp.gate.e_score_correction_bias", Role(Kind.ROUTER_BIAS, P, 60, None, "gate", "weight")),
    ("model.layers.60.mlp.shared_experts.gate_proj.weight", Role(Kind.SHARED_EXPERT, C, 60, None, "gate", "weight")),
    ("model.layers.60.mlp.shared_experts.down_proj.weight_scale_inv",
     Role(Kind.SHARED_EXPERT, R, 60, None, "down", "weight_scale_inv")),
    ("model.layers.60.mlp.experts.383.gate_proj.weight", Role(Kind.ROUTED_EXPERT, E, 60, 383, "gate", "weight")),
    ("model.layers.60.mlp.experts.383.gate_proj.weight_scale_inv",
     Role(Kind.ROUTED_EXPERT, E, 60, 383, "gate", "weight_scale_inv")),
    ("model.layers.1.mlp.experts.0.up_proj.weight", Role(Kind.ROUTED_EXPERT, E, 1, 0, "up", "weight")),
    ("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv",
     Role(Kind.ROUTED_EXPERT, E, 1, 0, "down", "weight_scale_inv")),
    # DeepSeek-V3 multi-token-prediction layer
    ("model.layers.61.enorm.weight", Role(Kind.MTP, P, 61, None, "enorm", "weight")),
    ("model.layers.61.eh_proj.weight", Role(Kind.MTP, P, 61, None, "eh_proj", "weight")),
    ("model.layers.61.shared_head.head.weight", Role(Kind.MTP, P, 61, None, "shared_head.head", "weight")),
]

# gpt-oss: all experts of a layer stacked in one MXFP4 tensor (blocks + scales) plus BF16 biases.
GPTOSS_NAMES = [
    ("model.layers.5.mlp.experts.gate_up_proj_blocks", Role(Kind.ROUTED_EXPERT, E, 5, None, "gate_up", "blocks")),
    ("model.layers.5.mlp.experts.gate_up_proj_scales", Role(Kind.ROUTED_EXPERT, E, 5, None, "gate_up", "scales")),
    ("model.layers.5.mlp.experts.gate_up_proj_bias", Role(Kind.ROUTED_EXPERT, E, 5, None, "gate_up", "bias")),
    ("model.layers.5.mlp.experts.down_proj_blocks", Role(Kind.ROUTED_EXPERT, E, 5, None, "down", "blocks")),
    ("model.layers.5.mlp.experts.down_proj_scales", Role(Kind.ROUTED_EXPERT, E, 5, None, "down", "scales")),
    ("model.layers.5.mlp.experts.down_proj_bias", Role(Kind.ROUTED_EXPERT, E, 5, None, "down", "bias")),
    ("model.layers.5.mlp.experts.gate_up_proj", Role(Kind.ROUTED_EXPERT, E, 5, None, "gate_up", "weight")),
    ("model.layers.5.mlp.router.weight", Role(Kind.ROUTER, P, 5, None, "router", "weight")),
    ("model.layers.5.mlp.router.bias", Role(Kind.ROUTER, P, 5, None, "router", "bias")),
    ("model.layers.5.self_attn.sinks", Role(Kind.ATTENTION, P, 5, None, "sinks", "weight")),
    ("model.layers.5.self_attn.q_proj.weight", Role(Kind.ATTENTION, C, 5, None, "q_proj", "weight")),
    ("model.layers.5.self_attn.q_proj.bias", Role(Kind.ATTENTION, C, 5, None, "q_proj", "bias")),
    ("model.layers.5.self_attn.k_proj.bias", Role(Kind.ATTENTION, C, 5, None, "k_proj", "bias")),
    ("model.layers.5.self_attn.o_proj.weight", Role(Kind.ATTENTION, R, 5, None, "o_proj", "weight")),
    ("model.layers.23.input_layernorm.weight", Role(Kind.NORM, P, 23, None, "input_layernorm", "weight")),
    ("model.embed_tokens.weight", Role(Kind.EMBEDDING, V, None, None, "embed_tokens", "weight")),
    ("lm_head.weight", Role(Kind.LM_HEAD, V, None, None, "lm_head", "weight")),
]


@pytest.mark.parametrize("name, role", K2_NAMES, ids=[n for n, _ in K2_NAMES])
def test_kimi_k2_fp8(name: str, role: Role) -> None:
    got = classify(name)
    assert got == role
    assert got.is_quant_scale == (role.part == "weight_scale_inv")


@pytest.mark.parametrize("name, role", GPTOSS_NAMES, ids=[n for n, _ in GPTOSS_NAMES])
def test_gptoss(name: str, role: Role) -> None:
    got = classify(name)
    assert got == role
    assert got.expert is None  # stacked: one tensor holds every expert of the layer
    assert got.is_quant_scale == (role.part == "scales")


def test_row_parallel_bias_is_replicated() -> None:
    assert classify("model.layers.5.self_attn.o_proj.bias").tp == P


@pytest.mark.parametrize("name", [
    "",
    "foo",
    "weight",
    ".",
    "...",
    ".experts.",
    "experts.1.w1.weight",
    "model.layers.x.mlp.gate_proj.weight",
    "model.layers.1.mlp.experts.1",
    "model.layers.1.mlp.experts.1.",
    "model.layers.1.mlp.experts.1.w4.weight",
    "model.layers.1.mlp.experts..w1.weight",
    "model.layers.1.mlp.experts.x.w1.weight",
    "model.layers.1.mlp.experts.-1.w1.weight",
    "model.layers.1.mlp.experts.1.w1",
    "model.layers.1.mlp.experts.1.w1.weight_packed.extra",
    "model.layers.1.mlp.experts.1.2.w1.weight",
    "model.layers.1.2.mlp.experts.1.w1.weight",
    "model.layers.1.mlp.experts.gate_up_proj_blocks.0",
    "language_model.model.layers.1.self_attn.q_proj.weight.extra",
    "language_model.model.layers.1.self_attn.unknown_proj.weight",
    "language_model.model.layers.1.self_attn.q_proj.weight_scales",
    "language_model.model.layers.1.block_sparse_moe.routed_expert_gate_proj.weight",
    "layers.1",
    "model.layers.1.mlp.gate_proj",
    "transformer.h.0.attn.c_attn.weight",
    "prefix.language_model.model.embed_tokens.weight",
    "model.layers.1.mlp.experts.١٢x.w1.weight",
])
def test_unknown_names(name: str) -> None:
    role = classify(name)
    assert role == UNKNOWN_ROLE
    assert role.kind == Kind.UNKNOWN and role.layer is None and role.expert is None


@pytest.mark.parametrize("expert", ["\u00b2", "\u2460"])
def test_unknown_never_raises_on_non_decimal_digits(expert: str) -> None:
    assert classify(f"model.layers.1.mlp.experts.{expert}.gate_proj.weight").kind == Kind.UNKNOWN


SEGMENTS = st.sampled_from([
    "model", "language_model", "layers", "experts", "block_sparse_moe", "mlp", "self_attn", "w1", "w2",
    "w3", "gate_proj", "up_proj", "down_proj", "weight", "weight_packed", "weight_scale", "weight_scale_inv",
    "gate", "router", "e_score_correction_bias", "gate_up_proj_blocks", "sinks", "A_log", "vision_tower",
    "mm_projector", "embed_tokens", "lm_head", "norm", "0", "1", "17", "007", "", "x",
]) | st.text(alphabet=st.characters(codec="ascii"), max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(SEGMENTS, max_size=9))
def test_property_classify_never_raises(segments: list[str]) -> None:
    name = ".".join(segments)
    role = classify(name)
    assert isinstance(role, Role)
    assert role.kind in {v for k, v in vars(Kind).items() if k.isupper()}
    if role.layer is not None:
        assert role.layer in [int(x) for x in re.findall(r"\d+", name)]
    # Classification is a function of the name: asking again gives the same answer.
    assert classify(name) == role


# ---------------------------------------------------------------------------------------------
# logical_params


def info(dtype: str, shape: tuple[int, ...]) -> TensorInfo:
    bits = {"U8": 8, "I8": 8, "BF16": 16, "F32": 32, "F8_E4M3": 8}[dtype]
    return TensorInfo("t", dtype, shape, 0, bits * math.prod(shape) // 8, "f.safetensors")


@pytest.mark.parametrize("name, dtype, shape, expected", [
    # K3 MXFP4 experts: two E2M1 values per packed byte, scales are not parameters.
    ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed", "U8", (3072, 1792), 3072 * 3584),
    ("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale", "U8", (3072, 112), 0),
    ("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed", "U8", (3584, 1536), 3584 * 3072),
    ("language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed", "I8", (4, 4), 32),
    # gpt-oss stacked blocks: [E, out, in/32, 16] bytes hold E*out*in values.
    ("model.layers.0.mlp.experts.gate_up_proj_blocks", "U8", (32, 5760, 90, 16), 32 * 5760 * 2880),
    ("model.layers.0.mlp.experts.gate_up_proj_scales", "U8", (32, 5760, 90), 0),
    ("model.layers.0.mlp.experts.gate_up_proj_bias", "BF16", (32, 5760), 32 * 5760),
    # Kimi-K2 FP8: one value per byte, the block scales are not parameters.
    ("model.layers.1.mlp.experts.0.gate_proj.weight", "F8_E4M3", (2048, 7168), 2048 * 7168),
    ("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv", "F32", (16, 56), 0),
    # Dense tensors count their elements.
    ("language_model.model.embed_tokens.weight", "BF16", (163840, 7168), 163840 * 7168),
    ("language_model.model.layers.0.self_attn.A_log", "F32", (128,), 128),
    ("language_model.model.layers.0.mlp_res_proj.weight", "BF16", (1, 7168), 7168),
])
def test_logical_params(name: str, dtype: str, shape: tuple[int, ...], expected: int) -> None:
    role = classify(name)
    assert role.kind != Kind.UNKNOWN
    assert logical_params(info(dtype, shape), role) == expected
    assert logical_params_of(dtype, shape, role.part) == expected


def test_logical_params_of_other_scale_parts() -> None:
    for part in ("weight_scale", "weight_scale_inv", "scales", "input_scale", "weight_global_scale",
                 "weight_zero_point"):
        assert logical_params_of("F32", (10, 10), part) == 0
    assert logical_params_of("BF16", (10, 10), "weight_packed") == 100  # only byte-packed dtypes double
    assert logical_params_of("U8", (0, 5), "weight_packed") == 0


# ---------------------------------------------------------------------------------------------
# Every tensor of every fixture has a known role


@pytest.mark.parametrize("fixture", ["k3_tiny", "gptoss_tiny", "k2_tiny"])
def test_fixture_tensors_all_known(request: pytest.FixtureRequest, fixture: str) -> None:
    root: Path = request.getfixturevalue(fixture)
    ck = open_checkpoint(root)
    unknown = [n for n in ck.tensors if classify(n).kind == Kind.UNKNOWN]
    assert unknown == []
    assert ck.unknown_tensors() == []
    for name in ck.tensors:
        role = classify(name)
        if role.kind in (Kind.ROUTED_EXPERT, Kind.SHARED_EXPERT, Kind.ATTENTION, Kind.DENSE_MLP, Kind.ROUTER):
            assert role.layer is not None and f"layers.{role.layer}." in name


def test_k3_tiny_logical_params(k3_tiny: Path) -> None:
    ck = open_checkpoint(k3_tiny)
    cfg = ck.config
    routed = sum(logical_params(t, ck.roles[n]) for n, t in ck.tensors.items()
                 if ck.roles[n].kind == Kind.ROUTED_EXPERT)
    per_expert = 3 * cfg.moe_intermediate_size * cfg.routed_expert_hidden_size
    assert routed == len(cfg.moe_layers) * cfg.num_experts * per_expert
    scales = [n for n in ck.tensors if ck.roles[n].is_quant_scale]
    assert len(scales) == len(cfg.moe_layers) * cfg.num_experts * 3
    assert all(logical_params(ck.tensors[n], ck.roles[n]) == 0 for n in scales)


def test_gptoss_tiny_logical_params(gptoss_tiny: Path) -> None:
    ck = open_checkpoint(gptoss_tiny)
    cfg = ck.config
    blocks = sum(logical_params(t, ck.roles[n]) for n, t in ck.tensors.items() if ck.roles[n].part == "blocks")
    h, inter = cfg.hidden_size, cfg.intermediate_size
    assert blocks == cfg.num_layers * cfg.num_experts * (2 * inter * h + h * inter)
