"""Per-device memory of one train step, by component, from the config and a device count alone:
no devices, no compile (`jax.eval_shape` only), so it answers for a cluster you do not have.

  parameters      fp32 master shards (the parameter layouts: `moejax.sharding.layout`)
  optimizer       the optimizer state of those shards (optax's own `init`, abstractly)
  gradients       fp32 gradient shards, live with both of the above before the update
  placement       fssdp's load history and expert owners, and its replica codec's caches
  codec_state     the compressed gather's caches (codec.mode; auto: a cache of every shard)
  batch           this device's inputs and targets
  gathered        compute-dtype copies of gathered weights live at once: the embedding and head
                  tables, one layer (two with prefetch) of every layer group, all layers when
                  remat="none" keeps them for backward, plus one layer's weight gradient
                  before its reduce-scatter (fp32, or config.reduce_dtype), and with prefetch
                  (and scatter_ahead not "never") the layer's before it (compute dtype: it is
                  reduce-scattered while the next layer's backward runs); under ep/fssdp the
                  experts are not gathered (their owned slots are cast, fssdp adds its M
                  replicas, gathered again in backward)
  activations     what the remat policy keeps per layer (`moejax.sharding.prefetch`): full, the
                  layer inputs; minimal, also every matmul output; none, also the elementwise
                  intermediates; plus one layer's working set twice (recompute and cotangents) and
                  the fp32 logits with their gradient
  exchange        ep/fssdp dispatch buffers of one MoE layer (forward and backward; every layer's
                  forward under remat="none"): on GPU (packed) the A = T x K rows sent and the
                  rows the experts run received (on CPU N x C rows each way), those rows
                  (moe.receive_capacity_factor's) sorted by expert and their hidden rows, and
                  fssdp's replica rows: Q = fssdp.owner_sends send
                  rows (compute dtype) and SparseReduceScatter's Q fp32 receive rows

It models the program a GPU runs (attention in the fused kernel, no score matrix kept, but
DeepSeek sparse attention's, a block of queries at a time: `sparse_attention_bytes`; bf16
matmuls accumulate in fp32 without upcast copies of the weights). XLA:CPU's buffers differ: it
upcasts every bf16 dot to fp32 copies and keeps small scratch for each fusion
(tests/sharding/test_memory.py: the state and batch exactly, the whole within 10% for the tiny
preset on 8 devices, with the ratios measured for the other placements and remat policies).

`check_fits` is what the Trainer calls: on a device whose memory XLA reports (GPUs), a config
whose step cannot fit stops with one line naming the largest component's field and the bytes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from moejax.config import Config, expert_values, num_moe_layers
from moejax.errors import ConfigError
from moejax.placement import ownership, planner

# The config field that sizes each component, named when the step does not fit.
FIELDS = {"parameters": "model (its shapes)", "optimizer": "optim", "gradients": "model",
          "placement": "fssdp.window",
          "codec_state": "codec.mode", "batch": "batch_size",
          "gathered": "prefetch / remat", "activations": "remat (or batch_size x seq_len)",
          "exchange": "moe.dispatch_capacity_factor"}


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes per device by component (`components`, in the module docstring's order)."""
  num_devices: int
  components: dict

  @property
  def total(self) -> int:
    return int(sum(self.components.values()))

  @property
  def largest(self) -> str:
    return max(self.components, key=self.components.get)

  def table(self) -> str:
    rows = [f"{name:<12} {_gib(b):>11}" for name, b in self.components.items()]
    return "\n".join(rows + [f"{'total':<12} {_gib(self.total):>11}"])



def linear_attention_bytes(cfg: Config, tokens: int) -> int:
  """One layer's extra working bytes of Gated DeltaNet (`model.linear_layers`) over `tokens`
  local tokens, fp32: its projections (q, k, v, z, b, a), per chunk of 64 the decays and the
  k.k and q.k products [Hv, 64, 64] and the updates and their changes per unit of memory
  [Hv, 64, Dv + Dk], and the memory before each chunk [Hv, Dk, Dv], which the scan's backward
  keeps."""
  from moejax.layers.linear_attention import CHUNK
  m = cfg.model
  if not m.linear_layers:
    return 0
  hv, dk, dv = m.linear_value_heads, m.linear_key_dim, m.linear_value_dim
  widths = 2 * m.linear_key_heads * dk + 2 * hv * dv + 2 * hv
  per_token = widths + hv * (3 * CHUNK + 2 * (dk + dv))
  return 4 * (tokens * per_token + -(-tokens // CHUNK) * hv * dk * dv)


def sparse_attention_bytes(cfg: Config, tokens: int) -> int:
  """One layer's extra working bytes of DeepSeek sparse attention over `tokens` local tokens:
  past index_topk keys the attention over the selection (`attention.attend_selected`) holds a
  block of queries' fp32 scores and probabilities [b, H, Sb, S] and, in the backward, their
  gradients beside them (XLA:CPU measured 4.1 such arrays), fp32 copies of k and v, and the mask
  [b, S, S] with its padded copy;
  the indexer scores a block of queries at a time, [b, Sb, Hi, S] fp32, and, training it, its
  loss also holds the attention's [b, H, Sb, S] fp32."""
  from moejax.layers.attention import INDEX_QUERY_BLOCK
  m, s = cfg.model, cfg.seq_len
  if not m.index_topk:
    return 0
  b, block = tokens // s, min(s, INDEX_QUERY_BLOCK)
  out = b * block * s * 4 * (m.index_heads + (m.num_heads if m.train_indexer else 0))
  if s > m.index_topk:
    heads = m.num_heads
    out += (b * block * s * 4 * heads * 4 + 2 * b * s * s
            + b * s * heads * (m.head_dim + m.v_head_dim) * 4)
  return out

def _gib(nbytes: float) -> str:
  """Binary units sized to the figure: a tiny preset's parts read in KiB or MiB, not 0.00 GiB."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(nbytes) >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes:.0f} B"


def _nbytes(tree) -> int:
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def memory_report(cfg: Config, num_devices: int, *,
                  dispatch_capacity_factor: float | None = None,
                  packed_exchange: bool = True) -> MemoryReport:
  """Per-device bytes of `cfg`'s train step on `num_devices` devices (module docstring).
  `dispatch_capacity_factor`: the ep/fssdp buffers' factor, if not the config's;
  `packed_exchange`: the GPU's packed exchange buffers (False: XLA:CPU's per-destination
  blocks, `Dispatch.packed`)."""
  from moejax.models import olmoe
  from moejax.placement.dispatch import ep_capacity, packed_span
  from moejax.sharding import axes, hook, layout as layout_lib
  from moejax.sharding.prefetch import recomputes
  from moejax.train import optim
  from moejax.train.state import placement_for
  from moejax.train.step import check_batch_divides
  n = num_devices
  # What training on n devices would refuse, refused here too (the mesh config.mesh.shape gives).
  check_batch_divides(cfg, n)
  from moejax.sharding.mesh import resolve_shape
  _, per_node = resolve_shape(cfg.mesh.shape, n)     # the mesh a run on n devices would build
  placement = placement_for(cfg, n, per_node, packed_exchange=packed_exchange)
  placement.check()
  m, moe = cfg.model, cfg.moe
  factor = moe.dispatch_capacity_factor if dispatch_capacity_factor is None else (
      dispatch_capacity_factor)
  placement = dataclasses.replace(placement, dispatch_capacity_factor=factor)
  c = np.dtype(hook.COMPUTE_DTYPES[cfg.compute_dtype]).itemsize
  meta = olmoe.param_meta(cfg)
  layouts = layout_lib.param_layouts(meta, moe.placement, n)
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))

  def shard(x, lay):
    shape = list(x.shape)
    if lay.kind != "replicate":
      shape[lay.dim] = -(-shape[lay.dim] // n)
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)

  shards = jax.tree.map(shard, shapes, layouts,
                        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
  parameters = _nbytes(shards)
  # The optimizer's state, and the step counter beside it.
  optimizer = _nbytes(jax.eval_shape(optim.make_optimizer(cfg).init, shards)) + 4

  # Gathered weights: per group, one copy's elements (a layer's slice of a layer group).
  tokens = cfg.batch_size * cfg.seq_len // n
  owns = moe.placement in ("ep", "fssdp")
  gathered = 0
  layer_elems = {}                          # group -> (gathered, local expert) elements per layer
  for group, group_meta in meta.items():
    leaves = jax.tree.leaves(group_meta)
    stacked = leaves[0].axes[0] == "layers"
    full = local = 0
    for leaf, lay in zip(leaves, jax.tree.leaves(layouts[group])):
      size = math.prod(leaf.shape) // (leaf.shape[0] if stacked else 1)
      if owns and lay.kind == "expert":
        local += size // n
      elif lay.kind != "replicate" or (c < 4 and leaf.group not in axes.FLOAT32_GROUPS):
        full += size        # gathered, or a replicated master cast to the compute dtype
    if not stacked:
      gathered += full * c
    else:
      layer_elems[group] = (full, local)
  fssdp_replicas = 0
  if moe.placement == "fssdp":
    fssdp_replicas = cfg.fssdp.replica_slots * expert_values(cfg)
  kept_layers = (sum(n for group, n in olmoe.layer_groups(cfg).items() if group in layer_elems)
                 if cfg.remat == "none" else 0)
  biggest = max([f + l + fssdp_replicas * (g in olmoe.MOE_GROUPS)
                 for g, (f, l) in layer_elems.items()], default=0)
  live = (2 if cfg.prefetch else 1)
  r = hook.reduce_dtype_of(hook.COMPUTE_DTYPES[cfg.compute_dtype],
                           hook.REDUCE_DTYPES[cfg.reduce_dtype]).itemsize
  pending = 1 if cfg.prefetch and cfg.scatter_ahead != "never" else 0    # the GPU's program
  gathered += live * biggest * c + biggest * r + pending * biggest * c + kept_layers * biggest * c

  # Activations (compute dtype unless noted), per layer of T tokens here.
  d, v = m.d_model, m.vocab_size
  heads, kv = m.num_heads, (m.num_kv_heads or m.num_heads)
  head_dim = m.head_dim or d // heads
  k, f, e = moe.top_k, moe.expert_hidden, moe.num_experts
  a = tokens * k
  q_heads = 2 * heads if m.attention_gate else heads     # the gate is a second q-sized output
  matmul_out = tokens * ((q_heads + 2 * kv) * head_dim + d) * c + tokens * e * 4 + (
      a * (2 * f + d) * c) + tokens * moe.shared_expert_hidden * 3 * c
  elementwise = tokens * d * 4 * c + a * f * 4 + a * d * 4        # norms, rope, silu, combine
  per_layer_saved = {"full": tokens * d * c, "minimal": tokens * d * c + matmul_out,
                     "none": tokens * d * c + matmul_out + elementwise}[cfg.remat]
  layers, linear = m.num_layers, len(m.linear_layers)
  linear_bytes = linear_attention_bytes(cfg, tokens)
  saved_linear = per_layer_saved
  if linear and cfg.remat != "full":   # a linear layer keeps its own projections and its
    # chunks' fp32 arrays (the saved dots among them) in place of q, k and v
    projections = (2 * m.linear_key_heads * m.linear_key_dim
                   + 2 * m.linear_value_heads * (m.linear_value_dim + 1))
    saved_linear += tokens * (projections - (q_heads + 2 * kv) * head_dim) * c + linear_bytes
  working = (2 * (tokens * d * c + matmul_out + elementwise) + sparse_attention_bytes(cfg, tokens)
             + linear_bytes)
  logits = 2 * tokens * v * 4
  activations = (layers - linear) * per_layer_saved + linear * saved_linear + working + logits

  exchange = 0
  if owns and n > 1:
    pieces = moe.dispatch_chunks
    cap = ep_capacity(a, n, factor, placement.max_rows(tokens))
    # the rows the experts run (`dispatch.receive_capacity`, each piece's)
    computed = placement.receive_capacity(tokens) * pieces
    # Per-destination blocks: N x C rows sent and received. Packed (GPU): the send regions
    # (`dispatch._packed_pieces`), and the computed rows received.
    blocks = n * -(-cap // pieces) * pieces
    sent = packed_span(a, n, pieces) * pieces if packed_exchange else blocks
    received = computed if packed_exchange else blocks
    # Rows out and back (sent, received, the experts' results, returned), the computed rows'
    # sorted-by-expert copies in and out of the grouped matmul, the expert ids, and their
    # hidden rows (gate and up accumulated in fp32, their product).
    forward = (2 * (sent + received) * d * c + 2 * computed * d * c + (sent + received) * 4
               + computed * f * (2 * 4 + c))
    exchange = forward * (num_moe_layers(cfg) if not recomputes(cfg.remat) else 1) + forward
  # fssdp's ragged SparseAllGather sends from Q rows (the most slots one owner fills, the
  # planner's fssdp.owner_sends; N x M unbounded) and its SparseReduceScatter receives Q fp32
  # gradient rows, sends its M replicas' gradients in fp32 and sums the C owned experts' in fp32.
  sends = planner.resolve_owner_sends(cfg.fssdp.resolved_owner_sends(), n,
                                      cfg.fssdp.replica_slots)
  expert = expert_values(cfg)
  owned = cfg.fssdp.max_per_layer or ownership.default_max_per_layer(e, max(n, 1))
  replica_rows = sends * expert * (c + 4)           # one gather's send rows and SpRS's rows
  if owns and n > 1 and moe.placement == "fssdp":
    exchange += replica_rows + (cfg.fssdp.replica_slots + owned) * expert * 4
  placement = 0
  if moe.placement == "fssdp":     # FssdpState: the load history (fp32), the owners and what
    experts = num_moe_layers(cfg) * e    # the replica slots held last step (int32)
    placement = ((cfg.fssdp.window * experts + experts) * 4 + 4
                 + num_moe_layers(cfg) * n * cfg.fssdp.replica_slots * 4)   # updated in place
    if cfg.fssdp.resolved_replica_codec(cfg.codec.mode) != "off":
      # The replica codec: last step's replicas (M) and owned experts (C) as bit patterns
      # (`moejax.codec.replicas`); the step's new ones live beside them until it returns. One
      # layer's coded gather adds the owned experts' plain and patch rows, and its Q rows
      # gathered from them beside the packed send buffer (uint32 words, about the expert's
      # bytes each; the packed buffer replaces the plain send rows).
      per_layer = owned + cfg.fssdp.replica_slots
      placement += 2 * num_moe_layers(cfg) * (per_layer * expert * c + 1)
      exchange += (2 * owned + sends) * expert * c
  if moe.placement == "fssdp" and cfg.fssdp.calibrate:
    # Calibration's late SparseAllGather (every step; it moves only a re-plan's new replicas)
    # holds a second set of M replicas (and its send rows and SpRS) beside the planned one.
    gathered += fssdp_replicas * c
    exchange += replica_rows
  codec_state = _codec_state_bytes(cfg, meta, layouts, n)
  batch = 2 * tokens * 4
  return MemoryReport(n, {
      "parameters": parameters, "optimizer": optimizer, "gradients": parameters,
      "placement": placement, "codec_state": codec_state, "batch": batch,
      "gathered": int(gathered),
      "activations": int(activations), "exchange": int(exchange)})


def _codec_state_bytes(cfg: Config, meta, layouts, n: int) -> int:
  """Caches of the compressed gather (`moejax.codec.gather.state_bytes`) for every sharded
  parameter in codec.mode; auto counts the largest, delta's whole-value caches, within
  codec.cache_budget_bytes when one is set."""
  from moejax.codec import gather as codec
  from moejax.sharding import hook
  mode = cfg.codec.mode
  if mode == "off" or n == 1:
    return 0
  c = cfg.codec
  spec = codec.CodecSpec("delta" if mode == "auto" else mode, block_size=c.block_size,
                         detect=c.detect if mode == "block" else "exact",
                         delta_bits=c.delta_bits)
  total = 0
  for group in meta:
    for leaf, lay in zip(jax.tree.leaves(meta[group]), jax.tree.leaves(layouts[group])):
      if lay.kind != "shard":
        continue
      stacked = leaf.axes[0] == "layers"
      shape = list(leaf.shape)
      shape[lay.dim] //= n
      total += (leaf.shape[0] if stacked else 1) * codec.state_bytes(
          tuple(shape[1:] if stacked else shape), hook.COMPUTE_DTYPE, n, spec)
  if mode == "auto" and c.cache_budget_bytes:
    total = min(total, c.cache_budget_bytes)
  return total


def device_memory_bytes(device) -> int | None:
  """The memory XLA lets one device use (GPUs report it; CPU devices do not: None)."""
  try:
    stats = device.memory_stats()
  except Exception:           # some backends raise instead of returning None
    return None
  return (stats or {}).get("bytes_limit")


# The report's accuracy against XLA's buffers (tests/sharding/test_memory.py: within 10%): a
# step estimated at most this much over the device's memory may still fit, and is not refused.
TOLERANCE = 1.1


def check_fits(cfg: Config, num_devices: int, limit_bytes: int, *, why: str = "",
               tolerance: float = 1.0, packed_exchange: bool = True) -> MemoryReport:
  """The report; ConfigError naming the largest component's field and the bytes when the step
  needs more than `tolerance` x `limit_bytes` per device (`device_memory_bytes`, or a GPU's
  you plan for). `packed_exchange` as `memory_report`'s."""
  report = memory_report(cfg, num_devices, packed_exchange=packed_exchange)
  limit = limit_bytes
  if report.total > tolerance * limit:
    part = report.largest
    field = FIELDS[part]
    if (part == "exchange" and packed_exchange and cfg.moe.dispatch_overflow == "grow"
        and cfg.moe.receive_capacity_factor > 0):   # uncapped sends: R bounds what arrives
      field = "moe.receive_capacity_factor"
    reason = f" ({why})" if why else ""
    raise ConfigError(
        f"config.{field}: the train step needs about {_gib(report.total)} per device"
        f"{reason}, more than the device's {_gib(limit)}; {part} alone takes "
        f"{_gib(report.components[part])} (moejax.train.memory.memory_report has every part)")
  return report


__all__ = ["MemoryReport", "memory_report", "check_fits", "device_memory_bytes"]
