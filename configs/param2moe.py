"""Param2-MoE configs (Hugging Face param2moe, BharatGen's Param2): Sarvam-MoE's architecture and
tensor names (GLM-4.5's, run by transformers as Glm4MoeForCausalLM: whole heads rotated,
per-head QK-norm, a leading dense layer, shared experts, sigmoid scores with a selection-only
score bias, renormalized top-k, routed scaling) with tied embeddings.

  python train.py --config configs/param2moe.py:tiny --workdir runs/param2_tiny

Presets:
  tiny  (default)  Param2's options at CPU size: 3 layers (the first dense), d_model 64, 4 heads
                   of 16 with 2 kv heads, per-head QK-norm, 8 experts top-2, two shared experts,
                   sigmoid scores renormalized and scaled by 2.5, score bias rate 1e-3, tied
                   embeddings.
  17b_a2b          transformers' Param2MoeConfig defaults (its docstring's
                   bharatgenai/Param2-17B-A2.4B-Thinking): 21 layers, the first dense (9216),
                   d_model 2048, 32 heads of 64 with 8 kv heads (theta 5e5), 2 shared + 64
                   routed experts top-6 of width 2048, routed scaling 2.5, vocab 128000, tied;
                   moejax counts 17.15B total, 2.55B active (2.29B without the embedding: the
                   name's "A2.4B" is neither, so no published count is checked).

17b_a2b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "17b_a2b")
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="param2moe", qk_norm="head", norm_eps=1e-6, rope_theta=5e5,
                 tie_embeddings=True)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=2.5, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, num_kv_heads=2)
    c.moe.update(shared_expert_hidden=128)
  elif preset == "17b_a2b":
    c.model.update(vocab_size=128000, d_model=2048, num_layers=21, dense_layers=(0,),
                   dense_hidden=9216, num_heads=32, num_kv_heads=8, head_dim=64)
    c.moe.update(num_experts=64, top_k=6, expert_hidden=2048, shared_expert_hidden=4096)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/param2moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
