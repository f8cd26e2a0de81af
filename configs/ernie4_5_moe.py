"""ERNIE-4.5 MoE configs (Hugging Face ernie4_5_moe): grouped-query attention whose rotary dims
pair up as neighbours, a leading dense layer, two shared experts beside fine-grained routed ones,
softmax scores with a selection-only score bias, renormalized; tied embeddings.

  python train.py --config configs/ernie4_5_moe.py:tiny --workdir runs/ernie_tiny

Presets:
  tiny  (default)  ERNIE-4.5's options at CPU size: 3 layers (the first dense), d_model 64, 4
                   heads of 16 over 2 kv heads, neighbour-pair rotary, 8 experts top-2, two shared
                   experts, softmax scores with a score bias (rate 1e-3), renormalized, tied
                   embeddings.
  a3b              ERNIE-4.5-21B-A3B (baidu/ERNIE-4.5-21B-A3B-PT; transformers'
                   Ernie4_5_MoeConfig defaults): 28 layers, the first dense (12288), d_model 2560,
                   20 heads of 128 over 4 kv heads, 2 shared + 64 routed experts top-6 of width
                   1536, RoPE base 5e5, vocab 103424, tied; 21.83B total, 3.35B active
                   (published "21B" / "3B").

a3b keeps the fine-tuning settings the published presets share
(`moejax.config.published_fine_tuning`).

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "a3b")
PUBLISHED = {
    "a3b": (21e9, 3e9, "ERNIE 4.5 model card (baidu/ERNIE-4.5-21B-A3B-PT): 21B total, 3B "
                       "activated per token"),
}


def _ernie_options(c) -> None:
  c.model.update(family="ernie4_5_moe", qk_norm="none", rotary_interleaved=True,
                 tie_embeddings=True)
  c.moe.update(score="softmax", renormalize=True, score_bias=True, score_bias_rate=1e-3,
               aux_loss_weight=0.001, z_loss_weight=0.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  _ernie_options(c)
  if preset == "tiny":
    c.model.update(num_layers=3, dense_layers=(0,), dense_hidden=128, num_kv_heads=2)
    c.moe.update(shared_expert_hidden=2 * 64)
  elif preset == "a3b":
    c.model.update(vocab_size=103424, d_model=2560, num_layers=28, dense_layers=(0,),
                   dense_hidden=12288, num_heads=20, num_kv_heads=4, head_dim=128,
                   rope_theta=5e5)
    c.moe.update(num_experts=64, top_k=6, expert_hidden=1536, shared_expert_hidden=2 * 1536)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/ernie4_5_moe.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
