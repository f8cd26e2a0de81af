"""The step of the sharded family (ZeRO-3, ZeRO++, CIERA, moejax fsdp and its codec modes).

Units in order: the embedding, each layer, the lm head. Each unit's weights are gathered in the
forward and again in the backward (re-gathered for recomputation / the backward), its gradient
reduce-scattered after its backward. Per unit and pass:

  deepspeed, on demand   a framework cost `host_s` per tensor (compute stream: the host is
                         busy, nothing else launches), then the all-gather (one collective per
                         tensor: LAUNCH_S each), then the compute. DeepSpeed keeps tensors under
                         1e5 elements (norms) unpartitioned: never gathered.
  CIERA's selected       gathered per unit by CIERA's path, issued one unit ahead: one `host_s`,
                         hash + pack (side stream with CCP, else compute stream), the
                         all-gather of the compressed payload, decode before the compute.
  xla (moejax)           one all-gather per parameter group and unit, issued before the previous
                         unit's compute; encode before it, decode after it, on the compute
                         stream (XLA runs them as kernels among the layer's).
Backward: recompute (remat) + backward FLOPs, then the reduce-scatter (deepspeed: `host_s` per
tensor first; moejax also reduce-scatters one layer's gradient of zeros as its backward scan
starts, config `scatter_ahead`); ZeRO++ gathers the backward from the node-local copy (hpZ) and reduces int4
gradients hierarchically (qgZ). The optimizer step (memory-bound) waits for the last
reduce-scatter.
"""
from __future__ import annotations

import dataclasses

from moejax.perf import codec as cd
from moejax.perf import compute as cp
from moejax.perf.hardware import LAUNCH_S
from moejax.perf.model import Calibration, Run, StepTime, net_of
from moejax.perf.schedule import Program, simulate
from moejax.perf.shapes import PERSISTENCE_THRESHOLD, ModelShape


@dataclasses.dataclass
class _Group:
  values: float
  tensors: int            # separately fetched tensors (deepspeed); 0: not partitioned
  ratio: float = 1.0      # bytes sent / plain
  compressed: bool = False
  encode_s: float = 0.0
  decode_s: float = 0.0


@dataclasses.dataclass
class _Unit:
  name: str
  groups: dict
  flops: float            # forward FLOPs of this GPU's tokens
  layer: bool


def _units(shape: ModelShape, run: Run) -> list[_Unit]:
  t, s = run.tokens_per_gpu, run.seq_len
  emb = shape.vocab_size * shape.d_model
  big = int(emb >= PERSISTENCE_THRESHOLD)
  out = [_Unit("embed", {"embeddings": _Group(emb, big)}, 0.0, False)]
  for i, (moe, linear) in enumerate(shape.layers()):
    sizes = shape.layer_groups(moe, linear)
    tensors = shape.modules_per_layer(moe, linear)
    groups = {g: _Group(n, tensors.get(g, 0)) for g, n in sizes.items()}
    out.append(_Unit(f"layer{i}", groups,
                     t * sum(cp.layer_flops(shape, s, moe, linear).values()), True))
  out.append(_Unit("head", {"embeddings": _Group(emb, big)}, t * cp.head_flops(shape), False))
  return out


def _apply_codec(units, shape, run, system, net, hbm, ratios):
  w = run.gpus
  for u in units:
    for g, grp in u.groups.items():
      if system.codec == "ciera":
        q = cd.block_rate(shape.name.split(" (")[0], g)
        r = cd.ciera_ratio(q, run.dtype)
        dec = cd.decode_seconds(grp.values, r, hbm)
        enc = cd.encode_seconds(grp.values / w, r, hbm)
        plain = net.all_gather(2 * grp.values)
        gain = plain - net.all_gather(2 * grp.values * r) - dec
        if (gain > 0 or not system.select) and (grp.tensors or system.framework != "deepspeed"):
          grp.ratio, grp.compressed, grp.encode_s, grp.decode_s = r, True, enc, dec
      elif system.codec in cd.CACHE_BYTES_PER_VALUE:
        r = ratios.of(g) if ratios is not None else cd.measured(system.codec).of(g)
        if r < 1.0:
          grp.ratio, grp.compressed = r, True
          grp.encode_s = cd.encode_seconds(grp.values / w, r, hbm)
          grp.decode_s = cd.decode_seconds(grp.values, r, hbm)


def step(shape: ModelShape, cluster, run: Run, system, calib: Calibration,
         ratios: cd.Ratios | None = None) -> StepTime:
  net = net_of(cluster, run.gpus, calib)
  gpu = cluster.gpu
  eff, hbm = calib.gpu(gpu.kind), gpu.hbm_bandwidth
  deepspeed = system.framework == "deepspeed"
  host = calib.host("deepspeed") if deepspeed else 0.0
  zpp = system.codec == "zero++"
  units = _units(shape, run)
  _apply_codec(units, shape, run, system, net, hbm, ratios)
  p = Program()
  state = {"prev": None}

  def on_demand(u: _Unit, backward: bool):
    """deepspeed: the tensors not on CIERA's path, fetched one by one."""
    if not deepspeed:
      return None
    groups = [g for g in u.groups.values() if g.tensors and not g.compressed]
    if not groups:
      return None
    tensors = sum(g.tensors for g in groups)
    full = sum(2 * g.values for g in groups)
    h = p.add("host", "compute", tensors * host, state["prev"], f"{u.name} fetch")
    if zpp and backward:
      t = net.intra_node_all_gather(full)
    elif zpp:
      t = net.all_gather(full * cd.ZEROPP_INT8)
    else:
      t = net.all_gather(full)
    ag = p.add("ag", "comm", t + (tensors - 1) * LAUNCH_S, (h,), f"{u.name} gather")
    if zpp and not backward:
      vals = sum(g.values for g in groups)
      q = p.add("codec", "compute", cd.quantize_seconds(vals / run.gpus, 2, 1, hbm), (h,))
      ag = p.add("ag", "comm", 0.0, (ag, q))
      return p.add("codec", "compute", cd.quantize_seconds(vals, 1, 2, hbm), (ag,),
                   f"{u.name} dequantize")
    return ag

  def prefetchable(u: _Unit):
    """(groups gathered ahead of use) for this framework."""
    if deepspeed:
      return [g for g in u.groups.values() if g.compressed]
    return list(u.groups.values())

  def issue(u: _Unit):
    """Issues the ahead-of-use gather of `u`; returns the op its decode waits for."""
    groups = prefetchable(u)
    if not groups:
      return None
    deps = state["prev"]
    if deepspeed:
      deps = p.add("host", "compute", host, deps, f"{u.name} ciera gather")
    enc = sum(g.encode_s for g in groups)
    if enc:
      stream = "side" if (deepspeed and system.overlap_codec) else "compute"
      deps = p.add("codec", stream, enc, deps, f"{u.name} encode")
    full = sum(2 * g.values * g.ratio for g in groups)
    t = net.all_gather(full) + (len(groups) - 1) * LAUNCH_S
    return p.add("ag", "comm", t, deps, f"{u.name} gather")

  last_comm = None
  xla = not (deepspeed or zpp)
  ahead, in_place = xla and system.scatter_ahead, xla and not system.scatter_ahead
  first_layer_back = next((u for u in units[::-1] if u.layer), None)
  last_rs = None
  for backward, seq in ((False, units), (True, units[::-1])):
    pending = {0: issue(seq[0])}
    for i, u in enumerate(seq):
      if i + 1 < len(seq):
        pending[i + 1] = issue(seq[i + 1])
      if ahead and backward and u is first_layer_back:
        # moejax's backward scan reduce-scatters each layer's gradient under the backward of
        # the layer before it, and its first layer a gradient of zeros (config scatter_ahead)
        p.add("rs", "comm", net.reduce_scatter(system.rs_bytes * sum(
            g.values for g in u.groups.values())), state["prev"], f"{u.name} zeros scattered")
      waits = [pending.pop(i), on_demand(u, backward)]
      dec = sum(g.decode_s for g in prefetchable(u))
      if dec:
        waits = [p.add("codec", "compute", dec, waits, f"{u.name} decode")]
      mult = (cp.BACKWARD + (1.0 if (run.remat and u.layer) else 0.0)) if backward else 1.0
      if in_place and backward and last_rs is not None:
        waits = waits + [last_rs]       # the unit after it waits for its reduce-scatter
      c = p.add("compute", "compute", cp.seconds(mult * u.flops, gpu.peak_flops, eff),
                waits + [state["prev"]], f"{u.name} {'bwd' if backward else 'fwd'}")
      state["prev"] = c
      if backward:
        # Every gradient is reduced, DeepSpeed's unpartitioned small tensors too (their
        # tensors count 0: no fetch hook; they were left out here, and a tiny shape's ZeRO-3
        # step came out as 0 ms).
        groups = list(u.groups.values())
        full = sum(g.values for g in groups)
        deps = c
        if deepspeed:
          deps = p.add("host", "compute", sum(g.tensors for g in groups) * host, c,
                       f"{u.name} reduce hooks")
          state["prev"] = deps
        if zpp:
          deps = p.add("codec", "compute", cd.quantize_seconds(full, 4, 0.5, hbm), deps)
          state["prev"] = deps
          t = net.reduce_scatter(2 * full * cd.ZEROPP_INT4, "hierarchical")
        else:
          t = net.reduce_scatter(system.rs_bytes * full)
        last_comm = last_rs = p.add("rs", "comm", t, deps, f"{u.name} reduce-scatter")
  total = shape.total_params()
  opt = cp.memory_seconds(cp.OPTIMIZER_BYTES_PER_PARAM * total / run.gpus, hbm)
  p.add("optimizer", "compute", opt, (state["prev"], last_comm), "optimizer")
  res = simulate(p)
  sent = sum(2 * g.values * g.ratio for u in units for g in u.groups.values())
  plain = sum(2 * g.values for u in units for g in u.groups.values())
  comp = sum(2 * g.values for u in units for g in u.groups.values() if g.compressed)
  largest = max(sum(g.values for g in u.groups.values()) for u in units)
  cache = 0.0
  if system.codec in cd.CACHE_BYTES_PER_VALUE:
    cache = cd.CACHE_BYTES_PER_VALUE[system.codec] * sum(
        g.values for u in units for g in u.groups.values() if g.compressed)
  elif system.codec == "ciera":
    cache = sum(g.values for u in units for g in u.groups.values() if g.compressed)
  # fp32 gradient shards beside master and moments where the reduction is fp32, and in moejax
  # whatever it sums in (the optimizer gets fp32 gradients)
  fp32_grads = system.rs_bytes > 2 or system.framework == "xla"
  state_bytes = (16.0 + (2.0 if fp32_grads else 0.0)) * total / run.gpus
  extra = {
      "gather_ratio": sent / plain,
      "compressed_fraction": comp / plain,
      "memory_gb": (state_bytes + 2 * 2 * largest + cache) / 1e9,
      "gather_gb": 2 * sent * (run.gpus - 1) / run.gpus / 1e9,
  }
  return StepTime(res.seconds, res.exposed, res.busy, extra)
