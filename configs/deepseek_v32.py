"""DeepSeek-V3.2 configs: DeepSeek-V3's architecture with DeepSeek sparse attention (DSA): in every
layer a lightning indexer (its own small q heads from the q latent, one key head, a weight per
head) scores each query's earlier keys and the query attends to its index_topk best only.

  python train.py --config configs/deepseek_v32.py:tiny --workdir runs/deepseek_v32_tiny

Presets:
  tiny  (default)  configs/deepseek.py's tiny (3 layers, the first dense, latent attention, 8
                   experts top-2 in groups, one shared) with an indexer of 4 heads of 16
                   selecting 32 keys, so the default 64-token sequences attend sparsely.
  v32              DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2 config.json): DeepSeek-V3's
                   dimensions (61 layers, the first 3 dense, 128 heads of latent attention, 1
                   shared + 256 routed experts top-8 in 8 groups of which 4 are used, YaRN RoPE
                   over 4096 positions by 40) and an indexer of 64 heads of 128 selecting 2048
                   keys; 671.9B total, 38.4B active (the indexers' 0.85B in both). The published
                   weights are FP8, dequantized on import: --config.init_from=DIR.

The selection carries no gradient: the indexer learns from its own KL loss
(model.train_indexer, default True; False freezes it), detached from the rest of the model.
Sequences no longer than index_topk attend densely, exactly as without an indexer.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "v32")
PUBLISHED: dict = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="deepseek_v32", qk_norm="none")
  c.moe.update(score="sigmoid", renormalize=True, routed_scale=2.5, score_bias=True,
               score_bias_rate=1e-3, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, head_dim=24,
                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16, index_topk=32, index_heads=4, index_head_dim=16)
    c.moe.update(expert_groups=4, top_groups=2, shared_expert_hidden=64)
  elif preset == "v32":
    c.model.update(vocab_size=129280, d_model=7168, num_layers=61, dense_layers=(0, 1, 2),
                   dense_hidden=18432, num_heads=128, head_dim=192, norm_eps=1e-6,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, rope_scaling="yarn", rope_factor=40.0,
                   rope_original_max_len=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                   index_topk=2048, index_heads=64, index_head_dim=128)
    c.moe.update(num_experts=256, top_k=8, expert_hidden=2048, shared_expert_hidden=2048,
                 expert_groups=8, top_groups=4)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/deepseek_v32.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
