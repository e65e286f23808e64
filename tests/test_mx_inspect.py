"""mx inspect (streaming statistics, histograms, flags) and mx error (round-trip MXFP4 error)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from helpers import run
from k3ckpt.errors import MxPlotUnavailableError
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.mx.codec import (
    E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_mxfp4_gptoss,
    quantize_mxfp4,
)
from k3ckpt.mx.error import quantization_error
from k3ckpt.mx.inspect import CODE_LABELS, OUTLIER_Z, inspect_mx
from k3ckpt.mx.render import render_inspect
from k3ckpt.mx.select import MxSelectionError, MxSource, MxTensor, find_mx_tensors

K3 = "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}"


def _one_line_error(res, code: int, *needles: str) -> None:
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3ckpt: error: "), res.output
    for n in needles:
        assert n in lines[0], lines[0]


def _mx(root: Path, name: str) -> MxTensor:
    (t,) = find_mx_tensors(MxSource.open(root), tensor=name)
    return t


def _write(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _reference(values: np.ndarray) -> dict[str, float]:
    """What the streaming statistics must equal: numpy over the whole dequantized tensor."""
    finite = values[np.isfinite(values)]
    return {
        "min": float(finite.min()), "max": float(finite.max()),
        "mean": float(finite.mean(dtype=np.float64)), "std": float(finite.std(dtype=np.float64)),
        "absmax": float(np.abs(finite).max()), "zero_fraction": float(np.count_nonzero(values == 0) / values.size),
        "nan_count": int(np.isnan(values).sum()), "inf_count": int(np.isinf(values).sum()),
        "finite_count": int(finite.size),
    }


def _assert_stats(stats: dict, ref: dict) -> None:
    for k in ("min", "max", "absmax", "zero_fraction", "nan_count", "inf_count", "finite_count"):
        assert stats[k] == ref[k], k
    assert stats["mean"] == pytest.approx(ref["mean"], rel=1e-10, abs=1e-15)
    assert stats["std"] == pytest.approx(ref["std"], rel=1e-10)


def _code_reference(packed: np.ndarray) -> list[int]:
    return np.bincount(np.concatenate([(packed & 0x0F).ravel(), (packed >> 4).ravel()]), minlength=16).tolist()


def _exponent_reference(scales: np.ndarray) -> dict[str, int]:
    counts = np.bincount(scales.ravel(), minlength=256)
    out = {str(b - 127): int(counts[b]) for b in range(255) if counts[b]}
    if counts[255]:
        out["nan"] = int(counts[255])
    return out


# ---------------------------------------------------------------------------------------------
# Statistics and histograms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("proj", ["w1", "w2"])
def test_k3_expert_statistics_equal_numpy_whatever_the_chunk_size(k3_tiny: Path, proj: str) -> None:
    base = K3.format(layer=2, expert=5, proj=proj)
    ckpt = open_checkpoint(k3_tiny)
    packed, scales = ckpt.read_tensor(base + ".weight_packed"), ckpt.read_tensor(base + ".weight_scale")
    ref = _reference(dequantize_mxfp4(packed, scales))
    reports = [inspect_mx(k3_tiny, tensor=base + ".weight", chunk_bytes=cb).to_json() for cb in (1, 100, 1 << 20)]
    for rep in reports:
        (t,) = rep["tensors"]
        assert t["name"] == base + ".weight" and t["format"] == "mxfp4" and t["layout"] == "compressed-tensors"
        assert t["stored"]["data"]["shape"] == list(packed.shape)
        assert t["stored"]["scales"]["shape"] == list(scales.shape)
        assert t["shape"] == [packed.shape[0], packed.shape[1] * 2]
        assert (t["layer"], t["expert"]) == (2, 5)
        _assert_stats(t["stats"], ref)
        assert t["code_histogram"] == _code_reference(packed)
        assert t["scale_exponent_histogram"] == _exponent_reference(scales)
        assert t["zero_blocks"] == 0 and t["flags"] == []
    # Chunking changes only float64 rounding of the sums.
    assert reports[0]["tensors"][0]["stats"]["std"] == pytest.approx(reports[2]["tensors"][0]["stats"]["std"], rel=1e-13)


def test_gptoss_stacked_statistics_equal_numpy(gptoss_tiny: Path) -> None:
    base = "model.layers.1.mlp.experts.gate_up_proj"
    ckpt = open_checkpoint(gptoss_tiny)
    blocks, scales = ckpt.read_tensor(base + "_blocks"), ckpt.read_tensor(base + "_scales")
    values = dequantize_mxfp4_gptoss(blocks, scales)
    for cb in (1, 3000, 1 << 20):
        (t,) = inspect_mx(gptoss_tiny, tensor=base, chunk_bytes=cb).to_json()["tensors"]
        assert t["layout"] == "gpt-oss" and t["shape"] == list(values.shape)
        assert t["stored"]["data"]["shape"] == list(blocks.shape)
        _assert_stats(t["stats"], _reference(values))
        assert t["code_histogram"] == _code_reference(blocks)
        assert t["scale_exponent_histogram"] == _exponent_reference(scales)
        # One entry per expert of the stack, each from that expert's scales alone.
        assert [e["expert"] for e in t["experts"]] == list(range(blocks.shape[0]))
        for e in t["experts"]:
            exps = scales[e["expert"]].astype(np.int64) - 127
            assert e["exponent_mean"] == pytest.approx(exps.mean(), rel=1e-12)
            assert e["exponent_max"] == exps.max()


def test_gptoss_expert_selection_reads_that_experts_slice(gptoss_tiny: Path) -> None:
    ckpt = open_checkpoint(gptoss_tiny)
    rep = inspect_mx(gptoss_tiny, layer=0, expert=3, chunk_bytes=2000).to_json()
    assert [t["name"] for t in rep["tensors"]] == [
        "model.layers.0.mlp.experts.down_proj[3]", "model.layers.0.mlp.experts.gate_up_proj[3]"]
    for t, base in zip(rep["tensors"], ("model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj")):
        blocks, scales = ckpt.read_tensor(base + "_blocks")[3], ckpt.read_tensor(base + "_scales")[3]
        assert t["expert"] == 3 and t["shape"] == [blocks.shape[0], blocks.shape[1] * 32]
        _assert_stats(t["stats"], _reference(dequantize_mxfp4_gptoss(blocks, scales)))
        assert t["code_histogram"] == _code_reference(blocks)
    with pytest.raises(MxSelectionError):
        inspect_mx(gptoss_tiny, layer=0, expert=99)


def test_selection_by_tensor_layer_expert_and_file(k3_tiny: Path) -> None:
    base = K3.format(layer=3, expert=7, proj="w3")
    for name in (base, base + ".weight", base + ".weight_packed", base + ".weight_scale"):
        assert [t.name for t in inspect_mx(k3_tiny, tensor=name).tensors] == [base + ".weight"]
    layer = inspect_mx(k3_tiny, layer=3)
    assert len(layer.tensors) == 16 * 3 and {t.tensor.role.layer for t in layer.tensors} == {3}
    one = inspect_mx(k3_tiny, layer=3, expert=7)
    assert [t.name for t in one.tensors] == [K3.format(layer=3, expert=7, proj=p) + ".weight" for p in ("w1", "w2", "w3")]
    # A single shard file: exactly the pairs stored in it.
    shard = k3_tiny / open_checkpoint(k3_tiny).tensors[base + ".weight_packed"].file
    in_file = inspect_mx(shard)
    expected = find_mx_tensors(MxSource.open(shard))
    assert [t.name for t in in_file.tensors] == [t.weight_name for t in expected] and base + ".weight" in [
        t.name for t in in_file.tensors]
    with pytest.raises(MxSelectionError, match="no MXFP4 tensor matches --layer 42"):
        inspect_mx(k3_tiny, layer=42)


def test_clean_fixtures_have_no_flags_and_exit_0(k3_tiny: Path, gptoss_tiny: Path) -> None:
    for root in (k3_tiny, gptoss_tiny):
        rep = inspect_mx(root)
        assert rep.flags == []
        # Every group big enough was actually compared (16 experts / 8 stacked experts).
        assert all(g.checked for g in rep.groups)
        res = run("mx", "inspect", str(root))
        assert res.exit_code == 0, res.output
        assert "flags: none" in res.output


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def test_nan_scale_is_flagged_and_stats_skip_the_nan_block(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    base = K3.format(layer=2, expert=3, proj="w1")
    t = _mx(root, base)
    _write(t.scale_path, t.scale_offset + 5, b"\xff")
    res = run("mx", "inspect", str(root), "--layer", "2")
    assert res.exit_code == 1, res.output
    assert f"{base.rsplit('experts.', 1)[1]}: nan-scale: 1 NaN scale byte (0xFF)" in res.output
    rep = inspect_mx(root, layer=2)
    assert {f.tensor for f in rep.flags} == {base + ".weight"}
    assert {f.kind for f in rep.flags} == {"nan-scale", "non-finite"}
    (nan_flag,) = [f for f in rep.flags if f.kind == "nan-scale"]
    assert nan_flag.count == 1
    # The slow (masking) path still equals numpy over the finite values.
    ckpt = open_checkpoint(root)
    values = dequantize_mxfp4(ckpt.read_tensor(base + ".weight_packed"), ckpt.read_tensor(base + ".weight_scale"))
    (ti,) = [x for x in rep.tensors if x.name == base + ".weight"]
    _assert_stats(ti.to_json()["stats"], _reference(values))
    assert ti.nan_count == 32 and ti.to_json()["scale_exponent_histogram"]["nan"] == 1
    # A single-tensor run is flagged too (the NaN check needs no siblings).
    res = run("mx", "inspect", str(root), "--tensor", base + ".weight")
    assert res.exit_code == 1 and "NaN" in res.output


def test_all_zero_block_is_flagged(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    base = K3.format(layer=1, expert=9, proj="w2")
    t = _mx(root, base)
    row_bytes = t.row_elements // 2
    _write(t.data_path, t.data_offset + 10 * row_bytes + 16, bytes(16))  # row 10, block 1
    rep = inspect_mx(root, layer=1)
    (flag,) = rep.flags
    assert (flag.kind, flag.tensor, flag.count) == ("zero-blocks", base + ".weight", 1)
    assert flag.fraction == pytest.approx(1 / (t.numel // 32))
    res = run("mx", "inspect", str(root), "--layer", "1")
    assert res.exit_code == 1 and "1 all-zero block of 32" in res.output


def test_exponent_shift_flags_exactly_that_tensor(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    base = K3.format(layer=3, expert=11, proj="w2")
    t = _mx(root, base)
    n = t.numel // 32
    with open(t.scale_path, "rb") as f:
        f.seek(t.scale_offset)
        scales = np.frombuffer(f.read(n), dtype=np.uint8)
    assert int(scales.max()) + 20 < 255
    _write(t.scale_path, t.scale_offset, (scales + 20).astype(np.uint8).tobytes())
    rep = inspect_mx(root, layer=3)
    (flag,) = rep.flags
    assert (flag.kind, flag.tensor) == ("exp-outlier", base + ".weight") and flag.z > OUTLIER_Z
    res = run("mx", "inspect", str(root), "--layer", "3", "--json")
    assert res.exit_code == 1
    data = json.loads(res.output)
    assert [(f["kind"], f["tensor"]) for f in data["flags"]] == [("exp-outlier", base + ".weight")]
    assert data["flagged_tensors"] == 1
    # The text report details the flagged tensor with its charts.
    text = run("mx", "inspect", str(root), "--layer", "3").output
    assert max(len(line) for line in text.splitlines()[1:]) <= 100
    assert "11.w2" in text and "E2M1 codes" in text
    assert f"{base}.weight\n  format   mxfp4, compressed-tensors layout; layer 3, expert 11, down" in text


def test_exponent_outlier_in_a_gptoss_stack_names_the_expert(gptoss_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(gptoss_tiny)
    t = _mx(root, "model.layers.2.mlp.experts.down_proj")
    per_expert = t.numel // t.shape[0] // 32
    with open(t.scale_path, "rb") as f:
        f.seek(t.scale_offset + 6 * per_expert)
        scales = np.frombuffer(f.read(per_expert), dtype=np.uint8)
    _write(t.scale_path, t.scale_offset + 6 * per_expert, (scales + 20).astype(np.uint8).tobytes())
    (flag,) = inspect_mx(root, layer=2).flags
    assert flag.kind == "exp-outlier" and flag.expert == 6 and flag.message.startswith("expert 6:")


# ---------------------------------------------------------------------------------------------
# CLI output
# ---------------------------------------------------------------------------------------------


def test_text_output_fits_100_columns(k3_tiny: Path, gptoss_tiny: Path) -> None:
    for args in ((str(k3_tiny), "--layer", "1"), (str(k3_tiny), "--layer", "1", "--expert", "0"),
                 (str(k3_tiny), "--tensor", K3.format(layer=1, expert=0, proj="w1")),
                 (str(gptoss_tiny), "--tensor", "model.layers.0.mlp.experts.gate_up_proj")):
        res = run("mx", "inspect", *args)
        assert res.exit_code == 0, res.output
        # Only the first line holds the (arbitrarily long) path.
        assert max(len(line) for line in res.output.splitlines()[1:]) <= 100, args
    single = run("mx", "inspect", str(k3_tiny), "--tensor", K3.format(layer=1, expert=0, proj="w1")).output
    for needle in ("format   mxfp4, compressed-tensors layout; layer 1, expert 0, gate",
                   "stored   weight_packed [64, 64] U8", "weight_scale [64, 4] U8 (E8M0 scales)",
                   "logical  [64, 128]", "E2M1 codes", "scale exponents", "flags    none"):
        assert needle in single
    assert all(label in single for label in CODE_LABELS)
    stacked = run("mx", "inspect", str(gptoss_tiny), "--tensor", "model.layers.0.mlp.experts.gate_up_proj").output
    assert "per-expert mean exponent (8 experts" in stacked


def test_json_output(k3_tiny: Path) -> None:
    res = run("mx", "inspect", str(k3_tiny), "--layer", "4", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["selection"] == {"layer": 4} and len(data["tensors"]) == 48
    assert data["flags"] == [] and data["aggregate"]["numel"] == sum(t["numel"] for t in data["tensors"])
    assert sum(data["aggregate"]["code_histogram"]) == data["aggregate"]["numel"]
    assert {g["proj"] for g in data["exponent_groups"]} == {"gate", "up", "down"}
    assert data["thresholds"]["outlier_z"] == OUTLIER_Z
    assert "▏" not in res.output and "█" not in res.output


def test_usage_and_input_errors(k3_tiny: Path, tmp_path: Path) -> None:
    assert run("mx", "inspect", str(k3_tiny), "--tensor", "x", "--layer", "1").exit_code == 2
    _one_line_error(run("mx", "inspect", str(tmp_path / "missing")), 2, "missing")
    _one_line_error(run("mx", "inspect", str(k3_tiny), "--layer", "99"), 2, "no MXFP4 tensor matches --layer 99")
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a safetensors file at all")
    _one_line_error(run("mx", "inspect", str(junk)), 2, "junk.safetensors")


def test_plot_without_matplotlib_is_a_one_line_error(k3_tiny: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    out = tmp_path / "h.png"
    res = run("mx", "inspect", str(k3_tiny), "--layer", "1", "--plot", str(out))
    _one_line_error(res, 2, "matplotlib", "pip install 'k3ckpt[plot]'")
    assert not out.exists()
    with pytest.raises(MxPlotUnavailableError):
        from k3ckpt.mx.render import require_matplotlib

        require_matplotlib()


def test_plot_with_matplotlib(k3_tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for args, name in (((("--layer", "1")), "layer.png"), (("--tensor", K3.format(layer=1, expert=0, proj="w1")), "one.png")):
        out = tmp_path / name
        res = run("mx", "inspect", str(k3_tiny), *args, "--plot", str(out))
        assert res.exit_code == 0, res.output
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_render_top_limits_detailed_views(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    for e in (1, 2, 3):
        t = _mx(root, K3.format(layer=4, expert=e, proj="w1"))
        _write(t.scale_path, t.scale_offset + e, b"\xff")
    rep = inspect_mx(root, layer=4)
    assert len(rep.flagged) == 3
    assert render_inspect(rep, top=0).count("format   mxfp4") == 0
    assert render_inspect(rep, top=2).count("format   mxfp4") == 2
    assert render_inspect(rep, top=5).count("format   mxfp4") == 3


# ---------------------------------------------------------------------------------------------
# mx error
# ---------------------------------------------------------------------------------------------

GATE0 = "model.layers.1.mlp.experts.0.gate_proj.weight"
DOWN1 = "model.layers.1.mlp.experts.1.down_proj.weight"
NORM = "model.layers.1.input_layernorm.weight"
QPROJ = "model.layers.1.self_attn.q_proj.weight"


def _float_file(path: Path, gate: np.ndarray | None = None, down: np.ndarray | None = None) -> Path:
    rng = np.random.default_rng(0)
    save_file({
        GATE0: rng.standard_normal((64, 128), dtype=np.float32) if gate is None else gate,
        DOWN1: (rng.standard_normal((128, 64), dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        if down is None else down,
        NORM: np.ones(128, dtype=np.float32),
        QPROJ: rng.standard_normal((64, 128), dtype=np.float32),
    }, str(path))
    return path


def test_error_measures_the_experts_only(tmp_path: Path) -> None:
    f = _float_file(tmp_path / "w.safetensors")
    rep = quantization_error(f)
    assert [r.name for r in rep.rows] == [GATE0, DOWN1]
    assert [r.dtype for r in rep.rows] == ["F32", "BF16"]
    for r in rep.rows:
        assert 0.05 < r.relative_rms_error < 0.2
        assert 0 < r.saturated_fraction < 0.1 and r.nonfinite == 0
    assert dict(rep.skipped)[NORM].endswith("not 2-D") and "role attention" in dict(rep.skipped)[QPROJ]
    # The chunked measurement equals one whole-tensor round trip.
    from safetensors.numpy import load_file

    x = load_file(str(f))[GATE0].astype(np.float64)
    q = dequantize_mxfp4(*quantize_mxfp4(x.astype(np.float32)), dtype=np.float64)
    assert rep.rows[0].relative_rms_error == pytest.approx(np.linalg.norm(q - x) / np.linalg.norm(x), rel=1e-12)
    assert rep.rows[0].max_abs_error == np.abs(q - x).max()
    small = quantization_error(f, chunk_bytes=300)
    for a, b in zip(small.rows, rep.rows):
        assert (a.values, a.saturated, a.max_abs_error) == (b.values, b.saturated, b.max_abs_error)
        assert a.relative_rms_error == pytest.approx(b.relative_rms_error, rel=1e-12)
    assert [r.name for r in quantization_error(f, include_all=True).rows] == [GATE0, DOWN1, QPROJ]
    assert [r.name for r in quantization_error(f, tensor=QPROJ).rows] == [QPROJ]
    # ceil never saturates.
    assert all(r.saturated == 0 for r in quantization_error(f, scale_mode="ceil").rows)


def test_error_is_zero_on_the_grid(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, size=(64, 128))
    codes[:, ::32] = 7  # every block holds +6, so the floor exponent is exactly the block's k
    k = rng.integers(-8, 3, size=(64, 4)).repeat(32, axis=1)
    gate = (E2M1_VALUES[codes].astype(np.float64) * np.exp2(k)).astype(np.float32)
    f = _float_file(tmp_path / "grid.safetensors", gate=gate)
    row = quantization_error(f, tensor=GATE0).rows[0]
    assert row.relative_rms_error == 0.0 and row.max_abs_error == 0.0 and row.saturated == 0


def test_error_cli(tmp_path: Path) -> None:
    f = _float_file(tmp_path / "w.safetensors")
    res = run("mx", "error", str(f))
    assert res.exit_code == 0, res.output
    assert "names below are after model.layers.1.mlp.experts." in res.output
    assert "\n0.gate_proj.weight F32" in res.output and "total: 2 tensors" in res.output
    assert "q_proj" not in res.output.split("total:")[0]
    data = json.loads(run("mx", "error", str(f), "--json", "--scale-mode", "even").output)
    assert data["scale_mode"] == "even" and [t["name"] for t in data["tensors"]] == [GATE0, DOWN1]
    assert 0.05 < data["totals"]["relative_rms_error"] < 0.2
    assert {s["name"] for s in data["skipped"]} == {NORM, QPROJ}
    assert "q_proj" in run("mx", "error", str(f), "--all").output


def test_error_with_nan_input_exits_1(tmp_path: Path) -> None:
    gate = np.random.default_rng(2).standard_normal((64, 128), dtype=np.float32)
    gate[3, 40] = np.nan
    f = _float_file(tmp_path / "nan.safetensors", gate=gate)
    row = quantization_error(f, tensor=GATE0).rows[0]
    assert row.nonfinite == 1 and row.values == 64 * 128 - 32 and math.isfinite(row.relative_rms_error)
    res = run("mx", "error", str(f))
    assert res.exit_code == 1 and "NaN/Inf inputs left out" in res.output


def test_error_bad_input(tmp_path: Path) -> None:
    _one_line_error(run("mx", "error", str(tmp_path / "nope.safetensors")), 2, "nope.safetensors", "file not found")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 3)
    _one_line_error(run("mx", "error", str(junk)), 2, "junk.safetensors")
    f = _float_file(tmp_path / "w.safetensors")
    _one_line_error(run("mx", "error", str(f), "--tensor", "nope"), 2, "no tensor named 'nope'")
    _one_line_error(run("mx", "error", str(f), "--tensor", NORM), 2, "not 2-D")
    only_norm = tmp_path / "norm.safetensors"
    save_file({NORM: np.ones(128, dtype=np.float32)}, str(only_norm))
    _one_line_error(run("mx", "error", str(only_norm)), 2, "no tensor to quantize")


def test_plot_wiring_with_a_stand_in_figure(k3_tiny: Path, tmp_path: Path, monkeypatch) -> None:
    """Without matplotlib installed, check what --plot draws with a recording stand-in for
    ``matplotlib.figure.Figure`` (the real one is covered by test_plot_with_matplotlib)."""
    import types

    calls: list[tuple[str, tuple, dict]] = []

    class Recorder:
        def __init__(self, prefix: str) -> None:
            self.prefix = prefix

        def __getattr__(self, name: str):
            return lambda *a, **k: calls.append((f"{self.prefix}.{name}", a, k))

    class Figure(Recorder):
        def __init__(self, **kwargs) -> None:
            super().__init__("fig")

        def subplots(self, n: int, m: int):
            return [Recorder(f"ax{i}") for i in range(n)]

        def savefig(self, path, dpi=None) -> None:
            Path(path).write_bytes(b"stand-in")

    mpl = types.ModuleType("matplotlib")
    fig_mod = types.ModuleType("matplotlib.figure")
    fig_mod.Figure = Figure  # type: ignore[attr-defined]
    mpl.figure = fig_mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", fig_mod)
    out = tmp_path / "layer.png"
    res = run("mx", "inspect", str(k3_tiny), "--layer", "1", "--plot", str(out))
    assert res.exit_code == 0, res.output
    assert out.read_bytes() == b"stand-in" and f"histograms saved to {out}" in res.output
    bars = [c for c in calls if c[0].endswith(".bar")]
    assert list(bars[0][1][1]) == inspect_mx(k3_tiny, layer=1).code_hist.tolist()
    assert any(c[0] == "ax2.scatter" for c in calls)  # per-tensor mean exponents


def test_worker_processes_give_the_same_report(k3_tiny: Path, monkeypatch) -> None:
    import k3ckpt.mx.inspect as mxi

    monkeypatch.setattr(mxi, "PARALLEL_MIN_BYTES", 0)
    seen: list[int] = []
    planned: list[int] = []
    par = inspect_mx(k3_tiny, layer=2, jobs=2, progress=seen.append, on_plan=planned.append).to_json()
    one = inspect_mx(k3_tiny, layer=2, jobs=1).to_json()
    par.pop("seconds"), one.pop("seconds")
    assert par == one
    assert len(seen) == 48 and sum(seen) == planned[0] == par["bytes_read"]
