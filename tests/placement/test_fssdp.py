"""SparseAllGather on 8 devices: every device receives the owner's expert in its replica slot,
and the transpose (SparseReduceScatter) sums the replicas' gradients on the owner in fp32,
rounding once (bf16 accumulation would lose the small parts)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from moejax.placement import fssdp
from moejax.placement.dispatch import Dispatch
from tests.helpers import assert_bits_equal, emulated_ragged_all_to_all, gpu_forms_of

N, R = 8, 4


def _spag(owner_sends: int = 0):
  mesh = Mesh(np.array(jax.devices()[:N]), ("devices",))
  dispatch = Dispatch(kind="fssdp", axis_names=("devices",), num_devices=N, devices_per_node=N,
                      replica_slots=1, owner_sends=owner_sends)
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


def test_a_plan_past_the_owner_bound_comes_back_as_nan():
  """Every device's slot holds expert 0: its owner fills all 8 slots. Under a bound of 7
  (`Dispatch.owner_sends`; the GPU forms then hold 7 send and gradient rows) the replicas and
  the gradients come back NaN, on every platform, instead of silently wrong; at 8 they arrive."""
  local_w = jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.bfloat16)[:, None, None], (N, 1, R))
  for sends, broken in ((N - 1, True), (N, False)):
    spag = _spag(sends)
    replicas = np.asarray(jax.jit(spag)(local_w), np.float32)
    grad = np.asarray(jax.jit(jax.grad(lambda w: jnp.sum(spag(w).astype(jnp.float32))))(local_w),
                      np.float32)
    assert np.all(np.isnan(replicas)) == broken and np.all(np.isnan(grad[0])) == broken
    assert broken or (np.all(replicas == 1) and np.all(grad[0] == N))


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
      # where owner o's rows for d started: d reads it off the plan, as the owner counted it
      size, land = p.recv_N[o], p.back_N[o]
      assert land == plans[o].start_N[d]
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


# ------------------------------------------------------------------ compressed replicas
E2, D, F, M2 = 2 * N, 4, 8, 2          # two experts per device, two replica slots


def _coded_setup(owner_sends: int = 0):
  from moejax.codec import replicas
  codec = replicas.ReplicaCodec(3 * D * F + 2 * F + D, "bfloat16")   # biased experts
  mesh = Mesh(np.array(jax.devices()[:N]), ("devices",))
  dispatch = Dispatch(kind="fssdp", axis_names=("devices",), num_devices=N, devices_per_node=4,
                      replica_slots=M2, replica_codec=codec, owner_sends=owner_sends)
  owners = fssdp.even_owners(E2, N)

  def body(ws, g_ws, replica_NxM, state):
    ws = tuple(w[0] for w in ws)
    state = {**state, "cache": state["cache"][0], "prev": state["prev"][0]}
    coding = fssdp.prepare_coding(ws, state, owners, codec, ("devices",))

    def coded(ws):
      return fssdp.coded_sparse_all_gather(ws, replica_NxM, coding, dispatch=dispatch,
                                           owners=owners, codec=codec)[0]

    def plain(ws):
      return tuple(fssdp.sparse_all_gather(w, replica_NxM, dispatch=dispatch, owners=owners)
                   for w in ws)

    def loss(fn, ws):
      return sum(jnp.sum((r * g[0]).astype(jnp.float32)) for r, g in zip(fn(ws), g_ws))

    _, choice_NxM = fssdp.coded_sparse_all_gather(ws, replica_NxM, coding, dispatch=dispatch,
                                               owners=owners, codec=codec)
    reps, want = coded(ws), plain(ws)
    grads = jax.grad(functools.partial(loss, coded))(ws)
    want_grads = jax.grad(functools.partial(loss, plain))(ws)
    cache = replicas.to_bits(reps, codec.layout)
    lead = lambda t: tuple(x[None] for x in t)   # noqa: E731
    return (lead(reps), lead(want), lead(grads), lead(want_grads), choice_NxM,
            coding.bits_CxR[None], cache[None])

  state_specs = {"held": P(), "cache": P("devices"), "prev": P("devices"), "valid": P()}
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("devices"), P("devices"), P(),
                                                        state_specs),
                             out_specs=(P("devices"),) * 4 + (P(), P("devices"), P("devices")),
                             check_vma=False))
  return codec, owners, fn, body, state_specs, mesh


def _bits_equal(a, b):
  return all(np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))
             for x, y in zip(a, b))


def _two_coded_steps(owner_sends: int = 0):
  """Two steps of the coded SparseAllGather on 8 devices (and the plain one beside it, with
  both backwards), every value of the second moved a few units in the last place but one
  expert's, moved wholesale; slots swap on every device, and device 0 takes an expert it did
  not hold -> (rep1, rep2, [(replicas, plain replicas, grads, plain grads, choice) per step]).
  `owner_sends`: the dispatch's bound on the slots one owner fills (sizes the GPU forms)."""
  codec, owners, fn, _, _, _ = _coded_setup(owner_sends)
  rng = np.random.default_rng(1)
  # gpt-oss's six expert arrays: the three matrices, then the biases (b_gate, b_up, b_down)
  shapes = ((E2, D, F), (E2, D, F), (E2, F, D), (E2, F), (E2, F), (E2, D))
  w0 = [rng.standard_normal(s).astype(jnp.bfloat16) for s in shapes]
  w0[0].reshape(-1)[:4] = np.array([0x7fbf, 0x8000, 0x7f80, 0xffc1], np.uint16).view(jnp.bfloat16)
  g = tuple(jnp.asarray(rng.standard_normal((N, M2) + s[1:]).astype(jnp.bfloat16)) for s in shapes)
  # Device d stores experts 2d and 2d + 1 (even ownership): [N, C, ...] per device.
  stored = lambda ws: tuple(jnp.asarray(w.reshape((N, 2) + w.shape[1:])) for w in ws)  # noqa: E731
  rep1 = jnp.asarray(rng.integers(0, E2 + 1, (N, M2)), jnp.int32)          # E2: empty
  state = {"held": jnp.full((N, M2), -1, jnp.int32),
           "cache": jnp.zeros((N, M2, codec.values), jnp.uint16),
           "prev": jnp.zeros((N, 2, codec.values), jnp.uint16), "valid": jnp.zeros((), bool)}
  *first, prev, cache = fn(stored(w0), g, rep1, state)
  w1 = []
  for w in w0:
    u = w.view(np.uint16).astype(np.int32)
    moved = np.where(np.isfinite(w.astype(np.float32)), u + rng.integers(-2, 3, u.shape), u)
    w1.append(moved.astype(np.uint16).view(jnp.bfloat16))
  w1[1][5] = rng.standard_normal(w1[1][5].shape).astype(jnp.bfloat16)
  rep2 = np.asarray(rep1)[:, ::-1].copy()
  rep2[0] = [e for e in range(E2) if e not in np.asarray(rep1[0])][:M2]
  rep2 = jnp.asarray(rep2)
  state = {"held": rep1, "cache": cache, "prev": prev, "valid": jnp.ones((), bool)}
  *second, _, _ = fn(stored(w1), g, rep2, state)
  return rep1, rep2, [first, second]


@pytest.fixture(scope="module")
def coded_steps():
  return _two_coded_steps()


def test_coded_replicas_equal_plain_ones_bit_for_bit_and_patch_kept_experts(coded_steps):
  """The first step sends everything plain (no state); in the second, slots whose device held
  the same expert last step (in either slot) arrive as patches, except the expert moved too far
  for any patch format; replicas (NaN payloads, -0.0 and infinities included) and gradients
  equal the plain path's bit for bit."""
  rep1, rep2, steps = coded_steps
  for reps, want, grads, want_grads, _ in steps:
    assert _bits_equal(reps, want) and _bits_equal(grads, want_grads)
  assert not np.any(steps[0][4])
  hit = np.asarray(steps[1][4]) > 0
  kept = np.asarray(rep2) == np.asarray(rep1)[:, ::-1]
  expected = kept & (np.asarray(rep2) < E2) & (np.asarray(rep2) != 5)
  expected[0] = False
  np.testing.assert_array_equal(hit, expected)
  assert hit.sum() >= 4


def test_the_gpu_forms_of_the_sparse_collectives_equal_the_cpu_forms(coded_steps, monkeypatch):
  """The sparse collectives' and the replica codec's `lax.platform_dependent`s take their GPU
  branches and `ragged_all_to_all` is emulated
  from all_gathers: the ragged SparseAllGather (rows), its coded form (rows in chunks of
  `bits.CHUNK_WORDS` words, patches and plain rows), the ragged SparseReduceScatter and the
  replica codec's encode/decode without conditionals give the CPU forms' replicas, gradients
  and choices bit for bit, over both steps. The GPU forms' send and gradient rows are sized by
  the dispatch's `owner_sends`, here the most slots any owner fills in either step (one fewer
  drops a row), well below the N x M rows an unbounded owner may fill."""
  rep1, rep2, _ = coded_steps
  owner = np.asarray(fssdp.even_owners(E2, N).owner_E)
  most = max(np.bincount(owner[r[r < E2]], minlength=N).max() for r in map(np.asarray,
                                                                           (rep1, rep2)))
  assert most < N * M2 // 2
  monkeypatch.setattr(lax, "platform_dependent",
                      gpu_forms_of("moejax.placement.fssdp", "moejax.codec.replicas"))
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  _, _, gpu_steps = _two_coded_steps(owner_sends=int(most))
  assert_bits_equal(coded_steps[2], gpu_steps)


def test_coded_ragged_chunks_deliver_the_static_rows():
  """The GPU path's `ragged_all_to_all` of the rows in chunks (emulated in numpy by its
  documented semantics from each device's `coded_ragged_plan`) hands every device the rows of the
  static buffer: patch rows for hits, plain rows otherwise, zeros for empty slots. Chunks of 2
  words here, a patch row's last one half full."""
  rng = np.random.default_rng(2)
  n, m, c, k = N, 3, 2, 2
  plain_chunks, patch_chunks, u = 3, 2, 3
  holder = rng.integers(0, n + 1, (n, m))                  # n: an empty slot
  rank = np.where(holder < n, rng.integers(0, c, (n, m)), 0)
  hit = (rng.random((n, m)) < 0.5) & (holder < n)
  chunks = np.where(holder < n, np.where(hit, patch_chunks, plain_chunks), 0)
  plain = rng.integers(1, 2 ** 31, (n, c, u, k)).astype(np.uint32)
  patch = rng.integers(1, 2 ** 31, (n, c, u, k)).astype(np.uint32)
  patch[..., patch_chunks:, :] = 0
  patch[..., patch_chunks - 1, 1:] = 0                     # 3 words: a chunk and a half
  want = np.where((holder < n)[..., None, None], np.where(
      hit[..., None, None], patch[np.minimum(holder, n - 1), rank],
      plain[np.minimum(holder, n - 1), rank]), 0)
  want = np.where((np.arange(u) < chunks[..., None])[..., None], want, 0)
  plans = [jax.tree.map(np.asarray, fssdp.coded_ragged_plan(
      jnp.asarray(holder), jnp.asarray(chunks), me)) for me in range(n)]
  out = np.zeros((n, m * u, k), np.uint32)
  for o, p in enumerate(plans):
    rows = np.where((holder == o)[..., None, None], np.where(
        hit[..., None, None], patch[o][rank], plain[o][rank]), 0).reshape(n * m, u, k)
    mine = np.where(holder == o, chunks, 0).reshape(-1)
    np.testing.assert_array_equal(p.chunks_Q, mine[p.order_Q])     # what the owner sends
    send = np.asarray(fssdp.pack_send_chunks(jnp.asarray(rows[p.order_Q]),
                                             jnp.asarray(mine[p.order_Q]), jnp.asarray(p.start_Q)))
    for d in range(n):
      assert p.send_N[d] == plans[d].recv_N[o]
      size, land = p.send_N[d], p.land_N[d]
      out[d, land:land + size] = send[p.offset_N[d]:p.offset_N[d] + size]
  for d, p in enumerate(plans):
    got = np.asarray(fssdp.unpack_recv_chunks(jnp.asarray(out[d]), jnp.asarray(chunks[d]),
                                              jnp.asarray(p.row_start_M), u))
    np.testing.assert_array_equal(got, want[d])


def test_coded_ragged_offsets_fit_int32_for_deepseek_v3_experts():
  """DeepSeek-V3's expert (3 x 7168 x 2048 bf16 values: 22M words plain) in 64 x 2 replica
  slots: offsets in words would pass 2^31 (the send buffer's Q x W = 2.8e9 words overflowed at
  trace time); in chunks they stay far below. Traced abstractly, nothing allocated."""
  from moejax.codec import bits, replicas
  codec = replicas.ReplicaCodec(3 * 7168 * 2048)
  q, u = 64 * 2, bits.chunks(codec.row_words)
  assert q * codec.row_words > 2 ** 31 > q * u
  out = jax.eval_shape(fssdp.pack_send_chunks,
                       jax.ShapeDtypeStruct((q, u, bits.CHUNK_WORDS), jnp.uint32),
                       jax.ShapeDtypeStruct((q,), jnp.int32), jax.ShapeDtypeStruct((q,), jnp.int32))
  assert out.shape == (q * u, bits.CHUNK_WORDS)
  plan = fssdp.coded_ragged_plan(jnp.full((64, 2), 63), jnp.full((64, 2), u, jnp.int32), 63)
  assert int(plan.start_Q[-1]) == (q - 1) * u and int(plan.offset_N[-1]) == 63 * 2 * u


def test_each_platform_lowers_its_own_coded_sparse_all_gather():
  from jax import export
  codec, _, _, body, state_specs, mesh = _coded_setup()
  fwd = jax.jit(jax.shard_map(lambda *a: body(*a)[0], mesh=mesh,
                              in_specs=(P("devices"), P("devices"), P(), state_specs),
                              out_specs=P("devices"), check_vma=False))
  shapes = ((N, 2, D, F), (N, 2, D, F), (N, 2, F, D), (N, 2, F), (N, 2, F), (N, 2, D))
  ws = tuple(jnp.zeros(s, jnp.bfloat16) for s in shapes)
  g = tuple(jnp.zeros((N, M2) + s[2:], jnp.bfloat16) for s in shapes)
  state = {"held": jnp.zeros((N, M2), jnp.int32), "cache": jnp.zeros((N, M2, codec.values),
                                                                      jnp.uint16),
           "prev": jnp.zeros((N, 2, codec.values), jnp.uint16), "valid": jnp.zeros((), bool)}
  rep = jnp.zeros((N, M2), jnp.int32)
  unchecked = [export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
  for platform, want in (("cpu", 0), ("cuda", 1)):
    text = export.export(fwd, platforms=[platform], disabled_checks=unchecked)(
        ws, g, rep, state).mlir_module()
    # body runs the coded gather twice (replicas, hits) and the plain one once, plus the
    # backward of each; the forward output keeps the coded and plain forwards
    assert (text.count("@ragged_all_to_all") > 0) == bool(want), platform


def test_replica_bytes_count_every_pass_and_are_per_device():
  """`Placement.metrics`: SparseAllGather's bytes count twice when remat recomputes the layer
  (the gather runs again) and once without; the layers' shares arrive summed over devices."""
  from moejax.placement import Placement
  placement = Placement("fssdp", 2, E2, 2, D, F, N, 4, ("devices",), replica_slots=M2)
  layer = {"replicas": jnp.array([3.0, 1.0]), "replica_bytes": jnp.array([300.0, 100.0]),
           "replica_bytes_plain": jnp.array([600.0, 200.0])}
  full = placement.metrics(dict(layer), tokens_per_device=8, remat="full")
  none = placement.metrics(dict(layer), tokens_per_device=8, remat="none")
  np.testing.assert_array_equal(full["spag_bytes"], 2 * none["spag_bytes"])
  np.testing.assert_array_equal(none["spag_bytes"], [300.0, 100.0])
  np.testing.assert_array_equal(none["spag_bytes_plain"], [600.0, 200.0])
  np.testing.assert_array_equal(full["spag_bytes_capacity"], 2 * none["spag_bytes_capacity"])
  # The plan's replicas, once, per device: 3 replicas over 8 devices of one expert's bytes.
  np.testing.assert_allclose(none["spag_bytes_needed"], np.array([3.0, 1.0]) / N
                             * placement.expert_bytes)
  assert "replica_bytes" not in none
  # Tokens travel in ep's exchange buffer: the same bytes as ep's (they read 0 under fssdp).
  ep = Placement("ep", 2, E2, 2, D, F, N, 4, ("devices",))
  assert none["a2a_bytes"] > 0
  assert none["a2a_bytes"] == ep.metrics({}, tokens_per_device=8, remat="none")["a2a_bytes"]


def test_a_re_plan_fetches_only_the_replicas_a_device_lacks():
  """Calibration's late SparseAllGather (`late_replicas`): of an adopted re-plan, only the
  replicas a device did not receive with the first plan travel; the kept ones are copied from
  whichever first-plan slot holds them. Replicas and gradients equal a full gather of the re-plan
  bit for bit (bf16: each expert's replica gradients, kept and moved alike, summed in fp32 and
  rounded once), and the first gather's SparseReduceScatter returns nothing."""
  mesh = Mesh(np.array(jax.devices()[:N]), ("devices",))
  dispatch = Dispatch(kind="fssdp", axis_names=("devices",), num_devices=N, devices_per_node=4,
                      replica_slots=M2)
  owners = fssdp.even_owners(E2, N)
  # Device d owns experts 2d and 2d + 1; E2 marks an empty slot. Expert 0 is kept on devices 1,
  # 2 (in another slot) and 5, and new on 3, 4 and 6: its gradient sums kept and moved replicas.
  first = np.array([[2, 4], [0, 4], [0, 6], [2, 8], [10, 12], [0, 14], [E2, E2], [3, 5]])
  fresh = np.array([[4, 2], [0, 5], [9, 0], [0, E2], [0, 12], [E2, 0], [0, 3], [5, E2]])
  need, kept, source = jax.tree.map(np.asarray, fssdp.new_replicas(
      jnp.asarray(first), jnp.asarray(fresh), E2))
  held = np.array([[x in row for x in new_row] for row, new_row in zip(first, fresh)])
  np.testing.assert_array_equal(kept, held & (fresh < E2))
  np.testing.assert_array_equal(need, np.where(kept, E2, fresh))
  assert np.sum(need < E2) == 6 and np.sum(kept) == 7
  np.testing.assert_array_equal(np.take_along_axis(first, source, axis=1)[kept], fresh[kept])

  def body(w_1xCxR, g_1xMxR):
    w, g = w_1xCxR[0], g_1xMxR[0]
    spag = lambda w, plan: fssdp.sparse_all_gather(w, jnp.asarray(plan), dispatch=dispatch,  # noqa: E731
                                                   owners=owners)

    def late(w, first_w):
      reps, _, _ = fssdp.late_replicas((w,), (spag(first_w, first),), jnp.asarray(first),
                                       jnp.asarray(fresh), dispatch=dispatch, owners=owners)
      return reps[0]

    def loss(w, first_w):
      return jnp.sum((late(w, first_w) * g).astype(jnp.float32))

    def full_loss(w):
      return jnp.sum((spag(w, fresh) * g).astype(jnp.float32))

    grads, first_grads = jax.grad(loss, argnums=(0, 1))(w, w)
    return (late(w, w)[None], spag(w, fresh)[None], grads[None],
            jax.grad(full_loss)(w)[None], first_grads[None])

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("devices"), P("devices")),
                             out_specs=(P("devices"),) * 5, check_vma=False))
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((N, 2, R)), jnp.bfloat16)      # 2 experts per device
  g = jnp.asarray(rng.standard_normal((N, M2, R)), jnp.bfloat16)
  reps, want, grads, want_grads, first_grads = fn(w, g)
  bits = lambda x: np.asarray(x).view(np.uint16)   # noqa: E731
  np.testing.assert_array_equal(bits(reps), bits(want))
  np.testing.assert_array_equal(bits(grads), bits(want_grads))
  assert np.any(np.asarray(grads, np.float32) != 0)
  np.testing.assert_array_equal(np.asarray(first_grads, np.float32), 0)
