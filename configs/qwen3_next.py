"""Qwen3-Next configs: three Gated DeltaNet linear-attention layers to every softmax attention
layer, whose output is gated and a quarter of each head rotated; zero-centered norms;
softmax top-k renormalized over many small experts beside a gated shared expert.

  python train.py --config configs/qwen3_next.py:tiny --workdir runs/qwen3_next_tiny

Presets:
  tiny     (default)  the typed defaults' shapes with Qwen3-Next's options: layers 0-2 linear
                      attention (2 key heads of 8 over 4 value heads of 8), layer 3 softmax
                      attention (4 query heads over 2 kv heads, per-head QK-norm, output gate, a
                      quarter of each head rotated), a gated shared expert; trains on CPU.
  80b_a3b             Qwen3-Next-80B-A3B (Qwen/Qwen3-Next-80B-A3B-Instruct config.json): 48
                      layers, d_model 2048, every fourth softmax attention (16 heads of 256 over 2
                      kv heads, 64 dims rotated, base 1e7), the others linear (16 key heads of 128,
                      32 value heads of 128, 4 taps), 512 experts top-10 of width 512 and a shared
                      one of 512, vocab 151936. Reads the checkpoint's tokenizer.json
                      (data.tokenizer=init_from): fine-tune with --config.init_from=HF_DIR.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "80b_a3b")
PUBLISHED = {"80b_a3b": (80e9, 3e9, "Qwen3-Next-80B-A3B model card: 80B total, 3B activated")}


def _family(c, layers: int, d_model: int) -> None:
  c.model.update(family="qwen3_next", qk_norm="head", attention_gate=True,
                 norm_kind="rms_zero_centered", num_layers=layers, d_model=d_model,
                 linear_layers=tuple(i for i in range(layers) if (i + 1) % 4))
  c.moe.update(renormalize=True)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  if preset == "tiny":
    _family(c, 4, c.model.d_model)
    c.model.update(num_kv_heads=2, rotary_dim=4, linear_key_heads=2, linear_value_heads=4,
                   linear_key_dim=8, linear_value_dim=8)
    c.moe.update(shared_expert_hidden=32, shared_expert_gate=True)
  elif preset == "80b_a3b":
    _family(c, 48, 2048)
    c.model.update(vocab_size=151936, num_heads=16, num_kv_heads=2, head_dim=256,
                   rotary_dim=64, rope_theta=1e7, norm_eps=1e-6, linear_key_heads=16,
                   linear_value_heads=32, linear_key_dim=128, linear_value_dim=128)
    c.moe.update(num_experts=512, top_k=10, expert_hidden=512, shared_expert_hidden=512,
                 shared_expert_gate=True, aux_loss_weight=0.001, z_loss_weight=0.0)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/qwen3_next.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
