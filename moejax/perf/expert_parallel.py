"""The step of the expert-parallel family (ep, uniform, FasterMoE, FlexMoE, Themis, moejax's
ep and fssdp), replayed over the steps of a load trace.

Per MoE layer, forward (each op on the critical GPU: the slowest device, the busiest link):
  [replicas] SparseAllGather of this step's planned replicas, issued before attention (overlaps
             it); with calibration, the replicas added after gating are fetched on the path;
             with the replica codec a replica its device held last step travels as a patch of
             `replica_ratio` of its bytes (moejax's `fssdp.replica_codec`)
  attention (+ router)  compute; [fsdp dense] its weights gathered one layer ahead
  [fastermoe] broadcast of the shadowed experts (on the path, after gating)
  dispatch all-to-all   tokens to the devices holding their experts (bf16 rows of width D)
  shared experts        compute, overlapping the dispatch
  experts               the busiest device's assignments; the excess over the mean is straggler
  combine all-to-all    (as dispatch's: the busiest link's excess over an even exchange is
                        straggler too)
Backward in reverse: [remat: the forward again], combine's transpose, expert backward, dispatch's
transpose, [replicas: SparseReduceScatter of replica gradients, fp32, overlapping attention's
backward], attention backward, then the dense gradients: all-reduced on their own stream (dp)
or reduce-scattered (fsdp). FasterMoE all-reduces shadowed experts' gradients; FlexMoE its
replicas' gradients; both and heterogeneous sharding pay their migrations amortized over their
interval (`reshard`). The optimizer step waits for all of it.
"""
from __future__ import annotations

import numpy as np

from moejax.perf import compute as cp
from moejax.perf import loads as ld
from moejax.perf.model import Calibration, Run, StepTime, mean_steps, net_of
from moejax.perf.schedule import Program, simulate
from moejax.perf.shapes import ModelShape

WINDOW = 5
"""Load predictor: the mean of the last WINDOW steps (Themis Sec. 4.2 w=5; moejax
fssdp.window=5). The first WINDOW steps of a trace warm it up and are not timed."""
FLEX_INTERVAL = 50
FLEX_SLOTS = 2
FASTER_CANDIDATES = (0, 1, 2, 4, 8, 16)
STATE_BYTES_PER_PARAM = 16.0
"""An expert that moves takes its bf16 weights, fp32 master copy and Adam moments (2+4+4+4)
and its bf16 gradient buffer (2)."""


def themis_overlap_degree(shape: ModelShape, cluster, run: Run, calib: Calibration) -> int:
  """Themis Sec. 4.2: t = floor(T_attn * bw / Psi), bw the per-node ingress when inter-node binds."""
  net = net_of(cluster, run.gpus, calib)
  flops = [cp.layer_flops(shape, run.seq_len, True, linear)["attention"]
           for moe, linear in shape.layers() if moe]       # its MoE layers' mean attention
  t_attn = cp.seconds(run.tokens_per_gpu * sum(flops) / len(flops),
                      cluster.gpu.peak_flops, calib.gpu(cluster.gpu.kind))
  bw = net.b_inter if net.nodes > 1 else net.b_intra
  return max(1, int(t_attn * bw / (2.0 * shape.expert_params())))


def _spag_bytes(holders_ExN, owner_E, dpn, psi, kept_ExN=None, ratio=1.0, direct=False):
  """(busiest GPU's bytes, busiest node's bytes over its NICs) of fetching the replicas; a
  replica in `kept_ExN` (its device held it last step) costs `ratio` of `psi`. Themis
  (`direct=False`) routes an expert once to each node that needs it and broadcasts it there: a
  node's ingress carries it once (as a patch when every receiver there kept it, else whole), a
  GPU's figure is what it receives. moejax (`direct=True`) sends every replica from its owner
  (one `ragged_all_to_all`): a GPU's figure is the larger of what it receives and what it sends
  as owner (at most `fssdp.owner_sends` replicas), a node's the larger of its NICs' ingress and
  egress, each replica crossing on its own. The transpose moves the same bytes the other way."""
  rep = holders_ExN.copy()
  rep[np.arange(rep.shape[0]), owner_E] = False
  n = rep.shape[1]
  kept = np.zeros_like(rep) if kept_ExN is None else (kept_ExN & rep)
  cost_ExN = np.where(kept, ratio * psi, psi) * rep
  node = np.arange(n) // dpn
  g = node.max() + 1
  per_gpu = cost_ExN.sum(0).max() if rep.any() else 0.0
  owner_node = node[owner_E]
  if direct:
    per_gpu = max(per_gpu, np.bincount(owner_E, weights=cost_ExN.sum(1), minlength=n).max())
    cross_ExN = cost_ExN * (owner_node[:, None] != node[None, :])
    ingress = np.bincount(node, weights=cross_ExN.sum(0), minlength=g)
    egress = np.bincount(owner_node, weights=cross_ExN.sum(1), minlength=g)
    return per_gpu, max(ingress.max(), egress.max()) if g > 1 else 0.0
  ingress = np.zeros(g)
  for e in np.nonzero(rep.any(1))[0]:
    for nd in np.unique(node[rep[e]]):
      if nd != owner_node[e]:
        here = (node == nd) & rep[e]
        ingress[nd] += ratio * psi if kept[e, here].all() else psi
  return per_gpu, ingress.max() if g > 1 else 0.0


def step(shape: ModelShape, cluster, run: Run, system, calib: Calibration,
         trace: np.ndarray | None = None, steps: int | None = None) -> StepTime:
  if trace is None:
    raise ValueError(f"system {system.name!r} places experts by load: pass a trace")
  trace = np.asarray(trace)
  s_count, l_count, n, e = trace.shape
  if n != run.gpus or e != shape.num_experts or l_count != shape.moe_layers:
    raise ValueError(f"trace is [steps, {l_count} layers, {n} devices, {e} experts]; the run "
                     f"needs {shape.moe_layers} layers, {run.gpus} devices, "
                     f"{shape.num_experts} experts")
  if s_count <= WINDOW:
    raise ValueError(f"trace has {s_count} steps; need more than {WINDOW} (predictor warm-up)")
  dpn = cluster.per_node(n)
  dropped = None
  if system.admission != "none":
    # admission runs before dispatch, so the load history the planner and re-sharding see is
    # of the admitted assignments (as moejax's LoadHistory records them)
    trace = trace.astype(np.float64)
    dropped = np.zeros((s_count, l_count))
    over = np.zeros((s_count, l_count))
    for i in range(s_count):
      for j in range(l_count):
        trace[i, j], dropped[i, j], over[i, j] = ld.admit(trace[i, j], system.capacity_factor,
                                              shape.top_k, int(run.tokens_per_gpu),
                                              system.admission)
  owner = np.tile(ld.even_owners(e, n), (l_count, 1))
  t = system.overlap_degree or themis_overlap_degree(shape, cluster, run, calib)
  m = system.replica_slots or t
  results = []
  last = s_count if steps is None else min(s_count, WINDOW + steps)
  flex_holders = None
  reshard_cost_bytes = 0.0
  flex_cost_bytes = 0.0
  moved_total = 0
  held_L = None      # the replica codec: each layer's holders last step
  for s in range(WINDOW, last):
    hist = trace[s - WINDOW:s].sum(2).mean(0).astype(np.float64)      # [L, E] predicted
    if system.het_sharding and (s - WINDOW) % system.reshard_every == 0 and n > 1:
      from moejax.placement.ownership import heterogeneous_placement
      from moejax.placement.reshard import by_pool
      new = by_pool(lambda h, o: heterogeneous_placement(h, n, dpn, previous_owner_LxE=o),
                    shape.moe_pools(), hist, owner)
      moved = int((new != owner).sum())
      if s > WINDOW:
        moved_total += moved
        reshard_cost_bytes = moved * STATE_BYTES_PER_PARAM * shape.expert_params()
      owner = new.astype(np.int64)
    if system.balance == "flexmoe" and (s - WINDOW) % FLEX_INTERVAL == 0:
      new = [ld.plan_replicas(hist[l], owner[l], n, dpn, slots=FLEX_SLOTS, overlap=n * FLEX_SLOTS,
                              method="lpt") for l in range(l_count)]
      if flex_holders is not None:
        changed = sum(int((a & ~b).sum()) for a, b in zip(new, flex_holders))
        flex_cost_bytes = changed * STATE_BYTES_PER_PARAM * shape.expert_params()
      flex_holders = new
    if system.het_sharding and (s - WINDOW) % system.reshard_every == 0:
      held_L = None   # owners moved: the codec's caches start again
    result, held_L = _one_step(shape, cluster, run, system, calib, trace[s], hist, owner, t, m,
                               dpn, flex_holders,
                               reshard_cost_bytes / max(system.reshard_every, 1)
                               + flex_cost_bytes / FLEX_INTERVAL, held_L)
    results.append(result)
  out = mean_steps(results)
  if dropped is not None:
    out.extra["dropped_fraction"] = float(dropped[WINDOW:last].mean())
    out.extra["over_capacity_fraction"] = float(over[WINDOW:last].mean())
  out.extra["overlap_degree"] = float(t)
  out.extra["reshard_moved_experts"] = float(moved_total)
  return out


def _layer_plan(system, counts, pred, owner_E, n, dpn, t, m, flex):
  """(holders, late holders (fetched after gating), shadowed experts) of one layer."""
  if system.balance == "replicas":
    sends = t if system.owner_sends == -1 else system.owner_sends
    h = ld.plan_replicas(pred, owner_E, n, dpn, slots=m, overlap=t, method=system.planner,
                         owner_sends=sends)
    late = np.zeros_like(h)
    if system.calibrate:
      h2 = ld.plan_replicas(counts.sum(0).astype(np.float64), owner_E, n, dpn, slots=m,
                            overlap=t, method=system.planner, owner_sends=sends)
      late = h2 & ~h
      h = h | h2
    return h, late
  if system.balance == "flexmoe":
    return flex, np.zeros_like(flex)
  h = ld.owner_holders(owner_E, n)
  return h, np.zeros_like(h)


def _one_step(shape, cluster, run, system, calib, counts_LxNxE, pred_LxE, owner_LxE, t, m, dpn,
              flex_holders, amortized_bytes, held_L=None):
  """(StepTime, each layer's holders: what the replica codec's caches hold next step)."""
  net = net_of(cluster, run.gpus, calib)
  gpu = cluster.gpu
  eff, hbm = calib.gpu(gpu.kind), gpu.hbm_bandwidth
  n, tok, d = run.gpus, run.tokens_per_gpu, shape.d_model
  sec = lambda flops: cp.seconds(flops, gpu.peak_flops, eff)
  psi = 2.0 * shape.expert_params()
  row = 2.0 * d
  shared_s = sec(tok * cp.shared_flops(shape))
  # each MoE layer's attention (softmax or linear) and router time, and its non-expert values
  kinds = [linear for moe, linear in shape.layers() if moe]
  attn_L = [sec(tok * (cp.layer_flops(shape, run.seq_len, True, linear)["attention"]
                       + cp.router_flops(shape))) for linear in kinds]
  dense_L = [sum(v for g, v in shape.layer_groups(True, linear).items() if g != "experts")
             for linear in kinds]
  layers = []
  holders_L = []
  stragglers, inter_frac, replicas = [], [], []
  for l in range(shape.moe_layers):
    counts = counts_LxNxE[l].astype(np.float64)
    shadow = 0
    late = None
    if system.balance == "uniform":
      load = np.full(n, counts.sum() / n)
      traffic = np.repeat(counts.sum(1, keepdims=True) / n, n, axis=1)
      holders = ld.owner_holders(owner_LxE[l], n)
    elif system.balance == "fastermoe":
      best = None
      order = np.argsort(-counts.sum(0), kind="stable")
      for c in FASTER_CANDIDATES:
        if c > shape.num_experts:
          break
        h = ld.owner_holders(owner_LxE[l], n)
        h[order[:c]] = True
        ld_, tr_ = ld.dispatch(counts, h, dpn, balance=False)
        a2a, _ = net.all_to_all(tr_ * row)
        cost = (2 * net.broadcast_all(c * psi) + 3 * (2 * a2a + sec(ld_.max() * cp.expert_flops(
            shape))) if c else 3 * (2 * a2a + sec(ld_.max() * cp.expert_flops(shape))))
        if best is None or cost < best[0]:
          best = (cost, c, h, ld_, tr_)
      _, shadow, holders, load, traffic = best
    else:
      holders, late = _layer_plan(system, counts, pred_LxE[l], owner_LxE[l], n, dpn, t, m,
                                  None if flex_holders is None else flex_holders[l])
      load, traffic = ld.dispatch(counts, holders, dpn, balance=system.balanced_dispatch)
    node = np.arange(n) // dpn
    off = traffic * ~np.eye(n, dtype=bool)
    cross = off * (node[:, None] != node[None, :])
    inter_frac.append(cross.sum() / max(traffic.sum(), 1e-12))
    stragglers.append(load.max() / max(load.mean(), 1e-12))
    reps = holders.sum() - shape.num_experts
    replicas.append(reps)
    a2a, a2a_even = net.all_to_all(traffic * row)
    exp_max = sec(load.max() * cp.expert_flops(shape))
    exp_mean = sec(load.mean() * cp.expert_flops(shape))
    spag = sprs = late_s = 0.0
    holders_L.append(holders)
    kept = None if held_L is None or system.replica_ratio >= 1.0 else held_L[l]
    if system.balance in ("replicas", "flexmoe") and reps:
      early = holders & ~late if late is not None else holders
      direct = system.planner == "lpt"          # moejax: every replica from its owner
      g, nd = _spag_bytes(early, owner_LxE[l], dpn, psi, kept, system.replica_ratio, direct)
      spag = net.sparse(g, nd)
      if late is not None and late.any():
        g2, nd2 = _spag_bytes(late | ld.owner_holders(owner_LxE[l], n), owner_LxE[l], dpn, psi,
                              kept, system.replica_ratio, direct)
        late_s = net.sparse(g2, nd2)
      g3, nd3 = _spag_bytes(holders, owner_LxE[l], dpn, 2 * psi, direct=direct)   # fp32 grads
      sprs = net.sparse(g3, nd3)
    # an exchange's fixed part (launch and one hop's latency), which each piece pays again
    a2a_lat = net._lat(1, 1 if net.nodes > 1 else 0) if a2a > 0 else 0.0
    layers.append({"a2a": a2a, "a2a_even": a2a_even, "a2a_lat": a2a_lat,
                   "exp_max": exp_max, "exp_mean": exp_mean,
                   "spag": spag, "late": late_s, "sprs": sprs, "shadow": shadow})
  p = Program()
  prev = None
  dense_ag_L = [net.all_gather(2 * v) if system.dense == "fsdp" else 0.0 for v in dense_L]
  # forward
  for l, L in enumerate(layers):
    prev = _forward_layer(p, system, L, attn_L[l], shared_s, dense_ag_L[l], net, psi, prev)
  head_s = sec(tok * cp.head_flops(shape))
  prev = p.add("compute", "compute", head_s, prev, "head fwd")
  prev = p.add("compute", "compute", cp.BACKWARD * head_s, prev, "head bwd")
  tail = []
  head = shape.vocab_size * shape.d_model
  kind, stream, coll = (("ar", "dp", net.all_reduce) if system.dense == "dp"
                        else ("rs", "comm", net.reduce_scatter))
  if not shape.tied_embeddings:
    tail.append(p.add(kind, stream, coll(4.0 * head), prev, "head grads"))
  for l in reversed(range(len(layers))):
    L = layers[l]
    if run.remat:
      prev = _forward_layer(p, system, L, attn_L[l], shared_s, dense_ag_L[l], net, psi, prev,
                            recompute=True)
    eb, d1 = _pieces(p, system, L, prev, [], cp.BACKWARD, "",
                     ("combine bwd", "experts bwd", "dispatch bwd"))
    if L["sprs"]:
      tail.append(p.add("sprs", "comm", L["sprs"], eb, "SpRS"))
    if L["shadow"]:
      tail.append(p.add("ar", "comm", net.all_reduce(2 * psi * L["shadow"]), eb,
                        "shadow grads"))
    if system.balance == "flexmoe":
      tail.append(p.add("ar", "comm", L["sprs"], eb, "replica grads"))
    prev = p.add("compute", "compute", cp.BACKWARD * (attn_L[l] + shared_s), d1,
                 "attention bwd")
    tail.append(p.add(kind, stream, coll(4.0 * dense_L[l]), prev, "dense grads"))
  tail.append(p.add(kind, stream, coll(4.0 * head), prev, "embedding grads"))
  if amortized_bytes:
    tail.append(p.add("reshard", "comm", amortized_bytes / (net.b_inter if net.nodes > 1
                                                            else net.b_intra), prev,
                      "migration (amortized)"))
  owned = shape.moe_layers * shape.num_experts * shape.expert_params() / n
  dense_total = shape.total_params() - shape.moe_layers * shape.num_experts * shape.expert_params()
  if system.dense == "fsdp":
    dense_total /= n
  opt = cp.memory_seconds(cp.OPTIMIZER_BYTES_PER_PARAM * (owned + dense_total), hbm)
  p.add("optimizer", "compute", opt, [prev] + tail, "optimizer")
  res = simulate(p)
  extra = {"straggler": float(np.mean(stragglers)), "inter_node_token_fraction":
           float(np.mean(inter_frac)), "replicas_per_layer": float(np.mean(replicas))}
  extra["memory_gb"] = (STATE_BYTES_PER_PARAM * (owned + dense_total)
                        + max(replicas) / n * psi) / 1e9
  return StepTime(res.seconds, res.exposed, res.busy, extra), holders_L


def _forward_layer(p, system, L, attn_s, shared_s, dense_ag, net, psi, prev, recompute=False):
  tag = " (recompute)" if recompute else ""
  deps = [prev]
  if dense_ag:
    deps.append(p.add("ag", "comm", dense_ag, prev, "dense gather" + tag))
  if L["spag"] and not recompute:
    deps_sp = p.add("spag", "comm", L["spag"], prev, "SpAG" + tag)
  else:
    deps_sp = None
  a = p.add("compute", "compute", attn_s, deps, "attention" + tag)
  waits = [deps_sp]
  if L["late"] and not recompute:
    waits.append(p.add("spag", "comm", L["late"], a, "SpAG after gating"))
  if L["shadow"] and not recompute:
    waits.append(p.add("bcast", "comm", net.broadcast_all(L["shadow"] * psi), a,
                       "shadow broadcast"))
  sh = p.add("compute", "compute", shared_s, a, "shared experts" + tag) if shared_s else a
  return _pieces(p, system, L, a, [sh] + waits, 1.0, tag, ("dispatch", "experts", "combine"))[1]


def _pieces(p, system, L, start, waits, scale, tag, names):
  """The exchange, the experts (`scale` x their forward time) and the exchange back, in
  `system.dispatch_chunks` pieces: piece j's first exchange goes out while piece j - 1's
  experts run, its second after them. Returns (the last experts op, the last op)."""
  k = system.dispatch_chunks
  if k < 1:
    raise ValueError(f"System.dispatch_chunks={k}: must be at least 1")
  lat = L["a2a_lat"]
  piece = lambda s: (s - lat) / k + lat if s > 0 else 0.0   # noqa: E731  (each its fixed cost)
  out = [p.add_split("a2a", "comm", piece(L["a2a"]), piece(L["a2a_even"]), start,
                     names[0] + tag)]
  last = None
  for j in range(k):
    ex = p.add_split("compute", "compute", scale * L["exp_max"] / k, scale * L["exp_mean"] / k,
                     [out[j]] + (waits if j == 0 else []), names[1] + tag)
    if j + 1 < k:
      out.append(p.add_split("a2a", "comm", piece(L["a2a"]), piece(L["a2a_even"]), start,
                             names[0] + tag))
    last = p.add_split("a2a", "comm", piece(L["a2a"]), piece(L["a2a_even"]), ex, names[2] + tag)
  return ex, last
