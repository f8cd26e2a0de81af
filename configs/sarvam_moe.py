"""Sarvam-MoE configs (Hugging Face sarvam_moe, Sarvam AI's sarvam-30b): GLM-4.5's architecture
(transformers runs it as Glm4MoeForCausalLM) with whole heads rotated and per-head QK-norm: a
leading dense layer, one shared expert beside fine-grained routed ones, sigmoid scores with a
selection-only score bias, renormalized top-k, routed scaling. Its published checkpoint names
the tensors its own way (q/k/v fused in attention.query_key_value, word_embeddings), read and
written by `moejax.convert`.

  python train.py --config configs/sarvam_moe.py:tiny --workdir runs/sarvam_tiny

Presets:
  tiny  (default)  Sarvam-MoE's options at CPU size: 3 layers (the first dense), d_model 64, 4
                   heads of 16 with 2 kv heads, per-head QK-norm, 8 experts top-2, one shared
                   expert, sigmoid scores renormalized and scaled by 2.5, score bias rate 1e-3.
  30b              transformers' SarvamMoEConfig defaults (its docstring's sarvamai/sarvam-30b):
                   19 layers, the first dense (8192), d_model 4096, 64 heads of 64 with 4 kv
                   heads (theta 8e6), 1 shared + 128 routed experts top-6 of width 1024, routed
                   scaling 2.5, vocab 262144; moejax counts 32.15B total, 4.52B active (3.45B
                   without the input embedding).

30b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`: --config.init_from=HF_DIR reads the checkpoint's
tokenizer.json).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "30b")
# No published parameter counts to check against: the preset is transformers' config default.
PUBLISHED = {}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="sarvam_moe", qk_norm="head", norm_eps=1e-6, rope_theta=8e6)
  c.moe.update(score="sigmoid", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               routed_scale=2.5, aux_loss_weight=0.0, z_loss_weight=0.0)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, num_kv_heads=2)
    c.moe.update(shared_expert_hidden=64)
  elif preset == "30b":
    c.model.update(vocab_size=262144, d_model=4096, num_layers=19, dense_layers=(0,),
                   dense_hidden=8192, num_heads=64, num_kv_heads=4, head_dim=64,
                   init_std=0.006)
    c.moe.update(num_experts=128, top_k=6, expert_hidden=1024, shared_expert_hidden=1024)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/sarvam_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
