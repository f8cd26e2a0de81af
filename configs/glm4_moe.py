"""GLM-4.5 configs (Hugging Face glm4_moe: GLM-4.5, GLM-4.5-Air and their successors of the same
architecture): grouped-query attention with q/k/v biases, rotary embeddings on half of each head,
optional per-head QK-norm, leading dense layers, a shared expert beside fine-grained routed ones,
DeepSeek-V3's router (sigmoid scores, a selection-only score bias, renormalized top-k, routed
scaling).

  python train.py --config configs/glm4_moe.py:tiny --workdir runs/glm_tiny

Presets:
  tiny  (default)  GLM-4.5's options at CPU size: 3 layers (the first dense), d_model 64, 4 heads
                   of 16 over 2 kv heads, q/k/v biases, per-head QK-norm, half of each head
                   rotated, 8 experts top-2 in 2 groups of which 1 is used, one shared expert,
                   sigmoid scores renormalized and scaled by 2.5, score bias rate 1e-3.
  air              GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): 46 layers, the first dense
                   (10944), d_model 4096, 96 heads of 128 over 8 kv heads, q/k/v biases, no
                   QK-norm, half-head rotary (theta 1e6), 1 shared + 128 routed experts top-8 of
                   width 1408, vocab 151552; 106.9B total, 12.8B active without the embedding
                   (the multi-token-prediction layer not counted).
  glm45            GLM-4.5 (zai-org/GLM-4.5 config.json): 92 layers, the first 3 dense (12288),
                   d_model 5120, 96 heads of 128 over 8 kv heads, q/k/v biases, per-head
                   QK-norm, half-head rotary, 1 shared + 160 routed experts top-8 of width 1536,
                   routed scaling 2.5; 352.8B total, 32.9B active without the embedding.

air and glm45 keep the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "air", "glm45")
# Published (total, active) parameters and where the figures come from; Z.ai counts the active
# ones without the input embedding (the test reads them so).
PUBLISHED = {
    "air": (106e9, 12e9, "GLM-4.5-Air model card (zai-org): 106B total, 12B active"),
    "glm45": (355e9, 32e9, "GLM-4.5 model card (zai-org): 355B total, 32B active"),
}


def _glm_options(c) -> None:
  c.model.update(family="glm4_moe", qkv_bias=True)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _glm_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, num_kv_heads=2,
                   qk_norm="head", rotary_dim=8)
    c.moe.update(expert_groups=2, top_groups=1, shared_expert_hidden=64, routed_scale=2.5)
  elif preset == "air":
    c.model.update(vocab_size=151552, d_model=4096, num_layers=46, dense_layers=(0,),
                   dense_hidden=10944, num_heads=96, num_kv_heads=8, head_dim=128,
                   rotary_dim=64, qk_norm="none", rope_theta=1e6)
    c.moe.update(num_experts=128, top_k=8, expert_hidden=1408, shared_expert_hidden=1408)
    published_fine_tuning(c)
  elif preset == "glm45":
    c.model.update(vocab_size=151552, d_model=5120, num_layers=92, dense_layers=(0, 1, 2),
                   dense_hidden=12288, num_heads=96, num_kv_heads=8, head_dim=128,
                   rotary_dim=64, qk_norm="head", rope_theta=1e6)
    c.moe.update(num_experts=160, top_k=8, expert_hidden=1536, shared_expert_hidden=1536,
                 routed_scale=2.5)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/glm4_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
