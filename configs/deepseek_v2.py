"""DeepSeek-V2 configs: multi-head latent attention, leading dense layers, shared experts beside
fine-grained routed ones; a softmax router, greedy top-k or limited to the best expert groups
(each group scored by its best expert), routed scaling, no renormalization; YaRN RoPE.

  python train.py --config configs/deepseek_v2.py:tiny --workdir runs/deepseek_v2_tiny

Presets:
  tiny  (default)  DeepSeek-V2's options at CPU size: 3 layers (the first dense), d_model 64, 4
                   heads of latent attention (no q latent, kv latent 32, head 16 + 8 rotary,
                   values 16), 8 experts top-2 in 4 groups of which 2 are used (scored by their
                   best), two shared experts, softmax scores scaled by 2.
  lite             DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json): 27 layers, the
                   first dense (10944), d_model 2048, 16 heads of latent attention (no q latent,
                   kv latent 512, 128 + 64 rotary, values 128), 2 shared + 64 routed experts
                   top-6 of width 1408, greedy, vocab 102400, YaRN (factor 40 over 4096
                   positions, mscale and mscale_all_dim 0.707); 15.71B total, 2.66B active
                   counting the embedding (DeepSeek's 2.4B leaves it out).
  v2               DeepSeek-V2 (deepseek-ai/DeepSeek-V2 config.json): 60 layers, the first dense
                   (12288), d_model 5120, 128 heads of latent attention (q latent 1536, kv latent
                   512, 128 + 64 rotary, values 128), 2 shared + 160 routed experts top-6 of
                   width 1536 in 8 groups of which 3 are used, routed scaling 16, vocab 102400,
                   the same YaRN; 235.7B total, 21.4B active.

lite and v2 keep the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json); their router's auxiliary loss weight is the published aux_loss_alpha (0.001;
moejax's balance loss is over the batch, DeepSeek-V2's per sequence).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "lite", "v2")
# Published (total, active) parameters and where the figures come from. DeepSeek counts V2-Lite's
# active parameters without the input embedding (2.66B - 0.21B = 2.45B, "2.4B"; the test reads
# it so), V2's with it.
PUBLISHED = {
    "lite": (15.7e9, 2.4e9, "DeepSeek-V2 (DeepSeek-AI, 2024), Appendix B: 15.7B total, 2.4B "
                            "activated"),
    "v2": (236e9, 21e9, "DeepSeek-V2 (DeepSeek-AI, 2024), abstract: 236B total, 21B activated "
                        "per token"),
}
_YARN = dict(rope_scaling="yarn", rope_factor=40.0, rope_original_max_len=4096,
             rope_mscale=0.707, rope_mscale_all_dim=0.707)


def _v2_options(c) -> None:
  c.model.update(family="deepseek_v2", qk_norm="none")
  c.moe.update(score="softmax", renormalize=False, group_score="max", z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _v2_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, head_dim=24,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    c.moe.update(expert_groups=4, top_groups=2, shared_expert_hidden=2 * 64, routed_scale=2.0)
  elif preset == "lite":
    c.model.update(vocab_size=102400, d_model=2048, num_layers=27, dense_layers=(0,),
                   dense_hidden=10944, num_heads=16, head_dim=192, norm_eps=1e-6,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   **_YARN)
    c.moe.update(num_experts=64, top_k=6, expert_hidden=1408, shared_expert_hidden=2 * 1408,
                 aux_loss_weight=0.001)
    published_fine_tuning(c)
  elif preset == "v2":
    c.model.update(vocab_size=102400, d_model=5120, num_layers=60, dense_layers=(0,),
                   dense_hidden=12288, num_heads=128, head_dim=192, norm_eps=1e-6,
                   q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, **_YARN)
    c.moe.update(num_experts=160, top_k=6, expert_hidden=1536, shared_expert_hidden=2 * 1536,
                 expert_groups=8, top_groups=3, routed_scale=16.0, aux_loss_weight=0.003)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/deepseek_v2.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
