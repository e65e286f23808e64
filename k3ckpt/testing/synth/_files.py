"""The checkpoint's layout and small files: shard names (each family's own style), which units
go in which shard, ``config.json`` with the family's real structure, and the side files
(tokenizer, generation config, LICENSE with synth's mark)."""

from __future__ import annotations

import json

from ...errors import SynthError
from ._plan import Planner, Unit
from ._spec import ENGINE_FAMILIES, SynthSpec


def shard_name(family: str, i: int, n: int) -> str:
    """File name of shard ``i`` (0-based) of ``n``, in the family's own style."""
    if family == "kimi_k3":
        return f"model-{i + 1:05d}-of-{n:06d}.safetensors"
    if family == "gpt_oss":
        return f"model-{i:05d}-of-{n - 1:05d}.safetensors"
    if family == "qwen3_moe":
        return f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return f"model-{i + 1}-of-{n}.safetensors"  # Kimi-K2-Instruct style, unpadded


def assign_shards(units: list[Unit], num_shards: int) -> list[list[Unit]]:
    """Group units into shards. ``0``: one shard per group (K3's layout: embed with layer 0, one
    layer per shard, head, vision, projector). Otherwise pack contiguously by size."""
    if num_shards == 0:
        shards: list[list[Unit]] = []
        last = None
        for u in units:
            if u.group != last and not (last == "embed" and u.group == "layer.0"):
                shards.append([])
            shards[-1].append(u)
            last = u.group
        return shards
    total = sum(u.nbytes for u in units)
    target = total / num_shards
    if num_shards > len(units):
        raise SynthError(f"{num_shards} shards requested but only {len(units)} units to place")
    shards = [[]]
    acc = 0
    for k, u in enumerate(units):
        remaining_units = len(units) - k
        remaining_shards = num_shards - len(shards)
        if shards[-1] and (acc >= target * len(shards) or remaining_units <= remaining_shards):
            shards.append([])
        shards[-1].append(u)
        acc += u.nbytes
    return shards


def make_config(spec: SynthSpec) -> dict:
    """A config.json with the real structure of the family."""
    s = spec
    if s.family == "gpt_oss":
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "intermediate_size": s.moe_intermediate_size, "num_local_experts": s.num_experts,
            "num_experts_per_tok": s.experts_per_token, "experts_per_token": s.experts_per_token,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": max(1, s.num_attention_heads // 4),
            "head_dim": s.kda_head_dim, "vocab_size": s.vocab_size, "tie_word_embeddings": False,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s.num_layers)],
            "sliding_window": 128, "rope_theta": 150000, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
        }
    if s.family == "kimi_k2":
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
            "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "moe_intermediate_size": s.moe_intermediate_size,
            "n_routed_experts": s.num_experts, "num_experts_per_tok": s.experts_per_token,
            "n_shared_experts": s.num_shared_experts, "first_k_dense_replace": s.first_k_dense,
            "moe_layer_freq": 1, "num_attention_heads": s.num_attention_heads,
            "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
            "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
            "v_head_dim": s.v_head_dim, "vocab_size": s.vocab_size, "tie_word_embeddings": False,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]},
        }
    if s.family in ENGINE_FAMILIES:
        return _engine_config(s)
    full = Planner(s).k3_full_attn_layers()
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                     "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "kimi_linear",
            "num_hidden_layers": s.num_layers, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "vocab_size": s.vocab_size,
            "tie_word_embeddings": False, "max_position_embeddings": 1048576,
            "num_experts": s.num_experts, "num_experts_per_token": s.experts_per_token,
            "num_shared_experts": s.num_shared_experts, "moe_intermediate_size": s.moe_intermediate_size,
            "routed_expert_hidden_size": s.routed_expert_hidden_size, "first_k_dense_replace": s.first_k_dense,
            "moe_layer_freq": 1, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
            "num_attention_heads": s.num_attention_heads, "q_lora_rank": s.q_lora_rank,
            "kv_lora_rank": s.kv_lora_rank, "qk_nope_head_dim": s.qk_nope_head_dim,
            "qk_rope_head_dim": s.qk_rope_head_dim, "v_head_dim": s.v_head_dim,
            "linear_attn_config": {
                "num_heads": s.kda_num_heads, "head_dim": s.kda_head_dim,
                "short_conv_kernel_size": s.short_conv_kernel_size,
                "kda_layers": [i for i in range(1, s.num_layers + 1) if i not in full],
                "full_attn_layers": full,
            },
        },
        "vision_config": {"model_type": "moonvit", "hidden_size": s.vision_hidden_size,
                          "num_hidden_layers": s.vision_layers, "intermediate_size": s.vision_intermediate_size,
                          "patch_size": s.vision_patch_size} if s.vision_layers else None,
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "mxfp4-pack-quantized",
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "scale_dtype": "uint8"}}},
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*block_sparse_moe\\.gate$",
                       "re:.*routed_expert_(down|up)_proj$", "re:.*mlp\\.(gate|up|down)_proj$",
                       "re:vision_tower.*", "re:mm_projector.*", "language_model.lm_head"],
        },
    }


def _engine_config(s: SynthSpec) -> dict:
    """config.json of an engine family, with the fields of the published checkpoints'
    (Kimi-K2-Instruct's for deepseek_v3, less its FP8 ``quantization_config``, its YaRN
    ``rope_scaling`` and its remote code; Qwen3-30B-A3B's for qwen3_moe), at this spec's sizes."""
    dtype = {"BF16": "bfloat16", "F32": "float32"}[s.dtype]
    bos, eos = s.vocab_size - 2, s.vocab_size - 1  # the tokenizer's two special tokens
    common = {
        "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size, "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_attention_heads, "num_experts_per_tok": s.experts_per_token,
        "vocab_size": s.vocab_size, "max_position_embeddings": 4096, "hidden_act": "silu",
        "rms_norm_eps": 1e-06, "attention_bias": False, "attention_dropout": 0.0, "norm_topk_prob": True,
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": dtype,
    }
    if s.family == "qwen3_moe":
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
            "head_dim": s.kda_head_dim, "num_key_value_heads": max(1, s.num_attention_heads // 4),
            "num_experts": s.num_experts, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "rope_theta": 1000000.0, "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
            "max_window_layers": s.num_layers, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
        "num_key_value_heads": s.num_attention_heads, "n_routed_experts": s.num_experts,
        "n_shared_experts": s.num_shared_experts, "first_k_dense_replace": s.first_k_dense, "moe_layer_freq": 1,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.827, "q_lora_rank": s.q_lora_rank, "kv_lora_rank": s.kv_lora_rank,
        "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
        "v_head_dim": s.v_head_dim, "rope_theta": 50000.0, "rope_scaling": None, "num_nextn_predict_layers": 0,
    }


_LICENSE_K3 = """Modified MIT License

Copyright (c) 2026 Moonshot AI (synthetic fixture generated by k3ckpt; not the real weights)

Permission is hereby granted, free of charge, to any person obtaining a copy of this software
and associated documentation files (the "Software"), to deal in the Software without
restriction, subject to the conditions of the MIT License and to the following modification:
a product or service using the Software with more than 100 million monthly active users or
more than 20 million US dollars of monthly revenue shall prominently display "Kimi K3" on its
user interface.
"""


_TOKENIZATION_KIMI = '''"""Tokenizer shim of the synthetic fixture (k3ckpt synth): the file layout of Kimi's
tiktoken tokenizer (tokenization_kimi.py + tiktoken.model), not its code."""
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
'''


def _tiktoken_model() -> str:
    """A tiktoken BPE file (``base64(token) rank`` per line) of the 256 byte-level tokens."""
    import base64

    return "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))


def _tokenizer_json() -> str:
    """A byte-level BPE ``tokenizer.json`` (the tokenizers library's format) of 256 tokens."""
    vocab = {f"<0x{i:02X}>": i for i in range(256)}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                       "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                                             "trim_offsets": True, "use_regex": True},
                       "post_processor": None, "decoder": {"type": "ByteLevel"},
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": True,
                                 "vocab": vocab, "merges": []}}, indent=2) + "\n"


def _byte_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte 0-255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


#: The special tokens of the engine families' tokenizer: the vocabulary's last two ids.
ENGINE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>")


def engine_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE ``tokenizer.json`` of exactly ``vocab_size`` tokens - so that every id
    the model can emit decodes: the 256 bytes, merges (a space with a lowercase letter, then
    letter pairs, then space-letter-letter) up to ``vocab_size - 2``, and the two special tokens.
    Written by hand (the tokenizers library's format), it loads in transformers' AutoTokenizer and
    in vLLM; text prompts encode to real ids."""
    alphabet = _byte_unicode()
    vocab = {c: i for i, c in enumerate(alphabet)}
    space, letters = alphabet[ord(" ")], "etaoinshrdlucmfwypvbgkjqxz"
    merges: list[list[str]] = []
    candidates = [(space, c) for c in letters] + [(a, b) for a in letters for b in letters] \
        + [(space + a, b) for a in letters for b in letters]
    for left, right in candidates:
        if len(vocab) >= vocab_size - len(ENGINE_SPECIAL_TOKENS):
            break
        vocab[left + right] = len(vocab)
        merges.append([left, right])
    added = []
    for tok in ENGINE_SPECIAL_TOKENS:
        added.append({"id": len(vocab), "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
        vocab[tok] = len(vocab)
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }, indent=1, ensure_ascii=False) + "\n"


def _tokenizer_files(spec: SynthSpec) -> dict[str, str]:
    """The tokenizer each family ships: Kimi (K3, K2) a tiktoken tokenizer as remote code, gpt-oss
    a tokenizers ``tokenizer.json`` (what :mod:`k3ckpt.format.loadable` requires); the engine
    families one an engine really tokenizes with (:func:`engine_tokenizer_json`)."""
    if spec.engine_family:
        bos, eos = ENGINE_SPECIAL_TOKENS
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                  "bos_token": bos, "eos_token": eos, "clean_up_tokenization_spaces": False}
        return {"tokenizer_config.json": json.dumps(config, indent=2) + "\n",
                "tokenizer.json": engine_tokenizer_json(spec.vocab_size)}
    if spec.family == "gpt_oss":
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072}
        return {"tokenizer_config.json": json.dumps(config, indent=2) + "\n", "tokenizer.json": _tokenizer_json()}
    config = {"tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    return {"tokenizer_config.json": json.dumps(config, indent=2) + "\n",
            "tokenization_kimi.py": _TOKENIZATION_KIMI, "tiktoken.model": _tiktoken_model()}


def side_files(spec: SynthSpec) -> dict[str, str]:
    if spec.engine_family:
        bos, eos = ENGINE_SPECIAL_TOKENS
        ids = {"bos_token_id": spec.vocab_size - 2, "eos_token_id": spec.vocab_size - 1}
        return {
            "generation_config.json": json.dumps(ids, indent=2) + "\n",
            **_tokenizer_files(spec),
            "special_tokens_map.json": json.dumps({"bos_token": bos, "eos_token": eos}, indent=2) + "\n",
            "LICENSE": "Apache License\nVersion 2.0, January 2004\n(synthetic fixture generated by k3ckpt)\n",
        }
    files = {
        "generation_config.json": json.dumps({"max_length": 1048576, "eos_token_id": 163586}, indent=2) + "\n",
        **_tokenizer_files(spec),
        "special_tokens_map.json": json.dumps({"bos_token": "[BOS]", "eos_token": "[EOS]"}, indent=2) + "\n",
    }
    if spec.family == "kimi_k3":
        files["LICENSE"] = _LICENSE_K3
        files["configuration_kimi_k3.py"] = (
            "# Remote-code config shim of the synthetic fixture (k3ckpt synth).\n"
            "from transformers import PretrainedConfig\n\n\n"
            "class KimiK3Config(PretrainedConfig):\n    model_type = \"kimi_k3\"\n"
        )
    else:
        files["LICENSE"] = "Apache License\nVersion 2.0, January 2004\n(synthetic fixture generated by k3ckpt)\n"
    return files
