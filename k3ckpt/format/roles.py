"""What each tensor *is*: role classification from rule tables.

A rule is data: a regular expression over the tensor name with its numbers replaced by ``#``
(``language_model.model.layers.#.block_sparse_moe.experts.#.w1.weight_packed``), the role it
gives, the tensor-parallel rule, and which of the numbers are the layer and the expert. One
table covers K3, Kimi-K2 / DeepSeek-V3 (per-expert FP8 with ``weight_scale_inv``) and gpt-oss
(stacked MXFP4 experts). Classification is cached per template, so the ~497k names of the full
K3 inventory cost one substitution each, not a scan of the table each.

Names that match no rule get :data:`Kind.UNKNOWN`; callers report them, never drop them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

from .header import TensorInfo


class Kind:
    """Tensor kinds. Plain string constants, not an Enum: Enum hashing runs in Python and the
    full K3 inventory hashes ~10^6 of these while aggregating."""

    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ROUTER = "router"
    ROUTER_BIAS = "router_bias"
    LATENT_PROJ = "latent_proj"
    DENSE_MLP = "dense_mlp"
    ATTENTION = "attention"
    NORM = "norm"
    RESIDUAL = "residual"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    MTP = "mtp"
    VISION = "vision"
    PROJECTOR = "projector"
    UNKNOWN = "unknown"


class TP:
    """How a dense tensor is split across tensor-parallel ranks (rank-layout.md)."""

    COLUMN = "column"  # dim 0
    ROW = "row"  # dim 1
    VOCAB = "vocab"  # dim 0 of embeddings / lm_head
    REPLICATED = "replicated"
    EXPERT = "expert"  # placed by expert parallelism; w1/w3 dim 0, w2 dim 1 when moe_tp > 1


class Role(NamedTuple):
    """A tensor's role. A named tuple because the full K3 inventory has ~497k of them."""

    kind: str  # a Kind constant
    tp: str  # a TP constant
    layer: int | None = None
    expert: int | None = None  # None for non-expert tensors and for stacked (all-expert) tensors
    proj: str | None = None  # gate / up / down / gate_up / q_proj / ...
    part: str = "weight"  # weight, weight_packed, weight_scale, weight_scale_inv, bias, blocks, scales, ...

    @property
    def is_quant_scale(self) -> bool:
        return self.part in _SCALE_PARTS


_SCALE_PARTS = frozenset(
    {"weight_scale", "weight_scale_inv", "scales", "input_scale", "weight_global_scale", "weight_zero_point"}
)

_LAYER = r"^(?:language_model\.(?:model\.)?|model\.(?:language_model\.)?)?layers\.#\."
_TOP = r"^(?:language_model\.(?:model\.)?|model\.(?:language_model\.)?)?"
_PART = r"(?P<part>weight|weight_packed|weight_scale|weight_scale_inv|weight_global_scale|weight_zero_point|input_scale|bias)"
_MOE = r"(?:block_sparse_moe|mlp)\."

_C, _R, _V, _P, _E = TP.COLUMN, TP.ROW, TP.VOCAB, TP.REPLICATED, TP.EXPERT


@dataclass(frozen=True)
class Rule:
    pattern: str
    kind: str
    tp: str | dict[str, str]  # a dict maps the ``proj`` group to its TP rule
    numbers: tuple[str, ...] = ()  # which ``#`` are the layer / expert, in order
    proj: str | None = None  # fixed proj when the pattern has no ``proj`` group


#: The rule table. First match wins, so specific rules come before general ones.
RULES: tuple[Rule, ...] = (
    # Routed experts, one tensor per expert (K3 w1/w2/w3, DeepSeek/K2 gate/up/down).
    Rule(_LAYER + _MOE + r"experts\.#\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\." + _PART + "$",
         Kind.ROUTED_EXPERT, _E, ("layer", "expert")),
    # gpt-oss: all experts of a layer stacked in one tensor.
    Rule(_LAYER + r"mlp\.experts\.(?P<proj>gate_up_proj|down_proj)(?:_(?P<part>blocks|scales|bias))?$",
         Kind.ROUTED_EXPERT, _E, ("layer",)),
    Rule(_LAYER + _MOE + r"shared_experts?\.(?P<proj>gate_proj|up_proj|down_proj)\." + _PART + "$",
         Kind.SHARED_EXPERT, {"gate_proj": _C, "up_proj": _C, "down_proj": _R}, ("layer",)),
    Rule(_LAYER + _MOE + r"gate\.e_score_correction_bias$", Kind.ROUTER_BIAS, _P, ("layer",), "gate"),
    Rule(_LAYER + _MOE + r"(?P<proj>gate|router)\.(?P<part>weight|bias)$", Kind.ROUTER, _P, ("layer",)),
    Rule(_LAYER + r"block_sparse_moe\.routed_expert_norm\.(?P<part>weight)$", Kind.NORM, _P, ("layer",),
         "routed_expert_norm"),
    Rule(_LAYER + r"block_sparse_moe\.routed_expert_(?P<proj>down_proj|up_proj)\." + _PART + "$",
         Kind.LATENT_PROJ, _P, ("layer",)),
    Rule(_LAYER + r"mlp\.(?P<proj>gate_proj|up_proj|down_proj)\." + _PART + "$",
         Kind.DENSE_MLP, {"gate_proj": _C, "up_proj": _C, "down_proj": _R}, ("layer",)),
    # Attention: MLA (q_a/q_b/kv_a/kv_b), KDA (q/k/v, f_a/f_b, b, g, conv1d, A_log, dt_bias), MHA.
    Rule(_LAYER + r"self_attn\.(?P<proj>q_a_layernorm|kv_a_layernorm|o_norm|q_norm|k_norm)\.(?P<part>weight|bias)$",
         Kind.NORM, _P, ("layer",)),
    Rule(_LAYER + r"self_attn\.(?P<proj>q_b_proj|kv_b_proj|q_proj|k_proj|v_proj|f_b_proj|b_proj|g_proj)\." + _PART + "$",
         Kind.ATTENTION, _C, ("layer",)),
    Rule(_LAYER + r"self_attn\.(?P<proj>o_proj)\." + _PART + "$", Kind.ATTENTION, _R, ("layer",)),
    Rule(_LAYER + r"self_attn\.(?P<proj>q_a_proj|kv_a_proj_with_mqa|f_a_proj|q_conv1d|k_conv1d|v_conv1d)\." + _PART + "$",
         Kind.ATTENTION, _P, ("layer",)),
    Rule(_LAYER + r"self_attn\.(?P<proj>A_log|dt_bias|sinks)$", Kind.ATTENTION, _P, ("layer",)),
    Rule(_LAYER + r"(?P<proj>input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)"
         r"\.(?P<part>weight|bias)$",
         Kind.NORM, _P, ("layer",)),
    # K3 attention residuals: [hidden] norms and [1, hidden] projections.
    Rule(_LAYER + r"(?P<proj>self_attention_res_norm|self_attention_res_proj|mlp_res_norm|mlp_res_proj)(?:\.(?P<part>weight))?$",
         Kind.RESIDUAL, _P, ("layer",)),
    # DeepSeek-V3 multi-token-prediction layer (beyond num_hidden_layers).
    Rule(_LAYER + r"(?P<proj>enorm|hnorm|eh_proj|shared_head\.head|shared_head\.norm|embed_tokens)\.(?P<part>weight)$",
         Kind.MTP, _P, ("layer",)),
    Rule(_TOP + r"embed_tokens\.(?P<part>weight)$", Kind.EMBEDDING, _V, (), "embed_tokens"),
    Rule(r"^(?:language_model\.)?(?:model\.)?lm_head\.(?P<part>weight)$", Kind.LM_HEAD, _V, (), "lm_head"),
    Rule(_TOP + r"norm\.(?P<part>weight)$", Kind.NORM, _P, (), "norm"),
    Rule(r"^(?:model\.)?(?:vision_tower|vision_model|visual|vision_encoder)\..*?(?:\.(?P<part>weight|bias))?$",
         Kind.VISION, _P),
    Rule(r"^(?:model\.)?(?:mm_projector|multi_modal_projector|mm_proj)\..*?(?:\.(?P<part>weight|bias))?$",
         Kind.PROJECTOR, _P),
)

# Compiled on first use, not at import: ~5 ms of every k3ckpt command's start, most of which
# (fetch, verify's first hashed byte) classify no tensor before they are under way.
_COMPILED: list[re.Pattern[str] | None] = [None] * len(RULES)


def _rule_regex(i: int) -> re.Pattern[str]:
    rx = _COMPILED[i]
    if rx is None:
        rx = _COMPILED[i] = re.compile(RULES[i].pattern)
    return rx


# A number between dots (or at the end) is an index: a layer, an expert, a vision block.
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)", re.ASCII)
_PROJ_ALIASES = {"gate_up_proj": "gate_up", "w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                 "down_proj": "down"}

UNKNOWN_ROLE = Role(Kind.UNKNOWN, TP.REPLICATED)


@lru_cache(maxsize=65536)
def _classify_template(template: str) -> tuple[str, str, tuple[str, ...], str | None, str] | None:
    for i, rule in enumerate(RULES):
        m = _rule_regex(i).match(template)
        if m is None:
            continue
        groups = m.groupdict()
        proj = groups.get("proj") or rule.proj
        if isinstance(rule.tp, dict):
            assert proj is not None  # a rule with a TP per projection captures the projection
            tp = rule.tp[proj]
        else:
            tp = rule.tp
        part = groups.get("part") or "weight"
        if tp == TP.ROW and part == "bias":
            tp = TP.REPLICATED  # a row-parallel layer adds its bias once, after the all-reduce
        if rule.kind in (Kind.ROUTED_EXPERT, Kind.SHARED_EXPERT, Kind.DENSE_MLP) and proj:
            proj = _PROJ_ALIASES.get(proj, proj)
        return rule.kind, tp, rule.numbers, proj, part
    return None


# Routed-expert names are >99% of a K3 inventory. They are split with two C-level
# ``str.partition`` calls around ".experts.<id>." and the (head, tail) template is classified
# once, so a name costs about a microsecond instead of a regex scan.
_expert_templates: dict[tuple[str, str], tuple[str, str, int, str | None, str] | None] = {}
_new_role = partial(tuple.__new__, Role)


def _expert_template(head: str, tail: str) -> tuple[str, str, int, str | None, str] | None:
    layer = _NUMBER.findall(head)
    if len(layer) != 1 or _NUMBER.search(tail):
        return None
    hit = _classify_template(_NUMBER.sub("#", head) + ".experts.#." + tail)
    if hit is None or len(hit[2]) != 2:
        return None
    kind, tp, _, proj, part = hit
    return kind, tp, int(layer[0]), proj, part


def classify(name: str) -> Role:
    """The :class:`Role` of tensor ``name``; :data:`UNKNOWN_ROLE` when no rule matches."""
    head, sep, rest = name.partition(".experts.")
    if sep:
        expert_digits, dot, tail = rest.partition(".")
        if dot and expert_digits.isascii() and expert_digits.isdigit():
            key = (head, tail)
            try:
                t = _expert_templates[key]
            except KeyError:
                t = _expert_templates[key] = _expert_template(head, tail)
            if t is not None:
                return _new_role((t[0], t[1], t[2], int(expert_digits), t[3], t[4]))
    numbers = _NUMBER.findall(name)
    template = _NUMBER.sub("#", name) if numbers else name
    hit = _classify_template(template)
    if hit is None:
        return UNKNOWN_ROLE
    kind, tp, slots, proj, part = hit
    layer = int(numbers[0]) if slots else None
    expert = int(numbers[1]) if len(slots) > 1 else None
    return Role(kind, tp, layer, expert, proj, part)


def logical_params(info: TensorInfo, role: Role) -> int:
    """Model parameters a tensor stores: packed 4-bit tensors hold two per byte, and quantization
    scales hold none (they are part of the encoding, not the model)."""
    return logical_params_of(info.dtype, info.shape, role.part)


def logical_params_of(dtype: str, shape: tuple[int, ...], part: str) -> int:
    """:func:`logical_params` from the parts of a tensor's signature."""
    if part in _SCALE_PARTS:
        return 0
    n = math.prod(shape)
    return n * 2 if part in ("weight_packed", "blocks") and dtype in ("U8", "I8") else n
