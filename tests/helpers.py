"""Small shared helpers for tests."""
from __future__ import annotations

import os
import subprocess
import sys

import configs.deepseek as deepseek_configs
import configs.afmoe as afmoe_configs
import configs.cohere2_moe as cohere2_moe_configs
import configs.qwen3_next as qwen3_next_configs
import configs.qwen3_5_moe as qwen3_5_moe_configs
import configs.deepseek_v2 as deepseek_v2_configs
import configs.deepseek_v32 as deepseek_v32_configs
import configs.dots1 as dots1_configs
import configs.ernie4_5_moe as ernie4_5_moe_configs
import configs.exaone_moe as exaone_moe_configs
import configs.flex_olmo as flex_olmo_configs
import configs.flint as flint_configs
import configs.glm4_moe as glm4_moe_configs
import configs.glm4_moe_lite as glm4_moe_lite_configs
import configs.glm_moe_dsa as glm_moe_dsa_configs
import configs.granitemoe as granitemoe_configs
import configs.granitemoe_swa as granitemoe_swa_configs
import configs.gpt_oss as gpt_oss_configs
import configs.granitemoeshared as granitemoeshared_configs
import configs.granitemoehybrid as granitemoehybrid_configs
import configs.hunyuan_v1_moe as hunyuan_v1_moe_configs
import configs.hy_v3 as hy_v3_configs
import configs.kolibri1 as kolibri1_configs
import configs.mellum as mellum_configs
import configs.minicpm5_moe as minicpm5_moe_configs
import configs.minimax_m2 as minimax_m2_configs
import configs.mixtral as mixtral_configs
import configs.llama4 as llama4_configs
import configs.olmoe as olmoe_configs
import configs.param2moe as param2moe_configs
import configs.qwen2_moe as qwen2_moe_configs
import configs.qwen3_moe as qwen3_moe_configs
import configs.sarvam_moe as sarvam_moe_configs
import configs.solar_open as solar_open_configs
from moejax.config import from_config_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Every family's config file (configs/FAMILY.py), by moejax.families name.
FAMILY_CONFIGS = {"olmoe": olmoe_configs, "mixtral": mixtral_configs,
                  "qwen2_moe": qwen2_moe_configs, "qwen3_moe": qwen3_moe_configs,
                  "minimax_m2": minimax_m2_configs, "ernie4_5_moe": ernie4_5_moe_configs,
                  "glm4_moe": glm4_moe_configs, "dots1": dots1_configs,
                  "deepseek_v2": deepseek_v2_configs, "deepseek_v3": deepseek_configs,
                  "deepseek_v32": deepseek_v32_configs, "glm_moe_dsa": glm_moe_dsa_configs,
                  "glm4_moe_lite": glm4_moe_lite_configs, "solar_open": solar_open_configs,
                  "minicpm5_moe": minicpm5_moe_configs, "hy_v3": hy_v3_configs,
                  "exaone_moe": exaone_moe_configs, "granitemoe": granitemoe_configs,
                  "granitemoeshared": granitemoeshared_configs,
                  "granitemoehybrid": granitemoehybrid_configs, "sarvam_moe": sarvam_moe_configs,
                  "param2moe": param2moe_configs, "flex_olmo": flex_olmo_configs,
                  "afmoe": afmoe_configs, "mellum": mellum_configs,
                  "granitemoe_swa": granitemoe_swa_configs, "flint": flint_configs,
                  "kolibri1": kolibri1_configs, "gpt_oss": gpt_oss_configs,
                  "cohere2_moe": cohere2_moe_configs, "llama4": llama4_configs,
                  "hunyuan_v1_moe": hunyuan_v1_moe_configs, "qwen3_next": qwen3_next_configs,
                  "qwen3_5_moe": qwen3_5_moe_configs}


def tiny_config(family: str = "olmoe", **overrides):
  """A family's tiny preset with dotted-path overrides, e.g.
  tiny_config(**{"moe.placement": "ep"})."""
  # plain dict: our validator sees raw values
  cd = FAMILY_CONFIGS[family].get_config("tiny").to_dict()
  # ep/fssdp dispatch buffers dropless unless a test sizes them: the tiny batches (tens of tokens
  # per device) overflow a bounded buffer by chance, and each growth compiles the step again
  # (tests/train/test_dispatch_growth.py runs the growth; tests/train/test_memory.py the
  # default's bytes at scale).
  cd["moe"]["dispatch_capacity_factor"] = 0.0
  for path, value in overrides.items():
    node = cd
    *parents, leaf = path.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return from_config_dict(cd)


def xla_flags(devices: int = 1) -> str:
  """The session's XLA flags (tests/conftest.py: its compile flags) for a process of `devices`
  CPU devices, so subprocesses compile like the tests that compare against them."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])


def run_train(args, timeout=300, env_extra=None):
  """Runs train.py in a subprocess on 1 CPU device; returns CompletedProcess (text)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(1))
  env.update(env_extra or {})
  return subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, env=env)


# The canonical training config of the suite: the tiny preset (16 x 64 tokens, 2 layers) with a
# short schedule, logged every step. Tests that train use it (on 8, or on 1 device; fsdp or ep)
# through the session fixture `trainer_for` (tests/conftest.py), so they share compiled steps.
# `canonical_flags` gives the same config on train.py's command line.
CANONICAL = {"steps": 12, "log_every": 1, "eval_batches": 1, "checkpoint.every": 4}


def canonical_config(placement: str = "fsdp", **overrides):
  return tiny_config(**CANONICAL, **{"moe.placement": placement}, **overrides)


def config_flags(overrides: dict) -> list[str]:
  """train.py arguments that build `tiny_config(**overrides)` (its dropless default too)."""
  overrides = {"moe.dispatch_capacity_factor": 0.0, **overrides}
  return ["--config", "configs/olmoe.py:tiny", *(f"--config.{k}={v}" for k, v in overrides.items())]


def canonical_flags(placement: str = "fsdp") -> list[str]:
  """train.py arguments that build `canonical_config(placement)`."""
  return config_flags({"moe.placement": placement, **CANONICAL})


# The suite's codec.mode=auto run (tests/conftest.py `codec_auto_run`, 8 devices in one process):
# tests/codec/test_loop.py checks the loop's decisions and resume on it, tests/report/ the
# TensorBoard files and report, tests/sharding/test_multiprocess.py a 2-process job against it.
CODEC_AUTO_STEPS = 8
CODEC_AUTO_RUN = {
    "batch_size": 8, "seq_len": 32, "log_every": 1, "eval_batches": 1, "steps": CODEC_AUTO_STEPS,
    "checkpoint.every": 3, "codec.mode": "auto", "codec.warmup_steps": 3,
    "codec.block_size": 64, "codec.comm_model": "bytes",
    # Steady change rates (no lr warm-up), so the capacities sized at step 3 hold.
    "optim.warmup_steps": 0, "optim.lr": 3e-4}


def random_batches(cfg, n):
  """n batches of uniformly random byte tokens (fixed seed) for `cfg`'s batch and sequence."""
  import numpy as np
  rng = np.random.default_rng(123)
  out = []
  for _ in range(n):
    toks = rng.integers(0, 256, (cfg.batch_size, cfg.seq_len + 1)).astype(np.int32)
    out.append({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
  return out


def run_steps(trainer):
  """`cfg.steps` train steps of `trainer` on `random_batches`: losses, gradient norms, metrics,
  the final state and parameters, and the first step's gradients, read back from Adam's first
  moment after it (mu = (1 - b1) * g; the first gradient norm is below optim.clip_norm, so g is
  unclipped): no separately jitted gradient function."""
  import jax
  import numpy as np
  import optax
  from moejax.train.loop import put_batch
  cfg = trainer.cfg
  state = trainer.init_state()
  batches = [put_batch(b, trainer.mesh) for b in random_batches(cfg, cfg.steps)]
  losses, grad_norms, grads, all_metrics = [], [], None, []
  for b in batches:
    state, metrics = trainer.train_step(state, b)
    if grads is None:
      mu = jax.device_get(optax.tree_utils.tree_get(state.opt_state, "mu"))
      grads = jax.tree.map(lambda m: m / (1 - cfg.optim.b1), mu)
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
    all_metrics.append(jax.device_get(metrics))
  assert grad_norms[0] < cfg.optim.clip_norm
  return {"grads": grads, "losses": np.array(losses), "grad_norms": np.array(grad_norms),
          "params": jax.device_get(state.params), "metrics": all_metrics[-1],
          "all_metrics": all_metrics, "state": state}


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all` by its documented semantics, from all_gathers (XLA:CPU has
  none), for running the GPU forms of moejax's exchanges on fake CPU devices: sender j's rows
  [input_offsets[me], + send_sizes[me]) land at its output_offsets[me] on this device, which
  takes recv_sizes[j] rows from j. Where the two sizes disagree, or a send reads past the
  operand, the whole output is poisoned (every bit set), so a caller's error shows as a
  mismatch instead of being papered over."""
  import jax.numpy as jnp
  from jax import lax
  me = lax.axis_index(axis_name)
  # Bit patterns through the all_gather: XLA:CPU's float collectives rewrite NaN payloads.
  uint = jnp.dtype(f"uint{8 * operand.dtype.itemsize}")
  ops = lax.all_gather(lax.bitcast_convert_type(operand, uint), axis_name)
  starts, sizes, lands = (lax.all_gather(x, axis_name)[:, me]      # each sender's, for me
                          for x in (input_offsets, send_sizes, output_offsets))
  row = jnp.arange(output.shape[0])[:, None]
  hit_RxW = (row >= lands[None, :]) & (row < (lands + recv_sizes)[None, :])
  sender = jnp.argmax(hit_RxW, axis=1)
  src = row[:, 0] - lands[sender] + starts[sender]
  hit = jnp.any(hit_RxW, axis=1)
  wrong = (jnp.any(sizes != recv_sizes) | jnp.any(hit & (src >= operand.shape[0]))
           | jnp.any(lands + recv_sizes > output.shape[0]))
  got = ops[sender, jnp.clip(src, 0, operand.shape[0] - 1)]
  out = jnp.where(hit.reshape((-1,) + (1,) * (output.ndim - 1)), got,
                  lax.bitcast_convert_type(output, uint))
  out = jnp.where(wrong, jnp.array(jnp.iinfo(uint).max, uint), out)
  return lax.bitcast_convert_type(out, output.dtype)


def gpu_forms_of(*modules):
  """A `jax.lax.platform_dependent` that takes the GPU (`default`) branch where it is defined in
  one of `modules` (a `functools.partial` by its function's) and the CPU one elsewhere (kernels
  with no CPU lowering stay out)."""
  def choose(*args, default=None, **per_platform):
    mine = getattr(getattr(default, "func", default), "__module__", None) in modules
    return (default if mine else per_platform.get("cpu", default))(*args)
  return choose


def assert_bits_equal(want, got):
  """Every leaf of two pytrees equal bit for bit (floats compared as their bit patterns, so NaN
  payloads and -0.0 count)."""
  import jax
  import numpy as np
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind not in "iub":
      a, b = a.view(f"uint{8 * a.dtype.itemsize}"), b.view(f"uint{8 * b.dtype.itemsize}")
    np.testing.assert_array_equal(a, b)
