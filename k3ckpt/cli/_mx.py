"""``k3ckpt mx ...``: inspect, measure, dequantize and quantize MXFP4 weights."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import click

from ..errors import EXIT_PROBLEMS
from ._options import CONTEXT, AliasedChoice, handle_errors, jobs_option, json_option
from ._output import ByteProgress, emit_json

if TYPE_CHECKING:  # the mx modules (and numpy) are imported by the commands that use them
    from ..mx.codec import ScaleMode


@click.group(context_settings=CONTEXT)
def mx() -> None:
    """Inspect, dequantize and quantize MXFP4 weights (E2M1 elements, one E8M0 scale per 32).

    Layouts are explicit, never guessed: compressed-tensors pairs (K3: `.weight_packed`
    [out, in/2] + `.weight_scale` [out, in/32]) and gpt-oss stacked experts (`_blocks`
    [E, out, G, 16] + `_scales` [E, out, G]). Everything works row-chunk by row-chunk.

    \b
    Examples:
      k3ckpt mx inspect ./Kimi-K3 --layer 1 --expert 0
      k3ckpt mx dequant ./Kimi-K3 --layer 1 --to bf16 -o layer1.safetensors
      k3ckpt mx quantize finetuned.safetensors -o packed.safetensors
      k3ckpt mx error finetuned.safetensors
    """


# The values are spelled out here (not imported from k3ckpt.mx.codec) so that `--help` does not
# import numpy; tests/test_mxfp4_golden.py checks they are codec.SCALE_MODES plus the alias.
_scale_mode_option = click.option(
    "--scale-mode", type=AliasedChoice(["compressed-tensors", "ocp", "ceil", "even"], aliases=("floor",)),
    default="compressed-tensors", show_default=True,
    help="Shared-exponent rule: compressed-tensors (what made K3's experts: amax rounded to one mantissa "
         "bit); ocp (OCP MX floor(log2(amax)) - 2); ceil (never saturates); even "
         "(compressed-tensors' exponent, -0.0 kept as -0).")


# -- mx inspect / mx error ---------------------------------------------------------------------


@mx.command("inspect", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=str))
@click.option("--tensor", help="One tensor: its dequantized name (...w1.weight), base or a stored name.")
@click.option("--layer", type=click.IntRange(0), help="Only this layer (compares its experts for outliers).")
@click.option("--expert", type=click.IntRange(0), help="Only this expert (gpt-oss: its slice of the stacked tensors).")
@click.option("--top", type=click.IntRange(0), default=3, show_default=True,
              help="Detailed charts for the K most severe flagged tensors.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=str),
              help="Also save the histograms as an image (needs the plot extra: matplotlib).")
@jobs_option("Tensors read in parallel [default: min(CPUs, 8)].")
@json_option("Machine-readable output (no charts).")
@handle_errors
def mx_inspect(path: str, tensor: str | None, layer: int | None, expert: int | None, top: int,
               plot_path: str | None, jobs: int | None, as_json: bool) -> None:
    """Statistics, code and scale-exponent histograms, and flags for MXFP4 tensors.

    PATH is a checkpoint directory or one .safetensors file. Reads row chunk by row chunk
    (bounded memory). Per tensor: stored and logical shapes; min, max, mean, std, absmax, zero
    fraction of the dequantized values (NaN/Inf counted apart); the 16 E2M1 codes; the E8M0 scale
    exponents. One tensor gets charts; several get a table, aggregate charts and charts for the
    --top most severe flagged ones. Exits 1 when anything is flagged:

    \b
      N  NaN scale byte (0xFF) - the whole block of 32 is NaN
      F  NaN/Inf dequantized values
      Z  all-zero blocks (32 codes all +-0: never made by quantizing real weights)
      E  scale-exponent outlier: mean or max exponent more than 5 robust deviations
         (1.4826 x MAD, at least 0.25 / 1.0) from the median of its layer and projection;
         needs >= 5 comparable tensors (or gpt-oss experts) in the selection

    \b
    Examples:
      k3ckpt mx inspect ./Kimi-K3 --layer 1
      k3ckpt mx inspect ./Kimi-K3 --layer 1 --expert 7
      k3ckpt mx inspect model-00002-of-000096.safetensors --top 10
      k3ckpt mx inspect ./Kimi-K3 --tensor language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight
      k3ckpt mx inspect ./gpt-oss-20b --layer 3 --plot layer3.png
      k3ckpt mx inspect ./Kimi-K3 --layer 1 --json | jq '.flags'
    """
    from ..mx.inspect import inspect_mx
    from ..mx.render import plot_inspect, render_inspect, require_matplotlib

    if tensor is not None and (layer is not None or expert is not None):
        raise click.UsageError("use --tensor, or --layer/--expert, not both")
    if plot_path:
        require_matplotlib()  # fail before reading anything
    with ByteProgress(not as_json, "inspecting") as bar:
        rep = inspect_mx(path, tensor=tensor, layer=layer, expert=expert, jobs=jobs, progress=bar, on_plan=bar.plan)
    if plot_path:
        plot_inspect(rep, plot_path)
    if as_json:
        d = rep.to_json()
        if plot_path:
            d["plot"] = plot_path
        emit_json(d)
    else:
        click.echo(render_inspect(rep, top=top))
        if plot_path:
            click.echo(f"histograms saved to {plot_path}")
    if rep.flags:
        sys.exit(EXIT_PROBLEMS)


@mx.command("error", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=str))
@_scale_mode_option
@click.option("--tensor", help="Only this tensor (measured whatever its role).")
@click.option("--all", "include_all", is_flag=True,
              help="Also measure roles K3 keeps in high precision (attention, norms, router, embeddings, ...).")
@json_option()
@handle_errors
def mx_error(path: str, scale_mode: ScaleMode, tensor: str | None, include_all: bool, as_json: bool) -> None:
    """What MXFP4 would do to float weights: round-trip quantization error per tensor.

    PATH is one .safetensors file with BF16/F16/F32 weights. Every 2-D float tensor whose last
    dimension is a multiple of 32 and whose role K3 quantizes (routed experts; also dense MLP,
    latent projections and unrecognized names) is quantized and dequantized back, row chunk by
    row chunk: relative RMS error, max abs error, fraction of saturated values (clipped to
    +-6 x scale). Exits 1 when a tensor holds NaN/Inf (MXFP4 cannot encode them).

    \b
    Examples:
      k3ckpt mx error finetuned.safetensors
      k3ckpt mx error finetuned.safetensors --scale-mode ocp
      k3ckpt mx error finetuned.safetensors --tensor model.layers.1.mlp.experts.0.gate_proj.weight
      k3ckpt mx error finetuned.safetensors --all --json | jq .totals
    """
    from ..mx.error import quantization_error
    from ..mx.render import render_error

    rep = quantization_error(path, scale_mode=scale_mode, tensor=tensor, include_all=include_all)
    if as_json:
        emit_json(rep.to_json())
    else:
        click.echo(render_error(rep))
    if rep.nonfinite:
        sys.exit(EXIT_PROBLEMS)


# -- mx dequant / mx quantize ------------------------------------------------------------------


@mx.command("dequant", context_settings=CONTEXT)
@click.argument("path", type=click.Path(path_type=str))
@click.option("--tensor", help="One quantized weight: its dequantized name, its base, or either stored name.")
@click.option("--layer", type=click.IntRange(0), help="Only this layer (0-based).")
@click.option("--expert", type=click.IntRange(0), help="Only this expert of --layer.")
@click.option("--to", "to", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Output dtype.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="The safetensors file to write (replaced atomically).")
@json_option("Print what was written as JSON.")
@handle_errors
def mx_dequant(path: str, tensor: str | None, layer: int | None, expert: int | None, to: str, output: str,
               as_json: bool) -> None:
    """Dequantize MXFP4 weights of a checkpoint (DIR) or one shard (FILE) into one safetensors file.

    Each quantized pair becomes one tensor: `<base>.weight` [out, in] for K3 / compressed-tensors,
    `<base>` [E, out, in] for gpt-oss stacked experts. Streams row chunk by row chunk (a whole
    MoE layer in a few hundred MB of RAM) into a temporary file that is renamed into place only
    when complete; free disk space is checked first.

    \b
    Examples:
      k3ckpt mx dequant ./Kimi-K3 --layer 1 --expert 0 --to fp32 -o l1e0.safetensors
      k3ckpt mx dequant ./Kimi-K3 --layer 1 --to bf16 -o layer1.safetensors
      k3ckpt mx dequant model-00002-of-000096.safetensors -o shard2-bf16.safetensors
      k3ckpt mx dequant ./gpt-oss --tensor model.layers.0.mlp.experts.down_proj -o down.safetensors --json
    """
    from ..mx.convert import dequantize_to_file, render_dequant

    if tensor is not None and (layer is not None or expert is not None):
        raise click.UsageError("use --tensor or --layer/--expert, not both")
    if expert is not None and layer is None:
        raise click.UsageError("--expert needs --layer")
    with ByteProgress(not as_json, "dequantizing") as bar:
        res = dequantize_to_file(path, output, to=to, tensor=tensor, layer=layer, expert=expert,
                                 progress=bar, on_plan=bar.plan)
    if as_json:
        emit_json(res.to_json())
    else:
        click.echo(render_dequant(res))


@mx.command("quantize", context_settings=CONTEXT)
@click.argument("input_path", metavar="IN", type=click.Path(path_type=str))
@click.option("-o", "--output", required=True, type=click.Path(path_type=str),
              help="IN a file: the safetensors file to write (replaced atomically). IN a checkpoint "
                   "directory: the checkpoint directory to write (new, empty or an earlier mx quantize's).")
@_scale_mode_option
@click.option("--all", "include_all", is_flag=True,
              help="Quantize every 2-D linear weight (in % 32 == 0), not only routed experts; "
                   "norms, embeddings and LM heads stay as they are.")
@json_option("Print what was written as JSON.")
@handle_errors
def mx_quantize(input_path: str, output: str, scale_mode: ScaleMode, include_all: bool, as_json: bool) -> None:
    """Quantize BF16/F16/F32 weights to MXFP4 in the K3 layout: one safetensors file, or a whole
    checkpoint directory into a loadable one.

    Each eligible `<base>.weight` [out, in] becomes `<base>.weight_packed` [out, in/2] U8 (low
    nibble first) + `<base>.weight_scale` [out, in/32] U8 (E8M0), as compressed-tensors
    `mxfp4-pack-quantized` stores them - by default with compressed-tensors' own rule, byte for
    byte. By default only routed-expert weights qualify (what K3 quantizes); every other tensor is
    copied through unchanged. A weight with NaN/Inf is refused, naming it, and nothing is written.

    With a checkpoint directory (config.json + shards) every shard is quantized under its own
    name, the index rewritten, the other files (tokenizer, licence, code) copied, and config.json
    given the `quantization_config` compressed-tensors reads (engines load the output as is).

    \b
    Examples:
      k3ckpt mx quantize finetuned.safetensors -o packed.safetensors
      k3ckpt mx quantize ./Kimi-K3-bf16 -o ./Kimi-K3-mxfp4
      k3ckpt mx quantize experts-bf16.safetensors -o packed.safetensors --scale-mode ocp --json
      k3ckpt mx quantize small-model.safetensors -o small-mxfp4.safetensors --all
    """
    from ..mx.checkpoint import quantize_checkpoint, render_quantize_checkpoint
    from ..mx.convert import quantize_file, render_quantize

    with ByteProgress(not as_json, "quantizing") as bar:
        if os.path.isdir(input_path):
            ckpt = quantize_checkpoint(input_path, output, scale_mode=scale_mode, include_all=include_all,
                                       progress=bar, on_plan=bar.plan)
            doc, line = ckpt.to_json(), render_quantize_checkpoint(ckpt)
        else:
            one = quantize_file(input_path, output, scale_mode=scale_mode, include_all=include_all,
                                progress=bar, on_plan=bar.plan)
            doc, line = one.to_json(), render_quantize(one)
    if as_json:
        emit_json(doc)
    else:
        click.echo(line)


COMMANDS = [mx]
