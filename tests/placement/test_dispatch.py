"""ep token dispatch on 8 devices: the static-buffer exchange gives the single-device experts'
results and counts what it drops; each platform lowers its own exchange (XLA:CPU the whole
buffer's `all_to_all`, GPU `ragged_all_to_all` of the filled rows, forward and backward); the
GPU's packed buffers (`Dispatch.packed`, ragged only, emulated here) give the blocks' bits."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax
from jax.sharding import Mesh, PartitionSpec as P

from moejax.placement import dispatch as dispatch_lib
from tests.helpers import assert_bits_equal, emulated_ragged_all_to_all, gpu_forms_of

N, T, K, D, F, E = 8, 16, 2, 32, 64, 16     # T tokens per device


def _inputs():
  keys = jax.random.split(jax.random.key(0), 5)
  experts = jax.random.randint(keys[1], (N * T, K), 0, E)
  experts = experts.at[:T, :].set(3)         # device 0 sends all it has to expert 3's owner
  w = [jax.random.normal(keys[i], shape, jnp.bfloat16) * 0.1
       for i, shape in ((2, (E, D, F)), (3, (E, D, F)), (4, (E, F, D)))]
  return (jax.random.normal(keys[0], (N * T, D), jnp.bfloat16), experts,
          jnp.full((N * T, K), 0.5, jnp.float32), *w)


@functools.lru_cache(maxsize=None)
def _ep(capacity_factor: float, chunks: int = 1, receive_factor: float = 0.0,
        packed: bool = False):
  """(y, dropped, received, rows needed at one destination, rows needed by the experts) per
  device. `packed` takes `ragged_all_to_all`: call it with the emulation in place."""
  mesh = Mesh(np.array(jax.devices()[:N]), ("devices",))
  dispatch = dispatch_lib.Dispatch(kind="ep", axis_names=("devices",), num_devices=N,
                                   devices_per_node=N, capacity_factor=capacity_factor,
                                   chunks=chunks, receive_capacity_factor=receive_factor,
                                   packed=packed)

  def body(*args):
    y, dropped, received, needed = dispatch_lib.ep_experts(*args, dispatch=dispatch)
    return y, dropped[None], received[None], needed.dispatch[None], needed.receive[None]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("devices"),) * 6,
                               out_specs=P("devices"), check_vma=False))


def test_dropless_ep_matches_local_experts():
  args = _inputs()
  y, dropped, received, _, _ = _ep(0.0)(*args)
  want, _ = jax.jit(dispatch_lib.local_experts)(*args)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  assert int(dropped.sum()) == 0
  owner = np.asarray(args[1]).reshape(-1) // (E // N)
  np.testing.assert_array_equal(np.asarray(received), np.bincount(owner, minlength=N))


def test_biased_clamped_experts_dispatch_as_they_run_locally():
  """gpt-oss's experts (biases owned with the experts, the clamped SwiGLU) through the ep
  exchange on 8 devices: the same outputs as on one device, and the same gradients, the
  biases' too (each owner's rows only)."""
  from moejax.placement.experts import ExpertFn
  fn = ExpertFn("swiglu_clamped", limit=0.05, bias=True)
  x, experts, weights, *w = _inputs()
  keys = jax.random.split(jax.random.key(5), 4)
  w = (*w, *(jax.random.normal(k, shape, jnp.bfloat16) * 0.05
             for k, shape in zip(keys, ((E, F), (E, F), (E, D)))))
  cot = jax.random.normal(keys[3], (N * T, D), jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:N]), ("devices",))
  dispatch = dispatch_lib.Dispatch(kind="ep", axis_names=("devices",), num_devices=N,
                                   devices_per_node=N, capacity_factor=0.0)
  ep = jax.shard_map(lambda x, e, g, *w: dispatch_lib.ep_experts(x, e, g, *w, dispatch=dispatch,
                                                                 fn=fn)[0],
                     mesh=mesh, in_specs=(P("devices"),) * 9, out_specs=P("devices"),
                     check_vma=False)
  local = lambda x, e, g, *w: dispatch_lib.local_experts(x, e, g, *w, fn=fn)[0]   # noqa: E731

  def value_and_grads(f):
    y, vjp = jax.vjp(lambda x, *w: f(x, experts, weights, *w), x, *w)
    return y, vjp(cot)

  (y, grads), (y_want, grads_want) = (jax.jit(lambda: value_and_grads(f))()
                                      for f in (ep, local))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_want))
  for g, want in zip(grads, grads_want):
    g, want = np.asarray(g, np.float32), np.asarray(want, np.float32)
    assert np.any(want)
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-2 * np.max(np.abs(want)))


def test_capacity_drops_what_does_not_fit_and_zeroes_it():
  args = _inputs()
  y, dropped, _, needed, _ = _ep(1.0)(*args)
  c = dispatch_lib.ep_capacity(T * K, N, 1.0)
  owner_NxA = np.asarray(args[1]).reshape(N, T * K) // (E // N)
  per_dest = np.stack([np.bincount(row, minlength=N) for row in owner_NxA])
  want = np.maximum(per_dest - c, 0).sum(axis=1)
  np.testing.assert_array_equal(np.asarray(dropped), want)
  # Each device reports the most rows it sent to one destination; their max (taken after the
  # layers, fssdp.finish_placement) is what a buffer grown from this step's loads must hold
  # (dispatch.grown_capacity_factor).
  np.testing.assert_array_equal(np.asarray(needed), per_dest.max(axis=1))
  grown = dispatch_lib.grown_capacity_factor(1.0, int(per_dest.max()), T * K, N)
  assert grown == 0.0 or dispatch_lib.ep_capacity(T * K, N, grown) >= per_dest.max()
  assert want[0] == T * K - c               # the hot source overflows
  # Its tokens all went to one owner: those past the first c//K tokens came back as zeros.
  assert np.all(np.asarray(y[c // K:T]) == 0) and np.any(np.asarray(y[:c // K]) != 0)


@pytest.mark.parametrize("packed", [False, True], ids=["blocks", "packed"])
def test_the_experts_run_the_first_rows_a_device_received_and_count_the_rest(packed, monkeypatch):
  """`Dispatch.receive_capacity_factor`: each device runs R = ceil(factor x T x K) of the rows it
  received through its experts: in blocks the first R of its receive buffer in expert order
  (local expert, then source, then the source's order); packed (GPU, emulated) the first R in
  source order, the buffer holding R rows. The rows past them come back as zeros and count as
  dropped there. Against the local experts with exactly those assignments dropped: the same
  outputs and gradients, and each device's count. The rows a device needed are what it
  received."""
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  x, experts, weights, *w = _inputs()
  experts = jax.random.randint(jax.random.key(7), (N * T, K), 0, E)    # no hot source
  c, r = 4.0, 0.75                # C = 16 rows a destination: nothing dropped at the sender
  rows = dispatch_lib.receive_capacity(T * K, N, c, r)
  assert rows == 24 and dispatch_lib.receive_capacity(T * K, N, c, 0.0) == N * 16
  ct_TxD = jax.random.normal(jax.random.key(1), (N * T, D), jnp.float32)
  # Which assignments each device's experts run: received rows in expert order, the first R.
  expert_NxA = np.asarray(experts).reshape(N, T * K)
  el = E // N
  keep_NxA = np.ones_like(expert_NxA, bool)
  for dest in range(N):
    rows_here = sorted((0 if packed else e % el, s, a) for s in range(N)
                       for a, e in enumerate(expert_NxA[s]) if e // el == dest)
    for _, s, a in rows_here[rows:]:
      keep_NxA[s, a] = False
  kept = jnp.asarray(np.where(keep_NxA, expert_NxA, E).reshape(N * T, K))

  def outputs(f, e):
    loss = lambda x, *w: jnp.sum(f(x, e, weights, *w)[0].astype(jnp.float32) * ct_TxD)  # noqa
    return f(x, e, weights, *w), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, *w)

  (y, dropped, received, needed, received_needed), grads = outputs(_ep(c, 1, r, packed),
                                                                   experts)
  (y_want, _), grads_want = outputs(jax.jit(dispatch_lib.local_experts), kept)
  assert int(np.sum(dropped)) > 0          # some device received more than R
  np.testing.assert_array_equal(np.asarray(dropped), np.maximum(np.asarray(received) - rows, 0))
  np.testing.assert_array_equal(np.asarray(received_needed), np.asarray(received))
  np.testing.assert_array_equal(np.asarray(received),
                                np.bincount(expert_NxA.reshape(-1) // el, minlength=N))
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_want), rtol=0, atol=1e-6)
  for g, want in zip(grads, grads_want):
    g, want = np.asarray(g, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(g, want, rtol=0, atol=1e-2 * np.max(np.abs(want)))


@pytest.mark.parametrize("platform", ["cpu", "cuda", "cuda packed"])
def test_each_platform_lowers_its_own_exchange(platform):
  args = _inputs()
  ep = _ep(0.0, packed=platform.endswith("packed"))
  grad = jax.jit(jax.grad(lambda *a: jnp.sum(ep(*a)[0]), argnums=(0, 3)))
  unchecked = [export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
  for fn in (ep, grad):
    text = export.export(fn, platforms=[platform.split()[0]],
                         disabled_checks=unchecked)(*args).mlir_module()
    ragged = text.count("@ragged_all_to_all")
    if platform == "cpu":
      assert ragged == 0 and "stablehlo.all_to_all" in text
    elif platform == "cuda":  # ids and tokens out, results back (and their transposes)
      assert ragged >= 3
    else:     # the same, and the offsets from one all_gather of the counts: no all_to_all
      assert ragged >= 3 and "stablehlo.all_to_all" not in text
      assert "stablehlo.all_gather" in text


def test_the_gpu_exchange_gives_the_cpu_ones_results_and_gradients(monkeypatch):
  """The GPU form of the exchange (ids, tokens and results as `ragged_all_to_all`s of the filled
  rows, emulated from all_gathers; the rest of the step on its CPU forms) gives the static
  buffer's outputs, drop counts and gradients bit for bit, at a capacity that one source
  overflows and the others fill in part."""
  args, capacity_factor = _inputs(), 1.0
  # Random cotangents: all ones would hide rows returned to the wrong token.
  ct_TxD = jax.random.normal(jax.random.key(1), (N * T, D), jnp.float32)

  def outputs(ep):
    loss = lambda *a: jnp.sum(ep(*a)[0].astype(jnp.float32) * ct_TxD)   # noqa: E731
    return ep(*args), jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5)))(*args)

  want = outputs(_ep(capacity_factor))
  monkeypatch.setattr(lax, "platform_dependent", gpu_forms_of("moejax.placement.dispatch"))
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  assert_bits_equal(want, outputs(_ep.__wrapped__(capacity_factor)))


def test_an_exchange_in_pieces_equals_the_whole_on_each_platform_s_form(monkeypatch):
  """`Dispatch.chunks`: the buffer's rows go in pieces (here 3 for C = 4 rows a destination:
  rows dealt in turn, 2 a piece, the last row of each block unused), each out, through the
  experts and back on its own, so one piece's exchange can run under another's expert matmuls. Outputs, drop counts, rows received and needed, and the
  tokens' gradients equal one exchange's bit for bit at a capacity one source overflows; the
  expert weights' gradients are each piece's, rounded to bf16 and then summed, so within bf16
  rounding of one exchange's. The CPU form has one all_to_all per piece and direction; the GPU
  form (ragged, emulated) gives the CPU form's pieces bit for bit."""
  args, capacity_factor = _inputs(), 1.0
  assert dispatch_lib.ep_capacity(T * K, N, capacity_factor) == 4
  ct_TxD = jax.random.normal(jax.random.key(1), (N * T, D), jnp.float32)

  def outputs(ep):
    loss = lambda *a: jnp.sum(ep(*a)[0].astype(jnp.float32) * ct_TxD)   # noqa: E731
    return ep(*args), jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5)))(*args)

  whole, pieces = outputs(_ep(capacity_factor)), outputs(_ep(capacity_factor, 3))
  assert int(np.sum(whole[0][1])) > 0                       # the hot source overflows
  # (the rows needed by the experts: pieces x the busiest piece's, at least one exchange's)
  assert_bits_equal((whole[0][:4], whole[1][0]), (pieces[0][:4], pieces[1][0]))
  assert np.all(pieces[0][4] >= whole[0][4]) and np.all(pieces[0][4] <= whole[0][4] + 3 * N)
  for want, got in zip(whole[1][1:], pieces[1][1:]):
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2.0 ** -7)
  text = _ep(capacity_factor, 3).lower(*args).as_text()
  assert text.count("all_to_all") == 3 * 3                 # ids, tokens and results, per piece
  monkeypatch.setattr(lax, "platform_dependent", gpu_forms_of("moejax.placement.dispatch"))
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  assert_bits_equal(pieces, outputs(_ep.__wrapped__(capacity_factor, 3)))


@pytest.mark.parametrize("capacity_factor,chunks,receive_factor", [(1.0, 1, 0.0), (2.0, 2, 1.5)])
def test_packed_buffers_give_the_blocks_results_and_gradients(capacity_factor, chunks,
                                                             receive_factor, monkeypatch):
  """`Dispatch.packed` (the GPU's exchange: A rows sent, the rows the experts run received,
  `ragged_all_to_all` emulated from all_gathers) against the per-destination blocks (the CPU's
  `all_to_all`): outputs, drop counts, rows received and needed, and gradients bit for bit, at
  a capacity one source overflows, whole and every received row run, or in pieces with R of
  them (a receive factor no device overflows here: R = 24 of a piece's 32 rows)."""
  args = _inputs()
  ct_TxD = jax.random.normal(jax.random.key(1), (N * T, D), jnp.float32)

  def outputs(ep):
    loss = lambda *a: jnp.sum(ep(*a)[0].astype(jnp.float32) * ct_TxD)   # noqa: E731
    return ep(*args), jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5)))(*args)

  blocks_ep = (_ep(capacity_factor, chunks) if receive_factor == 0     # shared with the above
               else _ep(capacity_factor, chunks, receive_factor))
  blocks = outputs(blocks_ep)
  assert int(np.sum(blocks[0][1])) > 0                      # the hot source overflows
  rows = dispatch_lib.receive_capacity(T * K, N, capacity_factor, receive_factor, chunks)
  whole = dispatch_lib.receive_capacity(T * K, N, capacity_factor, 0.0, chunks)
  assert (rows < whole) == (receive_factor > 0)             # the experts run R rows, or all
  assert np.all(np.asarray(blocks[0][4]) <= rows * chunks)  # no device past R
  monkeypatch.setattr(lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  assert_bits_equal(blocks, outputs(_ep(capacity_factor, chunks, receive_factor, True)))


def test_grown_capacity_covers_the_need_with_a_margin_and_at_least_doubles():
  a, n = 32768, 64                                  # the 1b7b preset: 4096 tokens x top-8
  assert dispatch_lib.ep_capacity(a, n, 2.0) == 1024
  # The need sets the size (x1.25), else at least twice the old capacity; the factor, in three
  # decimals, gives at least that many rows and at most 0.1% more.
  for needed, rows in ((1100, 2048), (2000, 2500)):
    factor = dispatch_lib.grown_capacity_factor(2.0, needed, a, n)
    assert rows <= dispatch_lib.ep_capacity(a, n, factor) <= rows * 1.001
  assert dispatch_lib.grown_capacity_factor(2.0, 30000, a, n) == 0.0     # dropless: all of A


def test_the_config_s_pieces_reach_the_exchange():
  from moejax.train.state import placement_for
  from tests.helpers import tiny_config
  for placement in ("ep", "fssdp"):
    cfg = tiny_config(**{"moe.placement": placement, "moe.dispatch_chunks": 3})
    assert placement_for(cfg, 8, 8).dispatch.chunks == 3


def test_a_mesh_of_cpu_devices_takes_the_blocks_and_others_the_packed_buffers():
  from moejax.errors import ConfigError
  from moejax.sharding.mesh import make_mesh
  from moejax.train.state import placement_of
  from tests.helpers import tiny_config
  cfg = tiny_config(**{"moe.placement": "ep"})
  mesh = make_mesh((1, 8), jax.devices()[:8])
  assert not placement_of(cfg, mesh).dispatch.packed
  # (what placement_of reads of a mesh: its shape and its devices' platform)
  gpu = type("GpuDevice", (), {"platform": "gpu"})()
  gpu_mesh = type("GpuMesh", (), {"shape": mesh.shape,
                                  "devices": np.array([gpu] * 8).reshape(1, 8)})()
  assert placement_of(cfg, gpu_mesh).dispatch.packed
  blocks = tiny_config(**{"moe.placement": "ep", "moe.exchange_buffers": "blocks"})
  assert not placement_of(blocks, gpu_mesh).dispatch.packed
  packed = tiny_config(**{"moe.placement": "ep", "moe.exchange_buffers": "packed"})
  with pytest.raises(ConfigError, match=r"moe\.exchange_buffers='packed' needs ragged"):
    placement_of(packed, mesh)


def test_pieces_share_what_is_sent_whatever_the_fill():
  """A destination's rows are dealt to the pieces in turn, so each piece carries its share
  (buffers are sized above the mean fill: split by position, the later pieces would go empty)."""
  sent_N = jnp.array([0, 1, 2, 5, 7, 8, 100], jnp.int32)
  for pieces in (1, 2, 3, 4):
    counts = np.stack([np.asarray(c) for c in dispatch_lib.piece_counts(sent_N, pieces)])
    np.testing.assert_array_equal(counts.sum(axis=0), np.asarray(sent_N))
    assert np.all(counts.max(axis=0) - counts.min(axis=0) <= 1)
    assert np.all(counts[:-1] >= counts[1:])          # the first pieces take the remainder


def test_packed_buffers_bound_what_a_dropless_exchange_receives():
  """Dropless blocks (C = `max_rows`) run every received row: their buffer holds them. Packed
  buffers hold the R rows the experts run, so R bounds them dropless too; and under "grow" the
  placement sends packed buffers uncapped (a cap would only drop rows and rerun), so the step
  can overflow only what a device receives."""
  import dataclasses
  from moejax.train.state import placement_for
  from tests.helpers import tiny_config
  a = T * K
  assert dispatch_lib.receive_capacity(a, N, 0.0, 1.25) == N * a
  assert dispatch_lib.receive_capacity(a, N, 0.0, 1.25, packed=True) == 40
  assert dispatch_lib.receive_capacity(a, N, 0.0, 1.25, 2, packed=True) == 20
  cfg = tiny_config(**{"moe.placement": "ep", "moe.dispatch_capacity_factor": 2.0})
  tokens = cfg.batch_size * cfg.seq_len // 8
  blocks, packed = (placement_for(cfg, 8, 8, packed_exchange=p) for p in (False, True))
  assert blocks.dispatch.capacity_factor == 2.0 and packed.dispatch.capacity_factor == 0.0
  # uncapped: the most a destination can be sent, one row per token (each device holds one of
  # the 8 experts: a token's top-2 reach two devices, never two rows to one)
  assert packed.dispatch_capacity(tokens) == packed.max_rows(tokens) == tokens
  assert blocks.grows_dispatch(tokens) and packed.grows_dispatch(tokens)
  assert packed.receive_capacity(tokens) == blocks.receive_capacity(tokens)
  # grown past the dispatch factor (2.5 x T x K > the blocks' 2 x T x K), R still bounds what a
  # device may receive (N x T x K uncapped): the step still grows, never drops silently
  grown = dataclasses.replace(packed, receive_capacity_factor=2.5)
  assert grown.receive_capacity(tokens) == math.ceil(2.5 * tokens * cfg.moe.top_k)
  assert grown.grows_dispatch(tokens)
  dropless = dataclasses.replace(blocks, dispatch_capacity_factor=0.0)
  assert not dropless.grows_dispatch(tokens)       # every received row runs: nothing to grow
  every_row = dataclasses.replace(packed, receive_capacity_factor=0.0)   # the cap bounds it
  assert every_row.dispatch.capacity_factor == 2.0 and every_row.grows_dispatch(tokens)
  assert not dataclasses.replace(every_row, dispatch_capacity_factor=0.0).grows_dispatch(tokens)
  drop = dataclasses.replace(packed, dispatch_overflow="drop")   # the cap is the drop rule
  assert drop.dispatch.capacity_factor == 2.0 and not drop.grows_dispatch(tokens)
  # One device under "grow": nothing travels and no step grows a cap, so none applies (a
  # factor below 1 would drop rows silently).
  one = placement_for(tiny_config(**{"moe.placement": "ep",
                                     "moe.dispatch_capacity_factor": 0.5}), 1, 1)
  assert one.dispatch.capacity_factor == 0.0 and not one.grows_dispatch(tokens * 8)


def test_a_dropless_buffer_holds_what_one_destination_can_be_sent():
  """A token sends one row per expert it routes to, so a destination gets at most T x min(K,
  the experts it holds) rows: the dropless buffer (and a grown one's cap) is that, not T x K.
  (That it drops nothing is what the dropless ep and fssdp training tests check against fsdp
  bit for bit: the tiny preset's 8 experts on 8 devices, top-2, hold one expert a device.)"""
  from moejax.train.state import placement_for
  from tests.helpers import tiny_config
  assert dispatch_lib.max_rows(T, 4, 2) == 2 * T and dispatch_lib.max_rows(T, 4, 0) == 4 * T
  assert dispatch_lib.ep_capacity(T * 4, N, 0.0, most=2 * T) == 2 * T
  assert dispatch_lib.ep_capacity(T * 4, N, 8.0, most=2 * T) == 2 * T   # capped there too
  assert dispatch_lib.grown_capacity_factor(1.0, 2 * T, T * 4, N, most=2 * T) == 0.0
  cfg = tiny_config(**{"moe.placement": "ep", "moe.dispatch_capacity_factor": 0.0})
  tokens = cfg.batch_size * cfg.seq_len // 8
  ep = placement_for(cfg, 8, 8)
  assert ep.experts_held == 1 and ep.dispatch_capacity(tokens) == tokens
  assert not ep.grows_dispatch(tokens)
  fs = placement_for(tiny_config(**{"moe.placement": "fssdp"}), 8, 8)
  assert fs.experts_held == fs.max_per_layer + fs.replica_slots
  assert fs.max_rows(tokens) == tokens * min(cfg.moe.top_k, fs.experts_held)


@pytest.mark.parametrize("weights_on_input", [False, True])
def test_a_step_drops_rows_only_where_its_placement_grows_and_reruns_it(weights_on_input):
  """The Placement (what the Trainer grows and reruns, the memory report) and the exchange must
  agree on what is dropless. With moe.weights_on_input the exchange sees T x K rows of one
  assignment each, so it bounds a destination by T x K; a Placement bounding it by T x min(K,
  experts held) called the buffer dropless while the exchange dropped 24% of the rows, applied
  under "grow" with no rerun. Every token routes to experts 0 and 1 (a zero router): device 0
  and 1 receive every token's rows."""
  from flax import nnx
  from jax.sharding import PartitionSpec as P
  from moejax.layers.moe import MoEBlock, MoESpec
  from moejax.train.state import placement_for
  from tests.helpers import tiny_config
  cfg = tiny_config(**{"moe.placement": "ep", "moe.weights_on_input": weights_on_input,
                       "moe.dispatch_capacity_factor": 4.0, "moe.receive_capacity_factor": 1.25})
  tokens = 8 * 5                                   # per device: x [64, 5, D] over 8 devices
  placement = placement_for(cfg, N, N)
  dispatch = dataclasses.replace(placement.dispatch, axis_names=("data",))
  mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  block = MoEBlock(32, 48, MoESpec(8, 2, weights_on_input=weights_on_input), rngs=nnx.Rngs(0))
  block.router[...] = jnp.zeros_like(block.router[...])
  graphdef, state = nnx.split(block)
  specs = jax.tree.map(lambda v: P("data") if v.ndim == 3 else P(), state)

  def per_device(state, x):
    return nnx.merge(graphdef, state)(x, dispatch=dispatch)[1]["dropped"][None]

  dropped = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P("data")),
                                  out_specs=P("data")))(state, jnp.ones((64, 5, 32)))
  assert int(np.sum(dropped)) == 0 or placement.grows_dispatch(tokens), np.asarray(dropped)
  assert placement.max_rows(tokens) == tokens * (2 if weights_on_input else 1)
