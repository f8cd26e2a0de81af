"""The compiled train step moves parameters only through the hook.

On 8 devices with fsdp, every all-gather in the compiled step is one the hook issued: one gather
group's sharded parameters packed into one buffer (a layer's, the embedding's; never a
layer-stacked array, never optimizer state), gathered as bf16 bit patterns (u16: no float
normalization can touch them);
none was added by XLA (say, to run the optimizer update on gathered parameters). Every
reduce-scatter returns a group's packed gradient shard in f32. The checker is shown to flag
programs that gather in those other ways. (Default config: codec off; the compressed gather
moves payloads of other shapes and would need its own expectations.)
"""
import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax.sharding.mesh import DEVICES
from tests.sharding import hlo


@pytest.fixture(scope="module")
def fsdp8(compiled_step):
  return compiled_step("fsdp", 8)


def _expected(step):
  return hlo.hook_shapes(step.trainer.layout, step.num_devices)


def _compiled_dtypes():
  # The hook gathers integer views: u16 on every backend (a float gather would be normalized).
  return {"all-gather": {"u16"}, "reduce-scatter": {"f32"}}


def test_train_step_gathers_only_through_the_hook(fsdp8):
  step = fsdp8
  expected = _expected(step)
  stacked = hlo.stacked_shapes(step.trainer.layout)
  # The premise: a stacked array can never pass for a packed buffer.
  assert not expected["all-gather"] & stacked

  written = hlo.stablehlo_gathers(step.lowered.as_text())
  assert written and hlo.stablehlo_problems(written, expected) == []

  found = hlo.compiled_collectives(step.compiled.as_text())
  assert hlo.missing(found, expected) == []          # every sharded parameter goes through it
  assert hlo.problems(found, expected, _compiled_dtypes(), stacked) == []


def test_checker_flags_a_gathered_optimizer_update(fsdp8):
  """Optimizer update on replicated parameters: XLA gathers whole fp32 stacked arrays."""
  trainer = fsdp8.trainer
  state = fsdp8.inputs[0]
  replicated = NamedSharding(trainer.mesh, P())

  def update(state):
    params = lax.with_sharding_constraint(state.params, replicated)
    updates, opt_state = trainer.tx.update(params, state.opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  bad = jax.jit(update, out_shardings=(replicated, trainer.layout.shardings.opt_state))
  found = hlo.compiled_collectives(bad.lower(state).compile().as_text())
  issues = hlo.problems(found, _expected(fsdp8), _compiled_dtypes(),
                        hlo.stacked_shapes(trainer.layout))
  w_up = ",".join(map(str, trainer.layout.param_shapes["layers"]["moe"]["w_up"].shape))
  assert any(f"f32[{w_up}]" in p and "a whole layer-stacked array" in p for p in issues), issues
  assert any(f"f32[{w_up}]" in p and "added by XLA" in p for p in issues), issues


def _embed_program(trainer, extra_gather: bool, gather_dtype):
  """A gather of `embed` as the hook does it (under shard_map), plus optionally one by XLA."""
  lay = trainer.layout.layouts["embed"]
  spec = trainer.layout.param_specs["embed"]
  replicated = NamedSharding(trainer.mesh, P())

  def body(shard):
    x = shard.astype(gather_dtype)
    if gather_dtype == jnp.bfloat16:     # as the hook does it: the bit patterns
      x = lax.bitcast_convert_type(x, jnp.uint16)
    return lax.all_gather(x, DEVICES, axis=lay.dim, tiled=True)

  gathered = jax.shard_map(body, mesh=trainer.mesh, in_specs=spec, out_specs=P(),
                           check_vma=False)

  def program(embed):
    out = gathered(embed)
    if extra_gather:       # e.g. an update computed on the replicated parameter
      out = out + lax.with_sharding_constraint(embed * 2, replicated).astype(jnp.bfloat16).view(
          out.dtype)
    return out

  shape = trainer.layout.param_shapes["embed"]
  arg = jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                             sharding=NamedSharding(trainer.mesh, spec))
  return jax.jit(program).lower(arg)


@pytest.mark.parametrize("extra_gather,gather_dtype,flagged", [
    (False, jnp.bfloat16, None),
    (True, jnp.bfloat16, "added by XLA"),
    (False, jnp.float32, "gathers f32, the hook gathers ui16"),
])
def test_checker_on_small_programs(fsdp8, extra_gather, gather_dtype, flagged):
  trainer = fsdp8.trainer
  assert trainer.layout.layouts["embed"].kind == "shard"
  expected = {"all-gather": {tuple(trainer.layout.param_shapes["embed"].shape)}}
  lowered = _embed_program(trainer, extra_gather, gather_dtype)
  issues = (hlo.stablehlo_problems(hlo.stablehlo_gathers(lowered.as_text()), expected) +
            hlo.problems(hlo.compiled_collectives(lowered.compile().as_text()), expected,
                         _compiled_dtypes()))
  if flagged is None:
    assert issues == []
  else:
    assert any(flagged in p for p in issues), issues


def test_bf16_reduce_writes_every_gradient_reduction_of_the_step_in_bf16(fsdp8, trainer_for):
  """config.reduce_dtype='bfloat16' reaches the step: its reduce-scatters (one per gather group,
  as the fp32 step's) are written in bf16, the metrics' scatter_bytes halve. (The tiny preset has
  no parameter gathered in float32; tests/sharding/test_hook.py checks those stay fp32.)"""
  from tests.helpers import tiny_config
  trainer = trainer_for(tiny_config(reduce_dtype="bfloat16"), 8)
  counts = {}
  for name, lowered in (("bf16", trainer.train_step.lower(*trainer.abstract_inputs())),
                        ("f32", fsdp8.lowered)):
    written = hlo.stablehlo_reductions(lowered.as_text())
    counts[name] = sorted(c.dtype for c in written if c.op == "reduce-scatter")
  assert counts["f32"] and set(counts["f32"]) == {"f32"}
  assert counts["bf16"] == ["bf16"] * len(counts["f32"])
  assert (trainer.layout.gatherer.scatter_bytes()
          == fsdp8.trainer.layout.gatherer.scatter_bytes() / 2)
