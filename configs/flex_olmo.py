"""FlexOlmo configs (Hugging Face flex_olmo, AllenAI's FlexOlmo): OLMo 2's layer (the two norms
on each sublayer's output before it joins the residual stream, model.norm_position "post";
QK-norm over all heads' width) with OLMoE's experts: softmax top-k, not renormalized.

  python train.py --config configs/flex_olmo.py:tiny --workdir runs/flex_olmo_tiny

Presets:
  tiny  (default)  FlexOlmo's options at CPU size: 2 layers, d_model 64, 4 heads of 16, post
                   norms, QK-norm over all heads, 8 experts top-2, not renormalized.
  7x7b             transformers' FlexOlmoConfig defaults (its docstring's
                   allenai/FlexOlmo-7x7B-1T): 32 layers, d_model 4096, 32 heads of 128 (theta
                   5e5), 7 experts top-5 of width 11008, vocab 100352; moejax counts 33.27B
                   total, 24.61B active (no published count is checked).

7x7b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "7x7b")
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="flex_olmo", qk_norm="full", norm_position="post", norm_eps=1e-6,
                 rope_theta=5e5)
  c.moe.update(renormalize=False, aux_loss_weight=0.01, z_loss_weight=0.0)
  if preset == "tiny":
    pass
  elif preset == "7x7b":
    c.model.update(vocab_size=100352, d_model=4096, num_layers=32, num_heads=32, head_dim=128)
    c.moe.update(num_experts=7, top_k=5, expert_hidden=11008)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/flex_olmo.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
