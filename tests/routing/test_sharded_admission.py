"""Admission inside the sharded train step on 8 fake devices, ep placement with rerouting, on the
routed experts of Qwen2-MoE (a gated shared expert beside them, which admission leaves alone).
Rerouting starts from strict admission's choice (each expert's most similar candidates up to its
capacity); strict alone, and rerouting under shard_map, are tests/routing/test_admission.py's."""
import jax
import numpy as np
import pytest

from moejax.routing.admission import capacity_schedule
from moejax.sharding.mesh import make_mesh
from moejax.train.loop import Trainer, put_batch
from tests.helpers import tiny_config


@pytest.mark.parametrize("family,placement,policy", [("qwen2_moe", "ep", "reroute")])
def test_admission_in_sharded_step(family, placement, policy):
  cfg = tiny_config(family, **{"moe.placement": placement, "routing.admission": policy,
                       "routing.admission_capacity_factor": 1.0, "routing.threshold": -1.0,
                       "routing.locality_weight": 0.01, "batch_size": 8, "seq_len": 32})
  trainer = Trainer(cfg, mesh=make_mesh((2, 4), jax.devices()[:8]))
  state = trainer.init_state()
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
  batch = put_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:]}, trainer.mesh)
  losses = []
  for _ in range(3):
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  m = jax.device_get(metrics)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
  assert float(m["grad_norm"]) > 0
  # Each device admits its own tokens: at most its capacity per expert.
  tokens_per_device = cfg.batch_size * cfg.seq_len // 8
  cap = int(np.max(capacity_schedule(10**6, num_tokens=tokens_per_device, k=cfg.moe.top_k,
                                     num_experts=cfg.moe.num_experts, factor=1.0)))
  assert np.all(m["load_max"] <= 8 * cap)
  # Capacity for exactly T*K assignments per device: the top-k overfills some experts, strict
  # admission would drop what they cannot hold (16-34% of the slots here); rerouting moves it to
  # the next most similar expert with room, so little is dropped.
  assert np.all(m["rerouted_frac"] > 0.05)
  assert np.all(m["dropped_frac"] < 0.25 * m["rerouted_frac"])
  assert float(m["locality_loss"]) > 0
