"""`inspect`: counts computed from shapes, and every disagreement between config and tensors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ckpt_edit import drop_tensors
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.inspect import inspect_checkpoint, render_text
from k3ckpt.testing.synth import PRESETS


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(root: Path, edit) -> None:
    cfg = json.loads((root / "config.json").read_text())
    edit(cfg)
    (root / "config.json").write_text(json.dumps(cfg))


def _messages(root: Path) -> list[str]:
    return [str(f) for f in inspect_checkpoint(open_checkpoint(root)).findings]


def test_k3_tiny_report(k3_tiny: Path) -> None:
    spec = PRESETS["k3-tiny"]
    rep = inspect_checkpoint(open_checkpoint(k3_tiny))
    assert rep.family == "kimi_k3" and rep.text_model_type == "kimi_linear"
    assert rep.num_layers == 5 and rep.dense_layers == [0] and rep.moe_layers == [1, 2, 3, 4]
    assert rep.attention_layers == {"kda": [0, 1, 2], "mla": [3, 4]}  # 1-based full_attn_layers 4 and 5
    assert (rep.routed_experts, rep.experts_per_token, rep.shared_experts) == (16, 4, 1)
    assert rep.findings == []
    # Parameters from first principles: routed experts hold 3 matrices of inter x width each.
    routed = 4 * 16 * 3 * spec.moe_intermediate_size * spec.expert_width
    assert rep.params_routed == routed
    assert rep.params_active == rep.params_text - routed + routed * 4 // 16
    assert rep.params_by_role["routed_expert"] == routed
    embed = spec.vocab_size * spec.hidden_size
    assert rep.params_by_role["embedding"] == rep.params_by_role["lm_head"] == embed
    assert rep.params_active_no_embed == rep.params_active - 2 * embed
    assert rep.bytes_total == sum((k3_tiny / f).stat().st_size for f in open_checkpoint(k3_tiny).shards)
    assert rep.quant_config == "mxfp4-pack-quantized" and rep.quant_tensors == {"mxfp4": 4 * 16 * 3}


def test_params_count_every_tensor_once(k3_tiny: Path) -> None:
    ckpt = open_checkpoint(k3_tiny)
    expected = 0
    for name, t in ckpt.tensors.items():
        if name.endswith("weight_scale"):
            continue
        expected += math.prod(t.shape) * (2 if name.endswith("weight_packed") else 1)
    assert inspect_checkpoint(ckpt).params_total == expected


@pytest.mark.parametrize("preset", ["gptoss-tiny", "k2-tiny"])
def test_other_families_are_clean(request: pytest.FixtureRequest, preset: str) -> None:
    root = request.getfixturevalue(preset.replace("-", "_"))
    rep = inspect_checkpoint(open_checkpoint(root))
    assert rep.findings == []
    spec = PRESETS[preset]
    assert rep.routed_experts == spec.num_experts
    assert rep.params_routed > 0
    if preset == "gptoss-tiny":
        assert rep.quant_config == "mxfp4" and rep.attention_layers == {"sliding": [0, 2], "full": [1, 3]}
    else:
        assert rep.quant_config == "fp8-block" and rep.quant_tensors["fp8"] > 0


def test_parallel_and_serial_open_report_the_same(k3_tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    serial = inspect_checkpoint(open_checkpoint(k3_tiny, jobs=1)).to_json()
    monkeypatch.setattr("k3ckpt.format.checkpoint.PARALLEL_HEADER_MIN_FILES", 1)
    parallel = inspect_checkpoint(open_checkpoint(k3_tiny, jobs=2)).to_json()
    assert serial == parallel


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c["text_config"].update(num_experts=32), "16 of 32 routed experts missing"),
        (lambda c: c["text_config"].update(num_hidden_layers=7), "num_hidden_layers is 7 but tensors stop at layer 4"),
        (lambda c: c["text_config"]["linear_attn_config"].update(full_attn_layers=[2, 4, 5], kda_layers=[1, 3]),
         "config says MLA but KDA tensors are present"),
        (lambda c: c["text_config"].update(hidden_size=512), "has width 256 but hidden_size is 512"),
        (lambda c: c["text_config"].update(moe_intermediate_size=128), "but the config implies"),
        (lambda c: c.pop("quantization_config"), "MXFP4 tensors are present but quantization_config says nothing"),
        (lambda c: c["text_config"].update(first_k_dense_replace=2), "has routed-expert tensors but the config makes it dense"),
    ],
)
def test_config_contradicting_tensors_is_an_error(k3_tiny: Path, tmp_path: Path, edit, expected: str) -> None:
    root = _copy(k3_tiny, tmp_path)
    _edit_config(root, edit)
    rep = inspect_checkpoint(open_checkpoint(root))
    assert rep.errors, render_text(rep)
    assert any(expected in str(f) for f in rep.errors), [str(f) for f in rep.findings]


def test_missing_expert_is_named(k3_tiny: Path, tmp_path: Path) -> None:
    root = _copy(k3_tiny, tmp_path)
    p = "language_model.model.layers.2.block_sparse_moe.experts.9."
    drop_tensors(root, {p + f"w{i}.weight_{k}" for i in (1, 2, 3) for k in ("packed", "scale")})
    msgs = _messages(root)
    assert any("layer 2" in m and "1 of 16 routed experts missing: 9" in m for m in msgs), msgs


def test_missing_scale_is_named(k3_tiny: Path, tmp_path: Path) -> None:
    root = _copy(k3_tiny, tmp_path)
    drop_tensors(root, {"language_model.model.layers.3.block_sparse_moe.experts.4.w2.weight_scale"})
    msgs = _messages(root)
    assert any("layer 3 expert 4" in m and "usual 6 tensors" in m for m in msgs), msgs
    assert "ERROR layer 3 experts down.weight_packed: 16 packed tensors but 15 scales" in msgs


def test_unknown_tensor_is_a_warning_not_dropped(k3_tiny: Path, tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    root = _copy(k3_tiny, tmp_path)
    save_file({"mystery.block.weight": np.ones((4, 4), np.float32)}, str(root / "extra.safetensors"))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"]["mystery.block.weight"] = "extra.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    rep = inspect_checkpoint(open_checkpoint(root))
    assert not rep.errors
    assert any(f.severity == "warning" and f.where == "mystery.block.weight" for f in rep.findings)
    assert rep.tensors == len(open_checkpoint(k3_tiny).tensors) + 1


def test_text_rendering_and_layer_table(k3_tiny: Path) -> None:
    text = render_text(inspect_checkpoint(open_checkpoint(k3_tiny)), show_layers=True)
    assert "KimiK3ForConditionalGeneration" in text
    assert "16 routed, 4 active per token, 1 shared" in text
    assert "KDA 3 [0-2], MLA 2 [3-4]" in text
    table = [line for line in text.splitlines() if line.strip().startswith(("0 ", "1 ", "4 "))]
    assert len(table) == 3 and "dense" in table[0] and "moe" in table[1]


def test_layer_missing_a_tensor_its_siblings_have(tmp_path: Path) -> None:
    """A tensor absent from both the header and the index is caught by comparing the layer with
    its siblings (same attention kind, same MLP kind)."""
    from k3ckpt.testing.synth import spec_from_preset, synthesize

    root = synthesize(spec_from_preset("k3-tiny", num_layers=8, num_experts=4, experts_per_token=2), tmp_path / "c").path
    assert not inspect_checkpoint(open_checkpoint(root)).findings
    drop_tensors(root, {"language_model.model.layers.5.self_attn.q_proj.weight"})
    msgs = _messages(root)
    assert msgs == ["ERROR layer 5: lacks q_proj.weight (attention) that the other KDA MoE layers have"]
