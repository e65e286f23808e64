"""``k3ckpt synth``'s engine presets, without the engine: the shape vLLM's CPU backend needs (#26),
the dtypes, the weights' spread, and a tokenizer.json whose every id decodes. That vLLM really
loads and runs them is tests/test_engine_run.py (it needs scripts/engine_env.sh)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import run
from k3ckpt.errors import SynthError
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.roles import Kind
from k3ckpt.testing.synth import spec_from_preset

ENGINE_PRESETS = ["k2-engine", "k2-engine-fp32", "qwen3-moe-engine", "qwen3-moe-engine-fp32"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-presets")
    for preset in ENGINE_PRESETS:
        res = run("synth", str(root / preset), "--preset", preset)
        assert res.exit_code == 0, res.output
    return {p: root / p for p in ENGINE_PRESETS}


def test_k2_engine_is_kimi_k2s_architecture_at_the_cpu_mla_head_size(written: dict[str, Path]) -> None:
    cfg = json.loads((written["k2-engine"] / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # the only head size vLLM's CPU MLA takes
    assert cfg["topk_method"] == "noaux_tc"  # else vLLM builds no e_score_correction_bias
    assert cfg["first_k_dense_replace"] >= 1 and cfg["n_shared_experts"] >= 1
    assert 8 <= cfg["n_routed_experts"] <= 16
    assert "quantization_config" not in cfg  # no FP8 on CPU
    ckpt = open_checkpoint(written["k2-engine"])
    assert len(ckpt.shards) > 1
    assert ckpt.config is not None and ckpt.config.family == "deepseek_v3"
    layer1 = {n for n in ckpt.tensors if n.startswith("model.layers.1.mlp.")}
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in layer1
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in layer1
    assert "model.layers.0.mlp.gate_proj.weight" in ckpt.tensors  # the dense first layer
    experts = {n for n in layer1 if ".experts." in n}
    assert len(experts) == 3 * cfg["n_routed_experts"]
    assert {ckpt.roles[n].kind for n in experts} == {Kind.ROUTED_EXPERT}
    assert not ckpt.unknown_tensors()


def test_qwen3_moe_engine_has_qwen3s_names(written: dict[str, Path]) -> None:
    ckpt = open_checkpoint(written["qwen3-moe-engine"])
    cfg = json.loads((written["qwen3-moe-engine"] / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    p = "model.layers.0."
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_norm.weight",
                 "self_attn.k_norm.weight", "mlp.gate.weight", "mlp.experts.15.down_proj.weight"):
        assert p + name in ckpt.tensors, name
    assert ckpt.tensors[p + "self_attn.k_proj.weight"].shape == (cfg["num_key_value_heads"] * cfg["head_dim"],
                                                                 cfg["hidden_size"])
    assert "model-00001-of-00003.safetensors" in ckpt.shards
    assert not ckpt.unknown_tensors()


@pytest.mark.parametrize(("preset", "dtype", "config_dtype"), [
    ("k2-engine", "BF16", "bfloat16"), ("k2-engine-fp32", "F32", "float32"),
    ("qwen3-moe-engine", "BF16", "bfloat16"), ("qwen3-moe-engine-fp32", "F32", "float32")])
def test_dtypes_and_weight_spread(written: dict[str, Path], preset: str, dtype: str, config_dtype: str) -> None:
    """Every weight in the preset's dtype (the gate's correction bias F32, as published); linear
    weights drawn with std 0.08, which keeps greedy argmaxes stable (#26)."""
    root = written[preset]
    assert json.loads((root / "config.json").read_text())["torch_dtype"] == config_dtype
    ckpt = open_checkpoint(root)
    assert {t.dtype for n, t in ckpt.tensors.items() if not n.endswith("e_score_correction_bias")} == {dtype}
    name = next(n for n in ckpt.tensors if n.endswith("experts.3.up_proj.weight"))
    std = float(ckpt.read_tensor(name).astype(np.float32).std())
    assert 0.075 < std < 0.085, std


def test_tokenizer_json_decodes_every_id_of_the_vocabulary(written: dict[str, Path]) -> None:
    """Byte-level BPE: the 256 byte symbols first, every merge made of tokens already there, the
    two special tokens last, exactly ``vocab_size`` ids - so any id the model emits decodes."""
    root = written["k2-engine"]
    cfg = json.loads((root / "config.json").read_text())
    tok = json.loads((root / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert sorted(vocab.values()) == list(range(cfg["vocab_size"]))
    assert specials == {k: vocab[k] for k in specials}
    assert sorted(specials.values()) == [cfg["bos_token_id"], cfg["eos_token_id"]] == [cfg["vocab_size"] - 2,
                                                                                       cfg["vocab_size"] - 1]
    assert len({c for c in vocab if len(c) == 1}) >= 256
    for rank, (left, right) in enumerate(tok["model"]["merges"]):
        assert vocab[left] < vocab[left + right] and vocab[right] < vocab[left + right], rank
    assert tok["pre_tokenizer"]["type"] == tok["decoder"]["type"] == "ByteLevel"
    tcfg = json.loads((root / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] in specials and tcfg["bos_token"] in specials
    gen = json.loads((root / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_dtype_is_only_for_the_engine_families() -> None:
    with pytest.raises(SynthError, match="dtype F32 is not available for kimi_k3"):
        spec_from_preset("k3-tiny", dtype="F32").validate()
    with pytest.raises(SynthError, match="dtype F16"):
        spec_from_preset("k2-engine", dtype="F16").validate()
