"""fssdp's replica codec in the train step (8 fake devices, 2 nodes x 4, reroute admission, 30
steps of the tiny preset): the losses and final parameters equal those of the same run with
every replica sent plain (its replica state invalidated before each step) bit for bit; no step
sends more than plain plus the agreement; over the last 10 steps the replicas cost under 0.8 of
their plain bytes (0.74 here). The aux loss is off so that hot experts (and so replicas) appear
in a tiny model within 30 steps. One compiled step serves both runs; the plain SparseAllGather
itself equals the coded one bit for bit in tests/placement/test_fssdp.py."""
import numpy as np
import jax
import pytest

from moejax.codec import replicas
from moejax.train.loop import Trainer, put_batch
from tests.helpers import tiny_config

STEPS = 30
LAYERS = 2


@pytest.fixture(scope="module")
def trainer():
  return Trainer(tiny_config(**{
      "moe.placement": "fssdp", "mesh.shape": (2, 4), "batch_size": 16, "seq_len": 32,
      "steps": STEPS, "fssdp.replica_codec": "delta", "fssdp.reshard_every": 0,
      "moe.aux_loss_weight": 0.0, "routing.admission": "reroute"}))


def _run(trainer, *, patches: bool):
  state = trainer.init_state()
  rng = np.random.default_rng(3)
  losses, sent, plain, late = [], [], [], []
  for _ in range(STEPS):
    if not patches:
      state = state.replace(placement=state.placement.replace(
          replicas=replicas.invalidate(state.placement.replicas)))
    toks = rng.integers(0, 256, (16, 33)).astype(np.int32)
    state, m = trainer.train_step(state, put_batch({"inputs": toks[:, :-1],
                                                    "targets": toks[:, 1:]}, trainer.mesh))
    losses.append(float(m["loss"]))
    sent.append(float(np.sum(m["spag_bytes"])))
    plain.append(float(np.sum(m["spag_bytes_plain"])))
    # Calibration's late SparseAllGather ran (adopted) when the replicas' bytes exceed the
    # planned ones' over the two passes.
    late.append(bool(np.any(np.asarray(m["spag_bytes_plain"])
                            > 2 * np.asarray(m["spag_bytes_needed"]) + 1)))
  return losses, sent, plain, late, jax.device_get(state.params)


def test_replica_codec_is_lossless_and_pays_once_devices_keep_their_experts(trainer):
  losses_off, sent_off, plain_off, _, params_off = _run(trainer, patches=False)
  losses, sent, plain, late, params = _run(trainer, patches=True)
  assert sum(late) >= 5          # the coded late gather (in its conditional) ran too
  assert losses == losses_off
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a).view(np.uint8),
                                                  np.asarray(b).view(np.uint8)),
                      params_off, params)
  assert all(jax.tree.leaves(same))
  placement = trainer.layout.placement
  n, codec = placement.num_devices, placement.replica_codec
  # The agreement: each device receives the 7 others' choices, per layer and pass (remat reruns
  # it).
  agreement = 2 * LAYERS * (n - 1) * codec.agree_bytes(placement.max_per_layer)
  assert plain == plain_off
  assert all(s == p + agreement for s, p in zip(sent_off, plain))
  assert all(s <= p + agreement for s, p in zip(sent, plain))
  assert sum(plain[-10:]) > 0
  assert sum(sent[-10:]) < 0.8 * sum(plain[-10:])
