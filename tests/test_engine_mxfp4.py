"""MXFP4 through its owning library (#26 item 6): ``mx quantize`` of the BF16 engine presets
(``k2-engine``: DeepseekV3ForCausalLM, ``qwen3-moe-engine``: Qwen3MoeForCausalLM) loads in
transformers through compressed-tensors (the versions the engine environment pins: transformers
5.19.0, compressed-tensors 0.17.0), decompressing on CPU; ``mx dequant`` equals
compressed-tensors' own decompression bit for bit; and the quantized model's logits stay within a
bound derived from the weights' MXFP4 error (docs/mx.md, "Checked by compressed-tensors itself").

torch and transformers run only in the engine environment's python (``tests/mx_ct_driver.py``, a
subprocess); without that environment these tests skip (under CI they fail: ``enginelib.engine``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from enginelib import Engine, synth
from helpers import run

pytestmark = pytest.mark.engine

DRIVER = Path(__file__).with_name("mx_ct_driver.py")
#: Token ids (< the preset's vocabulary of 1,024) of two prompts: 14 positions of logits.
TOKEN_IDS = [[5, 77, 300, 12, 900, 41, 7, 8], [100, 200, 300, 400, 500, 600]]
#: Weights per routed expert (gate, up, down), each quantized with its own independent error.
WEIGHTS_PER_EXPERT = 3


CLASSES = {"k2-engine": "DeepseekV3ForCausalLM", "qwen3-moe-engine": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def report(request: pytest.FixtureRequest, engine: Engine, ckpts: Path) -> dict:
    preset = request.param
    src = synth(ckpts, preset)
    quantized, dequant = ckpts / f"{preset}-mx", ckpts / f"{preset}-mx-dequant.safetensors"
    if not quantized.exists():
        res = run("mx", "quantize", str(src), "-o", str(quantized), "--json")
        assert res.exit_code == 0, res.output
    if not dequant.exists():
        res = run("mx", "dequant", str(quantized), "--to", "bf16", "-o", str(dequant))
        assert res.exit_code == 0, res.output
    req, out = engine.work / f"mx-ct-{preset}.request.json", engine.work / f"mx-ct-{preset}.out.json"
    req.write_text(json.dumps({"original": str(src), "quantized": str(quantized), "dequant": str(dequant),
                                   "token_ids": TOKEN_IDS}))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([str(engine.python), str(DRIVER), str(req), str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(out.read_text()), "preset": preset, "src": src, "quantized": quantized}


def moe_shape(src: Path) -> tuple[int, int]:
    """(MoE layers, routed experts per layer) from config.json (DeepSeek-V3's or Qwen3-MoE's keys)."""
    config = json.loads((src / "config.json").read_text())
    experts = config.get("n_routed_experts") or config["num_experts"]
    return config["num_hidden_layers"] - config.get("first_k_dense_replace", 0), experts


def quantized_names(quantized: Path) -> set[str]:
    index = json.loads((quantized / "model.safetensors.index.json").read_text())["weight_map"]
    return {n[: -len("_packed")] for n in index if n.endswith(".weight_packed")}


def test_mx_dequant_equals_compressed_tensors_decompressor_bit_for_bit(report: dict) -> None:
    """compressed-tensors' registry compressor for ``mxfp4-pack-quantized`` decompresses every
    packed pair ``mx quantize`` wrote to exactly the BF16 tensor ``mx dequant`` wrote."""
    d = report["decompressor"]
    assert d["compressor"] == "MXFP4PackedCompressor" and d["dtype"] == "torch.bfloat16", d
    assert d["compared"] == len(quantized_names(report["quantized"])) == 144, d
    assert d["differ"] == [], f"{len(d['differ'])} tensors differ, e.g. {d['differ'][:3]}"


def test_quantized_checkpoint_loads_in_transformers_through_compressed_tensors(report: dict) -> None:
    """Every tensor lands (no missing, unexpected or mismatched key), and the fused expert
    parameters transformers builds are, slice by slice, the ``mx dequant`` tensors."""
    m = report["model"]
    assert m["class"] == CLASSES[report["preset"]], m
    assert (m["missing"], m["unexpected"], m["mismatched"]) == ([], [], []), m
    moe_layers, experts = moe_shape(report["src"])
    assert m["compared"] == 2 * moe_layers * experts, m
    assert m["differ"] == [], m["differ"][:3]


def mxfp4_weight_error(src: Path) -> float:
    """The largest per-tensor relative RMS error ``k3ckpt mx error`` reports over the original's
    routed-expert weights (every shard)."""
    worst = 0.0
    for shard in sorted(src.glob("*.safetensors")):
        res = run("mx", "error", str(shard), "--json")
        assert res.exit_code == 0, res.output
        worst = max([worst, *(t["relative_rms_error"] for t in json.loads(res.output)["tensors"])])
    return worst


def test_logits_within_the_bound_derived_from_the_weights_mxfp4_error(report: dict) -> None:
    """First-order bound (docs/mx.md): each expert's three weights carry independent relative
    errors <= eps, so an expert's output moves by <= sqrt(3) eps (relative RMS); the MoE layers'
    errors are independent and add in quadrature over L layers; the routed experts' output is no
    larger than the residual stream it is added to, and the final norm and lm_head pass a relative
    perturbation on unchanged: ``rms(dlogits) / rms(logits) <= sqrt(3 L) eps``."""
    eps = mxfp4_weight_error(report["src"])
    moe_layers, _ = moe_shape(report["src"])
    bound = math.sqrt(WEIGHTS_PER_EXPERT * moe_layers) * eps
    lg = report["logits"]
    assert lg["finite"], lg
    rel = lg["diff_rms"] / lg["rms"]
    assert 0 < rel <= bound, f"relative RMS logit change {rel:.4f}, bound {bound:.4f} (eps {eps:.4f}): {lg}"
    assert 0.09 < eps < 0.14, f"eps {eps}: MXFP4 of N(0, 0.08) weights should be ~0.11 relative RMS"
