"""DeepSeek configs: leading dense layers, shared experts beside fine-grained routed ones; V3's
multi-head latent attention, sigmoid router with group-limited top-k, routed scaling and a
selection-only score bias moved from the load (auxiliary-loss-free balancing).

  python train.py --config configs/deepseek.py:tiny --workdir runs/deepseek_tiny

Presets:
  tiny  (default)  DeepSeek-V3's options at CPU size: 3 layers (the first dense), d_model 64, 4
                   heads of latent attention (q latent 32, kv latent 32, head 16 + 8 rotary,
                   values 16), 8 experts top-2 in 4 groups of which 2 are used, one shared
                   expert, sigmoid scores renormalized and scaled by 2.5, score bias rate 1e-3.
  moe_16b          DeepSeek-MoE-16B (deepseek-ai/deepseek-moe-16b-base config.json): 28 layers,
                   the first dense (10944), d_model 2048, 16 heads of width 128 (multi-head
                   attention), 2 shared + 64 routed experts top-6 of width 1408, softmax, vocab
                   102400; 16.38B total, 2.83B active. Hugging Face's DeepseekV3 class cannot
                   hold it (no latent attention), so it is a preset only: no import or export.
  v3               DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json): 61 layers, the first 3
                   dense (18432), d_model 7168, 128 heads of latent attention (q latent 1536, kv
                   latent 512, 128 + 64 rotary, values 128), 1 shared + 256 routed experts
                   top-8 of width 2048 in 8 groups of which 4 are used, vocab 129280; 671.0B
                   total, 37.5B active (the multi-token-prediction module not counted); YaRN
                   RoPE as published (factor 40 over 4096 positions, beta 32 / 1, mscale and
                   mscale_all_dim 1). The published weights are FP8 (128 x 128 blocks), dequantized
                   on import: --config.init_from=DIR reads them and their tokenizer.json; or
                   train from scratch with --config.data.tokenizer=PATH to V3's tokenizer.json.

moe_16b and v3 keep the fine-tuning optimizer settings the published presets share (lr 1e-5,
100 warm-up steps, 2000 steps; `moejax.config.published_fine_tuning`), though neither imports
weights: a run from scratch sets its own (--config.optim.lr, --config.optim.warmup_steps,
--config.steps).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "moe_16b", "v3")
# Published (total, active) parameters and where the figures come from.
PUBLISHED = {
    "moe_16b": (16.4e9, 2.8e9, "DeepSeekMoE (Dai et al., 2024), Table 1 / model card: 16.4B "
                               "total, 2.8B activated"),
    "v3": (671e9, 37e9, "DeepSeek-V3 Technical Report (2024), Sec. 1: 671B total, 37B "
                        "activated per token"),
}


def _v3_options(c) -> None:
  c.model.update(family="deepseek_v3", qk_norm="none")
  c.moe.update(score="sigmoid", renormalize=True, routed_scale=2.5, score_bias=True,
               score_bias_rate=1e-3, aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  if preset == "tiny":
    _v3_options(c)
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, head_dim=24,
                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=16)
    c.moe.update(expert_groups=4, top_groups=2, shared_expert_hidden=64)
  elif preset == "moe_16b":
    c.model.update(family="deepseek_v3", qk_norm="none", vocab_size=102400, d_model=2048,
                   num_layers=28, dense_layers=(0,), dense_hidden=10944, num_heads=16,
                   head_dim=128, norm_eps=1e-6)
    c.moe.update(num_experts=64, top_k=6, expert_hidden=1408, shared_expert_hidden=2 * 1408,
                 aux_loss_weight=0.001, z_loss_weight=0.0)
    published_fine_tuning(c)
    c.data.tokenizer = "bytes"      # no Hugging Face import: no tokenizer.json beside weights
  elif preset == "v3":
    _v3_options(c)
    c.model.update(vocab_size=129280, d_model=7168, num_layers=61, dense_layers=(0, 1, 2),
                   dense_hidden=18432, num_heads=128, head_dim=192, norm_eps=1e-6,
                   q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=4096,
                   rope_mscale=1.0, rope_mscale_all_dim=1.0)
    c.moe.update(num_experts=256, top_k=8, expert_hidden=2048, shared_expert_hidden=2048,
                 expert_groups=8, top_groups=4)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/deepseek.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
