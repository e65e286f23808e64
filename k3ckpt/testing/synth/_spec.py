"""What a synthetic checkpoint is: its shape (:class:`SynthSpec`, Kimi K3's by default), the
named :data:`PRESETS`, and :func:`spec_from_preset` (a preset with overrides)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import SynthError


@dataclass(frozen=True)
class SynthSpec:
    """Shape of a synthetic checkpoint. Defaults are Kimi K3's (k3-checkpoint.md)."""

    family: str = "kimi_k3"  # kimi_k3 | gpt_oss | kimi_k2 | deepseek_v3 | qwen3_moe
    num_layers: int = 93
    hidden_size: int = 7168
    intermediate_size: int = 33792  # dense MLP of the first_k_dense layers
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584  # K3 latent MoE width; 0 = experts run at hidden_size
    num_experts: int = 896
    experts_per_token: int = 16
    num_shared_experts: int = 2
    first_k_dense: int = 1
    vocab_size: int = 163840
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    full_attn_every: int = 4  # 1-based layers k*every are MLA, plus the last layer
    vision_layers: int = 27
    vision_hidden_size: int = 1152
    vision_intermediate_size: int = 4304
    vision_patch_size: int = 14
    num_shards: int = 0  # 0: one shard per layer plus embed / head / vision shards (K3's layout)
    seed: int = 0
    headers_only: bool = False
    dtype: str = "BF16"  # the weights of the engine families (deepseek_v3, qwen3_moe): BF16 or F32

    @property
    def engine_family(self) -> bool:
        """Written for a running engine (vLLM's CPU backend): plain BF16/F32 weights drawn with
        :data:`ENGINE_STD`, a real ``tokenizer.json``, a config transformers knows natively."""
        return self.family in ENGINE_FAMILIES

    @property
    def expert_width(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    def validate(self) -> None:
        if self.num_layers < 1 or self.hidden_size < 1:
            raise SynthError("layers and hidden size must be positive")
        if self.family in ("kimi_k3", "gpt_oss"):
            for what, n in (("expert width", self.expert_width), ("moe_intermediate_size", self.moe_intermediate_size)):
                if n % 32:
                    raise SynthError(f"{what} {n} is not a multiple of the MXFP4 block size 32")
        if self.experts_per_token > self.num_experts:
            raise SynthError(
                f"experts_per_token {self.experts_per_token} exceeds num_experts {self.num_experts}"
            )
        if self.num_shards < 0:
            raise SynthError("num_shards must be >= 0")
        if self.dtype not in ("BF16", "F32") or (self.dtype != "BF16" and not self.engine_family):
            raise SynthError(f"dtype {self.dtype} is not available for {self.family} "
                             f"(BF16 or F32 for {' and '.join(ENGINE_FAMILIES)}; the others have their own dtypes)")
        if self.engine_family and self.vocab_size < 512:
            raise SynthError(f"vocab_size {self.vocab_size} is too small for the byte-level tokenizer (>= 512)")


#: The families a running engine loads on CPU (tests/test_engine_run.py): DeepSeek-V3 / Kimi-K2's
#: text model without FP8, and Qwen3-MoE.
ENGINE_FAMILIES = ("deepseek_v3", "qwen3_moe")


_K2_ENGINE = SynthSpec(
    family="deepseek_v3", num_layers=4, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    routed_expert_hidden_size=0, num_experts=16, experts_per_token=4, num_shared_experts=1, first_k_dense=1,
    vocab_size=1024, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64,
    qk_rope_head_dim=64, v_head_dim=64, vision_layers=0, num_shards=4,
)
# Qwen3-MoE: grouped-query attention (kda_head_dim is its head_dim, as for gpt-oss; a quarter as
# many KV heads), per-head q/k norms, 16 experts without a shared one, every layer MoE.
_QWEN3_MOE_ENGINE = SynthSpec(
    family="qwen3_moe", num_layers=3, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    routed_expert_hidden_size=0, num_experts=16, experts_per_token=4, num_shared_experts=0, first_k_dense=0,
    vocab_size=1024, num_attention_heads=8, kda_head_dim=32, vision_layers=0, num_shards=3,
)

PRESETS: dict[str, SynthSpec] = {
    "k3-full": SynthSpec(headers_only=True),
    "k3-small": SynthSpec(
        num_layers=9, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        routed_expert_hidden_size=512, num_experts=256, experts_per_token=8, num_shared_experts=1,
        vocab_size=32768, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, kda_num_heads=8, kda_head_dim=128,
        vision_layers=2, vision_hidden_size=256, vision_intermediate_size=512,
    ),
    "k3-tiny": SynthSpec(
        num_layers=5, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
        routed_expert_hidden_size=128, num_experts=16, experts_per_token=4, num_shared_experts=1,
        vocab_size=1024, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, kda_num_heads=4, kda_head_dim=32,
        vision_layers=1, vision_hidden_size=64, vision_intermediate_size=128,
    ),
    "gptoss-tiny": SynthSpec(
        family="gpt_oss", num_layers=4, hidden_size=256, intermediate_size=0, moe_intermediate_size=256,
        routed_expert_hidden_size=0, num_experts=8, experts_per_token=2, num_shared_experts=0,
        first_k_dense=0, vocab_size=1024, num_attention_heads=4, kda_head_dim=64, vision_layers=0,
        num_shards=3,
    ),
    "k2-tiny": SynthSpec(
        family="kimi_k2", num_layers=4, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        routed_expert_hidden_size=0, num_experts=8, experts_per_token=2, num_shared_experts=1,
        vocab_size=1024, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vision_layers=0, num_shards=3,
    ),
    # For a running engine (docs/engines.md): Kimi-K2's architecture (DeepseekV3ForCausalLM) at a
    # few MB - MLA with kv_lora_rank 512 + qk_rope_head_dim 64 (head size 576, all vLLM's CPU MLA
    # takes), a dense first layer, a shared expert, the noaux_tc gate, 16 routed experts, 4 shards.
    "k2-engine": _K2_ENGINE,
    "k2-engine-fp32": replace(_K2_ENGINE, dtype="F32"),
    "qwen3-moe-engine": _QWEN3_MOE_ENGINE,
    "qwen3-moe-engine-fp32": replace(_QWEN3_MOE_ENGINE, dtype="F32"),
}


def spec_from_preset(preset: str, **overrides: object) -> SynthSpec:
    """The preset's spec with ``overrides`` (``None`` values ignored) applied."""
    if preset not in PRESETS:
        raise SynthError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    bad = set(changes) - set(SynthSpec.__dataclass_fields__)
    if bad:
        raise SynthError(f"unknown synth option(s): {', '.join(sorted(bad))}")
    # The values are whatever the caller passed (names checked above): mypy cannot match them to the fields.
    return replace(PRESETS[preset], **changes)  # type: ignore[arg-type]
