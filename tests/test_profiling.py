"""moejax.profiling: ops named by their moejax source line, times read from a real trace."""
import jax
import jax.numpy as jnp
import pytest

from moejax import profiling
from moejax.layers import norm


def _norm_then_double(x, s):
  return norm.rms_norm(x, s, 1e-6) * 2.0


def test_hlo_sources_name_the_moejax_line_of_each_op():
  x, scale = jnp.ones((4, 8), jnp.float32), jnp.ones((8,), jnp.float32)
  text = jax.jit(_norm_then_double).lower(x, scale).compile().as_text()
  lines = {src for _, src in profiling.hlo_sources(text).values()}
  assert any(src.startswith("moejax/layers/norm.py:") for src in lines), lines
  assert profiling.OUTSIDE in lines, lines   # the doubling: this test's own line


def test_op_times_read_device_lanes_or_host_spans_without_double_counting_loops():
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
  host = [{"ph": "X", "pid": 1, "name": "fusion.1", "dur": 3000.0, "args": {"hlo_op": "fusion.1"}},
          {"ph": "X", "pid": 1, "name": "end: fusion.1", "dur": 1.0, "args": {}},
          {"ph": "X", "pid": 1, "name": "while.2", "dur": 9000.0, "args": {"hlo_op": "while.2"}}]
  assert profiling.op_times({"traceEvents": meta + host}, calls=3) == ({"fusion.1": 1.0}, False)
  device = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "X", "pid": 2, "name": "loop_fusion", "dur": 500.0}]
  assert profiling.op_times({"traceEvents": meta + host + device}) == ({"loop_fusion": 0.5}, True)


def test_profile_of_a_compiled_function():
  x, scale = jnp.ones((256, 512), jnp.float32), jnp.ones((512,), jnp.float32)
  compiled = jax.jit(_norm_then_double).lower(x, scale).compile()
  out = profiling.profile(compiled, (x, scale), calls=2, top=1000)   # every source and op
  assert out["ops"] >= 1 and out["ms_per_call"] > 0 and not out["device_events"]
  # Every op's time is named once: by source line and by scope, each summing to the call's.
  for part in ("by_source", "by_scope"):
    assert sum(out[part].values()) == pytest.approx(out["ms_per_call"], rel=1e-9), part
  assert sum(op["ms"] for op in out["top_ops"]) == pytest.approx(out["ms_per_call"], rel=1e-9)
  assert len(profiling.profile(compiled, (x, scale), calls=1, top=1)["by_source"]) == 1
  assert any(s.startswith("moejax/layers/norm.py:") for s in out["by_source"]), out


def test_scopes_survive_autodiff_and_name_the_backward():
  @profiling.scoped("router")
  def route(x):
    return jnp.tanh(x) * 3.0

  loss = jax.checkpoint(lambda x: jnp.sum(route(x) ** 2))
  text = jax.jit(jax.grad(loss)).lower(jnp.ones((4, 8))).compile().as_text()
  scopes = {profiling.scope_of(op_name) for op_name, _ in profiling.hlo_sources(text).values()}
  assert "router backward" in scopes, scopes
  assert profiling.scope_of("jit(f)/jvp(attention)/tanh") == "attention"
  assert profiling.scope_of("jit(f)/transpose(jvp())/moe/experts/dot") == "experts backward"
  assert profiling.scope_of("jit(f)/mul") == "other"
  # The last part is the primitive: jnp.take_along_axis's `gather` is not the gather scope.
  assert profiling.scope_of("jit(f)/codec_decode/jit(take_along_axis)/gather") == "codec_decode"
  assert profiling.scope_of("jit(f)/router/gather") == "router"
  assert profiling.scope_of("jit(f)/gather/all_gather") == "gather"


def test_an_unknown_scope_stops_with_one_line():
  with pytest.raises(ValueError, match="^scope 'routing': must be one of"):
    profiling.scope("routing")
  with pytest.raises(ValueError, match="^scope 'routing': must be one of"):
    profiling.scoped("routing")
