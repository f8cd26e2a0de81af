"""The training loop: `run(cfg, workdir)`.

Metrics come back to the host one step late (the next step is dispatched before the previous
step's metrics are read), so the host never blocks the device.

A run resumes from the latest readable checkpoint in workdir/checkpoints (see
`moejax.train.checkpoint`): same step numbering, data position and learning-rate schedule, so an
interrupted run continues bit for bit. It saves every `checkpoint.every` steps and at the end.

A step whose loss or gradient norm is not finite stops the run with TrainingError naming the
latest good checkpoint; no checkpoint of a non-finite state is written (a save first reads that
step's figures and checks that every parameter is finite). A failed save stops it with
CheckpointError (`moejax.train.checkpoint`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax import families, host_memory, weights
from moejax.config import YARN_FIELDS, Config, num_params, unused_settings
from moejax.data import DataSpec, check_vocab, make_data
from moejax.errors import ConfigError, DataError, TrainingError
from moejax.sharding.mesh import make_mesh, num_devices
from moejax.train import (checkpoint as checkpoint_lib, memory, optim, state as state_lib,
                          step as step_lib, workdir as workdir_lib)
from moejax.train import latency_profile
from moejax.train.codec_control import CodecPolicy, specs_key
from moejax.train.metrics import MetricsWriter, Progress, log
from moejax.train.stop import StopRequests


def prepare_workdir(workdir: str) -> None:
  """The workdir and its checkpoints/ folder exist and take files, or a ConfigError now (not
  at the first save, `checkpoint.every` steps in)."""
  for directory in (workdir, checkpoint_lib.checkpoint_dir(workdir)):
    what = "workdir" if directory == workdir else "checkpoint directory"
    if os.path.exists(directory) and not os.path.isdir(directory):
      fix = "choose another --workdir" if what == "workdir" else "move the file away"
      raise ConfigError(f"{what} {directory!r} is a file, not a folder; {fix}")
    try:
      os.makedirs(directory, exist_ok=True)
      probe = os.path.join(directory, f".write_test.{jax.process_index()}")
      with open(probe, "w") as f:
        f.write("ok")
      os.remove(probe)
    except OSError as e:
      raise ConfigError(f"{what} {directory!r} is not writable: {e.strerror or e}") from None


def data_line(cfg: Config, data) -> str:
  """What the run reads: the splits' tokens, and how many times `cfg.steps` go over the
  training split (its windows are reshuffled each time)."""
  train = data.train
  epochs = cfg.steps * cfg.batch_size / train.num_windows
  val = (f"{len(data.val_tokens):,} validation tokens" if cfg.data.val_fraction > 0 else
         "no validation split (data.val_fraction=0: no val_loss)")
  return (f"moejax: data: {train.num_tokens:,} training tokens ({train.num_windows:,} windows "
          f"of {cfg.seq_len + 1}), {val}; {cfg.steps} steps read {epochs:.3g} epoch(s)")


def put_batch(batch: dict, mesh) -> dict:
  """Global host batch -> arrays sharded over the devices (each process fills its shards)."""
  sharding = NamedSharding(mesh, step_lib.BATCH_SPEC["inputs"])
  return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
          for k, v in batch.items()}


def training_data(cfg: Config):
  """The data `run` trains `cfg` on: its corpus, tokenizer, validation split and seed. A file
  that cannot be used is named with its config field."""
  try:
    return make_data(DataSpec(cfg.data.source, cfg.data.path or None, weights.tokenizer_of(cfg),
                              cfg.data.val_fraction, cfg.seed),
                     batch_size=cfg.batch_size, seq_len=cfg.seq_len, log=log)
  except DataError as e:
    if e.input is None:
      raise
    raise DataError(f"config.data.{e.input}={getattr(cfg.data, e.input)!r}: {e}",
                    e.input) from None


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A codec choice's layout and train step."""
  layout: state_lib.StateLayout
  train_step: object


@dataclasses.dataclass
class DispatchCapacityItem:
  """The checkpoint item "dispatch" (JSON): the dispatch and receive capacity factors in force,
  so a resumed run runs its next steps on the buffers the uninterrupted one had grown to (the
  capacities change no assignment, but the CPU expert kernel's tiling, hence float rounding,
  follows the buffers' sizes), unless the resumed run configures other factors than the saved
  run did. Registered with the Checkpointer like any feature state."""
  trainer: "Trainer"
  name: str = "dispatch"
  json: bool = True

  def item(self, state):
    moe = self.trainer.cfg.moe
    evaluation = self.trainer._eval_factors
    return {"dispatch_capacity_factor": self.trainer.dispatch_capacity_factor,
            "configured": moe.dispatch_capacity_factor,
            "receive_capacity_factor": self.trainer.receive_capacity_factor,
            "receive_configured": moe.receive_capacity_factor,
            # what evaluation grew for itself (`Trainer.eval_capacity_factors`), or None
            "eval_capacity_factors": None if evaluation is None else list(evaluation)}, state

  def target(self, saved_keys):
    del saved_keys
    return None

  # (factor, the key of its configured value, what it sizes); an older checkpoint may lack the
  # receive capacity's: the config's then
  FACTORS = (("dispatch_capacity_factor", "configured", "the dispatch buffers"),
             ("receive_capacity_factor", "receive_configured", "the rows run through the experts"))

  def restore(self, state, item, where: str, log):
    if item is None:      # an older checkpoint: the config's capacity, grown as needed
      return state
    kept = True
    for field, configured_key, what in self.FACTORS:
      if field not in item:
        continue
      configured = getattr(self.trainer.cfg.moe, field)
      if float(item[configured_key]) == configured:
        setattr(self.trainer, field, float(item[field]))
      else:
        kept = False
        log(f"moejax: {where} sized {what} by factor {item[field]:g}; this run configures "
            f"moe.{field}={configured:g} and starts from that")
    if kept and item.get("eval_capacity_factors") is not None:
      self.trainer._eval_factors = tuple(float(f) for f in item["eval_capacity_factors"])
    return state


class GrowingStep:
  """The train step of one codec choice when its dispatch buffers can overflow (ep/fssdp,
  moe.dispatch_overflow="grow"): runs the jitted step of the Trainer's current dispatch capacity
  and, when that step overflowed (it then applied nothing), grows the buffers from the loads it
  measured (`Trainer.grow_dispatch`) and reruns it on the same batch: lossless, with buffers
  sized by the loads rather than the worst case. It reads each step's overflow flag (one scalar:
  the host waits for the step before dispatching the next). Anything else (`lower`, `trace`,
  `compile` of a model-scheduled step) is the current step's."""

  def __init__(self, trainer: "Trainer", layout: state_lib.StateLayout):
    self._trainer, self._layout, self._steps = trainer, layout, {}

  def jitted(self):
    """The jitted train step at the Trainer's current capacity factors."""
    factors = self._trainer.capacity_factors
    if factors not in self._steps:
      self._steps[factors] = self._trainer.make_step(self._layout, *factors)
    return self._steps[factors]

  def __getattr__(self, name):
    if name.startswith("_"):      # (copy, pickle: not the step's)
      raise AttributeError(name)
    return getattr(self.jitted(), name)

  def __call__(self, state, batch):
    while True:
      state, metrics = self.jitted()(state, batch)
      # Grown to dropless, the step has nothing left to overflow (and no flag).
      if not int(metrics.get("dispatch_overflow", 0)):
        return state, metrics
      self._trainer.grow_dispatch(int(metrics["dispatch_needed"]),
                                  int(metrics["receive_needed"]))


class Trainer:
  """Everything compiled and placed for one config on one mesh."""

  def __init__(self, cfg: Config, mesh=None, *, trace_guard=None):
    """`trace_guard(fn) -> fn` wraps every train step function this Trainer jits (see
    `step.make_train_step`)."""
    self.cfg = cfg
    self.trace_guard = trace_guard
    self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh.shape)
    step_lib.check_divisibility(cfg, self.mesh)
    latency_profile.check_cluster(cfg.schedule_cluster)
    if self.mesh.devices.flat[0].platform == "cpu":   # XLA:CPU steps malloc their buffers
      host_memory.keep_freed_memory_mapped()
    self.tx = optim.make_optimizer(cfg)
    self.schedule = optim.lr_schedule(cfg)
    limit = memory.device_memory_bytes(self.mesh.devices.flat[0])
    if limit is not None:      # GPUs say how much they hold: stop now, not when XLA runs out
      memory.check_fits(cfg, num_devices(self.mesh), limit, tolerance=memory.TOLERANCE,
                        packed_exchange=state_lib.packs_exchange(cfg, self.mesh))
    self.layout = state_lib.state_layout(cfg, self.mesh, self.tx)
    # ep/fssdp: the dispatch buffers' size and the rows run through the experts, grown by
    # `grow_dispatch` when a step overflows them (kept for later runs with this Trainer; a new
    # one starts again from the config's).
    self.dispatch_capacity_factor = cfg.moe.dispatch_capacity_factor
    self.receive_capacity_factor = cfg.moe.receive_capacity_factor
    self._tokens_per_device = cfg.batch_size * cfg.seq_len // num_devices(self.mesh)
    self.train_step = self._train_step_of(self.layout)
    self._init = state_lib.make_init(cfg, self.tx, self.layout)   # jitted once, any seed
    self._eval_steps: dict = {}
    self._eval_factors = None      # evaluation's grown capacities (`eval_capacity_factors`)
    # One compiled train step per codec choice (`compiled`), the config's own first.
    self._compiled = {specs_key(self.layout.gatherer.specs): Compiled(self.layout,
                                                                      self.train_step)}

  def compiled(self, specs: dict) -> "Compiled":
    """The layout and train step of a codec choice ({group: {path: CodecSpec}}), made on first
    use (compiled on its first call) and kept for later runs."""
    key = specs_key(specs)
    if key not in self._compiled:
      gatherer = self.layout.gatherer.with_specs(specs)
      shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), gatherer.state_specs(),
                               is_leaf=lambda s: isinstance(s, P))
      layout = dataclasses.replace(self.layout, gatherer=gatherer,
                                   shardings=self.layout.shardings.replace(gather_state=shardings))
      self._compiled[key] = Compiled(layout, self._train_step_of(layout))
    return self._compiled[key]

  # -- dispatch buffers ----------------------------------------------------------------------------
  @property
  def checkpoint_items(self) -> tuple:
    """The grown dispatch capacity (`DispatchCapacityItem`) when steps can grow it."""
    grows = self.layout.placement.grows_dispatch(self._tokens_per_device)
    return (DispatchCapacityItem(self),) if grows else ()

  @property
  def capacity_factors(self) -> tuple[float, float]:
    """(dispatch, receive) capacity factors in force: what the steps are compiled for."""
    return self.dispatch_capacity_factor, self.receive_capacity_factor

  def _with_capacity(self, layout, dispatch_factor: float, receive_factor: float):
    placement = dataclasses.replace(layout.placement, dispatch_capacity_factor=dispatch_factor,
                                    receive_capacity_factor=receive_factor)
    return dataclasses.replace(layout, placement=placement)

  def make_step(self, layout, dispatch_factor: float, receive_factor: float):
    """The jitted train step of `layout` with these dispatch and receive capacity factors."""
    return step_lib.make_train_step(
        self.cfg, self.mesh, self._with_capacity(layout, dispatch_factor, receive_factor),
        self.tx, self.schedule, trace_guard=self.trace_guard)

  def _train_step_of(self, layout):
    if layout.placement.grows_dispatch(self._tokens_per_device):
      return GrowingStep(self, layout)
    return self.make_step(layout, *self.capacity_factors)

  @property
  def eval_capacity_factors(self) -> tuple[float, float]:
    """(dispatch, receive) capacity factors of evaluation, its own: it plans no replicas
    (fssdp's flat prediction), so its busiest owners receive more than training's, and growing
    training's capacities for them would cost every later train step the rows they save. Until
    an evaluation overflows: training's dispatch capacity, every received row run (with packed
    buffers, training's receive capacity: their sends are uncapped, and every row a device may
    receive would be the dropless worst case); then what evaluation grew (`_grown`)."""
    if self._eval_factors is not None:
      return self._eval_factors
    packed = self.layout.placement.packed_exchange
    return self.dispatch_capacity_factor, self.receive_capacity_factor if packed else 0.0

  @property
  def eval_step(self):
    """`step.make_eval_step`'s step at `eval_capacity_factors`."""
    factors = self.eval_capacity_factors
    if factors not in self._eval_steps:
      self._eval_steps[factors] = step_lib.make_eval_step(
          self.cfg, self.mesh, self._with_capacity(self.layout, *factors))
    return self._eval_steps[factors]

  def grow_dispatch(self, needed_rows: int, receive_rows: int = 0) -> None:
    """A train step overflowed: a device sent `needed_rows` rows to one destination, more than
    the dispatch buffer holds, or received `receive_rows` for its experts (pieces x one
    piece's), more than they run (`dispatch.receive_capacity`). What overflowed grows
    (`_grown`), and the step's callers rerun it."""
    self.dispatch_capacity_factor, self.receive_capacity_factor = self._grown(
        self.capacity_factors, needed_rows, receive_rows)

  def _grown(self, factors: tuple, needed_rows: int, receive_rows: int,
             what: str = "") -> tuple[float, float]:
    """The (dispatch, receive) capacity factors after a step at `factors` overflowed
    (`grow_dispatch`; `what`: the step, if not training's), grown where it overflowed
    (`dispatch.grown_capacity_factor`, `dispatch.grown_receive_factor`), if the buffers still fit
    the device (ConfigError naming the field and the bytes otherwise)."""
    from moejax.placement import dispatch as dispatch_lib
    old, old_receive = factors
    at = lambda f, r: dataclasses.replace(  # noqa: E731
        self.layout.placement, dispatch_capacity_factor=f, receive_capacity_factor=r)
    placement = at(old, old_receive)
    n, pieces, t = placement.num_devices, placement.dispatch_chunks, self._tokens_per_device
    a = t * placement.top_k
    rows = lambda f: at(f, old_receive).dispatch_capacity(t)  # noqa: E731
    computed = lambda f, r: pieces * at(f, r).receive_capacity(t)  # noqa: E731
    new, new_receive = old, old_receive
    receive_overflowed = receive_rows > computed(old, old_receive)
    # Either overflow reruns the step; without a measured one (none can be: a drop is one of
    # them) the buffer that can overflow grows, so every rerun makes progress. Uncapped sends
    # (`Placement.uncapped_sends`, packed buffers): only what a device receives can overflow.
    if placement.uncapped_sends:
      receive_overflowed = True
    elif needed_rows > rows(old) or not receive_overflowed:
      new = dispatch_lib.grown_capacity_factor(old, needed_rows, a, n, placement.max_rows(t))
    if receive_overflowed:
      new_receive = dispatch_lib.grown_receive_factor(old_receive, receive_rows, a)
    grown = dataclasses.replace(self.cfg, moe=dataclasses.replace(
        self.cfg.moe, dispatch_capacity_factor=new, receive_capacity_factor=new_receive))
    limit = memory.device_memory_bytes(self.mesh.devices.flat[0])
    if limit is not None:
      memory.check_fits(grown, num_devices(self.mesh), limit, tolerance=memory.TOLERANCE,
                        packed_exchange=placement.packed_exchange,
                        why=f"a{what and ' ' + what} step needed {needed_rows} dispatch rows at "
                            f"one destination and {receive_rows} rows through one device's "
                            "experts")
    step = f"{what} " if what else ""
    if new != old:
      log(f"moejax: the {placement.kind} dispatch buffers overflowed (a device sent "
          f"{needed_rows} rows to one destination, room for {rows(old)}): {step}"
          f"moe.dispatch_capacity_factor {old:g} -> {f'{new:g}' if new else '0 (dropless)'} "
          f"({rows(new)} rows per destination); rerunning the {step}step")
    if new_receive != old_receive:
      log(f"moejax: a device received {receive_rows} rows for its {placement.kind} experts, "
          f"which run {computed(old, old_receive)}: {step}moe.receive_capacity_factor "
          f"{old_receive:g} -> {new_receive:g} ({computed(new, new_receive)} rows"
          # the rows the experts run follow the dispatch buffer too (all it delivers, dropless)
          + (f", with the dispatch buffer's growth above; {computed(old, new_receive)} alone"
             if computed(new, new_receive) != computed(old, new_receive) else "")
          + f"); rerunning the {step}step")
    return new, new_receive

  def adopt(self, state, current: "Compiled", specs: dict):
    """Switch from `current` to the codec choice `specs`: (state with codec states for it,
    its Compiled). Parameters whose spec keeps the same state keep their caches; the others
    start warm (their first gather refills the caches)."""
    new = self.compiled(specs)
    states = new.layout.gatherer.init_states(self.mesh, warmed_up=True,
                                             reuse=(current.layout.gatherer, state.gather_state))
    return state.replace(gather_state=states), new

  def abstract_inputs(self):
    """(state, batch) of the train step as ShapeDtypeStructs with their shardings: enough to
    lower and compile it (`train_step.lower(*trainer.abstract_inputs())`) with no arrays."""
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         jax.eval_shape(self.init_state), self.layout.shardings)
    batch = {k: jax.ShapeDtypeStruct((self.cfg.batch_size, self.cfg.seq_len), np.int32,
                                     sharding=NamedSharding(self.mesh, spec))
             for k, spec in step_lib.BATCH_SPEC.items()}
    return state, batch

  def init_state(self, seed: int | None = None):
    seed = self.cfg.seed if seed is None else seed
    return state_lib.with_rebuilt_state(self.layout, self._init(jax.random.key(seed)))

  def evaluate(self, params, batches, placement_state=None) -> float:
    """Mean validation loss over `batches`; a batch that overflowed the dispatch buffers is
    evaluated again with grown ones (never a loss with dropped assignments)."""
    losses = []
    for b in batches:
      while True:
        loss, dropped, needed = self.eval_step(params, b, placement_state)
        if not int(dropped) or self.cfg.moe.dispatch_overflow != "grow":
          break
        self._eval_factors = self._grown(self.eval_capacity_factors,
                                         *(int(x) for x in np.asarray(needed)),
                                         what="evaluation")
      losses.append(float(loss))
    return float(np.mean(losses))

  def reshard(self, state):
    """fssdp: new expert owners balancing the load history, heterogeneous across layers; the
    experts' parameters and optimizer state move together. Returns (state, Resharding)."""
    shardings = (self.layout.shardings.params, self.layout.shardings.opt_state)
    params, opt_state, placement, resharding = self.layout.placement.reshard(
        state.params, state.opt_state, state.placement, shardings)
    return state.replace(params=params, opt_state=opt_state, placement=placement), resharding


# What the weights fix: their shapes, and the options that change what the same weights compute.
_WEIGHT_FIELDS = {
    "model": ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "num_kv_heads",
              "qk_norm", "qkv_bias", "attention_out_bias", "qk_norm_after_rope", "attention_gate",
              "attention_gate_own", "attention_sinks", "sliding_window", "sliding_layers",
              "sliding_rope_theta", "nope_layers", "norm_position", "norm_kind", "embed_scale",
              "residual_scale", "attention_scale", "logit_divisor", "rope_theta", "rotary_dim",
              "rotary_interleaved", "norm_eps", "dense_layers", "dense_hidden", "kv_lora_rank",
              "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "tie_embeddings", "attention_chunk", "chunked_layers", "nope_temperature",
              "nope_temperature_floor", "index_topk", "index_heads", "index_head_dim",
              "index_rotary_interleaved", "linear_layers", "linear_kind", "linear_key_heads",
              "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv_taps"),
    "moe": ("num_experts", "top_k", "expert_hidden", "shared_expert_hidden",
            "shared_expert_gate", "score", "renormalize", "routed_scale", "expert_groups",
            "top_groups", "group_score", "score_bias", "score_bias_on_logits", "router_bias",
            "expert_bias", "activation", "swiglu_alpha", "swiglu_limit",
            "shared_expert_scale", "weights_on_input"),
}


# RoPE scaling: weights trained with it compute something else without it (or with another),
# but extending the context of weights trained without it is what YaRN is for.
_ROPE_FIELDS = ("rope_scaling", *YARN_FIELDS)


def _first_mismatch(loaded: Config, cfg: Config) -> str | None:
  """The first field of `cfg` that the weights' config `loaded` contradicts, led by the family
  when that differs too (a family preset for another model's weights differs in many fields:
  one line names the family and the count, not one field per rerun)."""
  mismatches = _mismatches(loaded, cfg)
  if not mismatches:
    return None
  if loaded.model.family != cfg.model.family:
    more = f" and {len(mismatches) - 1} more field(s)" if len(mismatches) > 1 else ""
    return (f"config.model.family={cfg.model.family!r}, but the weights are "
            f"{loaded.model.family!r} ({mismatches[0]}{more}): train them with a preset of "
            f"{families.config_file(loaded.model.family)} of their size, or as their own config "
            "(--config configs/hf.py:DIR)")
  return mismatches[0]


def _mismatches(loaded: Config, cfg: Config) -> list[str]:
  out = []
  if loaded.model.rope_scaling != "none":
    for field in _ROPE_FIELDS:
      a, b = getattr(loaded.model, field), getattr(cfg.model, field)
      if a != b:
        out.append(f"config.model.{field}={b!r}, but the weights were trained with {a!r}"
                   + ("" if field == "rope_scaling"
                      else f" (model.rope_scaling={loaded.model.rope_scaling!r})"))
  for group, fields in _WEIGHT_FIELDS.items():
    for field in fields:
      a = getattr(getattr(loaded, group), field, None)
      b = getattr(getattr(cfg, group), field, None)
      if field == "num_kv_heads":      # 0 means as many as query heads
        a, b = a or loaded.model.num_heads, b or cfg.model.num_heads
      if field == "rotary_dim":        # 0 means the whole head
        a, b = a or loaded.model.head_dim, b or cfg.model.head_dim
      if field == "group_score" and loaded.moe.expert_groups == 1:    # read only with groups
        continue
      if field == "nope_temperature_floor" and not loaded.model.nope_temperature:
        continue                       # read only with a temperature
      if a is not None and a != b:
        out.append(f"config.{group}.{field}={b!r}, but the weights have {a!r}")
  return out


def init_from(trainer: Trainer, path: str):
  """A fresh train state (step 0) around the weights at `path` (Hugging Face dir or checkpoint)."""
  from moejax import convert
  from moejax.train import checkpoint as ckpt
  cfg = trainer.cfg
  shardings = trainer.layout.shardings.params
  if not os.path.isdir(path):
    raise ConfigError(f"config.init_from={path!r}: no such directory (a Hugging Face model "
                      "folder with config.json, or a moejax workdir or checkpoint)")
  hf_dir = os.path.isfile(os.path.join(path, "config.json"))
  # The weights' config first: a mismatch is one line naming the field, before any weight is
  # read (reading them in the preset's layout would fail on the first missing tensor instead).
  hf_config = convert.read_hf_config(path) if hf_dir else {}
  loaded = (convert.config_from_hf(hf_config, cfg, where=os.path.join(path, "config.json"))
            if hf_dir else ckpt.load_config(path))
  mismatch = _first_mismatch(loaded, cfg)
  if mismatch:
    advice = ("" if loaded.model.family != cfg.model.family
              else "; use a config with the model's shapes")
    raise ConfigError(f"config.init_from={path!r}: {mismatch}{advice}")
  if hf_dir:
    _, params = convert.load_hf(path, shardings=shardings, base=cfg, progress=log)
  else:
    params = ckpt.load_params(path, shardings=shardings)
  if not _all_finite(params):     # else ten steps train, and the NaN is blamed on optim.lr
    raise ConfigError(f"config.init_from={path!r}: the weights hold NaN or infinite values "
                      "(python -m moejax.convert from-hf names the tensor): a run from them "
                      "would be NaN from its first step")
  quantized = convert.quantization_summary(hf_config) if hf_dir else None
  log(f"moejax: initialized from {path}"
      + (f" (weights {quantized}, dequantized to fp32)" if quantized else ""))
  limit = hf_config.get("max_position_embeddings")
  if loaded.model.rope_scaling == "none" and cfg.model.rope_scaling != "none":
    log(f"moejax: note: the weights were trained with plain RoPE and this run scales it "
        f"(model.rope_scaling={cfg.model.rope_scaling!r}, rope_factor={cfg.model.rope_factor}, "
        f"rope_original_max_len={cfg.model.rope_original_max_len}): a context extension")
  elif isinstance(limit, int) and cfg.seq_len > limit:
    log(f"moejax: note: config.seq_len={cfg.seq_len} is past the weights' "
        f"max_position_embeddings={limit}: positions beyond it were never trained")
  return state_lib.state_from_params(params, trainer.tx, trainer.layout)


def _note_if_not_exportable(cfg: Config) -> None:
  """Says at the start, not after the run, when `model.family`'s Hugging Face architecture cannot
  hold the config's options (training runs; `to-hf` would refuse)."""
  from moejax.convert.hf_config import check_exportable
  from moejax.errors import CheckpointError
  try:
    check_exportable(cfg)
  except CheckpointError as e:
    log(f"moejax: note: {e}; training goes on, but `python -m moejax.convert to-hf` will refuse")


def _billions(n: int) -> str:
  """12,880,000,000 -> '12.88B'; small counts in full (the tiny presets)."""
  return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n:,}"


FINITE = ("loss", "grad_norm")     # a step whose figures are not finite stops the run
# jax's own durations of making a program: a step compiled mid-run (a codec decision's new step,
# grown dispatch buffers) spends them inside the window of steps it is timed in.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileSeconds:
  """Seconds jax spent tracing, lowering and compiling since the last `take()` (from
  `jax.monitoring`), left out of the logged step time as evaluation and saves are."""

  def __init__(self):
    self._seconds = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)

  def _on_duration(self, event, duration, **_):
    if event in COMPILE_EVENTS:
      self._seconds += duration

  def take(self) -> float:
    seconds, self._seconds = self._seconds, 0.0
    return seconds

  @contextlib.contextmanager
  def left_out(self):
    """What compiles inside the block is not counted (the block is timed apart)."""
    held = self.take()
    try:
      yield
    finally:
      self._seconds = held

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._on_duration)


def _all_finite(params) -> bool:
  """Every value of every parameter is finite: checked on the host, shard by shard (no program
  to compile: a jitted reduction cost each run's first save a compile), agreed by all
  processes."""
  finite = all(bool(np.isfinite(np.asarray(shard.data)).all())
               for x in jax.tree.leaves(params) for shard in x.addressable_shards)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    finite = bool(np.all(multihost_utils.process_allgather(np.int32(finite))))
  return finite


def _check_params_finite(step: int, params, checkpoints) -> None:
  """Raises TrainingError if a parameter is not finite after step `step`: an update can make
  them so with a finite loss and gradient norm (the loss shows it one step later, after the
  save), and a checkpoint of such a state would resume into NaN."""
  if not _all_finite(params):
    checkpoints.wait()
    raise TrainingError(f"a parameter became non-finite at step {step} with a finite loss and "
                        "gradient norm (an update too large: try a lower optim.lr); not saved; "
                        f"{checkpoints.resume_point()}")


def _check_finite(step: int, metrics: dict, checkpoints, clipped: bool = True) -> None:
  """Raises TrainingError if the step's loss or gradient norm is not finite, naming the latest
  good checkpoint a rerun would resume from (after waiting for a save still in flight), with the
  optimizer settings that a rerun may change (`checkpoint.MAY_DIFFER`)."""
  for name in FINITE:
    value = float(metrics[name])
    if not math.isfinite(value):
      checkpoints.wait()
      fix = "a lower optim.lr or a smaller optim.clip_norm" if clipped else "a lower optim.lr"
      raise TrainingError(f"{name} became {value} at step {step}; stopping (try {fix}: a rerun "
                          f"may change them); {checkpoints.resume_point()}")


def run(cfg: Config, workdir: str, *, trainer: Trainer | None = None,
        stop_at: int | None = None) -> dict:
  """Trains `cfg` (resuming from workdir/checkpoints if there is one), appends to
  workdir/metrics.jsonl and saves checkpoints. Returns the last logged record.

  trainer: a Trainer built for `cfg`, to reuse its compiled steps from run to run.
  stop_at: stop after this step, with a checkpoint there, as if the run were interrupted (run
    again to resume); the learning-rate schedule still spans `cfg.steps`.
  """
  # Asked of every process before any makes it (another's folder would read as this one's).
  created = workdir_lib.new_to_every_process(not os.path.exists(workdir))
  prepare_workdir(workdir)
  lock = workdir_lib.WorkdirLock(workdir) if jax.process_index() == 0 else None
  failed = True
  try:
    workdir_lib.check_same_job(weights.config_to_dict(cfg), workdir)
    record = _run(cfg, workdir, trainer, stop_at)
    failed = False
    return record
  finally:
    if lock is not None:
      if failed and created:      # under the lock: no run that waited for it starts in it first
        workdir_lib.remove_if_unused(workdir)
      lock.release()


def _run(cfg: Config, workdir: str, trainer: Trainer | None, stop_at: int | None) -> dict:
  data = training_data(cfg)
  try:
    check_vocab(data.tokenizer, cfg.model.vocab_size)
  except DataError as e:
    if not cfg.init_from:
      raise
    # The model's vocabulary is the weights': a larger config.model.vocab_size would not load.
    raise DataError(f"{data.tokenizer.name}: tokenizer vocab_size {data.tokenizer.vocab_size} "
                    f"exceeds the {cfg.model.vocab_size} rows of config.init_from's embedding: "
                    "the weights were trained with another tokenizer (set config.data.tokenizer "
                    "to theirs)") from e
  if trainer is None:
    trainer = Trainer(cfg)
  elif dataclasses.replace(trainer.cfg, data=cfg.data, eval_batches=cfg.eval_batches) != cfg:
    # What the run reads compiles nothing: a Trainer serves any data and validation batches.
    raise ValueError("run(trainer=...) needs a Trainer built for the same config (but for "
                     "data.* and eval_batches)")
  # codec.mode=auto / codec.select: plain gathers until the policy's first decision.
  policy = CodecPolicy(trainer.layout.gatherer, trainer.mesh, cfg.codec, workdir=workdir)
  checkpoints = checkpoint_lib.Checkpointer(
      workdir, cfg,
      trainer.layout.checkpoint_items + policy.checkpoint_items + trainer.checkpoint_items)
  try:
    restored = checkpoints.restore(trainer.layout, trainer.tx, data.train)
    if restored is None and cfg.init_from:
      state = init_from(trainer, cfg.init_from)
    elif restored is None:
      state = trainer.init_state()
    else:
      state, step = restored
      log(f"moejax: resuming from step {step} (checkpoint {checkpoints.step_path(step)})")
      checkpoints.prune()     # a run killed before its save pruned left one too many
    if jax.process_index() == 0:
      # Once the data, the vocabulary and any checkpoint accepted it: generate / evaluate and a
      # later init_from from this workdir read it (and the EOS it ends documents with) here.
      weights.keep_tokenizer(weights.tokenizer_of(cfg), workdir)
    counts = num_params(cfg)
    log(f"moejax: {cfg.model.family} model, {_billions(counts['total'])} parameters, "
        f"{_billions(counts['active'])} active per token")
    _note_if_not_exportable(cfg)
    for note in unused_settings(cfg):
      log(f"moejax: note: {note}")
    log(f"moejax: {data.name}, {num_devices(trainer.mesh)} device(s), "
        f"placement={cfg.moe.placement}, {cfg.steps} steps of {cfg.batch_size}x{cfg.seq_len}")
    log(data_line(cfg, data))
    val_batches = None
    if cfg.data.val_fraction > 0:
      num_val = min(cfg.eval_batches, data.num_val_batches)
      if num_val < cfg.eval_batches:
        log(f"moejax: the validation split holds {num_val} batch(es) of "
            f"{cfg.batch_size}x{cfg.seq_len}: val_loss is over {num_val}, not "
            f"config.eval_batches={cfg.eval_batches} (a larger data.val_fraction holds more)")
      val_batches = [put_batch(b, trainer.mesh) for b in data.val_batches(num_val)]
    compiled = trainer.compiled(trainer.layout.gatherer.specs)
    choice = policy.start(int(state.step), state.params)
    if choice is not None:
      state, compiled = trainer.adopt(state, compiled, choice)
    first_step = int(state.step) + 1
    writer = MetricsWriter(workdir, first_step=first_step)
    last_step = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    progress = Progress(cfg.steps, first_step)
    compile_seconds = CompileSeconds()
    stops = StopRequests()
    try:
      return _train(cfg, trainer, state, data, val_batches, writer, progress, checkpoints,
                    policy, compiled, last_step, compile_seconds, stops)
    finally:
      stops.close()
      compile_seconds.close()
      progress.close()
      writer.close()
  finally:
    checkpoints.close()     # waits for the last save to commit


# A dispatch dropping more than this share of the assignments (under "drop") is said once.
DROP_NOTE_SHARE = 0.1


def drop_note(step: int, record: dict, cfg: Config) -> str | None:
  """The line saying a logged step's ep/fssdp dispatch dropped more than `DROP_NOTE_SHARE` of
  its assignments (moe.dispatch_overflow='drop'; `record`'s ep_dropped_frac), or None."""
  share = record.get("ep_dropped_frac", 0.0)
  if share <= DROP_NOTE_SHARE:
    return None
  head = (f"moejax: note: step {step}: the {cfg.moe.placement} dispatch dropped {share:.1%} of "
          f"the routed assignments (moe.dispatch_overflow={cfg.moe.dispatch_overflow!r}, "
          f"moe.dispatch_capacity_factor={cfg.moe.dispatch_capacity_factor:g})")
  if cfg.moe.dispatch_overflow != "drop":    # a step that drops is rerun larger: never here
    return (f"{head}, which should have grown the buffers and rerun the step: a bug worth "
            "reporting with this config")
  return (f"{head}: those tokens skip those experts; a larger factor drops fewer, "
          "dispatch_overflow='grow' none (ep_dropped_frac in metrics.jsonl)")


def _train(cfg: Config, trainer: Trainer, state, data, val_batches, writer, progress,
           checkpoints, policy, compiled, last_step: int, compile_seconds: CompileSeconds,
           stops: StopRequests) -> dict:
  record: dict = {}
  previous = None                        # (step, metrics) read one step late
  t_start = t_log = time.perf_counter()
  steps_since_log = 0
  first_step = int(state.step) + 1
  if first_step > last_step:
    log(f"moejax: the checkpoint is at step {first_step - 1}, config.steps={cfg.steps}: "
        "nothing to train")
  first_step_time = 0.0
  noted_drops = False
  reshard_moved = None
  clipped = cfg.optim.clip_norm > 0
  epoch = data.train.epoch_read
  for step in range(first_step, last_step + 1):
    t_step = time.perf_counter()
    state, metrics = compiled.train_step(state, put_batch(next(data.train), trainer.mesh))
    if (read := data.train.epoch_read) > epoch:     # this batch reached into another pass
      epoch = read
      log(f"moejax: step {step}: epoch {epoch + 1} of the training split began (every window "
          "read once before it; reshuffled)")
    metrics, choice = policy.after_step(step, state.params, metrics)
    if choice is not None:       # the codec's new choice, from the next step on
      state, compiled = trainer.adopt(state, compiled, choice)
    if previous is not None:
      _check_finite(*previous, checkpoints, clipped)
    previous = (step, metrics)
    steps_since_log += 1
    if steps_since_log == 1 and t_log == t_start:
      # The first step compiles; time the steps after it.
      jax.block_until_ready(metrics)
      t_log, steps_since_log = time.perf_counter(), 0
      # Reported only if this step is logged alone (when due to log or to evaluate): its own
      # time, less its compile.
      first_step_time = max(t_log - t_step - compile_seconds.take(), 1e-9)
    if (cfg.moe.placement == "fssdp" and cfg.fssdp.reshard_every
        and step % cfg.fssdp.reshard_every == 0 and step < cfg.steps):
      # Before any checkpoint of this step, so a resumed run continues from the same owners;
      # before its record, which says how many moved. Only the re-shard's own time is left out
      # of the steps': the step it reads the load history of is waited for first, and its
      # asynchronous moves before the clock stops.
      jax.block_until_ready((state, metrics))
      t_reshard = time.perf_counter()
      with compile_seconds.left_out():
        state, resharding = trainer.reshard(state)
        jax.block_until_ready(state)
        # Summed until the next record (re-sharding may be more frequent than logging).
        reshard_moved = (reshard_moved or 0) + resharding.moved
        log(f"moejax: step {step}: re-sharded experts: {resharding.moved} moved "
            f"({resharding.moved_bytes / 2**20:.1f} MiB of parameters and optimizer state)")
      t_log += time.perf_counter() - t_reshard
    evaluate = step % cfg.eval_every == 0 or step == cfg.steps
    if step % cfg.log_every == 0 or evaluate:
      values = jax.device_get(metrics)   # waits for this step: the timing below is honest
      _check_finite(step, values, checkpoints, clipped)
      if steps_since_log:   # less any step compiled meanwhile (a codec decision's)
        step_time = (time.perf_counter() - t_log - compile_seconds.take()) / steps_since_log
      else:                                # the first (compiling) step, logged on its own
        step_time = first_step_time
      record = {"step": step, **values, "step_time_s": step_time,
                "tokens_per_s": cfg.batch_size * cfg.seq_len / step_time}
      if reshard_moved is not None:
        record["reshard_moved_experts"] = reshard_moved
        reshard_moved = None
      if evaluate and val_batches is not None:
        record["val_loss"] = trainer.evaluate(state.params, val_batches, state.placement)
      writer.write(record)
      if not noted_drops and (note := drop_note(step, record, cfg)):
        noted_drops = True
        log(note)
      progress.update(step, record, (cfg.steps - step) * step_time)
      t_log, steps_since_log = time.perf_counter(), 0
      compile_seconds.take()               # the evaluation's compile was not the steps'
    stop = step < last_step and stops.requested(step - first_step + 1)
    if checkpoints.should_save(step) or step == last_step or stop:
      # Never save a non-finite state: this step's loss (the parameters it started from) and
      # gradient norm (the update it made) must be finite, and so must the parameters it
      # made. Waits for this step's figures.
      _check_finite(step, metrics, checkpoints, clipped)
      _check_params_finite(step, state.params, checkpoints)
      t_save = time.perf_counter()      # the step is done (its figures were read): from here on
      with compile_seconds.left_out():
        checkpoints.save(step, state, data.train.get_state())
      t_log += time.perf_counter() - t_save   # the save's own time, left out of the steps'
    if stop:
      checkpoints.wait()
      raise stops.interrupted(step, checkpoints.step_path(step))
  return record
