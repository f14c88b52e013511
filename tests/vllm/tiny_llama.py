"""A tiny random-weight Llama written at test time (no download): config.json plus
model.safetensors from transformers' own classes, small enough for vLLM's CPU engine.

2 layers, hidden 128, 2 attention heads of head_dim 64 (the CPU attention kernel refuses 16),
1 KV head, intermediate 256, vocab 512, bf16.  The weights come from a fixed seed, so two
engines built on the same directory compute the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
              intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=64, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
              rope_theta=10000.0, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, hidden_act="silu")


def write_config(path: Path) -> Path:
    """config.json only: enough for vLLM's ModelConfig (the Tier A scheduler tests)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def write_model(path: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors with random weights from ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
