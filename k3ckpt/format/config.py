"""``config.json`` reading, normalized across the families k3ckpt supports.

K3 nests the text model under ``text_config`` (``model_type: kimi_k3`` around a
``kimi_linear`` text model); Kimi-K2 and DeepSeek-V3 are flat with ``n_routed_experts``;
gpt-oss uses ``num_local_experts`` and ``layer_types``. :class:`ModelConfig` gives every
consumer the same field names and keeps the raw dict for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..utils import load_json

#: More layers than any model has; a bigger count is a hostile or broken config, and would
#: otherwise size per-layer lists (10**12 layers: an allocation that never ends).
MAX_LAYERS = 100_000
#: Bound for sizes and counts (hidden size, vocabulary, experts, ...).
MAX_SIZE = 1 << 40
#: The keys that count the routed experts, across the families (K3, K2/DeepSeek-V3, gpt-oss).
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


def _int_field(d: dict[str, Any], *keys: str, source: str, default: Any = 0, hi: int = MAX_SIZE) -> Any:
    """The first of ``keys`` present in ``d`` as a non-negative int up to ``hi`` (``default`` if
    none is present).

    Raises:
        ConfigError: the value is not a whole number in range (a bool, a string, a list, inf,
            10**12 layers), naming the field.
    """
    key = next((k for k in keys if d.get(k) is not None), None)
    if key is None:
        return default
    value = d[key]
    if isinstance(value, float) and value.is_integer() and abs(value) <= hi:
        value = int(value)  # 64.0 is 64; inf and 1e300 stay refused
    if type(value) is not int or not 0 <= value <= hi:
        raise ConfigError(f"{source}: {key} is {json_repr(value)}, not a whole number from 0 to {hi}")
    return value


def json_repr(value: Any) -> str:
    """A short rendering of a config value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class ModelConfig:
    """What k3ckpt needs from a config, in one vocabulary.

    ``attention_kinds[i]`` is the attention of 0-based layer ``i``: ``kda``, ``mla``,
    ``full``, ``sliding`` or ``mha``; ``moe_layers`` the 0-based layers with routed experts.
    """

    family: str
    model_type: str
    text_model_type: str
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int | None
    intermediate_size: int | None
    routed_expert_hidden_size: int | None
    first_k_dense: int
    moe_layer_freq: int
    attention_kinds: list[str]
    quantization: dict[str, Any]
    tie_word_embeddings: bool
    has_vision: bool
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    #: where it was read (a path, or a hub file's label), for messages
    source: str = field(repr=False, default="config.json")

    @property
    def moe_layers(self) -> list[int]:
        if self.num_experts <= 1:
            return []
        return [
            i
            for i in range(self.num_layers)
            if i >= self.first_k_dense and (i - self.first_k_dense) % max(self.moe_layer_freq, 1) == 0
        ]

    @property
    def experts_key(self) -> str:
        """The key that counts the routed experts, as this config spells it: the one present,
        else the one its family uses, under ``text_config.`` when the text model is nested
        there (``text_config.num_experts`` for K3, ``n_routed_experts`` for K2)."""
        nested = isinstance(self.raw.get("text_config"), dict)
        text: dict[str, Any] = self.raw["text_config"] if nested else self.raw
        key = next((k for k in EXPERT_KEYS if text.get(k) is not None), None)
        if key is None:
            key = {"deepseek_v3": "n_routed_experts", "gpt_oss": "num_local_experts"}.get(self.family, "num_experts")
        return f"text_config.{key}" if nested else key

    @property
    def expert_groups_entry(self) -> tuple[str | None, Any]:
        """The key that counts the router's expert groups, as this config spells it (``n_group``,
        as DeepSeek-V3 and Kimi-K2 write it, else ``num_expert_group``), and its value as written;
        ``(None, None)`` when neither is there. vLLM reads a missing count as one group."""
        text = self.raw["text_config"] if isinstance(self.raw.get("text_config"), dict) else self.raw
        key = next((k for k in ("n_group", "num_expert_group") if text.get(k) is not None), None)
        return key, (text.get(key) if key else None)

    @property
    def expert_groups(self) -> int:
        """How many expert groups the router has: the count the config gives when it is an
        integer above one, else 1 (what vLLM makes of a missing, zero or malformed count)."""
        value = self.expert_groups_entry[1]
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1

    def describe_expert_groups(self) -> str:
        """The expert-group entry for a message: ``n_group 1``, or that neither key is there."""
        key, value = self.expert_groups_entry
        return f"{key} {json_repr(value)}" if key else "no n_group or num_expert_group (vLLM reads 1)"

    @property
    def quant_format(self) -> str | None:
        """A short name for the weight format the config declares, e.g. ``mxfp4-pack-quantized``."""
        q = self.quantization
        if not q:
            return None
        method = q.get("quant_method")
        if method == "compressed-tensors":
            return str(q.get("format") or "compressed-tensors")
        if method == "fp8":
            return "fp8-block" if q.get("weight_block_size") else "fp8"
        return str(method) if method else None


def _family(model_type: str, text_model_type: str, archs: list[str]) -> str:
    mt = {model_type, text_model_type}
    if "kimi_k3" in mt or any("KimiK3" in a for a in archs):
        return "kimi_k3"
    if "gpt_oss" in mt:
        return "gpt_oss"
    if mt & {"kimi_k2", "deepseek_v3", "deepseek_v2"} or any("Deepseek" in a for a in archs):
        return "deepseek_v3"
    if "kimi_linear" in mt:
        return "kimi_k3"
    return "unknown"


def _layer_numbers(lac: dict[str, Any], key: str, source: str) -> set[int]:
    """0-based layers from a list of 1-based layer numbers in ``linear_attn_config``."""
    value = lac.get(key) or []
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ConfigError(f"{source}: linear_attn_config.{key} is {json_repr(value)}, not a list of layer numbers")
    return {i - 1 for i in value}


def _attention_kinds(family: str, text: dict[str, Any], num_layers: int, source: str = "config.json") -> list[str]:
    lac = text.get("linear_attn_config")
    if isinstance(lac, dict) and (lac.get("kda_layers") or lac.get("full_attn_layers")):
        # 1-based layer numbers in the K3 / Kimi-Linear config.
        full = _layer_numbers(lac, "full_attn_layers", source)
        kda = _layer_numbers(lac, "kda_layers", source)
        kinds = []
        for i in range(num_layers):
            kinds.append("mla" if i in full else "kda" if i in kda or not full else "mla")
        return kinds
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return ["sliding" if "sliding" in str(t) else "full" for t in layer_types]
    if family == "deepseek_v3" or text.get("kv_lora_rank"):
        return ["mla"] * num_layers
    return ["mha"] * num_layers


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Normalize a parsed ``config.json``.

    Raises:
        ConfigError: when a field every family has (layers, hidden size) is missing, or a
            size, count or layer list is of the wrong kind or out of range (naming the field).
    """
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: not a JSON object")
    text_config = raw.get("text_config")  # a local, so that the isinstance check narrows its type
    text: dict[str, Any] = text_config if isinstance(text_config, dict) else raw
    model_type = str(raw.get("model_type", ""))
    text_model_type = str(text.get("model_type", model_type))
    archs_raw = raw.get("architectures") or []
    if not isinstance(archs_raw, list):
        raise ConfigError(f"{source}: architectures is {json_repr(archs_raw)}, not a list")
    archs = [str(a) for a in archs_raw]
    family = _family(model_type, text_model_type, archs)
    num_layers = _int_field(text, "num_hidden_layers", "n_layer", "num_layers", source=source, default=None,
                            hi=MAX_LAYERS)
    hidden = _int_field(text, "hidden_size", "n_embd", "d_model", source=source, default=None)
    if num_layers is None or hidden is None:
        raise ConfigError(f"{source}: missing num_hidden_layers or hidden_size")

    def count(*keys: str, default: Any = 0) -> Any:
        return _int_field(text, *keys, source=source, default=default)

    num_experts = count(*EXPERT_KEYS)
    quant = _first(raw, "quantization_config", default=None) or _first(text, "quantization_config", default={}) or {}
    return ModelConfig(
        family=family,
        model_type=model_type,
        text_model_type=text_model_type,
        architectures=archs,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=count("vocab_size"),
        num_attention_heads=count("num_attention_heads", "n_head"),
        num_experts=num_experts,
        experts_per_token=count("num_experts_per_token", "num_experts_per_tok", "experts_per_token"),
        num_shared_experts=count("num_shared_experts", "n_shared_experts"),
        moe_intermediate_size=count("moe_intermediate_size", default=None),
        intermediate_size=count("intermediate_size", default=None),
        routed_expert_hidden_size=count("routed_expert_hidden_size", default=None),
        first_k_dense=count("first_k_dense_replace"),
        moe_layer_freq=count("moe_layer_freq", default=1),
        attention_kinds=_attention_kinds(family, text, num_layers, source),
        quantization=quant if isinstance(quant, dict) else {},
        tie_word_embeddings=bool(_first(text, "tie_word_embeddings", default=_first(raw, "tie_word_embeddings", default=False))),
        has_vision=isinstance(raw.get("vision_config"), dict),
        raw=raw,
        source=source,
    )


def load_config(path: Path) -> ModelConfig:
    """Read and normalize ``path`` (a ``config.json``)."""
    raw, _ = load_json(path, ConfigError)
    return parse_config(raw, str(path))
