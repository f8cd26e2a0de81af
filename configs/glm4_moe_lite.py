"""GLM-4.7-Flash configs (Hugging Face glm4_moe_lite): DeepSeek-V3's multi-head latent attention
(a q latent, a kv latent, rotary dims stored interleaved) with GLM-4.5's MoE: a leading dense
layer, a shared expert beside fine-grained routed ones, sigmoid scores with a selection-only
score bias, renormalized top-k, routed scaling.

  python train.py --config configs/glm4_moe_lite.py:tiny --workdir runs/glm_lite_tiny

Presets:
  tiny  (default)  GLM-4.7-Flash's options at CPU size: 3 layers (the first dense), d_model 64,
                   4 heads of latent attention (q latent 32, kv latent 32, 16 + 8 rotary, values
                   16), 8 experts top-2, one shared expert, sigmoid scores renormalized and
                   scaled by 1.8, score bias rate 1e-3.
  flash            GLM-4.7-Flash (zai-org/GLM-4.7-Flash config.json): 47 layers, the first
                   dense (10240), d_model 2048, 20 heads of latent attention (q latent 768, kv
                   latent 512, 192 + 64 rotary, values 256; theta 1e6), 1 shared + 64 routed
                   experts top-4 of width 1536, routed scaling 1.8, vocab 154880; 29.9B total,
                   3.6B active without the embedding (published "30B-A3B"; the
                   multi-token-prediction layer not counted).

flash keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "flash")
# Published (total, active) parameters and where the figures come from; Z.ai counts the active
# ones without the input embedding (the test reads them so).
PUBLISHED = {
    "flash": (30e9, 3e9, "GLM-4.7-Flash model card (zai-org): a 30B-A3B MoE"),
}


def _lite_options(c) -> None:
  c.model.update(family="glm4_moe_lite", qk_norm="none")
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=1.8, aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _lite_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, head_dim=24,
                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16)
    c.moe.update(shared_expert_hidden=64)
  elif preset == "flash":
    c.model.update(vocab_size=154880, d_model=2048, num_layers=47, dense_layers=(0,),
                   dense_hidden=10240, num_heads=20, head_dim=256, rope_theta=1e6,
                   q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                   v_head_dim=256)
    c.moe.update(num_experts=64, top_k=4, expert_hidden=1536, shared_expert_hidden=1536)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/glm4_moe_lite.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
