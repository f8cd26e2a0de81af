"""Qwen3.5-MoE configs: Qwen3-Next's layers (three Gated DeltaNet linear-attention layers to
every gated softmax attention layer, zero-centered norms, a gated shared expert) with experts in
every layer, the top-k always renormalized, and the linear layers' projections held apart.

  python train.py --config configs/qwen3_5_moe.py:tiny --workdir runs/qwen3_5_moe_tiny

Presets:
  tiny     (default)  the typed defaults' shapes with Qwen3.5-MoE's options: layers 0-2 linear
                      attention (2 key heads of 8 over 4 value heads of 8), layer 3 softmax
                      attention (4 query heads over 2 kv heads, per-head QK-norm, output gate, a
                      quarter of each head rotated), a gated shared expert; trains on CPU.
  35b_a3b             transformers' Qwen3_5MoeTextConfig defaults (its docstring's
                      Qwen/Qwen3.5-35B-A3B): 40 layers, d_model 2048, every fourth softmax
                      attention (16 heads of 256 over 2 kv heads, 64 dims rotated), the others
                      linear (16 key heads of 128, 32 value heads of 128, 4 taps), 256 experts
                      top-8 of width 512 and a shared one of 512, vocab 248320; RoPE base 1e7
                      as the checkpoint has it (the class's default is 1e4). Reads the
                      checkpoint's tokenizer.json (data.tokenizer=init_from): fine-tune with
                      --config.init_from=HF_DIR (its multimodal checkpoint's text model).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "35b_a3b")
PUBLISHED = {"35b_a3b": (35e9, 3e9, "Qwen3.5-35B-A3B: 35B total, 3B activated (its name)")}


def _family(c, layers: int, d_model: int) -> None:
  c.model.update(family="qwen3_5_moe", qk_norm="head", attention_gate=True,
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
  elif preset == "35b_a3b":
    _family(c, 40, 2048)
    c.model.update(vocab_size=248320, num_heads=16, num_kv_heads=2, head_dim=256,
                   rotary_dim=64, rope_theta=1e7, norm_eps=1e-6, linear_key_heads=16, linear_value_heads=32,
                   linear_key_dim=128, linear_value_dim=128)
    c.moe.update(num_experts=256, top_k=8, expert_hidden=512, shared_expert_hidden=512,
                 shared_expert_gate=True, aux_loss_weight=0.001, z_loss_weight=0.0)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/qwen3_5_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
