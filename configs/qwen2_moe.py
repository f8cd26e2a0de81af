"""Qwen2-MoE configs (Qwen1.5-MoE and Qwen2-MoE): grouped-query attention with q/k/v biases, no
QK-norm, softmax top-k without renormalization, and a shared expert scaled by a sigmoid gate.

  python train.py --config configs/qwen2_moe.py:tiny --workdir runs/qwen2_moe_tiny

Presets:
  tiny  (default)  the typed defaults' shapes with Qwen2-MoE's options: 4 query heads over 2 kv
                   heads, qkv biases, a gated shared expert of width 128; trains on CPU.
  a2_7b            Qwen1.5-MoE-A2.7B (Qwen/Qwen1.5-MoE-A2.7B config.json): 24 layers, d_model
                   2048, 16 heads, 60 experts top-4 of width 1408, shared expert 5632, vocab
                   151936; 14.32B total, 2.69B active.
  57b_a14b         Qwen2-57B-A14B (Qwen/Qwen2-57B-A14B config.json): 28 layers, d_model 3584,
                   28 heads over 4 kv heads, 64 experts top-8 of width 2560, shared expert 20480;
                   57.41B total, 14.24B active.
The published presets read the checkpoint's tokenizer.json (data.tokenizer=init_from): fine-tune
with --config.init_from=HF_DIR.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "a2_7b", "57b_a14b")
PUBLISHED = {
    "a2_7b": (14.3e9, 2.7e9, "Qwen1.5-MoE-A2.7B model card and release post: 14.3B total, 2.7B "
                             "activated"),
    "57b_a14b": (57.4e9, 14e9, "Qwen2 Technical Report (Yang et al., 2024), Table 1 and the model "
                               "card: 57B total (57.4B), 14B activated"),
}


def _family(c) -> None:
  c.model.update(family="qwen2_moe", qk_norm="none", qkv_bias=True)
  c.moe.update(shared_expert_gate=True)


def _published(c) -> None:
  c.model.update(vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, head_dim=128)
  c.moe.update(aux_loss_weight=0.001, z_loss_weight=0.0)   # no router z-loss in Qwen2-MoE
  published_fine_tuning(c)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _family(c)
  if preset == "tiny":
    c.model.num_kv_heads = 2
    c.moe.shared_expert_hidden = 128
  elif preset == "a2_7b":
    _published(c)
    c.model.update(d_model=2048, num_layers=24, num_heads=16)
    c.moe.update(num_experts=60, top_k=4, expert_hidden=1408, shared_expert_hidden=5632)
  elif preset == "57b_a14b":
    _published(c)
    c.model.update(d_model=3584, num_layers=28, num_heads=28, num_kv_heads=4)
    c.moe.update(num_experts=64, top_k=8, expert_hidden=2560, shared_expert_hidden=20480)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/qwen2_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
