"""How MX reports read: the text tables and charts of ``mx inspect`` and ``mx error``, and the
optional matplotlib figure of ``mx inspect --plot`` (the ``plot`` extra)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import MxPlotUnavailableError
from ..utils import format_percent
from .codec import (
    E8M0_BIAS,
    E8M0_NAN,
)
from .error import QuantErrorReport
from .inspect import CODE_LABELS, FLAG_LETTERS, OUTLIER_MIN_GROUP, OUTLIER_Z, MxInspectReport, TensorInspection

__all__ = ["code_chart", "exponent_chart", "plot_inspect", "render_error", "render_inspect", "require_matplotlib"]


# ---------------------------------------------------------------------------------------------
# Text rendering
# ---------------------------------------------------------------------------------------------

_EIGHTHS = " ▏▎▍▌▋▊▉█"
_SPARKS = "▁▂▃▄▅▆▇█"
_BAR = 20
#: More distinct exponents than this are merged into this many equal-width bins.
_MAX_EXPONENT_LINES = 24


def _bar(count: int, peak: int, width: int = _BAR) -> str:
    """A bar of ``width`` cells in eighths; any non-zero count shows at least one eighth."""
    if peak <= 0 or count <= 0:
        return " " * width
    eighths = max(1, round(count / peak * width * 8))
    full, rest = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[rest] if rest else "")).ljust(width)


def _num(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def code_chart(hist: np.ndarray, indent: str = "  ") -> list[str]:
    """The 16 E2M1 codes as 8 lines: positive codes on the left, their negatives on the right."""
    total = int(hist.sum())
    peak = int(hist.max()) if total else 0
    lines = []
    for c in range(8):
        cells = []
        for code in (c, c + 8):
            n = int(hist[code])
            cells.append(f"{CODE_LABELS[code]:>4} {_bar(n, peak)} {n / total * 100 if total else 0:6.2f}% {n:>12,}")
        lines.append(indent + "   ".join(cells))
    return lines


def exponent_chart(scale_hist: np.ndarray, indent: str = "  ") -> list[str]:
    """One line per scale exponent that occurs (bins when too many), plus a NaN line."""
    total = int(scale_hist.sum())
    present = np.flatnonzero(scale_hist[:E8M0_NAN])
    rows: list[tuple[str, int]] = []
    if present.size > _MAX_EXPONENT_LINES:
        lo, hi = int(present[0]), int(present[-1])
        width = -(-(hi - lo + 1) // _MAX_EXPONENT_LINES)
        for b in range(lo, hi + 1, width):
            top = min(hi, b + width - 1)
            n = int(scale_hist[b:top + 1].sum())
            if n:
                rows.append((f"{b - E8M0_BIAS}..{top - E8M0_BIAS}", n))
    else:
        rows = [(str(int(b) - E8M0_BIAS), int(scale_hist[b])) for b in present]
    if scale_hist[E8M0_NAN]:
        rows.append(("NaN", int(scale_hist[E8M0_NAN])))
    peak = max((n for _, n in rows), default=0)
    label_w = max((len(lab) for lab, _ in rows), default=3)
    return [f"{indent}{lab:>{label_w}} {_bar(n, peak, 40)} {n / total * 100:6.2f}% {n:>12,}" for lab, n in rows]


def _sparkline(values: list[float | None]) -> str:
    finite = [v for v in values if v is not None]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    return "".join(" " if v is None else _SPARKS[0 if span == 0 else min(7, int((v - lo) / span * 8))] for v in values)


def _shape(shape: Iterable[int]) -> str:
    return "x".join(str(s) for s in shape)


def _common_prefix(names: list[str]) -> str:
    """Longest common prefix ending at a dot, so every name keeps its distinguishing part."""
    if len(names) < 2:
        return ""
    prefix = os.path.commonprefix(names)
    return prefix[: prefix.rfind(".") + 1]


def _short(name: str, prefix: str) -> str:
    """A name as the table shows it: without the common prefix and the ``.weight`` suffix."""
    name = name[len(prefix):]
    return name.removesuffix(".weight")


def _detail(r: TensorInspection, indent: str = "  ") -> list[str]:
    t = r.tensor
    m = r.moments
    role = ", ".join(s for s in (
        f"layer {t.role.layer}" if t.role.layer is not None else "",
        f"expert {r.expert_slice if r.expert_slice is not None else t.role.expert}"
        if (r.expert_slice is not None or t.role.expert is not None) else "",
        t.role.proj or "") if s)
    rng = r.exponent_range
    lines = [
        r.name,
        f"{indent}format   mxfp4, {t.layout} layout" + (f"; {role}" if role else ""),
        f"{indent}stored   {t.data_name.rsplit('.', 1)[-1]} {list(t.data_shape)} U8 (E2M1 codes, 2 per byte)",
        f"{indent}         {t.scale_name.rsplit('.', 1)[-1]} {list(t.scale_shape)} U8 (E8M0 scales)",
        f"{indent}logical  {list(r.shape)} = {r.numel:,} values in {r.blocks:,} blocks of 32",
        (f"{indent}values   min {_num(m.lo if m.n else None)}  max {_num(m.hi if m.n else None)}  "
         f"mean {_num(m.mean)}  std {_num(m.std)}  absmax {_num(r.absmax)}"),
        (f"{indent}         zero {format_percent(r.zero_fraction)}  NaN {r.nan_count:,}  Inf {r.inf_count:,}  "
         f"all-zero blocks {r.zero_blocks:,}"),
        (f"{indent}scales   exponent mean {_num(r.exponent_mean)}  range "
         f"{f'[{rng[0]}, {rng[1]}]' if rng else '-'}  NaN scale bytes {r.nan_scales:,}"),
    ]
    if len(r.units) > 1:
        means = [u.mean for u in r.units]
        known = [v for v in means if v is not None]
        lines.append(f"{indent}per-expert mean exponent ({len(means)} experts, "
                     f"{_num(min(known, default=None))} .. {_num(max(known, default=None))}):")
        spark = _sparkline(means)
        lines += [f"{indent}  {spark[i:i + 80]}" for i in range(0, len(spark), 80)]
    lines.append(f"{indent}E2M1 codes")
    lines += code_chart(r.code_hist, indent + "  ")
    lines.append(f"{indent}scale exponents (value = 2**e)")
    lines += exponent_chart(r.scale_hist, indent + "  ")
    if r.flags:
        lines.append(f"{indent}flags")
        lines += [f"{indent}  {f.kind}: {f.message}" for f in r.flags]
    else:
        lines.append(f"{indent}flags    none")
    return lines


def render_inspect(rep: MxInspectReport, *, top: int = 3) -> str:
    """Human-readable report, readable at 100 columns.

    One tensor: the detailed view. Several: a one-line-per-tensor table, aggregate charts, the
    exponent groups, every flag, and the detailed view of the ``top`` most severe flagged ones.
    """
    from ..utils import human_bytes, human_count

    sel = " ".join(f"--{k} {v}" for k, v in rep.selection.items())
    head = (f"{rep.source}{' ' + sel if sel else ''}: {len(rep.tensors):,} MXFP4 tensor"
            f"{'s' if len(rep.tensors) != 1 else ''}, {human_count(rep.numel)} values, "
            f"{human_bytes(rep.bytes_read)} read in {rep.seconds:.2f} s")
    if len(rep.tensors) == 1:
        return "\n".join([head, *_detail(rep.tensors[0])])

    names = [r.name for r in rep.tensors]
    prefix = _common_prefix(names)
    shown = [_short(n, prefix) for n in names]
    name_w = min(max(6, max(len(s) for s in shown)), 32)
    shapes = [_shape(r.shape) for r in rep.tensors]
    shape_w = max(5, max(len(s) for s in shapes))
    lines = [head]
    if prefix:
        lines.append(f"names below are after {prefix}")
    lines.append(f"{'tensor':<{name_w}} {'shape':>{shape_w}} {'mean':>10} {'std':>9} {'absmax':>9} "
                 f"{'zero':>6} {'exp':>6} {'range':<10} flags")
    for r, s, shp in zip(rep.tensors, shown, shapes):
        if len(s) > name_w:
            s = "…" + s[-(name_w - 1):]
        rng = r.exponent_range
        letters = "".join(sorted({FLAG_LETTERS[f.kind] for f in r.flags}, key="NFEZ".index)) or "-"
        zero = f"{r.zero_fraction * 100:.1f}%"
        lines.append(f"{s:<{name_w}} {shp:>{shape_w}} {_num(r.moments.mean, 3):>10} {_num(r.moments.std):>9} "
                     f"{_num(r.absmax):>9} {zero:>6} {_num(r.exponent_mean, 3):>6} "
                     f"{f'[{rng[0]},{rng[1]}]' if rng else '-':<10} {letters}")
    lines.append("flags: N NaN scale byte, F NaN/Inf values, E exponent outlier, Z all-zero blocks")
    lines.append("")
    lines.append(f"E2M1 codes, all {len(rep.tensors):,} tensors")
    lines += code_chart(rep.code_hist)
    lines.append(f"scale exponents, all {len(rep.tensors):,} tensors (value = 2**e)")
    lines += exponent_chart(rep.scale_hist)
    lines.append("")
    checked = [g for g in rep.groups if g.checked]
    if not checked:
        lines.append(f"scale-exponent outliers: not checked (needs >= {OUTLIER_MIN_GROUP} comparable tensors of one")
        lines.append("  layer and projection in the selection: select a whole layer with --layer N)")
    else:
        lines.append(f"scale-exponent groups (outlier when robust z > {OUTLIER_Z:g}; "
                     f"needs >= {OUTLIER_MIN_GROUP} members)")
        for g in rep.groups:
            if g.median_mean is None:
                lines.append(f"  {g.label}: {g.members} member(s), every scale byte NaN")
                continue
            stats = (f"mean exp median {g.median_mean:.3f} (MAD {g.mad_mean:.3f}), "
                     f"max exp median {g.median_max:g} (MAD {g.mad_max:g})")
            lines.append(f"  {g.label}: {g.members} member{'s' if g.members != 1 else ''}, {stats}"
                         + ("" if g.checked else " - too few to check"))
    flagged = rep.flagged
    lines.append("")
    if not flagged:
        lines.append("flags: none")
        return "\n".join(lines)
    flags = [f for r in flagged for f in r.flags]
    lines.append(f"flags: {len(flagged):,} of {len(rep.tensors):,} tensors flagged ({len(flags):,} flags)")
    cap = 200
    for f in flags[:cap]:
        lines.append(f"  {_short(f.tensor, prefix)}: {f.kind}: {f.message}")
    if len(flags) > cap:
        lines.append(f"  ... and {len(flags) - cap:,} more (--json lists all)")
    for r in flagged[:max(0, top)]:
        lines.append("")
        lines += _detail(r)
    if len(flagged) > top > 0:
        lines.append("")
        lines.append(f"(details for the {top} most severe; --top K shows more)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plotting (optional: matplotlib is the `plot` extra)
# ---------------------------------------------------------------------------------------------


def require_matplotlib() -> Any:
    """Import matplotlib's ``Figure`` lazily, or fail with how to install it.

    Called before any data is read, so a missing extra costs nothing. ``Figure`` (not pyplot)
    needs no GUI backend and keeps no global state."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MxPlotUnavailableError("--plot needs matplotlib, which is not installed: pip install 'k3ckpt[plot]'") from None
    return Figure


def plot_inspect(rep: MxInspectReport, out: str | os.PathLike[str]) -> Path:
    """Save the report's histograms to an image (format from the suffix, e.g. ``.png``).

    Panels: the E2M1 code histogram and the scale-exponent histogram (of the single tensor, or
    aggregated over the selection) and, with several members, each member's mean scale exponent
    grouped by projection with flagged ones marked.
    """
    figure_cls = require_matplotlib()
    members = [(r, u.mean) for r in rep.tensors for u in r.units if u.mean is not None]
    panels = 3 if len(members) > 1 else 2
    fig = figure_cls(figsize=(10, 3.2 * panels))
    axes = fig.subplots(panels, 1)
    title = rep.tensors[0].name if len(rep.tensors) == 1 else f"{len(rep.tensors)} tensors in {rep.source}"

    codes = rep.code_hist
    axes[0].bar(range(16), codes, color=["tab:blue"] * 8 + ["tab:orange"] * 8)
    axes[0].set_xticks(range(16))
    axes[0].set_xticklabels(CODE_LABELS)
    axes[0].set_title(f"E2M1 codes - {title}")
    axes[0].set_ylabel("count")

    hist = rep.scale_hist
    present = np.flatnonzero(hist[:E8M0_NAN])
    axes[1].bar(present.astype(int) - E8M0_BIAS, hist[present], color="tab:green", width=0.9)
    if hist[E8M0_NAN]:
        x_nan = (int(present[-1]) - E8M0_BIAS + 2) if present.size else 0
        axes[1].bar([x_nan], [hist[E8M0_NAN]], color="tab:red", width=0.9, label="NaN (0xFF)")
        axes[1].legend()
    axes[1].set_yscale("log")
    axes[1].set_title("scale exponents (value = 2**e)")
    axes[1].set_xlabel("exponent")
    axes[1].set_ylabel("blocks")

    if panels == 3:
        ax = axes[2]
        by_group: dict[str, list[tuple[int, float, bool]]] = {}
        for i, (r, mean) in enumerate(members):
            label = f"{r.tensor.role.proj or '?'}"
            by_group.setdefault(label, []).append((i, float(mean), any(f.kind == "exp-outlier" for f in r.flags)))
        for label, pts in sorted(by_group.items()):
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=8, label=label)
        bad = [(p[0], p[1]) for pts in by_group.values() for p in pts if p[2]]
        if bad:
            ax.scatter([b[0] for b in bad], [b[1] for b in bad], s=60, facecolors="none", edgecolors="red",
                       label="exp-outlier")
        ax.set_title("mean scale exponent per tensor / expert")
        ax.set_xlabel("member (selection order)")
        ax.set_ylabel("mean exponent")
        ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    return out


def render_error(rep: QuantErrorReport) -> str:
    """One line per tensor, totals, and a summary of what was skipped."""
    from ..utils import human_count

    names = [r.name for r in rep.rows]
    prefix = _common_prefix(names)
    shown = [n[len(prefix):] for n in names]
    name_w = min(max(6, max(len(s) for s in shown)), 44)
    shapes = [_shape(r.shape) for r in rep.rows]
    shape_w = max(5, max(len(s) for s in shapes))
    lines = [f"{rep.path}: MXFP4 round trip, scale mode {rep.scale_mode}"]
    if prefix:
        lines.append(f"names below are after {prefix}")
    lines.append(f"{'tensor':<{name_w}} {'dtype':<5} {'shape':>{shape_w}} {'rel RMS':>9} {'max abs':>10} "
                 f"{'saturated':>9} {'non-finite':>10}")
    for r, s, shp in zip(rep.rows, shown, shapes):
        if len(s) > name_w:
            s = "…" + s[-(name_w - 1):]
        lines.append(f"{s:<{name_w}} {r.dtype:<5} {shp:>{shape_w}} {r.relative_rms_error:>9.4f} "
                     f"{r.max_abs_error:>10.4g} {format_percent(r.saturated_fraction):>9} {r.nonfinite:>10,}")
    lines.append(f"total: {len(rep.rows):,} tensor{'s' if len(rep.rows) != 1 else ''}, {human_count(rep.values)} values: "
                 f"relative RMS error {rep.relative_rms_error:.4f}, max abs error {rep.max_abs_error:.4g}, "
                 f"{format_percent(rep.saturated_fraction)} saturated"
                 + (f", {rep.nonfinite:,} NaN/Inf inputs left out" if rep.nonfinite else ""))
    if rep.skipped:
        reasons: dict[str, int] = {}
        for _, why in rep.skipped:
            key = why if why.startswith("role ") else why.split(" is ")[-1] if " is " in why else why
            reasons[key] = reasons.get(key, 0) + 1
        lines.append(f"skipped {len(rep.skipped):,} tensor{'s' if len(rep.skipped) != 1 else ''}:")
        lines += [f"  {n:>6,}  {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
