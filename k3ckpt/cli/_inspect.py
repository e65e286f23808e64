"""``k3ckpt inspect`` and ``k3ckpt synth``: describe a checkpoint, or write a synthetic one."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import click

from ..errors import EXIT_PROBLEMS
from ._options import CONTEXT, handle_errors, jobs_option, json_option
from ._output import ByteProgress, emit_json

# -- inspect -----------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("path", type=click.Path(file_okay=False, path_type=str))
@click.option("--layers", "show_layers", is_flag=True, help="Add a per-layer table.")
@json_option()
@jobs_option("Processes reading headers [default: CPU count].")
@handle_errors
def inspect(path: str, show_layers: bool, as_json: bool, jobs: int | None) -> None:
    """Describe a checkpoint from its config and shard headers (no tensor data is read).

    PATH is a checkpoint directory (as `hf download --local-dir` leaves it), a Hugging Face
    cache snapshot, or a `models--org--name` cache folder. Exits 1 when the config, the index
    and the tensors disagree. A node's partial copy (with the k3ckpt-node.json or
    k3ckpt-partial.json that reshard --format hf-node and fetch --ranks write) must hold the
    experts its marker lists.

    \b
    Examples:
      k3ckpt inspect ./Kimi-K3
      k3ckpt inspect ~/.cache/huggingface/hub/models--moonshotai--Kimi-K3 --layers
      k3ckpt inspect ./Kimi-K3 --json | jq .params_active
    """
    from ..format.checkpoint import open_checkpoint
    from ..format.inspect import inspect_checkpoint, render_text
    from ..format.layout import read_node_marker

    t0 = time.perf_counter()
    with ByteProgress(not as_json, "reading headers", unit="shard") as bar:
        ckpt = open_checkpoint(path, jobs=jobs, progress=bar, on_plan=bar.plan)
    # a node's copy (reshard --format hf-node, fetch --ranks/--node) holds only the experts its
    # marker lists: those are the ones each MoE layer must have
    marker = read_node_marker(ckpt.root)
    rep = inspect_checkpoint(ckpt, experts=marker["experts"] if marker is not None else None)
    elapsed = time.perf_counter() - t0
    if as_json:
        d = rep.to_json(layers=show_layers)
        d["elapsed_seconds"] = round(elapsed, 3)
        emit_json(d)
    else:
        click.echo(render_text(rep, show_layers=show_layers))
    if rep.errors:
        sys.exit(EXIT_PROBLEMS)


# -- synth -------------------------------------------------------------------------------------


@click.command(context_settings=CONTEXT)
@click.argument("dest", type=click.Path(path_type=str))
@click.option("--preset", default="k3-tiny", show_default=True,
              type=click.Choice(["k3-tiny", "k3-small", "k3-full", "gptoss-tiny", "k2-tiny", "k2-engine", "k2-engine-fp32",
                                 "qwen3-moe-engine", "qwen3-moe-engine-fp32"]),
              help="Starting shape; the options below override it.")
@click.option("--layers", "num_layers", type=click.IntRange(1), help="Number of layers.")
@click.option("--experts", "num_experts", type=click.IntRange(1), help="Routed experts per MoE layer.")
@click.option("--active", "experts_per_token", type=click.IntRange(1), help="Experts per token.")
@click.option("--hidden", "hidden_size", type=click.IntRange(32), help="Hidden size.")
@click.option("--moe-intermediate", "moe_intermediate_size", type=click.IntRange(32),
              help="Expert intermediate size (multiple of 32).")
@click.option("--expert-hidden", "routed_expert_hidden_size", type=click.IntRange(0),
              help="Latent expert width (0: hidden size).")
@click.option("--vocab", "vocab_size", type=click.IntRange(1), help="Vocabulary size.")
@click.option("--shards", "num_shards", type=click.IntRange(0), help="Shard count (0: one per layer, K3 style).")
@click.option("--seed", type=int, help="Seed; the same seed gives byte-identical output.")
@click.option("--headers-only", is_flag=True, default=None,
              help="Real headers, data as sparse holes (what k3-full does): full-size inventories at no disk cost.")
@jobs_option("Shards written in parallel [default: CPU count].")
@click.option("--force", is_flag=True, help="Replace an earlier synthetic checkpoint in DEST (never other files).")
@json_option("Print what was written as JSON.")
@handle_errors
def synth(dest: str, preset: str, jobs: int | None, force: bool, as_json: bool, **overrides: Any) -> None:
    """Write a deterministic synthetic checkpoint shaped like Kimi K3 (or gpt-oss, Kimi-K2 FP8).

    Real config structure, tensor names, dtypes and shard naming; MXFP4 experts quantized from
    seeded random weights with compressed-tensors' MXFP4 rule (K3's producer); each expert's six
    tensors adjacent in one shard.

    \b
    Presets:
      k3-tiny      a few MB, for unit tests
      k3-small     about 1 GB, for benchmarks and the demo
      k3-full      the real K3 inventory (93 layers, 896 experts, 96 shards, ~497k tensors,
                   ~1.56 TB apparent) with --headers-only: sparse files, ~130 MB on disk
      gptoss-tiny  gpt-oss layout (stacked MXFP4 experts, zero-based shard names)
      k2-tiny      Kimi-K2 / DeepSeek-V3 layout (per-expert block FP8)
      k2-engine    Kimi-K2's architecture (DeepseekV3ForCausalLM) in BF16, a few MB, that
                   vLLM's CPU backend runs, with a real tokenizer.json (-fp32: in F32)
      qwen3-moe-engine
                   the same for Qwen3MoeForCausalLM (-fp32: in F32)

    \b
    Examples:
      k3ckpt synth work/k3-tiny
      k3ckpt synth work/k3-small --preset k3-small
      k3ckpt synth work/k3-full --preset k3-full --headers-only
      k3ckpt synth work/wide --preset k3-tiny --experts 64 --layers 8 --seed 7
    """
    from ..testing.synth import render_synth, spec_from_preset, synthesize

    spec = spec_from_preset(preset, **overrides)
    with ByteProgress(not as_json, "writing") as bar:
        res = synthesize(spec, dest, jobs=jobs or os.cpu_count() or 1, force=force, progress=bar, on_plan=bar.plan)
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(render_synth(res))


COMMANDS = [inspect, synth]
