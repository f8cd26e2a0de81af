"""MiniCPM5-MoE configs (Hugging Face minicpm5_moe): grouped-query attention whose output is
scaled by a sigmoid gate of the token (the q projection holds each head's query and gate), no
QK-norm, whole heads rotated; GLM-4.5's MoE: leading dense layers, a shared expert beside
fine-grained routed ones, sigmoid scores with a selection-only score bias, renormalized top-k,
routed scaling.

  python train.py --config configs/minicpm5_moe.py:tiny --workdir runs/minicpm5_tiny

Presets:
  tiny  (default)  MiniCPM5-MoE's options at CPU size: 3 layers (the first dense), d_model 64,
                   4 heads of 16 with 2 kv heads, gated, 8 experts top-2, one shared expert,
                   sigmoid scores renormalized and scaled by 3.66, score bias rate 1e-3.
  15b_a2b          MiniCPM5-15B-A2.5B (transformers' MiniCPM5MoeConfig defaults, which are the
                   published checkpoint's): 28 layers, the first dense (8192), d_model 2048, 32
                   gated heads of 128 with 2 kv heads (theta 5e6), 1 shared + 160 routed experts
                   top-16 of width 512, routed scaling 3.66, vocab 130560; 14.99B total, 2.50B
                   active without the input embedding.

15b_a2b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "15b_a2b")
# Published (total, active) parameters and where the figures come from; the active figure
# leaves the input embedding out (2.50B without it, 2.77B with it).
PUBLISHED = {
    "15b_a2b": (15e9, 2.5e9, "MiniCPM5-15B-A2.5B (openbmb): a 15B MoE with 2.5B active"),
}


def _minicpm5_options(c) -> None:
  c.model.update(family="minicpm5_moe", qk_norm="none", attention_gate=True, norm_eps=1e-6,
                 rope_theta=5e6)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=3.66, aux_loss_weight=0.0, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _minicpm5_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, num_kv_heads=2)
    c.moe.update(shared_expert_hidden=64)
  elif preset == "15b_a2b":
    c.model.update(vocab_size=130560, d_model=2048, num_layers=28, dense_layers=(0,),
                   dense_hidden=8192, num_heads=32, num_kv_heads=2, head_dim=128)
    c.moe.update(num_experts=160, top_k=16, expert_hidden=512, shared_expert_hidden=512)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/minicpm5_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
