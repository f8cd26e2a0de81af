"""gpt-oss configs (Hugging Face gpt_oss, OpenAI's gpt-oss): grouped-query attention with biases
on q, k, v and the output projection and a learned sink per head (model.attention_sinks), layers
alternating between a 128-token sliding window and the whole sequence, YaRN RoPE (not truncated);
a router with a bias (moe.router_bias), softmax over the top-k logits; experts with biases
(moe.expert_bias) and the clamped SwiGLU (moe.activation "swiglu_clamped": gate clipped above at
7, up to [-7, 7], gate * sigmoid(1.702 gate) * (up + 1)). No shared expert, no dense layer.

  python train.py --config configs/gpt_oss.py:tiny --workdir runs/gpt_oss_tiny

Presets:
  tiny  (default)  gpt-oss's options at CPU size: 4 layers (0 and 2 sliding within 32 tokens),
                   d_model 64, 4 heads of 16 with 2 kv heads, biases and sinks, YaRN x4 from 32
                   tokens (not truncated), 8 experts top-2 with biases and the clamped SwiGLU.
  20b              gpt-oss-20b: 24 layers, d 2880, 64 / 8 kv heads of 64, 32 experts top-4 of
                   2880, vocabulary 201088, YaRN x32 from 4096, window 128 on even layers.
  120b             gpt-oss-120b: the same with 36 layers and 128 experts.

The published presets take tokens from the checkpoint's tokenizer.json
(data.tokenizer=init_from): fine-tune with --config.init_from=HF_DIR, a download of
openai/gpt-oss-20b (its MXFP4 experts read dequantized), or convert it once with
`python -m moejax.convert from-hf HF_DIR CKPT_DIR`.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "20b", "120b")
# OpenAI's counts leave the embedding out of the active parameters (the LM head counts):
# tests/models/test_families.py WITHOUT_EMBEDDING.
PUBLISHED = {
    "20b": (20.91e9, 3.61e9, "gpt-oss-120b & gpt-oss-20b model card (OpenAI, 2025), Table 1: "
            "20.91B total, 3.61B active"),
    "120b": (116.83e9, 5.13e9, "gpt-oss-120b & gpt-oss-20b model card (OpenAI, 2025), Table 1: "
             "116.83B total, 5.13B active")}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="gpt_oss", qk_norm="none", qkv_bias=True, attention_out_bias=True,
                 attention_sinks=True, rope_theta=150000.0, rope_scaling="yarn",
                 rope_truncate=False)
  c.moe.update(renormalize=True, router_bias=True, expert_bias=True, activation="swiglu_clamped",
               aux_loss_weight=0.001, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=4, num_kv_heads=2, sliding_window=32, sliding_layers=(0, 2),
                   rope_factor=4.0, rope_original_max_len=32)
  elif preset in ("20b", "120b"):
    layers = 24 if preset == "20b" else 36
    c.model.update(vocab_size=201088, d_model=2880, num_layers=layers, num_heads=64,
                   num_kv_heads=8, head_dim=64, sliding_window=128,
                   sliding_layers=tuple(range(0, layers, 2)), rope_factor=32.0,
                   rope_original_max_len=4096)
    c.moe.update(num_experts=32 if preset == "20b" else 128, top_k=4, expert_hidden=2880)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/gpt_oss.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
