"""Typed, validated configuration.

Config files (`configs/*.py`) return an `ml_collections.ConfigDict`; `from_config_dict` turns it
into the frozen dataclasses below at the boundary, so the library never reads a ConfigDict. Every
check lives here and raises `ConfigError` naming the field, the value and what would be valid.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from moejax.errors import ConfigError

PLACEMENTS = ("fsdp", "ep", "fssdp")
ADMISSIONS = ("none", "strict", "reroute")
SCORES = ("softmax", "sigmoid")
DATA_SOURCES = ("builtin", "text", "jsonl")
CODEC_MODES = ("off", "block", "element", "word", "delta", "auto")
CODEC_COMM_MODELS = ("profile", "bytes")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 320
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  head_dim: int = 16
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  init_std: float = 0.02


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  expert_hidden: int = 64
  score: str = "softmax"
  renormalize: bool = False
  aux_loss_weight: float = 0.01
  z_loss_weight: float = 0.001
  placement: str = "fsdp"
  # 0 = dropless (static worst-case buffers); > 0: per-destination buffer of
  # ceil(capacity_factor * assignments / devices) tokens, overflow dropped and counted.
  capacity_factor: float = 0.0


@dataclasses.dataclass(frozen=True)
class FssdpConfig:
  """moe.placement='fssdp': owners plus this step's replicas of hot experts."""
  replica_slots: int = 2      # M: replica slots per device per layer
  overlap_degree: int = 4     # t: distinct experts materialized per layer and step
  window: int = 5             # load predictor: mean of the last `window` steps
  reshard_every: int = 100    # re-shard owners (parameters + optimizer state move); 0 = never
  # C: the most experts of one layer a device may own after re-sharding (a static buffer);
  # 0 = min(E, 2 * E/N); E/N keeps every layer's counts equal.
  max_per_layer: int = 0
  calibrate: bool = True      # re-plan from the actual loads after gating when it pays


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  admission: str = "none"
  threshold: float = -1.0
  capacity_factor: float = 1.25
  capacity_factor_warmup: float = 2.0
  warmup_steps: int = 0
  locality_weight: float = 0.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: str = "builtin"
  path: str = ""
  tokenizer: str = "bytes"
  val_fraction: float = 0.05


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 3e-3
  min_lr_ratio: float = 0.1
  warmup_steps: int = 10
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  # (nodes, devices per node); -1 fills in the rest of the devices. Devices of one node share a
  # fast interconnect; placement and dispatch use this to prefer intra-node traffic.
  shape: tuple = (1, -1)


@dataclasses.dataclass(frozen=True)
class CodecConfig:
  # off | block | element | word | delta: every sharded parameter in that mode (moejax.codec);
  # auto: a mode per parameter (or plain), chosen and re-chosen from measured change rates.
  mode: str = "off"
  block_size: int = 512
  warmup_steps: int = 30          # gathers that send everything while caches fill
  detect: str = "exact"           # exact | hash (block mode: 128-bit block hashes, less memory)
  capacity_fraction: float = 0.0  # patch capacity as a fraction of a shard; 0 = mode default
  # A fixed mode only where it pays (benefit vs cost), capacities sized from measured rates;
  # always on for auto (moejax.train.codec_control).
  select: bool = False
  delta_bits: int = 3             # delta mode: code bits per value (2, 3 or 4)
  cache_budget_bytes: int = 0     # codec state per device of the selected parameters; 0 = no limit
  reselect_every: int = 0         # steps between re-decisions from live rates; 0 = decide once
  capacity_margin: float = 1.25   # selected capacity = worst device's change rate x margin
  comm_model: str = "profile"     # gain in seconds from a profile of the mesh | "bytes" saved

  @property
  def controlled(self) -> bool:
    """Parameters and capacities are chosen at run time from measurements (plain until then)."""
    return self.mode == "auto" or (self.select and self.mode != "off")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  # Saves go to WORKDIR/checkpoints (moejax.train.checkpoint); a rerun resumes from the latest.
  every: int = 0          # save every N steps; 0 = only at the end (the last step always saves)
  keep: int = 3           # how many of the latest checkpoints to keep


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  moe: MoEConfig = MoEConfig()
  routing: RoutingConfig = RoutingConfig()
  fssdp: FssdpConfig = FssdpConfig()
  data: DataConfig = DataConfig()
  optim: OptimConfig = OptimConfig()
  mesh: MeshConfig = MeshConfig()
  codec: CodecConfig = CodecConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  steps: int = 200
  batch_size: int = 16
  seq_len: int = 64
  seed: int = 0
  log_every: int = 10
  eval_every: int = 50
  eval_batches: int = 4
  remat: bool = True
  # Start from these weights (a Hugging Face OLMoE directory, or a moejax checkpoint / from-hf
  # output) instead of a random init, when the workdir has no checkpoint to resume.
  init_from: str = ""
  # Issue layer i+1's parameter gather before layer i's compute (see moejax.sharding.prefetch).
  prefetch: bool = True


def _type_name(tp) -> str:
  return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp, path: str):
  """Checks one leaf value against the annotated type, allowing int -> float."""
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"config.{path}={value!r}: expected a number")
    return float(value)
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"config.{path}={value!r}: expected an integer")
    return value
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"config.{path}={value!r}: expected true or false")
    return value
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"config.{path}={value!r}: expected a string")
    return value
  if tp is tuple:
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value):
      raise ConfigError(f"config.{path}={value!r}: expected a tuple of integers")
    return tuple(value)
  raise TypeError(f"unsupported config type {_type_name(tp)} at {path}")


def _build(cls, cd, prefix: str):
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  keys = set(cd.keys())
  unknown = sorted(keys - fields)
  if unknown:
    raise ConfigError(f"unknown config field config.{prefix}{unknown[0]} "
                      f"(valid: {', '.join(sorted(fields))})")
  kwargs = {}
  for name in fields & keys:
    tp, value = hints[name], cd[name]
    if dataclasses.is_dataclass(tp):
      if not hasattr(value, "keys"):
        raise ConfigError(f"config.{prefix}{name} must be a group of fields, got {value!r}")
      kwargs[name] = _build(tp, value, f"{prefix}{name}.")
    else:
      kwargs[name] = _convert(value, tp, prefix + name)
  return cls(**kwargs)


def from_config_dict(cd) -> Config:
  """ConfigDict (or nested dict) -> validated `Config`."""
  config = _build(Config, cd, "")
  validate(config)
  return config


def _check(ok: bool, message: str):
  if not ok:
    raise ConfigError(message)


def _choice(value: str, field: str, valid: tuple):
  _check(value in valid, f"config.{field}={value!r}: must be one of {', '.join(valid)}")


def validate(c: Config) -> None:
  """Cross-field checks that do not need devices (mesh checks live in sharding.mesh)."""
  m, moe = c.model, c.moe
  for field, value in [("model.vocab_size", m.vocab_size), ("model.d_model", m.d_model),
                       ("model.num_layers", m.num_layers), ("model.num_heads", m.num_heads),
                       ("model.head_dim", m.head_dim), ("moe.num_experts", moe.num_experts),
                       ("moe.top_k", moe.top_k), ("moe.expert_hidden", moe.expert_hidden),
                       ("steps", c.steps), ("batch_size", c.batch_size), ("seq_len", c.seq_len),
                       ("log_every", c.log_every), ("eval_every", c.eval_every),
                       ("eval_batches", c.eval_batches), ("checkpoint.keep", c.checkpoint.keep),
                       ("codec.block_size", c.codec.block_size)]:
    _check(value > 0, f"config.{field}={value}: must be positive")
  _check(m.head_dim % 2 == 0, f"config.model.head_dim={m.head_dim}: must be even (rotary)")
  _check(moe.top_k <= moe.num_experts,
         f"config.moe.top_k={moe.top_k}: must be at most moe.num_experts={moe.num_experts}")
  _choice(moe.placement, "moe.placement", PLACEMENTS)
  for field in ("replica_slots", "overlap_degree", "window"):
    value = getattr(c.fssdp, field)
    _check(value > 0, f"config.fssdp.{field}={value}: must be positive")
  _check(c.fssdp.reshard_every >= 0,
         f"config.fssdp.reshard_every={c.fssdp.reshard_every}: must be >= 0 (0 = never)")
  _check(0 <= c.fssdp.max_per_layer <= moe.num_experts,
         f"config.fssdp.max_per_layer={c.fssdp.max_per_layer}: must be in [0, "
         f"moe.num_experts={moe.num_experts}] (0 = default)")
  _choice(moe.score, "moe.score", SCORES)
  _check(moe.capacity_factor >= 0,
         f"config.moe.capacity_factor={moe.capacity_factor}: must be >= 0 (0 = dropless)")
  _choice(c.routing.admission, "routing.admission", ADMISSIONS)
  _check(-1.0 <= c.routing.threshold <= 1.0,
         f"config.routing.threshold={c.routing.threshold}: a cosine similarity, in [-1, 1]")
  for field in ("capacity_factor", "capacity_factor_warmup"):
    value = getattr(c.routing, field)
    _check(value > 0, f"config.routing.{field}={value}: must be positive")
  _check(c.routing.locality_weight >= 0,
         f"config.routing.locality_weight={c.routing.locality_weight}: must be >= 0")
  _choice(c.data.source, "data.source", DATA_SOURCES)
  _check(c.data.source == "builtin" or bool(c.data.path),
         f"config.data.path is empty: data.source={c.data.source!r} needs a file path")
  _check(0.0 < c.data.val_fraction < 0.5,
         f"config.data.val_fraction={c.data.val_fraction}: must be in (0, 0.5)")
  o = c.optim
  _check(o.lr > 0, f"config.optim.lr={o.lr}: must be positive")
  _check(0 <= o.min_lr_ratio <= 1, f"config.optim.min_lr_ratio={o.min_lr_ratio}: must be in [0, 1]")
  _check(o.warmup_steps >= 0, f"config.optim.warmup_steps={o.warmup_steps}: must be >= 0")
  _check(o.clip_norm >= 0, f"config.optim.clip_norm={o.clip_norm}: must be >= 0 (0 = off)")
  _check(len(c.mesh.shape) == 2 and c.mesh.shape.count(-1) <= 1
         and all(s == -1 or s > 0 for s in c.mesh.shape),
         f"config.mesh.shape={c.mesh.shape}: must be (nodes, devices_per_node), "
         "positive, with at most one -1")
  _choice(c.codec.mode, "codec.mode", CODEC_MODES)
  _choice(c.codec.detect, "codec.detect", ("exact", "hash"))
  _check(c.codec.detect == "exact" or c.codec.mode in ("block", "auto"),
         f"config.codec.detect={c.codec.detect!r} needs codec.mode='block' or 'auto' (hashes "
         "tell which blocks changed, not which values)")
  _check(not c.codec.select or c.codec.mode != "off",
         "config.codec.select=True needs codec.mode=block, element, word or delta (auto always "
         "selects)")
  _check(c.codec.delta_bits in (2, 3, 4),
         f"config.codec.delta_bits={c.codec.delta_bits!r}: must be 2, 3 or 4")
  _check(c.codec.cache_budget_bytes >= 0,
         f"config.codec.cache_budget_bytes={c.codec.cache_budget_bytes}: must be >= 0 "
         "(0 = no limit)")
  _check(c.codec.reselect_every >= 0,
         f"config.codec.reselect_every={c.codec.reselect_every}: must be >= 0 (0 = decide once)")
  _check(c.codec.capacity_margin >= 1,
         f"config.codec.capacity_margin={c.codec.capacity_margin}: must be >= 1")
  _choice(c.codec.comm_model, "codec.comm_model", CODEC_COMM_MODELS)
  _check(0 <= c.codec.capacity_fraction <= 1,
         f"config.codec.capacity_fraction={c.codec.capacity_fraction}: must be in [0, 1]")
  _check(c.codec.warmup_steps >= 0,
         f"config.codec.warmup_steps={c.codec.warmup_steps}: must be >= 0")
  _check(c.checkpoint.every >= 0, f"config.checkpoint.every={c.checkpoint.every}: must be >= 0")


def num_params(c: Config) -> dict[str, int]:
  """Total and active (per token) parameter counts, from the shapes alone."""
  m, moe = c.model, c.moe
  d, hd = m.d_model, m.num_heads * m.head_dim
  attn = 2 * d * hd + 2 * d * hd + 2 * hd           # q, k, v, o + q/k norms
  expert = 3 * d * moe.expert_hidden
  per_layer_shared = attn + d * moe.num_experts + 2 * d   # + router + two norms
  embed = 2 * m.vocab_size * d + d                   # embedding, lm head, final norm
  total = embed + m.num_layers * (per_layer_shared + moe.num_experts * expert)
  active = embed + m.num_layers * (per_layer_shared + moe.top_k * expert)
  return {"total": total, "active": active}


def ceil_div(a: int, b: int) -> int:
  return -(-a // b)



