"""Qwen3-MoE configs: grouped-query attention with per-head QK-norm, no biases, softmax top-k
renormalized, no shared expert.

  python train.py --config configs/qwen3_moe.py:tiny --workdir runs/qwen3_moe_tiny

Presets:
  tiny  (default)  the typed defaults' shapes with Qwen3-MoE's options: 4 query heads over 2 kv
                   heads, QK-norm per head, top-k renormalized; trains on CPU.
  30b_a3b          Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, d_model 2048, 32
                   heads of width 128 over 4 kv heads, 128 experts top-8 of width 768, vocab
                   151936; 30.53B total, 3.35B active. Reads the checkpoint's tokenizer.json
                   (data.tokenizer=init_from): fine-tune with --config.init_from=HF_DIR.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "30b_a3b")
PUBLISHED = {"30b_a3b": (30.5e9, 3.3e9, "Qwen3-30B-A3B model card: 30.5B total, 3.3B "
                                        "activated")}


def _family(c) -> None:
  c.model.update(family="qwen3_moe", qk_norm="head")
  c.moe.update(renormalize=True)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _family(c)
  if preset == "tiny":
    c.model.num_kv_heads = 2
  elif preset == "30b_a3b":
    c.model.update(vocab_size=151936, d_model=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                   head_dim=128, rope_theta=1e6, norm_eps=1e-6)
    c.moe.update(num_experts=128, top_k=8, expert_hidden=768, aux_loss_weight=0.001,
                 z_loss_weight=0.0)   # Qwen3-MoE trains with no router z-loss
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/qwen3_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
