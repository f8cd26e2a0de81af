"""FSSDP per-step planning: load prediction, sparse materialization of expert replicas, token
dispatch. Pure jnp with static shapes; runs under jit, vmap (over layers) and shard_map.

Each step, for each MoE layer:
  1. predict every expert's load from the last W steps (`LoadHistory`, `predict`);
  2. decide which hot experts get extra replicas and where (`materialize_plan`); the integration
     fetches them with a SparseAllGather (issued before the layer, like the prefetched gather)
     and returns their gradients with a SparseReduceScatter;
  3. after gating, optionally re-plan from the actual loads when that pays (`calibrate`);
  4. send every token-expert assignment to a device that holds its expert: by the even rule
     (`dispatch_devices`), or by per-source send counts that water-fill the actual load over the
     holders (`balanced_send`, from an all_gather of the N x E routing counts).
The owner placement comes from `moejax.placement.ownership` and changes only at re-sharding.

Letters: W history window, L layers, E experts per layer, N devices, G nodes, Dn devices per node
(N = G * Dn), M replica slots per device, T tokens on one device, K experts per token,
A = T * K assignments, J lookahead chain length.

Even rule (what `dispatch_devices` does without send counts, and the planner's load model): an
assignment stays on its source device if that device holds the expert; else it goes to one of the
holders on the source's node, spread evenly (by the assignment's rank among this source's
assignments to that expert, offset by the source device); else evenly over all holders. Under
sources that each carry load_E / N, a holder d on node g of expert e then processes
    load_e / N * Dn * (1 / k_g + z / h)
where k_g is the number of holders on node g, z the number of nodes without a holder and h the
number of holders (`expert_device_load`; it also takes the actual per-source loads). The planner
minimizes the largest such device load.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

PREFER_WITHIN = 0.02
"""`materialize_plan`: how much worse (x the mean device load) a device that already holds, or
held last step, an expert's replica may make the modelled straggler and still get the new one."""

TWO_PHASE_WORK = 1 << 17
"""`materialize_plan` grows only the materialized experts' chains once there are
`overlap_degree` of them when the candidate evaluations that saves (rounds x other experts x
chain x devices) reach this many."""

# ----------------------------------------------------------------------------- load predictor


class LoadHistory(NamedTuple):
  """Ring buffer of the last W per-layer expert loads (fp32) and how many were recorded."""
  loads_WxLxE: jax.Array
  count: jax.Array          # int32 scalar: updates so far (slot of the next one: count % W)


def init_history(*, window: int = 5, num_layers: int, num_experts: int) -> LoadHistory:
  if window < 1:
    raise ValueError(f"window must be >= 1, got {window}")
  return LoadHistory(jnp.zeros((window, num_layers, num_experts), jnp.float32),
                     jnp.zeros((), jnp.int32))


def update_history(h: LoadHistory, load_LxE) -> LoadHistory:
  """Records one step's loads (e.g. psum of the router's assignment counts), evicting the oldest."""
  window = h.loads_WxLxE.shape[0]
  loads = lax.dynamic_update_index_in_dim(h.loads_WxLxE, jnp.asarray(load_LxE, jnp.float32),
                                          h.count % window, axis=0)
  return LoadHistory(loads, h.count + 1)


def predict(h: LoadHistory) -> jax.Array:
  """load_LxE fp32: the mean of the recorded loads in the window; all ones before any data."""
  window = h.loads_WxLxE.shape[0]
  filled = jnp.minimum(h.count, window)
  mean_LxE = jnp.sum(h.loads_WxLxE, axis=0) / jnp.maximum(filled, 1).astype(jnp.float32)
  return jnp.where(filled > 0, mean_LxE, jnp.ones_like(mean_LxE))


# ----------------------------------------------------------------------------- load model


def _node_of(num_devices: int, devices_per_node: int) -> jax.Array:
  return jnp.arange(num_devices, dtype=jnp.int32) // devices_per_node


def expert_device_load(load_E, holders_ExN, *, devices_per_node: int,
                       source_load_ExN=None) -> jax.Array:
  """load_ExN fp32: the part of each expert's load each device processes under the even rule of
  `dispatch_devices` (see the module docstring). Its largest device load also bounds from above
  what `balanced_send` achieves for the same holders (up to rounding): that starts from this
  split and only lowers the maximum.

  By default every source device carries load_E / N of each expert (see the module docstring);
  `source_load_ExN` (each expert's assignments on each source device, e.g. gathered after
  gating) replaces that assumption, and `load_E` is then ignored. Works with any leading batch
  dimensions (`holders_...ExN`, with `load_...E` / `source_load_...ExN` broadcastable to it).
  Rows sum to the expert's load for experts with at least one holder.
  """
  held = holders_ExN.astype(jnp.float32)
  n = held.shape[-1]
  g = n // devices_per_node
  if source_load_ExN is None:
    src = jnp.asarray(load_E, jnp.float32)[..., None] / n
  else:
    src = jnp.asarray(source_load_ExN, jnp.float32)
  src = jnp.broadcast_to(src, held.shape)

  def per_node(x):
    return jnp.sum(x.reshape(*x.shape[:-1], g, devices_per_node), axis=-1)

  k_G = per_node(held)                          # holders on each node
  rest_G = per_node((1.0 - held) * src)         # load of the non-holder sources on each node
  has_G = k_G > 0
  near_G = jnp.where(has_G, rest_G / jnp.maximum(k_G, 1.0), 0.0)
  far = jnp.sum(jnp.where(has_G, 0.0, rest_G), axis=-1)      # from nodes without a holder
  h = jnp.maximum(jnp.sum(held, axis=-1), 1.0)
  spread = jnp.repeat(near_G, devices_per_node, axis=-1) + (far / h)[..., None]
  return held * (src + spread)


def straggler_of(load_N) -> jax.Array:
  """max / mean of per-device work (1 when there is no work)."""
  load_N = jnp.asarray(load_N, jnp.float32)
  mean = jnp.mean(load_N)
  return jnp.where(mean > 0, jnp.max(load_N) / jnp.where(mean > 0, mean, 1.0), 1.0)


# ----------------------------------------------------------------------------- planner


class Plan(NamedTuple):
  """One layer's materialization for one step (all int32 / bool / fp32 arrays).

  replica_expert_NxM  expert id in each replica slot of each device; E = empty. The SparseAllGather
                      fills slot (n, m) with expert replica_expert_NxM[n, m] from its owner, and
                      the SparseReduceScatter sends that slot's gradient back.
  replica_slot_ExN    the replica slot of expert e on device n, -1 where none.
  holders_ExN         devices holding each expert this step: its owner plus its replicas.
  num_replicas        replicas added (<= N * M).
  num_materialized    distinct experts given replicas (<= overlap_degree).
  sends_N             replica slots each device fills as owner (<= owner_sends).
  load_N              modelled work per device under the plan, for the load it was made for.
  straggler           max / mean of load_N.
  """
  replica_expert_NxM: jax.Array
  replica_slot_ExN: jax.Array
  holders_ExN: jax.Array
  num_replicas: jax.Array
  num_materialized: jax.Array
  load_N: jax.Array
  straggler: jax.Array
  sends_N: jax.Array


def owner_holders(owner_E, num_devices: int) -> jax.Array:
  """holders_ExN of the owner-only placement (ep)."""
  return jax.nn.one_hot(owner_E, num_devices, dtype=jnp.bool_)


def materialize_plan(load_E, owner_E, *, num_devices: int, devices_per_node: int,
                     replica_slots: int, overlap_degree: int, target_straggler: float = 1.05,
                     lookahead: int | None = None, source_load_NxE=None, prefer_ExN=None,
                     prefer_within: float = PREFER_WITHIN, owner_sends: int | None = None,
                     candidates=None) -> Plan:
  """Chooses this step's expert replicas for one layer (greedy, static shapes).

  load_E: predicted load per expert (any non-negative scale); owner_E: int32 owning device;
  source_load_NxE (optional): the load per source device and expert, when known (after gating);
  it then replaces load_E in the load model (see `expert_device_load`).

  Greedy longest-processing-time first with a short lookahead. Starting from the owners, each
  round grows, for every expert e in parallel, a chain of up to `lookahead` (J) new replicas, one
  at a time, each on the device (without e, with a free replica slot) that gives the lowest
  modelled straggler (the largest device load under `expert_device_load`; ties: lower sum of
  squared device loads, then a device on a node with no holder of e yet, then the less loaded
  device). Of all the (expert, chain length) candidates that lower the straggler (or keep it and
  lower the sum of squares) it adopts the one with the lowest straggler, preferring fewer
  replicas within 1% of the mean device load. The lookahead (default J = devices_per_node + 1)
  matters because the even rule sends a node's tokens to that node's holders: a hot expert's
  first replica on a node takes the whole node's share and can overload its host, while a few
  together relieve everyone.

  prefer_ExN (optional bool [E, N]): devices that already hold, or held last step, a replica of
  e (a replica there moves nothing, or only a patch). A new replica goes to such a device when
  its modelled straggler is within `prefer_within` x the mean device load of the best choice.
  Those choices add up over the rounds (a cheap replica of a cold expert can take an opening
  that a hot one needed), so the plan is also made without the preference, and the preferred
  one is kept only when its modelled straggler is within `prefer_within` of that one's.

  So the hottest experts get replicas first, each gets a number roughly proportional to its load,
  spread over nodes that lack a holder first, then onto the least-loaded devices with free slots.
  It stops when the modelled straggler is at most `target_straggler`, when nothing improves it,
  or after min(N * M, t * (N - 1), N * owner_sends) rounds (a static bound; `lax.while_loop`).
  At most `overlap_degree` (t) distinct experts get replicas, at most N - 1 per expert, at most
  `replica_slots` (M) per device, at most `owner_sends` (default N * M: no bound) from one
  owner, over all its experts; a replica never sits on its owner or twice on one device.
  The owner bound sizes SparseAllGather's send rows and SparseReduceScatter's fp32 receive
  rows on the ragged (GPU) path: `owner_sends` rows per device instead of N * M.

  Each chain step weighs every device as the next holder in O(N) (`candidate_loads`; its
  definition, O(N^2), is `candidate_loads_direct`, which `candidates` may name instead): a
  round costs O(E * J * N).
  """
  n, dpn = num_devices, devices_per_node
  if n % dpn:
    raise ValueError(f"num_devices={n} is not a multiple of devices_per_node={dpn}")
  if source_load_NxE is None:
    load_E = jnp.maximum(jnp.asarray(load_E, jnp.float32), 0.0)
    src_ExN = jnp.broadcast_to(load_E[:, None] / n, (load_E.shape[0], n))
  else:
    src_ExN = jnp.maximum(jnp.asarray(source_load_NxE, jnp.float32), 0.0).T
  lookahead = dpn + 1 if lookahead is None else lookahead
  owner_E = jnp.asarray(owner_E, jnp.int32)
  owner_sends = resolve_owner_sends(owner_sends, n, replica_slots)
  plan = functools.partial(_plan, src_ExN, owner_E, n, dpn, replica_slots, overlap_degree,
                           target_straggler, lookahead, prefer_within=prefer_within,
                           owner_sends=owner_sends, candidates=candidates or candidate_loads)
  base = plan(jnp.zeros(src_ExN.shape, jnp.bool_))
  if prefer_ExN is None:
    return base
  preferred = plan(jnp.asarray(prefer_ExN, jnp.bool_))
  keep = preferred.straggler <= base.straggler + prefer_within
  return jax.tree.map(lambda a, b: jnp.where(keep, a, b), preferred, base)


def resolve_owner_sends(owner_sends: int | None, num_devices: int, replica_slots: int) -> int:
  """The bound on replica slots one owner fills per layer and step: `owner_sends`, at most
  N * M (every slot of every device), which None or 0 means."""
  most = num_devices * replica_slots
  return most if not owner_sends else min(int(owner_sends), most)


def candidate_loads(src_N, held_N, base_N, devices_per_node: int):
  """(max_N, sos_N): the largest device load and the sum of squared device loads if device d
  were added to the holders `held_N` of one expert (whose per-source loads are `src_N`; the
  devices' loads from everything else `base_N`), for every d at once, in O(N).

  `candidate_loads_direct` is the definition (N candidate holder sets through
  `expert_device_load`, O(N^2)). Adding d on node g changes only node g's holders' share (one
  more holder, d's own load no longer spread), the share from nodes without a holder (node g
  leaves them) and the count h they split over, so each candidate is read off per-node sums:
  holders on other nodes keep their node share and all move by the same far share c; the
  largest non-holder load is the largest base load but d's (a top-2)."""
  n = src_N.shape[0]
  g = n // devices_per_node
  held = held_N.astype(jnp.float32)
  node_N = _node_of(n, devices_per_node)

  def per_node(x):
    return jnp.sum(x.reshape(g, devices_per_node), axis=-1)

  k_G = per_node(held)
  rest_G = per_node((1.0 - held) * src_N)
  has_G = k_G > 0
  near_G = jnp.where(has_G, rest_G / jnp.maximum(k_G, 1.0), 0.0)
  far = jnp.sum(jnp.where(has_G, 0.0, rest_G))
  a_N = base_N + src_N                                   # a holder's load before any spread
  # Candidate d (node g_d): node g_d's share and the far share c after adding it.
  k1_N = k_G[node_N] + 1.0
  near1_N = (rest_G[node_N] - src_N) / k1_N
  c_N = (far - jnp.where(has_G[node_N], 0.0, rest_G[node_N])) / (jnp.sum(held) + 1.0)
  # Largest load: non-holders but d; holders of other nodes; holders of d's node and d.
  top1, top2 = _top2(jnp.where(held_N, -jnp.inf, base_N))
  other_N = jnp.where(base_N >= top1, top2, top1)
  x_G = jnp.max(jnp.where(held_N, a_N, -jnp.inf).reshape(g, devices_per_node), axis=-1)
  node1, node2 = _top2(x_G + near_G)
  away_N = jnp.where(x_G[node_N] + near_G[node_N] >= node1, node2, node1) + c_N
  own_N = jnp.maximum(x_G[node_N], a_N) + near1_N + c_N
  max_N = jnp.maximum(jnp.maximum(other_N, away_N), own_N)
  # Sum of squares: sum(base^2) plus each holder's (a + u)^2 - base^2, u its node share + c,
  # per node D + 2 u P + k u^2 with D = sum src (2 base + src), P = sum a (no cancellation).
  d_G = per_node(held * src_N * (2.0 * base_N + src_N))
  p_G = per_node(held * a_N)

  def term(d, p, k, u):
    return d + 2.0 * u * p + k * u * u

  s0 = jnp.sum(term(d_G, p_G, k_G, near_G))
  s1 = jnp.sum(p_G + k_G * near_G)
  h = jnp.sum(k_G)
  everywhere_N = s0 + 2.0 * c_N * s1 + c_N * c_N * h     # every node's holders, moved by c
  gn = node_N
  mine_old_N = term(d_G[gn], p_G[gn], k_G[gn], near_G[gn] + c_N)
  mine_new_N = term(d_G[gn] + src_N * (2.0 * base_N + src_N), p_G[gn] + a_N, k1_N, near1_N + c_N)
  sos_N = jnp.sum(base_N * base_N) + jnp.maximum(everywhere_N - mine_old_N, 0.0) + mine_new_N
  return max_N, sos_N


def candidate_loads_direct(src_N, held_N, base_N, devices_per_node: int):
  """`candidate_loads` by its definition: each candidate's N device loads, O(N^2)."""
  n = src_N.shape[0]
  plus_NxN = held_N[None, :] | jnp.eye(n, dtype=jnp.bool_)
  loads_NxN = base_N[None, :] + expert_device_load(
      None, plus_NxN, devices_per_node=devices_per_node, source_load_ExN=src_N[None, :])
  return jnp.max(loads_NxN, axis=1), jnp.sum(loads_NxN * loads_NxN, axis=1)


def _top2(x_N):
  """(largest, second largest) of x_N (the same value twice when it occurs twice; -inf for the
  second of a single element: one node has one, where `lax.top_k(x, 2)` is refused)."""
  top1 = jnp.max(x_N)
  first = jnp.argmax(x_N)
  return top1, jnp.max(jnp.where(jnp.arange(x_N.shape[0]) == first, -jnp.inf, x_N))


def _plan(src_ExN, owner_E, n, dpn, m, overlap_degree, target_straggler, lookahead, prefer_ExN,
          prefer_within, owner_sends, candidates) -> Plan:
  e = src_ExN.shape[0]
  g = n // dpn
  load_E = jnp.sum(src_ExN, axis=1)
  node_N = _node_of(n, dpn)
  total = jnp.sum(load_E)
  mean = total / n
  eps = 1e-6 * jnp.maximum(total, 1e-30)
  rounds = min(n * m, max(overlap_degree, 0) * (n - 1), n * owner_sends)
  chain = max(1, min(lookahead, n - 1))
  eye_NxN = jnp.eye(n, dtype=jnp.bool_)

  def contributions(holders_ExN):
    return expert_device_load(None, holders_ExN, devices_per_node=dpn, source_load_ExN=src_ExN)

  def grow(src_N, held_N, base_N, allowed_N, prefer_N):
    """A chain of up to J new replicas of one expert; (held_JxN, max_J, sos_J) after each."""
    node_tiebreak_N = base_N / jnp.maximum(2.0 * jnp.max(base_N), 1e-30)

    def add_one(held_N, _):
      max_N, sos_N = candidates(src_N, held_N, base_N, dpn)
      ok_N = allowed_N & ~held_N
      max_N = jnp.where(ok_N, max_N, jnp.inf)
      sos_N = jnp.where(ok_N, sos_N, jnp.inf)
      tie_N = max_N <= jnp.min(max_N) + eps
      tie_N = tie_N & (sos_N <= jnp.min(jnp.where(tie_N, sos_N, jnp.inf)) + eps * mean)
      node_has_N = (jnp.sum(held_N.reshape(g, dpn), axis=1) > 0)[node_N]
      rank_N = node_has_N.astype(jnp.float32) * 2.0 + node_tiebreak_N
      d = jnp.argmin(jnp.where(tie_N, rank_N, jnp.inf))
      # A preferred device close enough to the best wins: its replica is cheaper to move.
      near_N = prefer_N & ok_N & (max_N <= jnp.min(max_N) + prefer_within * mean + eps)
      d = jnp.where(jnp.any(near_N), jnp.argmin(jnp.where(near_N, sos_N, jnp.inf)), d)
      any_ok = jnp.any(ok_N)
      held_N = held_N | (eye_NxN[d] & any_ok)
      return held_N, (held_N, jnp.where(any_ok, max_N[d], jnp.inf),
                      jnp.where(any_ok, sos_N[d], jnp.inf))

    return lax.scan(add_one, held_N, None, length=chain)[1]

  def cond(carry):
    i, done = carry[0], carry[-1]
    return (i < rounds) & ~done

  def body(carry, idx_X=None):
    """One round; with `idx_X` (expert ids, E for none) only those experts' chains are grown:
    once `overlap_degree` experts have replicas, no other expert is valid."""
    i, holders_ExN, rep_NxM, used_N, sends_N, done = carry
    contrib_ExN = contributions(holders_ExN)
    load_N = jnp.sum(contrib_ExN, axis=0)
    cur_max, cur_sos = jnp.max(load_N), jnp.sum(load_N * load_N)
    materialized_E = jnp.sum(holders_ExN, axis=1) > 1
    can_open = jnp.sum(materialized_E) < overlap_degree
    room_E = owner_sends - sends_N[owner_E]            # replicas each expert's owner can still fill
    valid_E = (materialized_E | can_open) & (load_E > 0) & (room_E > 0)
    allowed_ExN = valid_E[:, None] & (used_N < m)[None, :]
    base_ExN = load_N[None, :] - contrib_ExN
    if idx_X is None:
      pick = lambda a: a                                # noqa: E731
      allowed_XxN = allowed_ExN
    else:
      pick = lambda a: a[jnp.minimum(idx_X, e - 1)]     # noqa: E731
      allowed_XxN = pick(allowed_ExN) & (idx_X < e)[:, None]
    holders_XxN, prefer_XxN, room_X = pick(holders_ExN), pick(prefer_ExN), pick(room_E)
    x = holders_XxN.shape[0]
    held_XxJxN, max_XxJ, sos_XxJ = jax.vmap(grow)(
        pick(src_ExN), holders_XxN, pick(base_ExN), allowed_XxN, prefer_XxN)
    better_XxJ = (max_XxJ < cur_max - eps) | ((max_XxJ <= cur_max + eps)
                                              & (sos_XxJ < cur_sos - eps * mean))
    length_XxJ = jnp.broadcast_to(jnp.arange(chain)[None, :], (x, chain))
    better_XxJ = better_XxJ & (length_XxJ < room_X[:, None])    # a chain of j + 1 replicas
    max_XxJ = jnp.where(better_XxJ, max_XxJ, jnp.inf)
    tie_XxJ = max_XxJ <= jnp.min(max_XxJ) + 0.01 * mean
    # Candidates that add replicas only where they are cheap to move win when close enough.
    cheap_XxJ = ~jnp.any(held_XxJxN & ~holders_XxN[:, None, :] & ~prefer_XxN[:, None, :], axis=2)
    cheap_XxJ = cheap_XxJ & better_XxJ & (max_XxJ <= jnp.min(max_XxJ) + prefer_within * mean)
    tie_XxJ = jnp.where(jnp.any(cheap_XxJ), cheap_XxJ, tie_XxJ)
    tie_XxJ = tie_XxJ & (length_XxJ == jnp.min(jnp.where(tie_XxJ, length_XxJ, chain)))
    # The lowest sum of squares; within rounding of it, the first candidate (how the loads were
    # summed, e.g. over all experts' chains or over the materialized ones', moves the last bits).
    sos_XxJ = jnp.where(tie_XxJ, sos_XxJ, jnp.inf)
    flat = jnp.argmax(tie_XxJ & (sos_XxJ <= jnp.min(sos_XxJ) + eps * mean))
    bx, bj = flat // chain, flat % chain
    be = bx if idx_X is None else jnp.minimum(idx_X[bx], e - 1)
    take = jnp.any(better_XxJ) & (cur_max > target_straggler * mean + eps)
    added_N = held_XxJxN[bx, bj] & ~holders_ExN[be] & take
    holders_ExN = holders_ExN.at[be].set(holders_ExN[be] | added_N)
    slot_N = jnp.minimum(used_N, m - 1)
    rows = jnp.arange(n)
    rep_NxM = rep_NxM.at[rows, slot_N].set(jnp.where(added_N, be, rep_NxM[rows, slot_N]))
    used_N = used_N + added_N.astype(jnp.int32)
    sends_N = sends_N.at[owner_E[be]].add(jnp.sum(added_N, dtype=jnp.int32))
    return i + 1, holders_ExN, rep_NxM, used_N, sends_N, ~take

  def opening(carry):
    return cond(carry) & (jnp.sum(jnp.sum(carry[1], axis=1) > 1) < overlap_degree)

  carry = (jnp.zeros((), jnp.int32), owner_holders(owner_E, n), jnp.full((n, m), e, jnp.int32),
           jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32), jnp.zeros((), jnp.bool_))
  # Once t experts have replicas no other expert is valid, so the rounds left may grow those t
  # chains alone (the same rounds and plan, O(t) instead of O(E) each): a second loop, which
  # costs about 0.2 ms on XLA:CPU, so only where it saves more work than that (E=64 experts on
  # 16 devices: 6.1 -> 3.7 ms a plan; E=256 on 64: 238 -> 38 ms; `bench/planner.py`).
  two_phase = overlap_degree < e and rounds * (e - overlap_degree) * chain * n >= TWO_PHASE_WORK
  if rounds > 0 and two_phase:
    carry = lax.while_loop(opening, body, carry)
    idx_X = jnp.nonzero(jnp.sum(carry[1], axis=1) > 1, size=overlap_degree, fill_value=e)[0]
    carry = lax.while_loop(cond, functools.partial(body, idx_X=idx_X), carry)
  elif rounds > 0:
    carry = lax.while_loop(cond, body, carry)
  _, holders_ExN, rep_NxM, used_N, sends_N, _ = carry
  slot_ExN = jnp.full((e + 1, n), -1, jnp.int32)
  slot_ExN = slot_ExN.at[rep_NxM, jnp.broadcast_to(jnp.arange(n)[:, None], (n, m))].set(
      jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[None, :], (n, m)))[:e]
  load_N = jnp.sum(contributions(holders_ExN), axis=0)
  return Plan(replica_expert_NxM=rep_NxM, replica_slot_ExN=slot_ExN, holders_ExN=holders_ExN,
              num_replicas=jnp.sum(used_N),
              num_materialized=jnp.sum(jnp.sum(holders_ExN, axis=1) > 1).astype(jnp.int32),
              load_N=load_N, straggler=straggler_of(load_N), sends_N=sends_N)


def calibrate(plan: Plan, actual_load_E, owner_E, *, num_devices: int, devices_per_node: int,
              replica_slots: int, overlap_degree: int, target_straggler: float = 1.05,
              lookahead: int | None = None, margin: float = 0.05,
              actual_source_load_NxE=None, fresh: Plan | None = None,
              prefer_ExN=None, owner_sends: int | None = None) -> tuple[Plan, jax.Array]:
  """After gating: re-plan with the actual loads, adopted only when it pays.

  Returns (plan, adopted). The fresh plan (`materialize_plan` on the actual loads, per source
  device when `actual_source_load_NxE` is given: an all_gather of N x E counts) is adopted when
  its modelled straggler is below the current plan's under the same actual loads by more than
  `margin` (re-planning costs a late SparseAllGather of the replicas that change). Either way the
  returned plan's `load_N` and `straggler` are those under the actual loads. Pass `fresh` when
  it is already made (e.g. batched with other plans in one `vmap`) to skip re-planning here.
  `prefer_ExN` as in `materialize_plan` (default: the current plan's holders, whose replicas the
  re-plan keeps without moving them).
  """
  dpn = devices_per_node
  src = None if actual_source_load_NxE is None else jnp.asarray(actual_source_load_NxE,
                                                                  jnp.float32).T
  cur_load_N = jnp.sum(expert_device_load(actual_load_E, plan.holders_ExN, devices_per_node=dpn,
                                          source_load_ExN=src), axis=0)
  cur = plan._replace(load_N=cur_load_N, straggler=straggler_of(cur_load_N))
  if fresh is None:
    if prefer_ExN is None:
      prefer_ExN = plan.holders_ExN
    fresh = materialize_plan(actual_load_E, owner_E, num_devices=num_devices,
                             devices_per_node=dpn, replica_slots=replica_slots,
                             overlap_degree=overlap_degree, target_straggler=target_straggler,
                             lookahead=lookahead, source_load_NxE=actual_source_load_NxE,
                             prefer_ExN=prefer_ExN, owner_sends=owner_sends)
  adopted = fresh.straggler < cur.straggler - margin
  chosen = jax.tree.map(lambda a, b: jnp.where(adopted, a, b), fresh, cur)
  return chosen, adopted


# ----------------------------------------------------------------------------- dispatch


def dispatch_devices(experts_TxK, my_device, plan: Plan, *, devices_per_node: int,
                     send_ExN=None) -> jax.Array:
  """dest_TxK int32: the device each assignment of this source device goes to.

  Even rule (default): local if `my_device` holds the expert; else evenly over the holders on my
  node; else evenly over all holders (see the module docstring). With `send_ExN` (this source's
  row of `balanced_send`: how many of its assignments to each expert go to each device), the
  r-th assignment to expert e goes to the device whose cumulative share of send_ExN[e] covers r;
  assignments beyond the counts fall back to the even rule. Expert ids outside [0, E) (the
  dropped sentinel E) get N, a discard destination, as in ep dispatch. `my_device` may be traced
  (`lax.axis_index`).
  """
  holders_ExN = plan.holders_ExN
  e, n = holders_ExN.shape
  t, k = experts_TxK.shape
  a = t * k
  expert_A = jnp.asarray(experts_TxK, jnp.int32).reshape(a)
  valid_A = (expert_A >= 0) & (expert_A < e)
  safe_A = jnp.where(valid_A, expert_A, 0)
  # Rank of each assignment among this source's assignments to the same expert.
  order_A = jnp.argsort(expert_A, stable=True)
  sorted_A = expert_A[order_A]
  pos_A = jnp.arange(a, dtype=jnp.int32)
  starts_A = jnp.concatenate([jnp.ones((1,), jnp.bool_), sorted_A[1:] != sorted_A[:-1]])
  first_A = lax.cummax(jnp.where(starts_A, pos_A, 0))
  rank_A = jnp.zeros((a,), jnp.int32).at[order_A].set(pos_A - first_A)
  my_device = jnp.asarray(my_device, jnp.int32)
  hold_AxN = holders_ExN[safe_A]
  on_node_N = _node_of(n, devices_per_node) == my_device // devices_per_node
  near_AxN = hold_AxN & on_node_N[None, :]
  use_near_A = jnp.any(near_AxN, axis=1)
  cand_AxN = jnp.where(use_near_A[:, None], near_AxN, hold_AxN)
  count_A = jnp.maximum(jnp.sum(cand_AxN, axis=1), 1).astype(jnp.int32)
  pick_A = (rank_A + my_device) % count_A
  index_AxN = jnp.cumsum(cand_AxN.astype(jnp.int32), axis=1) - 1
  spread_A = jnp.argmax(cand_AxN & (index_AxN == pick_A[:, None]), axis=1).astype(jnp.int32)
  mine_A = jnp.take(hold_AxN, my_device, axis=1)
  dest_A = jnp.where(mine_A, my_device, spread_A)
  if send_ExN is not None:
    cum_AxN = jnp.cumsum(jnp.asarray(send_ExN, jnp.int32)[safe_A], axis=1)
    covered_A = rank_A < cum_AxN[:, -1]
    quota_A = jnp.argmax(cum_AxN > rank_A[:, None], axis=1).astype(jnp.int32)
    dest_A = jnp.where(covered_A, quota_A, dest_A)
  return jnp.where(valid_A, dest_A, n).reshape(t, k)


# ----------------------------------------------------------------------------- balanced dispatch


def _waterfill(base_N, mask_N, amount):
  """alloc_N >= 0, zero off mask_N, summing to `amount`, minimizing max(base_N + alloc_N) on it."""
  n = base_N.shape[0]
  b_N = jnp.sort(jnp.where(mask_N, base_N, jnp.inf))
  finite_N = jnp.isfinite(b_N)
  csum_N = jnp.cumsum(jnp.where(finite_N, b_N, 0.0))
  level_N = (amount + csum_N) / jnp.arange(1, n + 1, dtype=jnp.float32)
  ok_N = finite_N & (b_N <= level_N)
  last = n - 1 - jnp.argmax(ok_N[::-1])
  alloc_N = jnp.where(mask_N, jnp.maximum(level_N[last] - base_N, 0.0), 0.0)
  return jnp.where(jnp.any(ok_N), alloc_N, 0.0)


# The re-splits run one expert after another, each a handful of kernels on a few values: on GPU
# the loop's own step and the launches are the cost (priced in XLA:GPU's compiled program,
# `scripts/gpu_schedule.py`'s model). Over every expert, 2 E a layer, that was 1.81 ms a layer at
# OLMoE-1B-7B's 64 experts and 7.19 ms at DeepSeek-V3's 256 (0.42 s a step over its 58 MoE
# layers); unrolled 4 deep, XLA:GPU fuses across iterations (7 kernels an iteration -> 5.5) and
# steps the loop a quarter as often: 1.43 / 5.65 ms. Now only the experts with replicas are
# visited (2 t a layer). XLA:CPU keeps the plain loop (it compiles faster and runs it in
# microseconds).
SWEEP_UNROLL = 4


def balanced_quotas(holders_ExN, source_load_NxE, *, devices_per_node: int,
                    passes: int = 2, max_shared: int | None = None) -> jax.Array:
  """quota_ExN int32: how many of each expert's actual assignments each holder should process.

  Starts from the even rule's split and re-splits one expert at a time over its holders by
  water-filling against everything else (heaviest experts first, `passes` sweeps), which never
  raises the largest device load; then rounds to integers that keep every expert's total.
  Only an expert with two or more holders has a split to change (one holder takes its whole
  load), so the sweeps visit those: at most `max_shared` of them (a plan's overlap_degree: at
  most that many experts get replicas; None: up to E), heaviest first. A sweep is sequential
  (each re-split reads the others'): visiting t experts instead of E takes OLMoE-1B-7B's 2 x 64
  steps a layer to 2 x 4, DeepSeek-V3's 2 x 256 to 2 x 4.
  """
  src_ExN = jnp.asarray(source_load_NxE).T
  load_E = jnp.sum(src_ExN, axis=1)
  e = load_E.shape[0]
  alloc_ExN = expert_device_load(None, holders_ExN, devices_per_node=devices_per_node,
                                 source_load_ExN=src_ExN.astype(jnp.float32))
  order_E = jnp.argsort(-load_E, stable=True)
  shared_E = jnp.sum(holders_ExN, axis=1) > 1
  s = max(1, e if max_shared is None else min(e, max_shared))
  # the shared experts first, heaviest first (a stable sort of the load order); past the shared
  # ones a slot is left as it is
  order_S = order_E[jnp.argsort(~shared_E[order_E], stable=True)[:s]]
  visit_S = shared_E[order_S]

  def refill(i, alloc_ExN):
    x = order_S[i % s]
    base_N = jnp.sum(alloc_ExN, axis=0) - alloc_ExN[x]
    filled_N = _waterfill(base_N, holders_ExN[x], load_E[x].astype(jnp.float32))
    return alloc_ExN.at[x].set(jnp.where(visit_S[i % s], filled_N, alloc_ExN[x]))

  def sweeps(unroll: int):
    return lambda alloc_ExN: lax.fori_loop(0, passes * s, refill, alloc_ExN,
                                           unroll=min(unroll, passes * s))

  alloc_ExN = lax.platform_dependent(alloc_ExN, cpu=sweeps(1), default=sweeps(SWEEP_UNROLL))
  floor_ExN = jnp.where(holders_ExN, jnp.floor(alloc_ExN), 0.0).astype(jnp.int32)
  short_E = load_E.astype(jnp.int32) - jnp.sum(floor_ExN, axis=1)
  frac_ExN = jnp.where(holders_ExN, alloc_ExN - jnp.floor(alloc_ExN), -1.0)
  rank_ExN = jnp.argsort(jnp.argsort(-frac_ExN, axis=1, stable=True), axis=1)
  return floor_ExN + (holders_ExN & (rank_ExN < short_E[:, None])).astype(jnp.int32)


def _northwest(supply_ExI, demand_ExJ):
  """Flow_ExIxJ of the northwest-corner rule: supplies i meet demands j in index order."""
  s_hi, d_hi = jnp.cumsum(supply_ExI, axis=-1), jnp.cumsum(demand_ExJ, axis=-1)
  s_lo, d_lo = s_hi - supply_ExI, d_hi - demand_ExJ
  return jnp.maximum(0, jnp.minimum(s_hi[..., :, None], d_hi[..., None, :])
                     - jnp.maximum(s_lo[..., :, None], d_lo[..., None, :]))


def balanced_send(holders_ExN, source_load_NxE, *, devices_per_node: int,
                  passes: int = 2, max_shared: int | None = None) -> jax.Array:
  """send_NxExN int32: assignments each source sends to each device, per expert.

  For the actual routing counts (`source_load_NxE`, an all_gather of every device's per-expert
  counts after gating; every device computes the same table). Each holder processes its
  `balanced_quotas` share; the tokens to fill it come from its own source first, then from its
  node, then from other nodes (northwest-corner order), so only what balancing needs crosses
  nodes. Row `send[my_device]` is `dispatch_devices`' `send_ExN`. `max_shared`: as
  `balanced_quotas`.
  """
  counts_ExN = jnp.asarray(source_load_NxE, jnp.int32).T
  e, n = counts_ExN.shape
  g, dpn = n // devices_per_node, devices_per_node
  quota_ExN = balanced_quotas(holders_ExN, source_load_NxE, devices_per_node=dpn, passes=passes,
                              max_shared=max_shared)
  local_ExN = jnp.minimum(counts_ExN, quota_ExN)
  supply_ExN, demand_ExN = counts_ExN - local_ExN, quota_ExN - local_ExN
  node_ExGxDxD = _northwest(supply_ExN.reshape(e, g, dpn), demand_ExN.reshape(e, g, dpn))
  supply_ExN = supply_ExN - jnp.sum(node_ExGxDxD, axis=-1).reshape(e, n)
  demand_ExN = demand_ExN - jnp.sum(node_ExGxDxD, axis=-2).reshape(e, n)
  node_ExNxN = jnp.einsum("egij,gh->egihj", node_ExGxDxD, jnp.eye(g, dtype=jnp.int32)).reshape(
      e, n, n)
  send_ExNxN = (node_ExNxN + _northwest(supply_ExN, demand_ExN)
                + local_ExN[:, :, None] * jnp.eye(n, dtype=jnp.int32)[None, :, :])
  return jnp.transpose(send_ExNxN, (1, 0, 2))


def owner_dispatch(experts_TxK, owner_E, num_devices: int) -> jax.Array:
  """dest_TxK of owner-only placement (ep): the owner of each expert; N for the sentinel."""
  e = owner_E.shape[0]
  experts_TxK = jnp.asarray(experts_TxK, jnp.int32)
  valid = (experts_TxK >= 0) & (experts_TxK < e)
  return jnp.where(valid, jnp.asarray(owner_E, jnp.int32)[jnp.where(valid, experts_TxK, 0)],
                   num_devices)


def global_dispatch(experts_NxTxK, plan: Plan, *, devices_per_node: int,
                    send_NxExN=None) -> jax.Array:
  """dest_NxTxK for the whole global batch's routing, one row per source device (even rule, or
  `balanced_send` counts when `send_NxExN` is given)."""
  n = experts_NxTxK.shape[0]
  sources = jnp.arange(n, dtype=jnp.int32)
  if send_NxExN is None:
    return jax.vmap(lambda x, d: dispatch_devices(x, d, plan, devices_per_node=devices_per_node))(
        experts_NxTxK, sources)
  return jax.vmap(lambda x, d, s: dispatch_devices(x, d, plan, devices_per_node=devices_per_node,
                                                   send_ExN=s))(experts_NxTxK, sources, send_NxExN)


def tokens_per_device(dest_NxTxK, num_devices: int) -> jax.Array:
  """int32 [N]: assignments each device processes (discarded ones, dest N, not counted)."""
  flat = dest_NxTxK.reshape(-1)
  return jnp.zeros((num_devices + 1,), jnp.int32).at[flat].add(1)[:num_devices]


def straggler_factor(experts_NxTxK, plan: Plan, *, devices_per_node: int) -> jax.Array:
  """max / mean over devices of the expert assignments each processes under `plan`."""
  n = plan.holders_ExN.shape[1]
  dest = global_dispatch(experts_NxTxK, plan, devices_per_node=devices_per_node)
  return straggler_of(tokens_per_device(dest, n))


def traffic(dest_NxTxK, *, devices_per_node: int) -> dict[str, jax.Array]:
  """Assignments kept on their source device, sent within its node, and sent across nodes."""
  n = dest_NxTxK.shape[0]
  src = jnp.arange(n, dtype=jnp.int32).reshape((n,) + (1,) * (dest_NxTxK.ndim - 1))
  valid = dest_NxTxK < n
  local = valid & (dest_NxTxK == src)
  same_node = valid & (dest_NxTxK // devices_per_node == src // devices_per_node)
  return {"local": jnp.sum(local), "intra_node": jnp.sum(same_node & ~local),
          "inter_node": jnp.sum(valid & ~same_node)}
