"""Hugging Face `OlmoeConfig` (config.json) <-> moejax `Config`.

Only what moejax models is carried over; a config that asks for something moejax does not model
(clipped q/k/v, grouped-query attention, tied embeddings, attention biases, scaled RoPE, another
activation) is refused with a message naming the field, rather than converted into a different
model.

  config.json                   moejax
  vocab_size                    model.vocab_size
  hidden_size                   model.d_model
  num_hidden_layers             model.num_layers
  num_attention_heads           model.num_heads
  head_dim (or hidden/heads)    model.head_dim
  rope_theta (or rope_parameters.rope_theta)  model.rope_theta
  rms_norm_eps                  model.norm_eps
  initializer_range             model.init_std
  num_experts                   moe.num_experts
  num_experts_per_tok           moe.top_k
  intermediate_size             moe.expert_hidden
  norm_topk_prob                moe.renormalize
  router_aux_loss_coef          moe.aux_loss_weight
  router_z_loss_coef (if any)   moe.z_loss_weight
"""
from __future__ import annotations

import copy
import dataclasses

from moejax.config import Config, validate
from moejax.errors import CheckpointError, ConfigError

MODEL_TYPE = "olmoe"
ARCHITECTURE = "OlmoeForCausalLM"
DEFAULT_ROPE_THETA = 10000.0   # OlmoeConfig's default when config.json names none


def _get(hf: dict, key: str, kind, where: str, default=None):
  value = hf.get(key, default)
  if value is None:
    raise CheckpointError(f"{where}: field {key!r} is missing")
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
        else isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
  if not ok:
    raise CheckpointError(f"{where}: {key}={value!r} should be {getattr(kind, '__name__', kind)}")
  return float(value) if kind is float else value


def _refuse(where: str, key: str, value, why: str):
  raise CheckpointError(f"{where}: {key}={value!r} is not supported: {why}")


def _rope_theta(hf: dict, where: str) -> float:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling")
  theta = hf.get("rope_theta", DEFAULT_ROPE_THETA)
  if rope is not None:
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, dict):
      _refuse(where, key, rope, "expected a dict with rope_type and rope_theta")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      _refuse(where, f"{key}.rope_type", rope_type, "moejax implements plain (default) RoPE only")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
      _refuse(where, f"{key}.partial_rotary_factor", rope["partial_rotary_factor"],
              "moejax rotates the whole head")
    theta = rope.get("rope_theta", theta)
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
    _refuse(where, "rope_theta", theta, "expected a positive number")
  return float(theta)


def check_supported(hf: dict, where: str = "config.json") -> None:
  """Raises CheckpointError if `hf` is not an OLMoE config moejax can represent exactly."""
  if not isinstance(hf, dict):
    raise CheckpointError(f"{where}: expected a JSON object")
  model_type = hf.get("model_type")
  if model_type != MODEL_TYPE:
    raise CheckpointError(f"{where}: model_type={model_type!r}, but only {MODEL_TYPE!r} "
                          f"({ARCHITECTURE}) checkpoints can be converted")
  heads = _get(hf, "num_attention_heads", int, where)
  kv_heads = hf.get("num_key_value_heads")
  if kv_heads is not None and kv_heads != heads:
    _refuse(where, "num_key_value_heads", kv_heads,
            f"moejax has no grouped-query attention (needs num_key_value_heads == "
            f"num_attention_heads = {heads})")
  if hf.get("clip_qkv") is not None:
    _refuse(where, "clip_qkv", hf["clip_qkv"], "moejax does not clip q/k/v (needs null)")
  if hf.get("tie_word_embeddings", False):
    _refuse(where, "tie_word_embeddings", hf["tie_word_embeddings"],
            "moejax keeps a separate lm_head (needs false)")
  if hf.get("attention_bias", False):
    _refuse(where, "attention_bias", hf["attention_bias"],
            "moejax attention projections have no bias (needs false)")
  if hf.get("hidden_act", "silu") != "silu":
    _refuse(where, "hidden_act", hf["hidden_act"], "moejax experts are SwiGLU (needs 'silu')")
  hidden = _get(hf, "hidden_size", int, where)
  head_dim = hf.get("head_dim")
  if head_dim is not None and head_dim * heads != hidden:
    _refuse(where, "head_dim", head_dim,
            f"OLMoE normalizes q over hidden_size={hidden}, so num_attention_heads * head_dim "
            f"must equal it ({heads} * {head_dim} = {heads * head_dim})")
  if head_dim is None and hidden % heads:
    _refuse(where, "hidden_size", hidden, f"not divisible by num_attention_heads={heads}")
  _rope_theta(hf, where)


def config_from_hf(hf: dict, base: Config | None = None, where: str = "config.json") -> Config:
  """The moejax `Config` of an OLMoE config.json; fields moejax does not take from it come from
  `base` (default: `Config()`)."""
  check_supported(hf, where)
  base = Config() if base is None else base
  heads = _get(hf, "num_attention_heads", int, where)
  hidden = _get(hf, "hidden_size", int, where)
  model = dataclasses.replace(
      base.model,
      vocab_size=_get(hf, "vocab_size", int, where),
      d_model=hidden,
      num_layers=_get(hf, "num_hidden_layers", int, where),
      num_heads=heads,
      head_dim=hf.get("head_dim") or hidden // heads,
      rope_theta=_rope_theta(hf, where),
      norm_eps=_get(hf, "rms_norm_eps", float, where, 1e-5),
      init_std=_get(hf, "initializer_range", float, where, base.model.init_std))
  moe = dataclasses.replace(
      base.moe,
      num_experts=_get(hf, "num_experts", int, where, hf.get("num_local_experts")),
      top_k=_get(hf, "num_experts_per_tok", int, where),
      expert_hidden=_get(hf, "intermediate_size", int, where),
      score="softmax",
      renormalize=_get(hf, "norm_topk_prob", bool, where, False),
      aux_loss_weight=_get(hf, "router_aux_loss_coef", float, where, base.moe.aux_loss_weight),
      z_loss_weight=_get(hf, "router_z_loss_coef", float, where, base.moe.z_loss_weight))
  cfg = dataclasses.replace(base, model=model, moe=moe)
  try:
    validate(cfg)
  except ConfigError as e:
    raise CheckpointError(f"{where}: gives an invalid moejax config: {e}") from None
  return cfg


def hf_config_from(cfg: Config, base: dict | None = None, *, dtype: str = "float32") -> dict:
  """An OLMoE config.json for `cfg`. Fields moejax does not model (token ids, maximum length)
  come from `base`, e.g. the config.json the parameters were imported from."""
  m, moe = cfg.model, cfg.moe
  if moe.score != "softmax":
    raise CheckpointError(f"config.moe.score={moe.score!r}: OLMoE routes with a softmax; "
                          "a sigmoid router has no Hugging Face OLMoE equivalent")
  if m.num_heads * m.head_dim != m.d_model:
    raise CheckpointError(
        f"config.model.num_heads * head_dim = {m.num_heads * m.head_dim} differs from d_model="
        f"{m.d_model}; Hugging Face OLMoE normalizes q over hidden_size and needs them equal")
  hf = copy.deepcopy(base) if base else {
      "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
      "max_position_embeddings": 4096, "use_cache": True}
  for stale in ("torch_dtype", "dtype", "transformers_version", "head_dim"):
    hf.pop(stale, None)
  hf.update({
      "architectures": [ARCHITECTURE],
      "model_type": MODEL_TYPE,
      "vocab_size": m.vocab_size,
      "hidden_size": m.d_model,
      "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_heads,
      "rope_theta": m.rope_theta,
      "rms_norm_eps": m.norm_eps,
      "initializer_range": m.init_std,
      "num_experts": moe.num_experts,
      "num_experts_per_tok": moe.top_k,
      "intermediate_size": moe.expert_hidden,
      "norm_topk_prob": moe.renormalize,
      "router_aux_loss_coef": moe.aux_loss_weight,
      "router_z_loss_coef": moe.z_loss_weight,
      "hidden_act": "silu",
      "attention_bias": False,
      "attention_dropout": hf.get("attention_dropout", 0.0),
      "clip_qkv": None,
      "tie_word_embeddings": False,
      "output_router_logits": hf.get("output_router_logits", False),
  })
  # transformers >= 5 writes "dtype"; older versions, and the Hub's configs, "torch_dtype".
  hf["dtype" if base and "dtype" in base else "torch_dtype"] = dtype
  if isinstance(hf.get("rope_parameters"), dict):
    hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": m.rope_theta}
  else:
    hf.pop("rope_parameters", None)
    hf["rope_scaling"] = None
  return dict(sorted(hf.items()))
