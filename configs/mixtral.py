"""Mixtral configs: grouped-query attention without QK-norm, softmax top-2 renormalized.

  python train.py --config configs/mixtral.py:tiny --workdir runs/mixtral_tiny

Presets:
  tiny  (default)  the typed defaults' shapes (2 layers, d_model 64, 8 experts top-2) with
                   Mixtral's options: 4 query heads over 2 kv heads, no QK-norm; trains on CPU.
  8x7b             Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, d_model
                   4096, 32 heads over 8 kv heads, 8 experts top-2 of width 14336, vocab 32000;
                   46.70B total, 12.88B active. Tokens come from the checkpoint's tokenizer.json
                   (data.tokenizer=init_from): fine-tune with --config.init_from=HF_DIR.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "8x7b")
# Published (total, active) parameters and where the figures come from.
PUBLISHED = {"8x7b": (46.7e9, 12.9e9, "Mixtral of Experts (Jiang et al., 2024), Sec. 2: 47B "
                                      "total, 13B active; Mistral AI's release: 46.7B / 12.9B")}


def _family(c) -> None:
  c.model.update(family="mixtral", qk_norm="none")
  c.moe.update(renormalize=True)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _family(c)
  if preset == "tiny":
    c.model.num_kv_heads = 2
  elif preset == "8x7b":
    c.model.update(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, rope_theta=1e6)
    # Mixtral trains with no router z-loss.
    c.moe.update(num_experts=8, top_k=2, expert_hidden=14336, aux_loss_weight=0.02,
                 z_loss_weight=0.0)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/mixtral.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
