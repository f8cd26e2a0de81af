"""Expert loads per step: traces (synthetic, recorded, from a run's metrics) and what each
placement makes of them (device loads, token traffic, replicas). Host-side numpy.

A trace is `counts_SxLxNxE`: per step, MoE layer, source device and expert, the assignments the
router made (tokens x top-k). Letters: S steps, L layers, N devices, E experts, Dn devices per
node.

Placements of one layer and step (`holders_ExN`: which devices hold each expert):
  ep        owners only (device n owns experts [n E/N, (n+1) E/N), or heterogeneous owners)
  uniform   the reference: every device gets the mean, tokens spread evenly
  replicas  owners plus this step's replicas of the hottest experts, planned from the predicted
            load like Themis Algorithm 1 (top-t experts; every device when t <= m, else replica
            counts by load over nodes lacking the expert first), tokens dispatched like Themis
            Algorithm 3 (local, else a holder in my node, else any holder) with the holders'
            shares water-filled so device loads balance (moejax's balanced dispatch).
"""
from __future__ import annotations

import json
import os

import numpy as np

from moejax.report.series import cut_short

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDED = os.path.join(REPO, "bench", "traces", "tiny_recorded.npz")

SKEW_CV = 0.69
"""Default expert-popularity spread (coefficient of variation over experts): Themis Fig. 16a
reports a Std of 0.046 of the per-expert token proportion for Qwen1.5-MoE (60 experts, top-4)
without load-balancing loss, 0.034 at weight 0.1; read as the fraction of tokens routed to each
expert (mean top_k/E = 0.067) that is a CV of 0.69 (0.51 at weight 0.1). Themis trains with
weight 0.001, so 0.69."""


# ----------------------------------------------------------------------------- traces
def _sample(rng, p_E: np.ndarray, num_devices: int, tokens: int, k: int) -> np.ndarray:
  """Counts [N, E] of `tokens * k` assignments per device from popularity p_E; an expert gets
  at most `tokens` from one device (a token picks k distinct experts), the excess re-drawn."""
  out = rng.multinomial(tokens * k, p_E, size=num_devices).astype(np.int64)
  for _ in range(8):
    over = np.maximum(out - tokens, 0)
    if not over.any():
      break
    out -= over
    room = (out < tokens) * p_E[None, :]
    room /= room.sum(1, keepdims=True)
    for n in np.nonzero(over.sum(1))[0]:
      out[n] += rng.multinomial(over[n].sum(), room[n])
  return out


def synthetic_trace(num_experts: int, top_k: int, num_devices: int, tokens_per_device: int, *,
                    steps: int = 24, layers: int = 2, kind: str = "gamma", cv: float = SKEW_CV,
                    zipf_s: float = 1.0, drift: float = 0.05, seed: int = 0) -> np.ndarray:
  """counts_SxLxNxE with skewed, drifting expert popularity.

  kind="gamma": each layer's popularity is drawn iid Gamma(1/cv^2) over experts (coefficient of
  variation `cv`); kind="zipf": proportional to rank^-zipf_s in a random order. Every step the
  log-popularity takes a Gaussian step of std `drift` (slow drift, as Themis Sec. 4.2 and Fig. 15
  describe: adjacent steps barely differ, distant ones do). Each device's assignments are then
  sampled multinomially (its own noise on top of the shared popularity).
  """
  if top_k > num_experts:
    raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
  rng = np.random.default_rng(seed)
  e = num_experts
  if kind == "gamma":
    shape = 1.0 / max(cv, 1e-6) ** 2
    base = rng.gamma(shape, 1.0 / shape, size=(layers, e))
  elif kind == "zipf":
    base = np.stack([rng.permutation(1.0 / np.arange(1, e + 1) ** zipf_s) for _ in range(layers)])
  else:
    raise ValueError(f"unknown trace kind {kind!r} (valid: gamma, zipf)")
  logp = np.log(np.maximum(base, 1e-12))
  out = np.zeros((steps, layers, num_devices, e), np.int64)
  for s in range(steps):
    if s:
      logp = logp + rng.normal(0.0, drift, size=logp.shape)
    p = np.exp(logp - logp.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    for layer in range(layers):
      out[s, layer] = _sample(rng, p[layer], num_devices, tokens_per_device, top_k)
  return out


def deepseek_v3_trace(num_devices: int, *, tokens_per_device: int = 4096, steps: int = 24,
                      layers: int = 2, num_experts: int = 256, seed: int = 0,
                      **kw) -> np.ndarray:
  """DeepSeek-V3's routing shape (256 experts, top-8 by default) on 16-64 devices."""
  return synthetic_trace(num_experts, 8, num_devices, tokens_per_device, steps=steps,
                         layers=layers, seed=seed, **kw)


def load_recorded(path: str = RECORDED) -> tuple[np.ndarray, dict]:
  """bench/fssdp.py's recorded trace (tiny preset, E8 top-2 on 8 devices) and its metadata."""
  with np.load(path) as z:
    return z["counts"].astype(np.int64), {k: z[k].item() for k in z.files if k != "counts"}


def retarget(counts_SxLxNxE: np.ndarray, num_experts: int, top_k: int, num_devices: int,
             tokens_per_device: int, seed: int = 0) -> np.ndarray:
  """A trace's popularity moved to another shape: source expert j's share of each step and layer
  is spread evenly over a fixed random group of E/E_src target experts (the hot groups stay hot;
  where they land among the owners is random, not aligned with ep's contiguous blocks), and each
  target device's assignments are sampled from it."""
  rng = np.random.default_rng(seed)
  src = counts_SxLxNxE.sum(2).astype(np.float64)          # [S, L, E_src]
  s, l, e_src = src.shape
  groups = rng.permutation(np.arange(num_experts) % e_src)
  size = np.bincount(groups, minlength=e_src)
  out = np.zeros((s, l, num_devices, num_experts), np.int64)
  for i in range(s):
    for j in range(l):
      p = src[i, j][groups] / size[groups]
      p = np.maximum(p, 1e-9)
      out[i, j] = _sample(rng, p / p.sum(), num_devices, tokens_per_device, top_k)
  return out


def read_metrics(path: str) -> list[dict]:
  """The records of a run's metrics.jsonl (one JSON object per logged step); a run's workdir
  stands for the metrics.jsonl in it."""
  if os.path.isdir(path):
    inside = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(inside):
      raise ValueError(f"{path}: a directory without metrics.jsonl (give a run's workdir or its "
                       "metrics.jsonl)")
    path = inside
  if not os.path.isfile(path):
    raise ValueError(f"{path}: no such file (give a run's workdir or its metrics.jsonl)")
  out = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        if cut_short(line, e):
          continue        # a record cut short (a run killed while writing), as the report skips
        raise ValueError(f"{path}:{number}: not JSON ({e})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: a {type(record).__name__}, where metrics.jsonl has "
                         "one JSON object per line")
      out.append(record)
  if not out:
    raise ValueError(f"{path}: no records")
  return out


def skew_from_metrics(records: list[dict]) -> np.ndarray:
  """load_max / load_mean per logged step and MoE layer [S, L] (the hottest expert's load over
  the mean), from the routing figures moejax writes per layer."""
  rows = []
  for r in records:
    if "load_max" in r and "load_mean" in r:
      mx = np.atleast_1d(np.asarray(r["load_max"], np.float64))
      mean = np.atleast_1d(np.asarray(r["load_mean"], np.float64))
      rows.append(mx / np.maximum(mean, 1e-12))
  if not rows:
    raise ValueError("metrics have no load_max / load_mean figures")
  return np.stack(rows)


def experts_in_metrics(records: list[dict]) -> int | None:
  """The routed experts per layer of the run whose metrics these are (its per-layer expert
  loads, `expert_load_LxE`), or None when no record has them."""
  for r in records:
    loads = r.get("expert_load_LxE")
    if loads:
      return len(np.atleast_2d(np.asarray(loads))[0])
  return None


def trace_from_skew(skew_SxL: np.ndarray, num_experts: int, top_k: int, num_devices: int,
                    tokens_per_device: int, seed: int = 0) -> np.ndarray:
  """A trace whose hottest expert of each step and layer carries `skew` times the mean load (the
  others share the rest evenly): what a run's metrics say about its loads."""
  rng = np.random.default_rng(seed)
  s, l = skew_SxL.shape
  out = np.zeros((s, l, num_devices, num_experts), np.int64)
  for i in range(s):
    for j in range(l):
      hot_share = min(skew_SxL[i, j] / num_experts, 1.0 / top_k)
      p = np.full(num_experts, (1 - hot_share) / max(num_experts - 1, 1))
      p[(3 + 5 * j) % num_experts] = hot_share
      out[i, j] = _sample(rng, p, num_devices, tokens_per_device, top_k)
  return out


# ------------------------------------------------------------------------- placements
def even_owners(num_experts: int, num_devices: int) -> np.ndarray:
  """owner_E of ep's even placement (contiguous blocks; E % N == 0 or N % E == 0)."""
  if num_experts >= num_devices:
    return (np.arange(num_experts) * num_devices // num_experts).astype(np.int64)
  return (np.arange(num_experts) * (num_devices // num_experts)).astype(np.int64)


def owner_holders(owner_E: np.ndarray, num_devices: int) -> np.ndarray:
  h = np.zeros((owner_E.shape[0], num_devices), bool)
  h[np.arange(owner_E.shape[0]), owner_E] = True
  return h


def plan_replicas(pred_load_E: np.ndarray, owner_E: np.ndarray, num_devices: int,
                  devices_per_node: int, *, slots: int, overlap: int,
                  method: str = "themis", owner_sends: int = 0) -> np.ndarray:
  """holders_ExN: owners plus replicas; `slots` = m replicas per device, `overlap` = t distinct
  experts per layer.

  method="themis": Themis Algorithm 1 (the top-t experts by load: on every device when t <= m,
  else replica counts in proportion to load, nodes lacking the expert first).
  method="lpt": longest-processing-time first on the straggler, as moejax's planner
  (`moejax.placement.planner.materialize_plan`): repeatedly give the busiest device's hottest
  expert one more holder (a node without it first, then the least-loaded device with a free
  slot), loads water-filled over holders, until t distinct experts are used or it stops helping;
  at most `owner_sends` replicas from one owner (0: no bound), as fssdp.owner_sends.
  """
  if method == "lpt":
    return _plan_lpt(pred_load_E, owner_E, num_devices, devices_per_node, slots, overlap,
                     owner_sends)
  if method != "themis":
    raise ValueError(f"unknown planning method {method!r} (valid: themis, lpt)")
  n, dpn = num_devices, devices_per_node
  holders = owner_holders(owner_E, n)
  e = pred_load_E.shape[0]
  t = min(overlap, e)
  m = min(slots, t)
  if t <= 0 or m <= 0 or n <= 1:
    return holders
  top = np.argsort(-pred_load_E, kind="stable")[:t]
  if t <= m:
    holders[top] = True
    return holders
  free = np.full(n, m)
  node = np.arange(n) // dpn
  load_N = np.bincount(owner_E, weights=pred_load_E, minlength=n)
  total_top = max(pred_load_E[top].sum(), 1e-12)
  tot_slots = n * m
  for ex in top:
    want = round(tot_slots * pred_load_E[ex] / total_top)
    want = min(want, n - 1, int(free.sum()))
    for _ in range(want):
      have_node = np.bincount(node[holders[ex]], minlength=node.max() + 1) > 0
      cand = np.nonzero(~holders[ex] & (free > 0))[0]
      if not cand.size:
        break
      # nodes without the expert first, then more free slots, then less load
      key = np.lexsort((load_N[cand], -free[cand], have_node[node[cand]]))
      d = cand[key[0]]
      holders[ex, d] = True
      free[d] -= 1
      load_N[d] += pred_load_E[ex] / holders[ex].sum()
  return holders


def _plan_lpt(load_E, owner_E, n, dpn, slots, overlap, owner_sends=0) -> np.ndarray:
  load_E = np.asarray(load_E, np.float64)
  owner_E = np.asarray(owner_E)
  holders = owner_holders(owner_E, n)
  room = np.full(n, owner_sends if owner_sends > 0 else n * slots)   # replicas each owner sends
  if n <= 1 or slots <= 0 or overlap <= 0:
    return holders
  node = np.arange(n) // dpn
  free = np.full(n, slots)
  chosen: set[int] = set()
  dev = np.bincount(owner_E, weights=load_E, minlength=n)
  for _ in range(n * slots):
    hot = int(np.argmax(dev))
    mine = np.nonzero(holders[:, hot])[0]
    mine = [int(x) for x in mine[np.argsort(-load_E[mine] / holders[mine].sum(1))]
            if holders[x].sum() < n and room[owner_E[x]] > 0
            and (int(x) in chosen or len(chosen) < overlap)]
    placed = False
    for ex in mine:
      cand = np.nonzero(~holders[ex] & (free > 0))[0]
      if not cand.size:
        continue
      have_node = np.bincount(node[holders[ex]], minlength=node.max() + 1) > 0
      d = int(cand[np.lexsort((dev[cand], have_node[node[cand]]))[0]])
      trial = holders.copy()
      trial[ex, d] = True
      new_dev = _device_loads(load_E, trial)
      if new_dev.max() < dev.max() - 1e-9 * max(dev.max(), 1e-30):
        holders, dev = trial, new_dev
        free[d] -= 1
        room[owner_E[ex]] -= 1
        chosen.add(ex)
        placed = True
        break
    if not placed:
      break
  return holders


def _device_loads(load_E: np.ndarray, holders_ExN: np.ndarray) -> np.ndarray:
  """Device loads with single-holder experts fixed and the others water-filled, hottest first."""
  nh = holders_ExN.sum(1)
  owner = np.argmax(holders_ExN, axis=1)
  single = nh == 1
  dev = np.bincount(owner[single], weights=load_E[single], minlength=holders_ExN.shape[1])
  multi = np.nonzero(~single)[0]
  for ex in multi[np.argsort(-load_E[multi], kind="stable")]:
    hs = np.nonzero(holders_ExN[ex])[0]
    dev[hs] += _waterfill(dev[hs], load_E[ex])
  return dev


def dispatch(counts_NxE: np.ndarray, holders_ExN: np.ndarray, devices_per_node: int,
             balance: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """(device load [N] in assignments, token traffic [N, N] source -> destination).

  Experts with one holder: everything to it. Experts with several: each holder's share of the
  expert's load is water-filled over the holders on top of the single-holder load (hottest
  expert first), or equal shares with balance=False (Themis's even rule); each source then
  fills its own device's share first, then same-node holders, then the others.
  """
  counts = counts_NxE.astype(np.float64)
  n = counts.shape[0]
  node = np.arange(n) // devices_per_node
  nh = holders_ExN.sum(1)
  single = nh == 1
  owner = np.argmax(holders_ExN, axis=1)
  traffic = np.zeros((n, n))
  for ex in np.nonzero(single)[0]:
    traffic[:, owner[ex]] += counts[:, ex]
  load = traffic.sum(0)
  multi = np.nonzero(~single)[0]
  multi = multi[np.argsort(-counts[:, multi].sum(0), kind="stable")]
  for ex in multi:
    hs = np.nonzero(holders_ExN[ex])[0]
    total = counts[:, ex].sum()
    if balance:
      share = _waterfill(load[hs], total)
    else:
      share = np.full(hs.size, total / hs.size)
    cap = dict(zip(hs.tolist(), share.tolist()))
    src = counts[:, ex].copy()
    for d in hs:                                   # local first
      take = min(src[d], cap[int(d)])
      traffic[d, d] += take
      src[d] -= take
      cap[int(d)] -= take
    for d in np.nonzero(src > 0)[0]:               # then my node, then anyone
      for group in (hs[node[hs] == node[d]], hs):
        for h in group:
          if src[d] <= 0:
            break
          take = min(src[d], cap[int(h)])
          if take > 0:
            traffic[d, h] += take
            src[d] -= take
            cap[int(h)] -= take
    if src.sum() > 1e-9:                           # rounding: spread the rest evenly
      traffic[:, hs] += src[:, None] / hs.size
    load = traffic.sum(0)
  return load, traffic


def _waterfill(base: np.ndarray, amount: float) -> np.ndarray:
  """Amounts x >= 0 summing to `amount` that level base + x from the bottom."""
  order = np.argsort(base, kind="stable")
  b = base[order].astype(np.float64)
  level, rest = b[0], float(amount)
  i = 0
  while i < b.size:
    nxt = b[i + 1] if i + 1 < b.size else np.inf
    need = (nxt - level) * (i + 1)
    if rest <= need:
      level += rest / (i + 1)
      break
    rest -= need
    level = nxt
    i += 1
  x = np.maximum(level - b, 0.0)
  out = np.empty_like(x)
  out[order] = x
  return out


def admit(counts_NxE: np.ndarray, factor: float, top_k: int, tokens: int,
          policy: str = "reroute") -> tuple[np.ndarray, float]:
  """Capacity-limited admission (moejax.routing.admission) on counts: each expert admits at
  most ceil(factor * tokens * top_k / E) assignments from each device; `strict` drops the rest,
  `reroute` hands them to the experts with room on that device (in proportion to the room).
  Returns (counts, dropped fraction, fraction over capacity: dropped or rerouted)."""
  e = counts_NxE.shape[1]
  cap = int(np.ceil(factor * tokens * top_k / e))
  kept = np.minimum(counts_NxE, cap).astype(np.float64)
  total = max(counts_NxE.sum(), 1)
  over = float((counts_NxE.sum() - kept.sum()) / total)
  if policy == "strict":
    return kept, over, over
  if policy != "reroute":
    raise ValueError(f"unknown admission policy {policy!r} (valid: strict, reroute)")
  excess = (counts_NxE - kept).sum(1)
  room = cap - kept
  total_room = room.sum(1, keepdims=True)
  add = np.minimum(room, room / np.maximum(total_room, 1e-12) * excess[:, None])
  kept += add
  dropped = counts_NxE.sum() - kept.sum()
  return kept, float(max(dropped, 0.0) / total), over
