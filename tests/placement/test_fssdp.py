"""SparseAllGather on 8 devices: every device receives the owner's expert in its replica slot,
and the transpose (SparseReduceScatter) sums the replicas' gradients on the owner in fp32,
rounding once (bf16 accumulation would lose the small parts)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moejax.placement import fssdp
from moejax.placement.dispatch import Dispatch

N, R = 8, 4


def _spag():
  mesh = Mesh(np.array(jax.devices()[:N]), ("devices",))
  dispatch = Dispatch(kind="fssdp", axis_names=("devices",), num_devices=N, devices_per_node=N,
                      replica_slots=1)
  replica_NxM = jnp.zeros((N, 1), jnp.int32)      # every device's one slot: expert 0

  def body(local_w_1xCxR):
    return fssdp.sparse_all_gather(local_w_1xCxR[0], replica_NxM, dispatch=dispatch)[None]

  return jax.shard_map(body, mesh=mesh, in_specs=P("devices"), out_specs=P("devices"),
                       check_vma=False)


def test_replicas_arrive_and_their_gradients_sum_in_fp32():
  spag = _spag()
  # Device d owns expert d (one per device); its weights are d + 1.
  local_w = jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.bfloat16)[:, None, None], (N, 1, R))
  replicas = jax.jit(spag)(local_w)
  np.testing.assert_array_equal(np.asarray(replicas, np.float32), np.ones((N, 1, R)))
  # Replica gradients 1 + d/256 (d = 0..7): in fp32 they sum to 8.109375 -> bf16 8.125.
  g = (1 + jnp.arange(N, dtype=jnp.float32) / 256).astype(jnp.bfloat16)[:, None, None]
  grad = jax.jit(jax.grad(lambda w: jnp.sum((spag(w) * g).astype(jnp.float32))))(local_w)
  exact = np.float32(np.sum(np.asarray(g, np.float32)))
  assert exact == np.float32(8.109375)
  np.testing.assert_array_equal(np.asarray(grad[0], np.float32),
                                np.full((1, R), np.asarray(jnp.bfloat16(exact), np.float32)))
  np.testing.assert_array_equal(np.asarray(grad[1:], np.float32), 0)


def _simulate_ragged(holder_NxM, rank_NxM, local_NxCxR, g_NxMxR):
  """The GPU path's `ragged_all_to_all`s by their documented semantics, in numpy, from each
  device's `ragged_plan`: (replicas [N, M, R], owners' gradients [N, C, R])."""
  n, m = holder_NxM.shape
  plans = [jax.tree.map(np.asarray, fssdp.ragged_plan(holder_NxM, me)) for me in range(n)]
  for o in range(n):
    for d in range(n):
      assert plans[o].send_N[d] == plans[d].recv_N[o]
  flat_rank = np.asarray(rank_NxM).reshape(-1)
  out = np.zeros((n, m) + local_NxCxR.shape[2:], np.float32)
  for o, p in enumerate(plans):
    rows = local_NxCxR[o][flat_rank[p.order]]
    for d in range(n):
      size, land = p.send_N[d], p.land_N[d]
      out[d, land:land + size] = rows[p.start_N[d]:p.start_N[d] + size]
  replicas = np.zeros_like(out)
  for d, p in enumerate(plans):
    replicas[d, p.slot_of_row] = out[d]
  back = np.zeros((n, n * m) + local_NxCxR.shape[2:], np.float32)
  for d, p in enumerate(plans):
    sent = g_NxMxR[d][p.slot_of_row]
    starts = np.cumsum(p.recv_N) - p.recv_N
    for o in range(n):
      size, land = p.recv_N[o], plans[o].start_N[d]
      back[o, land:land + size] = sent[starts[o]:starts[o] + size]
  grads = np.zeros(local_NxCxR.shape, np.float32)
  for o, p in enumerate(plans):
    np.add.at(grads[o], flat_rank[p.order], back[o])
  return replicas, grads


def test_ragged_plan_moves_what_the_static_path_moves():
  """The GPU exchange (by its documented semantics) gives every slot the owner's expert, and
  brings every replica gradient to its owner's row, as the static path does."""
  rng = np.random.default_rng(0)
  n, m, c, e = N, 3, 2, 2 * N
  owners = fssdp.even_owners(e, n)
  expert_NxM = rng.integers(0, e + 1, (n, m))           # e: an empty slot
  safe = np.minimum(expert_NxM, e - 1)
  valid = expert_NxM < e
  holder = np.where(valid, np.asarray(owners.owner_E)[safe], n)
  rank = np.where(valid, np.asarray(owners.rank_E)[safe], 0)
  local = rng.standard_normal((n, c, R)).astype(np.float32)
  g = rng.standard_normal((n, m, R)).astype(np.float32)
  replicas, grads = _simulate_ragged(jnp.asarray(holder), jnp.asarray(rank), local, g)
  want = np.where(valid[..., None], local[np.minimum(holder, n - 1), rank], 0)
  np.testing.assert_array_equal(replicas, want)
  want_grads = np.zeros_like(local)
  for d in range(n):
    for s in range(m):
      if valid[d, s]:
        want_grads[holder[d, s], rank[d, s]] += g[d, s]
  np.testing.assert_allclose(grads, want_grads, rtol=1e-6)


def test_each_platform_lowers_its_own_sparse_all_gather():
  from jax import export
  spag = _spag()
  local_w = jnp.ones((N, 1, R), jnp.bfloat16)
  grad = jax.jit(jax.grad(lambda w: jnp.sum(spag(w).astype(jnp.float32))))
  unchecked = [export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
  for fn in (jax.jit(spag), grad):                    # forward, and its transpose alone
    for platform, want in (("cpu", 0), ("cuda", 1)):
      text = export.export(fn, platforms=[platform],
                           disabled_checks=unchecked)(local_w).mlir_module()
      assert text.count("@ragged_all_to_all") == want, platform
