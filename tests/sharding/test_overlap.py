"""The collectives of a train step can overlap compute: none is alone in a conditional branch.

A collective inside a conditional's branch starts and finishes inside it, so no scheduler can
run it under compute outside. Read from the compiled 8-device train step (codec off):
- fsdp (the suite's shared compiled step): the prefetching layer scan issues the next layer's
  gather unconditionally, in forward and in backward; no conditional holds a collective.
- fsdp with the codec (`element`, `codec.transport="single"`: what GPUs run; XLA:CPU's default
  keeps a conditional per pool, its collectives never overlapping compute anyway): the
  agreement and the one payload collective of each gather sit beside the layer compute, in no
  conditional (a gather that must go dense sends its bit patterns through the same collective);
  no computation issues a collective without a matmul.
- fssdp with calibration (tests/placement/test_fssdp_train.py, on its compiled step): the late
  SparseAllGather runs every step (moving only the replicas a re-plan adds), beside the
  exchange and the expert matmuls; no conditional holds a collective.
The checker is shown to flag a collective alone in a branch.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from tests.helpers import tiny_config
from tests.sharding import hlo


def test_fsdp_step_has_no_collective_in_a_conditional(compiled_step):
  step = compiled_step("fsdp", 8)
  assert step.trainer.cfg.prefetch
  text = step.compiled.as_text()
  assert hlo.compiled_collectives(text)            # the premise: the step does gather
  assert [b for b in hlo.conditional_branches(text) if b.collectives] == []


def test_fsdp_layer_scans_sum_no_router_counts(compiled_step):
  """The router's counts (the balance loss's, the z-loss's tokens, the statistics) are summed
  after the layer scans, every layer in one collective: a psum of them in a layer waits on the
  router's matmul, and on GPU held the one collective slot, so the next layer's prefetched
  gather could span only the matmuls after it (scripts/gpu_schedule.py: one expert matmul of
  three). What waits on a scan iteration's matmuls on XLA:CPU is only the gradient's
  reduce-scatter, in place there (config `scatter_ahead`; ahead elsewhere, where nothing
  waits: tests/sharding/test_prefetch.py)."""
  text = compiled_step("fsdp", 8).compiled.as_text()
  waiting = [c.op for c in hlo.loop_collectives_after_matmuls(text)]
  assert waiting and set(waiting) == {"reduce-scatter"}, waiting


def test_the_cost_model_prices_every_instruction_of_the_step(compiled_step):
  """`moejax.perf.latencies` (config schedule_latencies="model") on the compiled 8-device step:
  every instruction of every computation that is not a fusion's body gets a price; the layer
  loops cost their trip count times their bodies; on XLA:CPU every collective is exposed."""
  from moejax.perf import calibrate, hardware, latencies
  from moejax.perf.model import net_of
  text = compiled_step("fsdp", 8).compiled.as_text()
  calib = calibrate.load_fitted()
  costs = latencies.instruction_costs(text, hardware.H200, net_of(hardware.H200_NODE, 8, calib),
                                      calib.gpu("h200"))
  comps = latencies.parse_module(text)
  fused = {c for comp in comps.values() for i in comp if i.op == "fusion"
           for c in re.findall(r"calls=%([\w.\-]+)", i.line)}
  scheduled = [i for name, comp in comps.items() if name not in fused for i in comp]
  assert {i.name for i in scheduled} <= set(costs)
  loops = [i for i in scheduled if i.op == "while"]
  assert loops and all(costs[i.name] > 0 for i in loops)
  priced = latencies.schedule_time(text, costs)
  assert priced.compute > 0 and priced.collectives > 0
  assert priced.exposed == pytest.approx(priced.collectives)


def test_loop_reader_flags_a_reduction_of_the_iteration_s_matmul():
  mesh = Mesh(np.array(jax.devices()[:8]), ("d",))

  def body(w_Lx4x4, x):
    def layer(h, w):
      h = jnp.tanh(h @ w)
      return h, lax.psum(jnp.sum(h), "d")      # waits on the matmul
    return lax.scan(layer, x, w_Lx4x4)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P("d"), P()),
                            check_vma=False))
  text = f.lower(jnp.ones((3, 4, 4)), jnp.ones((16, 4))).compile().as_text()
  assert [c.op for c in hlo.loop_collectives_after_matmuls(text)] == ["all-reduce"]


def test_codec_step_has_no_collective_in_a_conditional(trainer_for):
  trainer = trainer_for(tiny_config(**{"codec.mode": "element", "codec.warmup_steps": 2,
                                       "codec.transport": "single"}), 8)
  assert trainer.layout.gatherer.enabled
  text = trainer.train_step.lower(*trainer.abstract_inputs()).compile().as_text()
  gathers = [c for c in hlo.compiled_collectives(text) if c.op == "all-gather"]
  assert any(c.dtype == "u32" for c in gathers)        # the premise: the codec's payload
  assert [b for b in hlo.conditional_branches(text) if b.collectives] == []
  assert hlo.lonely_collectives(text) == []


def test_checker_flags_a_collective_alone_in_a_branch():
  mesh = Mesh(np.array(jax.devices()[:8]), ("d",))

  def body(x, flag):
    gathered = lax.cond(flag[0] > 0, lambda x: lax.all_gather(x, "d", tiled=True),
                        lambda x: jnp.tile(x, (8, 1)), x)
    return gathered @ gathered.T

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P(),
                            check_vma=False))
  text = f.lower(jnp.ones((64, 4)), jnp.ones((1,), jnp.int32)).compile().as_text()
  alone = [b for b in hlo.conditional_branches(text) if b.collectives]
  assert len(alone) == 1 and alone[0].collectives == ("all-gather",) and alone[0].dots == 0
  assert [x for x in hlo.lonely_collectives(text) if "all-gather" in x] != []
