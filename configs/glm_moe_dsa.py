"""GLM-5 configs (`glm_moe_dsa`, transformers' GlmMoeDsaForCausalLM): DeepSeek-V3's latent
attention and routing with DeepSeek-V3.2's sparse-attention indexer in every layer, whose rotated
dims pair up as neighbours (`model.index_rotary_interleaved`), and GLM's dimensions.

  python train.py --config configs/glm_moe_dsa.py:tiny --workdir runs/glm5_tiny

Presets:
  tiny  (default)  configs/deepseek_v32.py's tiny with GLM-5's interleaved indexer rotation and
                   no expert groups.
  glm5             GLM-5 and GLM-5.1 (zai-org/GLM-5; transformers' GlmMoeDsaConfig defaults): 78
                   layers, the first 3 dense (12288), d_model 6144, 64 heads of latent attention
                   (q latent 2048, kv latent 512, 192 + 64 rotary, values 256), 1 shared + 256
                   routed experts top-8 of width 2048, no groups, sigmoid with score bias,
                   routed scaling 2.5, an indexer of 32 heads of 128 selecting 2048 keys, vocab
                   154880; RoPE base transformers' default 10000 (a checkpoint's own is read by
                   `--config configs/hf.py:DIR`).

Its indexer trains by its own loss, as DeepSeek-V3.2's (configs/deepseek_v32.py).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "glm5")
PUBLISHED = {
    "glm5": (744e9, 40e9, "GLM-5 technical report (GLM-5: from Vibe Coding to Agentic "
                          "Engineering), Table 1: 744B total, 40B activated"),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="glm_moe_dsa", qk_norm="none", index_rotary_interleaved=True)
  c.moe.update(score="sigmoid", renormalize=True, routed_scale=2.5, score_bias=True,
               score_bias_rate=1e-3, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, head_dim=24,
                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, index_topk=32, index_heads=4, index_head_dim=16)
    c.moe.update(shared_expert_hidden=64)
  elif preset == "glm5":
    c.model.update(vocab_size=154880, d_model=6144, num_layers=78, dense_layers=(0, 1, 2),
                   dense_hidden=12288, num_heads=64, head_dim=256, q_lora_rank=2048,
                   kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                   index_topk=2048, index_heads=32, index_head_dim=128)
    c.moe.update(num_experts=256, top_k=8, expert_hidden=2048, shared_expert_hidden=2048)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/glm_moe_dsa.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
