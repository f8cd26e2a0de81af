"""TrainIterator: windows, per-epoch shuffles, determinism and exact resume from a state.

The token stream is arange(N), so a window is identified by its first token: window w starts at
w * S.
"""
import json

import numpy as np
import pytest

from moejax.data.iterator import TrainIterator, windows
from moejax.errors import DataError

S, B = 8, 4
W = 10  # Windows per epoch; B does not divide W, so batches straddle epochs.
TOKENS_N = np.arange(W * S + 1, dtype=np.int32)


def _iterator(seed=0, tokens_N=TOKENS_N, prefetch=2):
  return TrainIterator(tokens_N, batch_size=B, seq_len=S, seed=seed, prefetch=prefetch)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _window_ids(batches):
  return np.concatenate([b["inputs"][:, 0] for b in batches]) // S


def test_windows_overlap_by_one_token():
  windows_WxL = windows(np.arange(3 * S + 2, dtype=np.int32), S)
  assert windows_WxL.shape == (3, S + 1)
  assert windows_WxL[:, 0].tolist() == [0, S, 2 * S]
  assert windows_WxL[0, -1] == windows_WxL[1, 0]
  assert windows(np.arange(S, dtype=np.int32), S).shape == (0, S + 1)


def test_batches_are_windows_with_targets_shifted():
  for batch in _take(_iterator(), 6):
    assert set(batch) == {"inputs", "targets"}
    assert batch["inputs"].shape == batch["targets"].shape == (B, S)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    starts_B = batch["inputs"][:, :1]
    np.testing.assert_array_equal(batch["inputs"], starts_B + np.arange(S))
    np.testing.assert_array_equal(batch["targets"], starts_B + 1 + np.arange(S))
    assert np.all(starts_B % S == 0)


def test_each_epoch_is_a_new_permutation_of_all_windows():
  ids = _window_ids(_take(_iterator(), 15))  # 60 windows: six epochs.
  epochs = ids.reshape(6, W)
  for order in epochs:
    assert sorted(order.tolist()) == list(range(W))
  assert len({tuple(order) for order in epochs}) == 6


def test_same_seed_same_batches_other_seed_other_batches():
  a, b, c = (_window_ids(_take(_iterator(seed), 5)) for seed in (3, 3, 4))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert sorted(a[:W]) == sorted(c[:W])  # Same windows, other order.


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7])  # 2 (8 windows) and 3 (12) straddle epoch 0 -> 1.
def test_resume_yields_the_uninterrupted_batches(n):
  reference = _take(_iterator(seed=5), n + 6)
  it = _iterator(seed=5)
  _take(it, n)
  state = json.loads(json.dumps(it.get_state()))
  assert state["next_batch"] == n
  resumed = _iterator(seed=5, prefetch=0)
  resumed.set_state(state)
  for want, got in zip(reference[n:], _take(resumed, 6), strict=True):
    np.testing.assert_array_equal(got["inputs"], want["inputs"])
    np.testing.assert_array_equal(got["targets"], want["targets"])


def test_state_with_numpy_values_restores():
  it = _iterator()
  _take(it, 4)
  state = {k: np.asarray(v) for k, v in it.get_state().items()}
  resumed = _iterator()
  resumed.set_state(state)
  assert resumed.epoch == 1  # Batch 4 starts at window 16 of the stream.
  np.testing.assert_array_equal(next(resumed)["inputs"], next(it)["inputs"])


def test_state_from_another_stream_is_refused():
  state = _iterator(seed=1).get_state()
  with pytest.raises(DataError, match=r"^the checkpoint's data position is for other training "
                                      r"data \(seed 1 there, 2 now\): resume with the "
                                      r"data.source, data.path"):
    _iterator(seed=2).set_state(state)
  other_tokens = TOKENS_N.copy()
  other_tokens[5] += 1
  with pytest.raises(DataError, match="tokens_crc32"):
    _iterator(seed=1, tokens_N=other_tokens).set_state(state)
  with pytest.raises(DataError, match="^data iterator state lacks 'seed'"):
    _iterator(seed=1).set_state({"next_batch": 3})
  with pytest.raises(DataError, match="needs a non-negative 'next_batch', got -1"):
    _iterator(seed=1).set_state({**state, "next_batch": -1})


def test_too_few_windows_for_a_batch():
  with pytest.raises(DataError, match=f"^17 tokens make 2 windows of {S + 1}, fewer than one "
                                      f"batch of {B}$"):
    _iterator(tokens_N=np.arange(2 * S + 1, dtype=np.int32))
