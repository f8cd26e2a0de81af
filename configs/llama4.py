"""Llama 4 configs (Hugging Face llama4 / llama4_text; Meta's Llama 4 Scout and Maverick, their
text model): grouped-query attention in which three layers of four rotate q and k (neighbour
pairs; Scout's scaled by Llama 3's rule) and attend within 8192-token chunks (model.chunked_layers), the
fourth unrotated over the whole sequence with its queries' temperature rising with the position
(model.nope_temperature); Scout normalizes the rotated q and k per head without a scale
(model.qk_norm "l2"). Every MoE layer has a shared expert beside one routed expert of a sigmoid
router, whose weight scales the token going into the expert (moe.weights_on_input); Maverick
alternates dense and MoE layers.

  python train.py --config configs/llama4.py:tiny --workdir runs/llama4_tiny

Presets:
  tiny  (default)  Llama 4's options at CPU size: 4 layers (0 and 2 dense, 1 and 3 MoE; 3
                   unrotated with the temperature, the others chunked within 16 tokens),
                   d_model 64, 4 heads of 16 with 2 kv heads, QK-norm "l2", Llama 3 RoPE scaling
                   x4 from 32 tokens, 8 experts top-1 and a shared expert.
  scout            Llama-4-Scout-17B-16E: 48 layers, d 5120, 40 / 8 kv heads of 128, chunks of
                   8192, every 4th layer unrotated, 16 experts top-1 (8192) and a shared expert
                   in every layer, RoPE scaled x8 (Llama 3's), vocabulary 202048.
  maverick         Llama-4-Maverick-17B-128E: the same with 128 experts in every other layer
                   (the others dense, 16384), no QK-norm and no RoPE scaling.

The published checkpoints are Llama4ForConditionalGeneration: import reads their text model
(language_model.*) and leaves the vision encoder; exports are Llama4ForCausalLM. The published
presets take tokens from the checkpoint's tokenizer.json (data.tokenizer=init_from): fine-tune
with --config.init_from=HF_DIR, or convert once with
`python -m moejax.convert from-hf HF_DIR CKPT_DIR`.

Each preset sets only what differs from the typed defaults in moejax/config.py.
"""
import ml_collections

from moejax.config import default_config_dict, published_fine_tuning

PRESETS = ("tiny", "scout", "maverick")
# Meta's counts include the vision encoder moejax does not hold (about 0.9B): Maverick's text
# model alone still reads as "400B / 17B"; Scout's 107.8B text model is below its "109B" (the
# README's family table gives both).
PUBLISHED = {
    "maverick": (400e9, 17e9, "Llama 4 model card (Meta, 2025): Llama 4 Maverick, 17B active, "
                 "400B total parameters")}


def _layers(num_layers: int, every: int = 4) -> tuple[tuple, tuple]:
  """(rotated and chunked, unrotated) layers: every `every`-th from layer every - 1 unrotated
  (transformers' no_rope_layer_interval)."""
  nope = tuple(range(every - 1, num_layers, every))
  return tuple(i for i in range(num_layers) if i not in nope), nope


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  preset = arg or "tiny"
  c = default_config_dict()
  c.model.update(family="llama4", qk_norm="l2", rotary_interleaved=True, rope_theta=500000.0,
                 nope_temperature=0.1)
  c.moe.update(top_k=1, score="sigmoid", weights_on_input=True, aux_loss_weight=0.001,
               z_loss_weight=0.0)
  if preset == "tiny":
    chunked, nope = _layers(4)
    c.model.update(num_layers=4, num_kv_heads=2, dense_layers=(0, 2), dense_hidden=128,
                   attention_chunk=16, chunked_layers=chunked, nope_layers=nope,
                   nope_temperature_floor=8, rope_scaling="llama3", rope_factor=4.0,
                   rope_original_max_len=32)
    c.moe.update(shared_expert_hidden=64)
  elif preset in ("scout", "maverick"):
    chunked, nope = _layers(48)
    c.model.update(vocab_size=202048, d_model=5120, num_layers=48, num_heads=40,
                   num_kv_heads=8, head_dim=128, attention_chunk=8192, chunked_layers=chunked,
                   nope_layers=nope, nope_temperature_floor=8192)
    c.moe.update(expert_hidden=8192, shared_expert_hidden=8192)
    if preset == "scout":
      c.model.update(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=8192,
                     rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)
      c.moe.update(num_experts=16)
    else:
      c.model.update(qk_norm="none", dense_layers=tuple(range(0, 48, 2)), dense_hidden=16384)
      c.moe.update(num_experts=128)
    published_fine_tuning(c)
  else:
    raise ValueError(f"unknown preset {preset!r} for configs/llama4.py (valid: "
                     f"{', '.join(PRESETS)})")
  return c
