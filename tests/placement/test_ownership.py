"""FSSDP sharding (host side): even and heterogeneous placements, slot tables, re-sharding."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moejax.placement import ownership as fs

N, DPN = 8, 4


def skewed_loads(rng, num_layers, num_experts, kind):
  """Per-layer expert loads: random, one hot expert, rotating hotspot (per layer), bursts."""
  if kind == "random":
    return rng.gamma(0.5, size=(num_layers, num_experts)) * 100
  load = np.ones((num_layers, num_experts)) * 10 + rng.random((num_layers, num_experts))
  if kind == "one_hot":
    load[:, 3 % num_experts] += 50 * num_experts
  elif kind == "rotating":
    load[np.arange(num_layers), np.arange(num_layers) * 3 % num_experts] += 40 * num_experts
  elif kind == "bursts":
    hot = rng.choice(num_experts, size=min(3, num_experts), replace=False)
    load[:, hot] += rng.gamma(2.0, size=(num_layers, len(hot))) * 20 * num_experts
  elif kind == "mixed":          # hot expert in even layers, mild random skew in odd ones
    load[::2, 3 % num_experts] += 50 * num_experts
    load[1::2] = rng.gamma(0.5, size=load[1::2].shape) * 20
  return load


def check_placement(owner, num_layers, num_experts, cap, slots=None):
  assert owner.shape == (num_layers, num_experts) and owner.dtype == np.int32
  assert owner.min() >= 0 and owner.max() < N
  count = fs.experts_per_device(owner, N)
  slots = num_layers * num_experts // N if slots is None else slots
  if slots * N == num_layers * num_experts:
    np.testing.assert_array_equal(count.sum(axis=0), slots)     # equal slots on every device
  assert count.sum(axis=0).max() <= slots
  assert count.max() <= cap
  np.testing.assert_array_equal(count.sum(axis=1), num_experts)  # every expert owned once


def test_initial_placement_is_contiguous_and_even():
  owner = fs.initial_placement(3, 16, N)
  np.testing.assert_array_equal(owner[1], np.repeat(np.arange(N), 2))
  np.testing.assert_array_equal(fs.experts_per_device(owner, N), 2)
  with pytest.raises(ValueError, match="num_experts=12"):
    fs.initial_placement(2, 12, N)


@settings(max_examples=60, deadline=None)
@given(num_layers=st.integers(1, 4), experts_per=st.sampled_from([1, 2, 8]),
       kind=st.sampled_from(["random", "one_hot", "rotating", "bursts", "mixed"]),
       tight=st.booleans(), seed=st.integers(0, 2**16))
def test_heterogeneous_placement_invariants(num_layers, experts_per, kind, tight, seed):
  num_experts = experts_per * N
  load = skewed_loads(np.random.default_rng(seed), num_layers, num_experts, kind)
  cap = experts_per if tight else None        # tight: the even share, forcing the repair path
  owner = fs.heterogeneous_placement(load, N, DPN, max_per_layer=cap)
  check_placement(owner, num_layers, num_experts,
                  cap or fs.default_max_per_layer(num_experts, N))


def test_repair_path_keeps_slot_counts_exact():
  # Cap 1 with 8 experts on 8 devices: every device must end with exactly one expert per layer,
  # whatever the greedy order wanted.
  rng = np.random.default_rng(3)
  for _ in range(20):
    load = rng.gamma(0.2, size=(3, 8))
    owner = fs.heterogeneous_placement(load, N, DPN, max_per_layer=1)
    np.testing.assert_array_equal(fs.experts_per_device(owner, N), 1)


def test_uniform_load_spreads_evenly():
  owner = fs.heterogeneous_placement(np.ones((2, 16)), N, DPN)
  np.testing.assert_array_equal(fs.experts_per_device(owner, N), 2)


def test_extra_slots_and_errors():
  owner = fs.heterogeneous_placement(np.ones((2, 8)), N, DPN, slots_per_device=3)
  check_placement(owner, 2, 8, fs.default_max_per_layer(8, N), slots=3)
  with pytest.raises(ValueError, match="slots_per_device=1"):
    fs.heterogeneous_placement(np.ones((3, 8)), N, DPN, slots_per_device=1)
  with pytest.raises(ValueError, match="max_per_layer=1"):
    fs.heterogeneous_placement(np.ones((1, 16)), N, DPN, max_per_layer=1)
  with pytest.raises(ValueError, match="non-negative"):
    fs.heterogeneous_placement(-np.ones((1, 8)), N, DPN)


# When one expert dominates every layer alike, no placement can move much load between nodes
# (each node still holds half of every layer's experts), so only the device figure improves.
@pytest.mark.parametrize("kind,node_gain,device_gain", [
    ("one_hot", 0.0, 0.05), ("rotating", 0.0, 0.05), ("bursts", 0.1, 0.3),
    ("random", 0.1, 0.3), ("mixed", 0.05, 0.2)])
def test_heterogeneous_balances_owned_load_better_than_even(kind, node_gain, device_gain):
  """Max per-node and per-device owned load per layer (relative to the mean), over seeds."""
  rng = np.random.default_rng(0)
  node_even, node_het, dev_even, dev_het = [], [], [], []
  for _ in range(10):
    load = skewed_loads(rng, 4, 32, kind)
    for owner, node_out, dev_out in ((fs.initial_placement(4, 32, N), node_even, dev_even),
                                     (fs.heterogeneous_placement(load, N, DPN), node_het,
                                      dev_het)):
      dev = fs.owned_load(load, owner, N)
      node = dev.reshape(4, N // DPN, DPN).sum(-1)
      node_out.append((node.max(1) / node.mean(1)).mean())
      dev_out.append((dev.max(1) / dev.mean(1)).mean())
  node_even, node_het = np.array(node_even), np.array(node_het)
  dev_even, dev_het = np.array(dev_even), np.array(dev_het)
  assert np.all(node_het <= node_even + 1e-9)
  assert node_het.mean() <= node_even.mean() - node_gain
  assert np.all(dev_het <= dev_even + 1e-9)
  assert dev_het.mean() < dev_even.mean() - device_gain


def test_stickiness_keeps_owners_on_noisy_loads():
  rng = np.random.default_rng(1)
  load = skewed_loads(rng, 4, 32, "bursts")
  first = fs.heterogeneous_placement(load, N, DPN)
  same = fs.heterogeneous_placement(load, N, DPN, previous_owner_LxE=first)
  np.testing.assert_array_equal(same, first)
  noisy = load * rng.uniform(0.95, 1.05, size=load.shape)
  fresh = fs.heterogeneous_placement(noisy, N, DPN)
  sticky = fs.heterogeneous_placement(noisy, N, DPN, previous_owner_LxE=first)
  check_placement(sticky, 4, 32, fs.default_max_per_layer(32, N))
  assert (sticky != first).sum() < (fresh != first).sum()


def check_tables(owner, tables, slots):
  num_layers, num_experts = owner.shape
  at = tables.expert_at_slot_NxSx2.reshape(N * slots, 2)
  l_idx, e_idx = np.indices(owner.shape)
  np.testing.assert_array_equal(at[tables.slot_of_LxE, 0], l_idx)
  np.testing.assert_array_equal(at[tables.slot_of_LxE, 1], e_idx)
  np.testing.assert_array_equal(tables.slot_of_LxE // slots, owner)   # slot on its owner
  assert len(np.unique(tables.slot_of_LxE)) == owner.size
  c = tables.local_experts_LxNxC.shape[2]
  for l in range(num_layers):
    for d in range(N):
      mine = np.flatnonzero(owner[l] == d)
      np.testing.assert_array_equal(tables.local_experts_LxNxC[l, d, :len(mine)], mine)
      assert np.all(tables.local_experts_LxNxC[l, d, len(mine):] == -1)
      local = tables.local_slot_LxNxC[l, d, :len(mine)]
      np.testing.assert_array_equal(tables.expert_at_slot_NxSx2[d, local, 1], mine)
      np.testing.assert_array_equal(tables.expert_at_slot_NxSx2[d, local, 0], l)
      assert np.all(tables.local_slot_LxNxC[l, d, len(mine):] == -1)
  assert c >= fs.experts_per_device(owner, N).max()


def test_slot_tables():
  load = skewed_loads(np.random.default_rng(2), 3, 16, "bursts")
  owner = fs.heterogeneous_placement(load, N, DPN)
  tables = fs.slot_tables(owner, N)
  assert tables.local_experts_LxNxC.shape[2] == fs.experts_per_device(owner, N).max()
  check_tables(owner, tables, 6)
  capped = fs.slot_tables(owner, N, max_per_layer=fs.default_max_per_layer(16, N))
  assert capped.local_experts_LxNxC.shape == (3, N, 4)
  check_tables(owner, capped, 6)
  with pytest.raises(ValueError, match="max_per_layer=1"):
    fs.slot_tables(owner, N, max_per_layer=1)


@pytest.mark.parametrize("slots", [None, 7])
def test_reshard_permutation_moves_params_and_optimizer_state(slots):
  rng = np.random.default_rng(4)
  num_layers, num_experts = 3, 16
  s = slots or num_layers * num_experts // N
  old = fs.initial_placement(num_layers, num_experts, N)
  new = fs.heterogeneous_placement(skewed_loads(rng, num_layers, num_experts, "one_hot"), N, DPN,
                                   slots_per_device=slots)
  t_old = fs.slot_tables(old, N, slots_per_device=s)
  t_new = fs.slot_tables(new, N, slots_per_device=s)
  # Fake storage: each expert's parameters and Adam moments carry its (layer, expert) identity.
  ident = np.full(N * s, -1.0)
  ident[t_old.slot_of_LxE.ravel()] = np.arange(old.size)
  storage = {"w": ident[:, None, None] * np.ones((1, 4, 3)),
             "opt": {"mu": ident[:, None] * 2, "nu": ident[:, None] * 3}}
  r = fs.reshard_moves(old, new, expert_bytes=1000, num_devices=N, slots_per_device=slots)
  assert sorted(r.perm.tolist()) == list(range(N * s))              # a permutation
  moved = fs.apply_permutation(storage, r.perm)
  want = np.arange(old.size).reshape(old.shape)
  np.testing.assert_array_equal(moved["w"][t_new.slot_of_LxE, 0, 0], want)
  np.testing.assert_array_equal(moved["opt"]["mu"][t_new.slot_of_LxE, 0], 2 * want)
  np.testing.assert_array_equal(moved["opt"]["nu"][t_new.slot_of_LxE, 0], 3 * want)
  # Moves: exactly the experts whose owner changed, with their endpoints.
  changed = np.argwhere(old != new)
  assert r.num_moves == len(changed) > 0 and r.bytes_moved == 1000 * len(changed)
  np.testing.assert_array_equal(r.moves_Mx4[:, :2], changed)
  np.testing.assert_array_equal(r.moves_Mx4[:, 2], old[old != new])
  np.testing.assert_array_equal(r.moves_Mx4[:, 3], new[old != new])
  # Every slot that changes device carries a moved expert; nothing else crosses devices.
  crosses = (r.perm // s) != (np.arange(N * s) // s)
  crossing_ids = moved["w"][crosses, 0, 0]
  assert sorted(crossing_ids[crossing_ids >= 0].astype(int).tolist()) == sorted(
      (changed[:, 0] * num_experts + changed[:, 1]).tolist())


def test_reshard_to_itself_moves_nothing():
  owner = fs.initial_placement(2, 8, N)
  r = fs.reshard_moves(owner, owner, expert_bytes=10)
  assert r.num_moves == 0 and r.bytes_moved == 0 and r.moves_Mx4.shape == (0, 4)
  np.testing.assert_array_equal(r.perm, np.arange(16))
