#!/usr/bin/env python3
"""Benchmark: MXFP4 decode throughput of `k3ckpt.mxfp4.dequantize_mxfp4` against its peers, per core.

Decodes, in one run and on the same inputs, K3-shaped MXFP4 tensors (random packed bytes, E8M0
scales drawn from 115..125 like real expert weights) to bfloat16 and to float32 with:
  - k3ckpt: `k3ckpt.mxfp4.dequantize_mxfp4`;
  - numpy, straightforward: the decoder a user writes by hand - unpack the low/high nibbles with
    `& 0xF` / `>> 4` into an interleaved code array, look the 16 E2M1 values up, multiply by
    `np.exp2(scale - 127)` repeated per 32, cast to bfloat16 with ml_dtypes;
  - torch, transformers' approach: a faithful CPU re-implementation of
    `transformers.integrations.mxfp4.convert_moe_packed_tensors` (skipped with a note when torch
    does not import; torch is a benchmark-only dependency, not a k3ckpt one).
Everything runs on one thread (`torch.set_num_threads(1)`, BLAS/OpenMP pools pinned to 1), so
the figures are per core. Before timing, every contender's output is asserted byte-identical to
k3ckpt's. Each contender runs `--runs` times, interleaved round-robin with the others so that
background load hits all of them alike; the table reports the median. A last row times only the
first touch of a fresh output-sized array, the page-fault cost every contender pays.

Usage: .venv/bin/python scripts/bench_mxfp4.py [--runs 7] [--large-mb 64] [--dtype bf16 fp32]
Prints Markdown to paste into BENCHMARKS.md.
"""

from __future__ import annotations

import os

# Pin every thread pool to one thread before numpy / torch are imported: per-core figures.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse
import datetime
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import benchlib as bl
import ml_dtypes
import numpy as np

from k3ckpt.mx.codec import dequantize_mxfp4

try:
    import torch
except (ImportError, OSError) as exc:  # pragma: no cover - depends on the environment
    torch = None
    TORCH_ERROR = f"{type(exc).__name__}: {exc}"
else:
    torch.set_num_threads(1)
    TORCH_ERROR = ""

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}


# --------------------------------------------------------------------------------------------
# (a) numpy, the straightforward way
# --------------------------------------------------------------------------------------------

FP4_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                   dtype=np.float32)


def numpy_straightforward(packed: np.ndarray, scales: np.ndarray, dtype: Any) -> np.ndarray:
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    codes[..., 0::2] = lo
    codes[..., 1::2] = hi
    values = FP4_LUT[codes]
    scale = np.repeat(np.exp2(scales.astype(np.float32) - 127), 32, axis=-1)
    return (values * scale).astype(dtype, copy=False)


# --------------------------------------------------------------------------------------------
# (b) torch, transformers' convert_moe_packed_tensors
# --------------------------------------------------------------------------------------------

FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def convert_moe_packed_tensors(blocks: Any, scales: Any, *, dtype: Any = None, rows_per_chunk: int = 32768 * 1024) -> Any:
    """Mirrors transformers.integrations.mxfp4.convert_moe_packed_tensors (the gpt-oss dequantizer).

    Same steps as upstream: int32 scales minus 127, a 16-entry LUT in the output dtype, blocks
    flattened to [rows_total, 16] with one scale per row, then per `rows_per_chunk` rows: int64
    nibble indices `idx_lo = blk & 0x0F` / `idx_hi = blk >> 4`, `sub[:, 0::2] = lut[idx_lo]`,
    `sub[:, 1::2] = lut[idx_hi]`, `torch.ldexp(sub, exp, out=sub)`. Left out: the move to CUDA
    when available (CPU is the point here) and the final `.transpose(1, 2).contiguous()`, which
    only re-lays gpt-oss's [E, out, in] as [E, in, out] - a copy that is no part of decoding and
    would give a layout the other contenders do not produce.
    """
    dtype = torch.bfloat16 if dtype is None else dtype
    scales = scales.to(torch.int32) - 127
    assert blocks.shape[:-1] == scales.shape, f"{blocks.shape[:-1]=} does not match {scales.shape=}"
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    *prefix_shape, G, B = blocks.shape
    rows_total = math.prod(prefix_shape) * G
    blocks = blocks.reshape(rows_total, B)
    scales = scales.reshape(rows_total, 1)
    out = torch.empty(rows_total, B * 2, dtype=dtype, device=blocks.device)
    for r0 in range(0, rows_total, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, rows_total)
        blk = blocks[r0:r1]
        exp = scales[r0:r1]
        idx_lo = (blk & 0x0F).to(torch.long)
        idx_hi = (blk >> 4).to(torch.long)
        sub = out[r0:r1]
        sub[:, 0::2] = lut[idx_lo]
        sub[:, 1::2] = lut[idx_hi]
        torch.ldexp(sub, exp, out=sub)
        del idx_lo, idx_hi, blk, exp, sub
    return out.reshape(*prefix_shape, G, B * 2).view(*prefix_shape, G * B * 2)


def torch_contender(packed: np.ndarray, scales: np.ndarray, dtype: Any) -> Callable[[], Any]:
    rows, groups = scales.shape
    blocks = torch.from_numpy(packed.reshape(rows, groups, 16))  # K3 [out, in/2] is gpt-oss [out, G, 16]
    scales_t = torch.from_numpy(scales)
    torch_dtype = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(np.float32): torch.float32}[np.dtype(dtype)]
    return lambda: convert_moe_packed_tensors(blocks, scales_t, dtype=torch_dtype)


def torch_bytes(result: Any) -> bytes:
    width = result.element_size()
    as_int = result.view({2: torch.int16, 4: torch.int32}[width])
    return as_int.numpy().tobytes()


# --------------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------------


def make_inputs(rows: int, packed_cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (rows, packed_cols), dtype=np.uint8)
    scales = rng.integers(115, 126, (rows, packed_cols // 16), dtype=np.uint8)
    return packed, scales


def bench_case(label: str, packed: np.ndarray, scales: np.ndarray, dtype_name: str, runs: int) -> list[str]:
    dtype = DTYPES[dtype_name]
    elements = packed.size * 2
    out_bytes = elements * np.dtype(dtype).itemsize
    contenders: list[tuple[str, Callable[[], Any], Callable[[Any], bytes]]] = [
        ("k3ckpt `dequantize_mxfp4`", lambda: dequantize_mxfp4(packed, scales, dtype), lambda r: r.tobytes()),
        ("numpy, straightforward (nibbles, 16-value LUT, `exp2(s-127)` per 32, ml_dtypes cast)",
         lambda: numpy_straightforward(packed, scales, dtype), lambda r: r.tobytes()),
    ]
    if torch is not None:
        contenders.append(("torch 1 thread, transformers `convert_moe_packed_tensors` approach",
                           torch_contender(packed, scales, dtype), torch_bytes))

    # Same inputs, identical output bytes - asserted before anything is timed.
    reference = contenders[0][1]().tobytes()
    for name, run, to_bytes in contenders[1:]:
        got = to_bytes(run())
        assert got == reference, f"{name} differs from k3ckpt on {label} ({dtype_name})"
    gc.collect()

    # Not a decoder: what every contender pays to fault in its fresh output array (the kernel
    # zeroes each page on first touch), to read the large-tensor rows against.
    floor_name = "floor: first touch of a fresh output-sized array (`np.empty` + one write per 4 KiB)"

    def touch() -> None:
        fresh = np.empty(out_bytes, dtype=np.uint8)
        fresh[::4096] = 1

    times: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    times[floor_name] = []
    for _ in range(runs):
        for name, run in [(name, run) for name, run, _ in contenders] + [(floor_name, touch)]:
            start = time.perf_counter()
            result = run()
            times[name].append(time.perf_counter() - start)
            del result
    baseline = statistics.median(times[contenders[1][0]])
    lines = [
        f"**{label}** -> {dtype_name}: {elements:,} elements, {out_bytes / 2**20:,.0f} MiB out",
        "",
        "| method | median (ms) | best (ms) | elements/s | output GB/s | vs straightforward numpy |",
        "|---|---|---|---|---|---|",
    ]
    for name, samples in times.items():
        median = statistics.median(samples)
        ratio = "-" if name == floor_name else f"{baseline / median:.2f}x"
        lines.append(
            f"| {name} | {median * 1e3:,.1f} | {min(samples) * 1e3:,.1f} | {elements / median / 1e9:.2f} G "
            f"| {out_bytes / median / 1e9:.2f} | {ratio} |"
        )
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="timed runs per contender (median reported)")
    parser.add_argument("--large-mb", type=int, default=64, help="packed MiB of the large tensor (0 to skip)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"- Date: {datetime.date.today().isoformat()}")
    print(f"- {bl.machine_line(bl.machine(bl.ROOT))}; numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}, "
          f"torch {torch.__version__ if torch is not None else 'not available'}; all contenders on 1 thread")
    if torch is None:
        print(f"- Note: torch did not import ({TORCH_ERROR}); the transformers-approach contender is skipped. "
              "Install it into the venv for the full comparison: `.venv/bin/pip install torch==2.13.0`.")
    print(f"- Median of {args.runs} runs per contender, interleaved; outputs asserted byte-identical first.")
    print()

    cases = [("K3 expert w1", 3072, 1792, "`weight_packed` [3072, 1792] + `weight_scale` [3072, 112]")]
    if args.large_mb:
        cols = 4096
        rows = args.large_mb * 2**20 // cols
        cases.append((f"{args.large_mb} MiB packed", rows, cols, f"[{rows}, {cols}] + [{rows}, {cols // 16}]"))
    for label, rows, cols, shape in cases:
        packed, scales = make_inputs(rows, cols, args.seed)
        for dtype_name in args.dtype:
            print("\n".join(bench_case(f"{label}, {shape}", packed, scales, dtype_name, args.runs)))
        del packed, scales
        gc.collect()


if __name__ == "__main__":
    main()
