"""Golden MXFP4 vectors from compressed-tensors itself (the producer of K3's expert weights).

Writes ``tests/data/mxfp4_golden.npz``: inputs, and the packed E2M1 bytes and E8M0 scale bytes
that compressed-tensors' own ``mxfp4-pack-quantized`` path makes of them, plus its decoding of
every scale byte and its serialisation of the quantization config. ``tests/test_mxfp4_golden.py``
compares k3ckpt against this file byte for byte, with numpy only: torch and compressed-tensors
are NEVER a dependency of k3ckpt or its tests, only of this script, run once by hand.

How to run (a scratch venv, not the repository's .venv)::

    python3 -m venv /tmp/ctvenv
    /tmp/ctvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    /tmp/ctvenv/bin/pip install compressed-tensors==0.20.1
    /tmp/ctvenv/bin/python scripts/make_mxfp4_golden.py            # writes tests/data/mxfp4_golden.npz
    /tmp/ctvenv/bin/python scripts/make_mxfp4_golden.py --validate OUT/config.json

Recorded with compressed-tensors 0.20.1, torch 2.13.0+cpu, numpy 2.4.6 (the versions are also
stored in the file, key ``meta``). ``--validate`` parses a config.json written by
``k3ckpt mx quantize DIR -o OUT`` with compressed-tensors (``QuantizationConfig.model_validate``,
and ``ModelCompressor.from_compression_config`` on transformers' ``CompressedTensorsConfig``, as
``from_pretrained`` does) and prints what it understood.

The quantization path is the one llm-compressor drives for a static MXFP4 weight: per group of
32, ``amin``/``amax`` (what its min-max observer computes) -> ``calculate_qparams`` (which calls
``generate_mx_scales``: amax rounded to one mantissa bit by ``round_to_power_2``, then
``floor(log2) - 2``, clamped to a byte) -> ``MXFP4PackedCompressor.compress`` (divide, clamp to
+-6, round to E2M1 by ``cast_to_fp4``, pack low nibble first, scale to its E8M0 byte). On CPU
the compressor takes its torch fallback, not the Triton kernel.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from compressed_tensors import __version__ as ct_version
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "mxfp4_golden.npz"
SCHEME: QuantizationScheme = preset_name_to_scheme("MXFP4A16", ["Linear"])

# What k3ckpt's checkpoint writer must produce, in compressed-tensors' own serialisation (the
# ignore list is K3's: everything that is not a routed expert stays in BF16).
K3_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*block_sparse_moe\\.gate$",
             "re:.*mlp\\.(gate|up|down)_proj$", "re:vision_tower.*", "re:mm_projector.*", "re:.*lm_head$"]


def ct_quantize(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """compressed-tensors' MXFP4 of a 2-D weight: (packed [out, in/2], scale bytes [out, in/32])."""
    groups = w.unflatten(-1, (w.shape[-1] // 32, 32))
    scale, zero_point = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), SCHEME.weights)
    state = MXFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero_point}, SCHEME)
    packed, scale_bytes = state["weight_packed"], state["weight_scale"]
    assert packed.dtype == torch.uint8 and scale_bytes.dtype == torch.uint8
    return packed.numpy(), scale_bytes.numpy()


def _block(amax: float, rest: list[float] | None = None, seed: int = 0) -> list[float]:
    """One block of 32 whose largest magnitude is ``amax`` (placed first), the rest given or
    random below it."""
    if rest is None:
        rng = np.random.default_rng(seed)
        rest = list(rng.uniform(-1.0, 1.0, 31) * amax)
    values = [amax] + list(rest)
    return (values + [0.0] * 32)[:32]


def edge_blocks() -> tuple[list[str], np.ndarray]:
    """Named [N, 32] float64 blocks covering the edge cases (cast to each input dtype later)."""
    names: list[str] = []
    rows: list[list[float]] = []

    def add(name: str, row: list[float]) -> None:
        assert len(row) <= 32, name
        names.append(name)
        rows.append(row + [0.0] * (32 - len(row)))

    add("all +0", [0.0] * 32)
    add("all -0", [-0.0] * 32)
    add("mixed +-0", [0.0, -0.0] * 16)
    add("-0 among values", [1.0, -0.0, 0.0, -0.1, 0.1, -0.2, -1e-3] + [-0.0] * 25)
    add("negative underflow to -0", [-4.0, -0.2, -0.25, -1e-6] + [-0.01] * 28)
    # Exact halfway points of the E2M1 grid at scale 1 (amax 4.0 -> shared exponent 0), both
    # signs, and their float32 neighbours: ties go to the even code.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    add("halfway points +", [4.0] + mids + [-m for m in mids] + [0.0] * 17)
    below = [float(np.nextafter(np.float32(m), np.float32(0))) for m in mids]
    above = [float(np.nextafter(np.float32(m), np.float32(10))) for m in mids]
    add("halfway neighbours", [4.0] + below + above + [-b for b in below])
    add("halfway points scale 2^-10", [v * 2.0**-10 for v in ([4.0] + mids + [-m for m in mids])] + [0.0] * 17)
    add("grid values", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2 + [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0] * 2)
    # Saturation: amax significand in [1.5, 1.75) keeps the floor exponent, so values > 6 clip.
    for amax in (6.0, 6.5, 6.99, 6.5 * 2.0**-20, 6.9 * 2.0**30):
        add(f"saturating amax {amax!r}", _block(amax, [amax * 0.97, -amax, -amax * 0.9] + [amax / 7] * 28))
    # The rule itself: amax significand below, at and above 1.75 (the bump), several binades.
    for sig in (1.0, 1.5, 1.625, 1.7421875, 1.75, 1.7578125, 1.875, 1.9921875):
        for k in (-40, -3, 0, 2, 9, 50):
            add(f"amax {sig}*2^{k}", _block(sig * 2.0**k, seed=len(rows)))
            add(f"amax -{sig}*2^{k}", _block(-sig * 2.0**k, seed=len(rows)))
    # Near the bottom of E8M0: shared exponent -127 (byte 0) and clamping below it.
    for amax in (2.0**-122, 1.75 * 2.0**-125, 2.0**-124, 1.9 * 2.0**-124, 1.5 * 2.0**-125, 2.0**-125,
                 2.0**-126, 2.0**-127, 2.0**-130, 2.0**-133):
        add(f"tiny amax {amax!r}", _block(amax, seed=len(rows)))
    # Near the top: largest finite shared exponents; 1.75 * 2**127 and above overflow the rounding.
    for amax in (2.0**120, 1.9 * 2.0**126, 2.0**127, 1.5 * 2.0**127, 1.7 * 2.0**127):
        add(f"huge amax {amax!r}", _block(amax, seed=len(rows)))
    rng = np.random.default_rng(15)
    for i in range(200):  # random blocks over a wide exponent range
        add(f"random {i}", list(rng.standard_normal(32) * 2.0 ** rng.integers(-60, 60)))
    return names, np.array(rows, dtype=np.float64)


OVERFLOW = {  # amax >= 1.75 * 2**127 (float32/bf16) or 1.75 * 2**15 (float16): the scale rounds to inf
    "f32": [1.75 * 2.0**127, float(np.finfo(np.float32).max)],
    "bf16": [1.75 * 2.0**127, 1.9921875 * 2.0**127],
    "f16": [57344.0, 65504.0],
}
NONFINITE = [math.nan, math.inf, -math.inf]

TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
RAW = {"f32": np.uint32, "bf16": np.uint16, "f16": np.uint16}  # inputs are stored as their bits


def to_bits(t: torch.Tensor, dtype: str) -> np.ndarray:
    return t.view({"f32": torch.int32, "bf16": torch.int16, "f16": torch.int16}[dtype]).numpy().view(RAW[dtype])


def special_blocks(dtype: str) -> tuple[list[str], torch.Tensor]:
    names, rows = [], []
    for amax in OVERFLOW[dtype]:
        names.append(f"overflow amax {amax!r}")
        rows.append(_block(amax, seed=len(rows)))
    for v in NONFINITE:
        names.append(f"non-finite {v!r}")
        rows.append([1.0, v] + [0.5] * 30)
    return names, torch.tensor(rows, dtype=torch.float64).to(TORCH[dtype])


def decode_golden() -> dict[str, np.ndarray]:
    """compressed-tensors' decoding of every scale byte with every code (to bf16, its default)."""
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)
    packed = np.tile(codes[0::2] | (codes[1::2] << 4), (256, 1))
    scale = np.arange(256, dtype=np.uint8).reshape(256, 1)
    state = MXFP4PackedCompressor.decompress(
        {"weight_packed": torch.from_numpy(packed), "weight_scale": torch.from_numpy(scale)}, SCHEME)
    weight = state["weight"]
    assert weight.dtype == torch.bfloat16
    return {"decode_packed": packed, "decode_scale": scale, "decode_bf16": to_bits(weight, "bf16")}


def golden_config() -> dict:
    config = QuantizationConfig(config_groups={"group_0": SCHEME}, format="mxfp4-pack-quantized",
                                quantization_status="compressed", ignore=K3_IGNORE)
    return json.loads(config.model_dump_json())


def make() -> None:
    arrays: dict[str, np.ndarray] = {}
    meta: dict = {"versions": {"compressed_tensors": ct_version, "torch": torch.__version__,
                               "numpy": np.__version__, "python": sys.version.split()[0]},
                  "sets": {}}
    names, edge = edge_blocks()
    for dtype in ("f32", "bf16", "f16"):
        x = torch.from_numpy(edge).to(TORCH[dtype])
        if dtype == "f16":  # float16 cannot hold the extreme binades: keep the rows it can
            keep = [i for i, n in enumerate(names) if torch.isfinite(x[i]).all() and not n.startswith("huge")]
        else:
            keep = list(range(len(names)))
        x = x[keep]
        packed, scales = ct_quantize(x)
        arrays |= {f"edge_{dtype}_input": to_bits(x, dtype), f"edge_{dtype}_packed": packed,
                   f"edge_{dtype}_scale": scales}
        meta["sets"][f"edge_{dtype}"] = [names[i] for i in keep]
        special_names, special = special_blocks(dtype)
        packed, scales = ct_quantize(special)
        arrays |= {f"special_{dtype}_input": to_bits(special, dtype), f"special_{dtype}_packed": packed,
                   f"special_{dtype}_scale": scales}
        meta["sets"][f"special_{dtype}"] = special_names
    # A realistic weight: bf16 normal(0, 0.02), 96 x 1024 (3,072 blocks).
    gen = torch.Generator().manual_seed(15)
    w = (torch.randn(96, 1024, generator=gen, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    packed, scales = ct_quantize(w)
    arrays |= {"weights_bf16_input": to_bits(w, "bf16"), "weights_bf16_packed": packed,
               "weights_bf16_scale": scales}
    arrays |= decode_golden()
    meta["quantization_config"] = golden_config()
    arrays["meta"] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes): compressed-tensors {ct_version}, torch {torch.__version__}")


def validate(path: Path) -> None:
    from transformers.utils.quantization_config import CompressedTensorsConfig

    quant = json.loads(path.read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(quant)
    # What transformers does on from_pretrained (CompressedTensorsHfQuantizer); vLLM reads the
    # same dict with its own parser of compressed-tensors' schema.
    compressor = ModelCompressor.from_compression_config(CompressedTensorsConfig.from_dict(quant))
    print(f"QuantizationConfig: format={parsed.format} status={parsed.quantization_status} "
          f"groups={list(parsed.config_groups)} ignore={len(parsed.ignore or [])}")
    q = compressor.quantization_config
    print(f"ModelCompressor: format={q.format if q else None} groups={list(q.config_groups) if q else []}")
    for name, scheme in parsed.config_groups.items():
        print(f"  {name}: {scheme.model_dump_json(exclude_none=True)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validate", type=Path, help="parse this config.json's quantization_config instead")
    args = parser.parse_args()
    if args.validate:
        validate(args.validate)
    else:
        make()


if __name__ == "__main__":
    main()
