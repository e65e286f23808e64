"""``k3ckpt inspect``: what a person wants to know about a checkpoint before committing hardware.

Everything here is computed from the config and the shard headers - parameter counts included
(from shapes, never quoted from a model card) - so it runs on a headers-only checkpoint and on
the full K3 inventory in seconds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ..utils import format_ranges, human_bytes, human_count
from .checkpoint import Checkpoint, bulk_allocation
from .roles import Kind, classify, logical_params_of

#: Kinds that belong to the vision side of a multimodal checkpoint, not the text model.
VISION_KINDS = frozenset({Kind.VISION, Kind.PROJECTOR})
#: Words of the finding for a MoE layer that lacks routed experts. ``preflight`` recognizes it:
#: a per-node (``hf-node``) copy lacks other nodes' experts by design.
MISSING_EXPERTS = "routed experts missing"


@dataclass
class LayerSummary:
    layer: int
    attention: str  # kda / mla / full / sliding / mha / ?
    mlp: str  # dense / moe / none
    experts: int  # routed experts with tensors in this layer
    tensors: int = 0
    bytes: int = 0
    params: int = 0


@dataclass
class Finding:
    severity: str  # "error" (config and tensors disagree) or "warning"
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity.upper()} {self.where}: {self.message}"


@dataclass
class InspectReport:
    path: str
    source: dict[str, Any]
    architectures: list[str]
    model_type: str
    text_model_type: str
    family: str
    num_layers: int
    dense_layers: list[int]
    moe_layers: list[int]
    attention_layers: dict[str, list[int]]
    routed_experts: int
    experts_per_token: int
    shared_experts: int
    params_total: int
    params_text: int
    params_vision: int
    params_routed: int
    params_active: int
    params_active_no_embed: int
    params_by_role: dict[str, int]
    bytes_total: int
    bytes_by_dtype: dict[str, int]
    bytes_by_role: dict[str, int]
    quant_config: str | None
    quant_tensors: dict[str, int]
    shards: int
    shard_bytes_min: int
    shard_bytes_median: int
    shard_bytes_max: int
    tensors: int
    layers: list[LayerSummary]
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    def to_json(self, *, layers: bool = True) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("layers", "findings")}
        d["findings"] = [f.__dict__ for f in self.findings]
        if layers:
            d["layers"] = [lay.__dict__ for lay in self.layers]
        return d


def inspect_checkpoint(ckpt: Checkpoint, *, experts: Collection[int] | None = None) -> InspectReport:
    """Summarize ``ckpt`` (opened with :func:`~k3ckpt.checkpoint.open_checkpoint`).

    Args:
        experts: the routed experts each MoE layer should hold (default: all the config's) -
            a node's share, for a ``reshard --format hf-node`` directory.
    """
    with bulk_allocation():
        return _inspect(ckpt, experts)


def _median_of_sorted(values: list[int]) -> int:
    """``int(statistics.median(values))`` of a sorted list (without loading ``statistics``,
    which costs ``verify`` more start-up time than its whole structure check)."""
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else int((values[mid - 1] + values[mid]) / 2)


def _inspect(ckpt: Checkpoint, experts: Collection[int] | None = None) -> InspectReport:
    cfg = ckpt.config
    # Every statistic is computed per distinct signature x count, never per tensor.
    signatures = ckpt.stats.signatures
    parts_per_expert = ckpt.stats.expert_parts
    bytes_by_dtype: Counter[str] = Counter()
    bytes_by_role: Counter[str] = Counter()
    params_by_role: Counter[str] = Counter()
    quant_tensors: Counter[str] = Counter()
    layer_tensors: Counter[int] = Counter()
    layer_bytes: Counter[int] = Counter()
    layer_params: Counter[int] = Counter()
    names_by_layer_proj: dict[int, set[str]] = defaultdict(set)
    stacked_expert_layers: set[int] = set()
    routed_shapes: dict[tuple[str, str], set[tuple[int, ...]]] = defaultdict(set)
    experts_seen: dict[int, set[int]] = defaultdict(set)
    for lay, ex in parts_per_expert:
        experts_seen[lay].add(ex)

    for (layer, kind, part, proj, dtype, shape, nbytes), count in signatures.items():
        params = logical_params_of(dtype, shape, part) * count
        nbytes *= count
        bytes_by_dtype[dtype] += nbytes
        bytes_by_role[kind] += nbytes
        params_by_role[kind] += params
        if part in ("weight_packed", "blocks"):
            quant_tensors["mxfp4"] += count
        elif part == "weight_scale_inv":
            quant_tensors["fp8_scales"] += count
        elif dtype in ("F8_E4M3", "F8_E5M2"):
            quant_tensors["fp8"] += count
        if layer is None:
            continue
        layer_tensors[layer] += count
        layer_bytes[layer] += nbytes
        layer_params[layer] += params
        if kind == Kind.ROUTED_EXPERT:
            if layer in experts_seen:
                routed_shapes[(proj or "", part)].add(shape)
            else:
                stacked_expert_layers.add(layer)
        elif proj:
            names_by_layer_proj[layer].add(proj)

    num_layers = cfg.num_layers if cfg else (max(layer_tensors) + 1 if layer_tensors else 0)
    attn_kinds = cfg.attention_kinds if cfg else ["?"] * num_layers
    cfg_moe = set(cfg.moe_layers) if cfg else set(experts_seen) | stacked_expert_layers
    moe_layers = sorted(set(experts_seen) | stacked_expert_layers | cfg_moe)
    dense_layers = [i for i in range(num_layers) if i not in moe_layers]

    n_experts = cfg.num_experts if cfg else max((len(v) for v in experts_seen.values()), default=0)
    k = cfg.experts_per_token if cfg else 0
    params_total = sum(params_by_role.values())
    params_vision = sum(params_by_role[v] for v in VISION_KINDS)
    params_text = params_total - params_vision
    params_routed = params_by_role[Kind.ROUTED_EXPERT]
    frac = (k / n_experts) if n_experts and k else 1.0
    params_active = params_text - params_routed + round(params_routed * frac)
    embed = params_by_role[Kind.EMBEDDING] + params_by_role[Kind.LM_HEAD]

    layers = []
    for i in range(max(num_layers, max(layer_tensors, default=-1) + 1)):
        layers.append(LayerSummary(
            layer=i,
            attention=attn_kinds[i] if i < len(attn_kinds) else "?",
            mlp="moe" if i in moe_layers else ("dense" if i < num_layers else "extra"),
            experts=n_experts if i in stacked_expert_layers else len(experts_seen.get(i, ())),
            tensors=layer_tensors[i], bytes=layer_bytes[i], params=layer_params[i],
        ))

    shard_sizes = sorted(h.file_size for h in ckpt.shards.values())
    attention_layers: dict[str, list[int]] = defaultdict(list)
    for i, a in enumerate(attn_kinds):
        attention_layers[a].append(i)

    report = InspectReport(
        path=str(ckpt.root),
        source={k2: v for k2, v in ckpt.source.__dict__.items() if v is not None},
        architectures=cfg.architectures if cfg else [],
        model_type=cfg.model_type if cfg else "",
        text_model_type=cfg.text_model_type if cfg else "",
        family=cfg.family if cfg else "unknown",
        num_layers=num_layers,
        dense_layers=dense_layers,
        moe_layers=moe_layers,
        attention_layers=dict(attention_layers),
        routed_experts=n_experts,
        experts_per_token=k,
        shared_experts=cfg.num_shared_experts if cfg else 0,
        params_total=params_total,
        params_text=params_text,
        params_vision=params_vision,
        params_routed=params_routed,
        params_active=params_active,
        params_active_no_embed=params_active - embed,
        params_by_role=dict(params_by_role.most_common()),
        bytes_total=ckpt.total_bytes,
        bytes_by_dtype=dict(bytes_by_dtype.most_common()),
        bytes_by_role=dict(bytes_by_role.most_common()),
        quant_config=cfg.quant_format if cfg else None,
        quant_tensors=dict(quant_tensors),
        shards=len(shard_sizes),
        shard_bytes_min=shard_sizes[0] if shard_sizes else 0,
        shard_bytes_median=_median_of_sorted(shard_sizes) if shard_sizes else 0,
        shard_bytes_max=shard_sizes[-1] if shard_sizes else 0,
        tensors=len(ckpt.tensors),
        layers=layers,
    )
    report.findings = _findings(ckpt, report, experts_seen, parts_per_expert, names_by_layer_proj,
                                stacked_expert_layers, routed_shapes, experts)
    return report


def _compact(nums: list[int], limit: int = 6) -> str:
    shown = ", ".join(map(str, nums[:limit]))
    return shown + (f", ... ({len(nums)} in all)" if len(nums) > limit else "")


_MLA_ONLY = frozenset({"q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_b_proj"})
_KDA_ONLY = frozenset({"f_a_proj", "f_b_proj", "b_proj", "q_conv1d", "A_log", "dt_bias"})


def _findings(
    ckpt: Checkpoint,
    rep: InspectReport,
    experts_seen: dict[int, set[int]],
    parts_per_expert: Counter[tuple[int, int]],
    names_by_layer_proj: dict[int, set[str]],
    stacked_expert_layers: set[int],
    routed_shapes: dict[tuple[str, str], set[tuple[int, ...]]],
    experts: Collection[int] | None = None,
) -> list[Finding]:
    """Where the config, the index and the tensors disagree."""
    out = [Finding("error", p.where, p.message) for p in ckpt.problems]
    unknown = ckpt.unknown_tensors()
    if unknown:
        out.append(Finding("warning", unknown[0], f"{len(unknown)} tensor(s) of unknown role (first shown); "
                                                  "they are kept and counted, but no rule describes them"))
    cfg = ckpt.config
    if cfg is None:
        out.append(Finding("warning", "config.json", "missing: layer schedule and expert counts come from tensor names"))
        return out
    for layer in sorted(experts_seen):
        if layer not in cfg.moe_layers:
            out.append(Finding("error", f"layer {layer}", "has routed-expert tensors but the config makes it dense"))
    expected = set(range(cfg.num_experts)) if experts is None else set(experts)
    whose = f"{cfg.num_experts}" if experts is None else f"this node's {len(expected)}"
    for layer in cfg.moe_layers:
        seen = experts_seen.get(layer, set())
        if layer in stacked_expert_layers:
            continue
        missing = sorted(expected - seen)
        if missing:
            out.append(Finding("error", f"layer {layer}",
                               f"{len(missing)} of {whose} {MISSING_EXPERTS}: {_compact(missing)}"))
        extra = sorted(e for e in seen if e >= cfg.num_experts)
        if extra:
            out.append(Finding("error", f"layer {layer}", f"expert ids beyond num_experts {cfg.num_experts}: {_compact(extra)}"))
        foreign = sorted(e for e in seen - expected if e < cfg.num_experts)
        if foreign:
            out.append(Finding("error", f"layer {layer}", f"experts not in this node's share: {_compact(foreign)}"))
    if parts_per_expert:
        usual = Counter(parts_per_expert.values()).most_common(1)[0][0]
        short = sorted(k for k, n in parts_per_expert.items() if n != usual)
        if short:
            l0, e0 = short[0]
            out.append(Finding("error", f"layer {l0} expert {e0}",
                               f"{len(short)} expert(s) do not have the usual {usual} tensors (first shown: "
                               f"{parts_per_expert[short[0]]})"))
    for (proj, part), shapes in sorted(routed_shapes.items()):
        if len(shapes) > 1:
            out += _odd_shape_findings(ckpt, proj, part)
    _check_expert_widths(cfg, routed_shapes, out)
    _check_layer_completeness(ckpt, cfg, set(cfg.moe_layers), out)
    for layer, projs in sorted(names_by_layer_proj.items()):
        if layer >= len(cfg.attention_kinds):
            continue
        kind = cfg.attention_kinds[layer]
        if kind == "kda" and projs & _MLA_ONLY:
            out.append(Finding("error", f"layer {layer}",
                               f"config says KDA but MLA tensors are present ({sorted(projs & _MLA_ONLY)[0]})"))
        if kind == "mla" and projs & _KDA_ONLY:
            out.append(Finding("error", f"layer {layer}",
                               f"config says MLA but KDA tensors are present ({sorted(projs & _KDA_ONLY)[0]})"))
    layers_with_tensors = {lay.layer for lay in rep.layers if lay.tensors}
    if layers_with_tensors and max(layers_with_tensors) + 1 < cfg.num_layers:
        out.append(Finding("error", "config.json",
                           f"num_hidden_layers is {cfg.num_layers} but tensors stop at layer {max(layers_with_tensors)}"))
    embeddings = [n for n in ckpt.tensors if n.endswith("embed_tokens.weight") and classify(n).kind == Kind.EMBEDDING]
    for name in embeddings:
        info = ckpt.tensors[name]
        if len(info.shape) == 2:
            if cfg.vocab_size and info.shape[0] != cfg.vocab_size:
                out.append(Finding("error", name, f"has {info.shape[0]} rows but vocab_size is {cfg.vocab_size}"))
            if info.shape[1] != cfg.hidden_size:
                out.append(Finding("error", name, f"has width {info.shape[1]} but hidden_size is {cfg.hidden_size}"))
    quant = cfg.quant_format
    has_mx = rep.quant_tensors.get("mxfp4", 0) > 0
    if quant and "mxfp4" in quant and not has_mx:
        out.append(Finding("error", "config.json", f"quantization_config says {quant} but no MXFP4 tensors are present"))
    if has_mx and not (quant and "mxfp4" in quant):
        out.append(Finding("error", "config.json",
                           f"MXFP4 tensors are present but quantization_config says {quant or 'nothing'}"))
    if quant and quant.startswith("fp8") and not rep.quant_tensors.get("fp8"):
        out.append(Finding("error", "config.json", f"quantization_config says {quant} but no FP8 tensors are present"))
    _check_mx_pairs(ckpt, out)
    return out


def _check_layer_completeness(ckpt: Checkpoint, cfg: Any, moe: set[int], out: list[Finding]) -> None:
    """Every layer has the full set of (non-expert) tensors its siblings have: layers of the same
    attention kind and MLP kind are compared, and what most of them hold is the expected set."""
    held: dict[int, set[tuple[str, str, str]]] = defaultdict(set)
    for (layer, kind, part, proj, *_), _n in ckpt.stats.signatures.items():
        if layer is not None and kind != Kind.ROUTED_EXPERT and layer < cfg.num_layers:
            held[layer].add((kind, proj or "", part))
    groups: dict[tuple[str, bool], list[int]] = defaultdict(list)
    for layer in range(cfg.num_layers):
        attn = cfg.attention_kinds[layer] if layer < len(cfg.attention_kinds) else "?"
        groups[(attn, layer in moe)].append(layer)
    for (attn, is_moe), layers in sorted(groups.items()):
        if len(layers) < 3:
            continue  # no majority to speak of
        counts = Counter(item for layer in layers for item in held.get(layer, ()))
        expected = {item for item, n in counts.items() if n * 2 > len(layers)}
        for layer in layers:
            missing = sorted(expected - held.get(layer, set()))
            if missing:
                kind, proj, part = missing[0]
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                out.append(Finding("error", f"layer {layer}",
                                   f"lacks {proj}.{part} ({kind}) that the other {attn.upper()} "
                                   f"{'MoE' if is_moe else 'dense'} layers have{more}"))


def _odd_shape_findings(ckpt: Checkpoint, proj: str, part: str) -> list[Finding]:
    """Routed-expert tensors whose shape differs from their siblings', by name (a slow scan, run
    only when the signatures already show a disagreement)."""
    names = [n for n, r in ckpt.roles.items() if r.kind == Kind.ROUTED_EXPERT and r.proj == proj and r.part == part]
    counts = Counter(ckpt.tensors[n].shape for n in names)
    usual = counts.most_common(1)[0][0]
    odd = [n for n in names if ckpt.tensors[n].shape != usual]
    more = f" ({len(odd)} such tensors; first shown)" if len(odd) > 1 else ""
    first = odd[0]
    return [Finding("error", first, f"shape {list(ckpt.tensors[first].shape)} differs from the other experts' "
                                    f"{list(usual)}{more}")]


def _check_expert_widths(cfg: Any, routed_shapes: dict[tuple[str, str], set[tuple[int, ...]]], out: list[Finding]) -> None:
    inter = cfg.moe_intermediate_size
    width = cfg.routed_expert_hidden_size or cfg.hidden_size
    if not inter:
        return
    expect = {("gate", "weight_packed"): (inter, width // 2), ("up", "weight_packed"): (inter, width // 2),
              ("down", "weight_packed"): (width, inter // 2), ("gate", "weight"): (inter, width),
              ("up", "weight"): (inter, width), ("down", "weight"): (width, inter)}
    for key, want in expect.items():
        for shape in routed_shapes.get(key, ()):
            if tuple(shape) != want:
                out.append(Finding("error", f"experts {key[0]}.{key[1]}",
                                   f"shape {list(shape)} but the config implies {list(want)} "
                                   f"(moe_intermediate_size {inter}, expert width {width})"))


def _check_mx_pairs(ckpt: Checkpoint, out: list[Finding]) -> None:
    """Every ``weight_packed`` [out, in/2] U8 needs a ``weight_scale`` [out, in/32] U8.

    Routed experts are checked per signature (each expert having its usual tensor count is
    checked elsewhere, so a missing scale shows there); other packed tensors name by name."""
    groups: dict[tuple, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for (layer, kind, part, proj, dtype, shape, _), n in ckpt.stats.signatures.items():
        if kind == Kind.ROUTED_EXPERT and part in ("weight_packed", "weight_scale"):
            groups[(layer, proj)][part][(dtype, shape)] += n
    for (layer, proj), by_part in sorted(groups.items(), key=str):
        packed, scale = by_part.get("weight_packed", Counter()), by_part.get("weight_scale", Counter())
        if not packed:
            continue
        for pd, ps in packed:
            # Against the usual scale shape: a single odd scale is named by _odd_shape_findings.
            sd, ss = scale.most_common(1)[0][0] if scale else (None, None)
            problem = _mx_pair_problem(pd, ps, sd, ss) if sd else "has no weight_scale"
            if problem or sum(scale.values()) != sum(packed.values()):
                out.append(Finding("error", f"layer {layer} experts {proj}.weight_packed",
                                   problem or f"{sum(packed.values())} packed tensors but {sum(scale.values())} scales"))
    if not any(sig[2] == "weight_packed" and sig[1] != Kind.ROUTED_EXPERT for sig in ckpt.stats.signatures):
        return
    tensors, roles = ckpt.tensors, ckpt.roles
    for name in [n for n in tensors if n.endswith(".weight_packed") and roles[n].kind != Kind.ROUTED_EXPERT]:
        p, s = tensors[name], tensors.get(name[: -len("weight_packed")] + "weight_scale")
        problem = _mx_pair_problem(p.dtype, p.shape, s.dtype if s else None, s.shape if s else None)
        if problem:
            out.append(Finding("error", name, problem))


def _mx_pair_problem(pdtype: str, pshape: tuple, sdtype: str | None, sshape: tuple | None) -> str:
    if sdtype is None:
        return "has no weight_scale"
    if pdtype != "U8" or sdtype != "U8":
        return f"packed {pdtype} / scale {sdtype}, expected U8 / U8"
    if len(pshape) != 2 or pshape[1] % 16 or sshape != (pshape[0], pshape[1] // 16):
        return f"packed {list(pshape)} and scale {list(sshape or ())} do not pair as [out, in/2] + [out, in/32]"
    return ""


# -- text rendering ---------------------------------------------------------------------------


def render_text(rep: InspectReport, *, show_layers: bool = False) -> str:
    lines = [f"checkpoint   {rep.path}"]
    if rep.source.get("repo") or rep.source.get("revision"):
        what = " @ ".join(x for x in (rep.source.get("repo"), rep.source.get("revision")) if x)
        lines.append(f"source       {what} ({rep.source.get('layout')})")
    lines.append(f"architecture {', '.join(rep.architectures) or '?'}  (model_type {rep.model_type or '?'}"
                 + (f", text {rep.text_model_type}" if rep.text_model_type and rep.text_model_type != rep.model_type else "")
                 + f"; family {rep.family})")
    attn = ", ".join(f"{k.upper()} {len(v)} [{format_ranges(v)}]" for k, v in sorted(rep.attention_layers.items()))
    lines.append(f"layers       {rep.num_layers}: dense {len(rep.dense_layers)} [{format_ranges(rep.dense_layers)}], "
                 f"MoE {len(rep.moe_layers)} [{format_ranges(rep.moe_layers)}]")
    lines.append(f"attention    {attn}")
    if rep.routed_experts:
        lines.append(f"experts      {rep.routed_experts} routed, {rep.experts_per_token} active per token, "
                     f"{rep.shared_experts} shared")
    lines.append(f"parameters   {human_count(rep.params_total)} total ({human_count(rep.params_text)} text"
                 + (f", {human_count(rep.params_vision)} vision" if rep.params_vision else "")
                 + f"); {human_count(rep.params_active)} active per token "
                 f"({human_count(rep.params_active_no_embed)} without embeddings and lm_head)")
    lines.append(f"size         {human_bytes(rep.bytes_total)} in {rep.shards} shards "
                 f"(min {human_bytes(rep.shard_bytes_min)}, median {human_bytes(rep.shard_bytes_median)}, "
                 f"max {human_bytes(rep.shard_bytes_max)}), {rep.tensors:,} tensors")
    q = ", ".join(f"{k} {v:,}" for k, v in rep.quant_tensors.items()) or "none"
    lines.append(f"quantization {rep.quant_config or 'none declared'}; quantized tensors: {q}")
    lines.append("bytes by dtype  " + ", ".join(f"{k} {human_bytes(v)}" for k, v in rep.bytes_by_dtype.items()))
    lines.append("bytes by role   " + ", ".join(f"{k} {human_bytes(v)}" for k, v in rep.bytes_by_role.items()))
    lines.append("params by role  " + ", ".join(f"{k} {human_count(v)}" for k, v in rep.params_by_role.items() if v))
    if show_layers:
        lines.append("")
        lines.append(f"{'layer':>5}  {'attn':<7} {'mlp':<6} {'experts':>7} {'tensors':>8} {'bytes':>11} {'params':>9}")
        for lay in rep.layers:
            lines.append(f"{lay.layer:>5}  {lay.attention:<7} {lay.mlp:<6} {lay.experts:>7} {lay.tensors:>8} "
                         f"{human_bytes(lay.bytes):>11} {human_count(lay.params):>9}")
    if rep.findings:
        lines.append("")
        lines.extend(str(f) for f in rep.findings)
    return "\n".join(lines)
