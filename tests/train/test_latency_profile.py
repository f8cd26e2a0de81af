"""Config `schedule_latencies="model"`: the train step compiled again with moejax's latencies as
XLA:GPU's profile (`moejax.train.latency_profile`). The same lowering, so the same math: on 8
CPU devices it trains bit for bit as the step XLA schedules by its own estimate (on XLA:CPU the
schedule itself does not change: its collectives never overlap compute). What it changes on
GPU is read from XLA:GPU's compiled programs without a GPU: `scripts/gpu_schedule.py
--latencies both` (README, "The GPU schedule read without a GPU")."""
import re

import jax
import numpy as np
import pytest

from moejax.train.latency_profile import ModelScheduledStep, write_profile
from moejax.errors import ConfigError
from moejax.train.loop import Trainer, put_batch
from tests.helpers import canonical_config, random_batches, tiny_config


def test_the_model_scheduled_step_trains_bit_for_bit_as_xla_s(trainer, trainer_for, capsys):
  model = trainer_for(canonical_config("fsdp", schedule_latencies="model"), 8)
  assert isinstance(model.train_step, ModelScheduledStep)
  assert model.train_step.cluster.name == "h100"     # "auto" on a device of no known GPU kind
  batches = [put_batch(b, trainer.mesh) for b in random_batches(trainer.cfg, 2)]
  # (the same layout: both start from the plain Trainer's jitted init)
  states = [trainer.init_state() for _ in range(2)]
  for batch in batches:
    out = [t.train_step(s, batch) for t, s in zip((trainer, model), states)]
    states = [s for s, _ in out]
    assert float(out[0][1]["loss"]) == float(out[1][1]["loss"])
  for a, b in zip(jax.tree.leaves(jax.device_get(states[0].params)),
                  jax.tree.leaves(jax.device_get(states[1].params))):
    np.testing.assert_array_equal(a, b)
  [scheduled] = model.train_step.scheduled          # one input signature, compiled twice
  with open(scheduled.profile_path) as f:
    names = re.findall(r'name: "([^"]+)"', f.read())
  text = scheduled.compiled.as_text()
  assert len(names) == scheduled.instructions > 100
  # The profile names the program's own instructions (a later compile of the same lowering
  # sees them under these names).
  assert all(f"%{n} " in text for n in names)
  assert scheduled.names_found == 1.0
  # XLA:CPU: no collective overlaps anything, so the model's price of the step is the sum of
  # its compute and its collectives, both schedules alike.
  assert scheduled.model.exposed == scheduled.model.collectives > 0
  assert scheduled.xla.step == scheduled.model.step
  logged = capsys.readouterr().out
  assert "train step scheduled by moejax's latencies" in logged and "XLA:CPU" in logged


def test_a_profile_is_named_by_its_content(tmp_path):
  """The same profile, the same path in every run (so the compile option, a key of jax's
  persistent compilation cache, is too); another profile, another path."""
  first, again = (write_profile('costs { name: "a" cost_us: 1.000 }\n', str(tmp_path))
                  for _ in range(2))
  other = write_profile('costs { name: "a" cost_us: 2.000 }\n', str(tmp_path))
  assert first == again != other
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
      [first.rsplit("/", 1)[1], other.rsplit("/", 1)[1]])       # no temporary file left
  with open(other) as f:
    assert f.read().endswith("cost_us: 2.000 }\n")


def test_an_unknown_cluster_is_refused_by_name():
  with pytest.raises(ConfigError, match=r"config.schedule_cluster='nowhere': must be one of "
                                        r"auto, ciera-a100"):
    Trainer(tiny_config(schedule_cluster="nowhere"))
