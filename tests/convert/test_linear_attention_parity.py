"""moejax's Gated DeltaNet against transformers' Qwen3-Next linear attention layer
(Qwen3NextGatedDeltaNet), on the same weights and hidden states, fp32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.layers.linear_attention import GatedDeltaNet

D, HK, HV, DK, DV, TAPS = 24, 2, 4, 8, 6, 4
CONFIG = dict(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
              linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=TAPS,
              rms_norm_eps=1e-6, hidden_act="silu", num_hidden_layers=1,
              layer_types=["linear_attention"])


def hf_weights(rng) -> dict[str, np.ndarray]:
  r = HV // HK
  normal = lambda *shape, std=0.3: (std * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
  return {"in_proj_qkvz.weight": normal(HK * (2 * DK + 2 * r * DV), D),
          "in_proj_ba.weight": normal(2 * HV, D),
          "conv1d.weight": normal(2 * HK * DK + HV * DV, 1, TAPS, std=0.5),
          "dt_bias": normal(HV, std=1.0),
          "A_log": np.log(rng.uniform(0.5, 4.0, HV)).astype(np.float32),
          "norm.weight": 1.0 + normal(DV, std=0.2),
          "out_proj.weight": normal(D, HV * DV)}


def moejax_params(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """transformers' tensors as moejax's: in_proj_qkvz's rows are, per key head, its q, its k,
  then its value heads' v and z; in_proj_ba's its value heads' b then a."""
  r = HV // HK
  qkvz = hf["in_proj_qkvz.weight"].reshape(HK, 2 * DK + 2 * r * DV, D)
  bounds = np.cumsum([0, DK, DK, r * DV, r * DV])
  q, k, v, z = (qkvz[:, a:b].reshape(-1, D).T for a, b in zip(bounds[:-1], bounds[1:]))
  ba = hf["in_proj_ba.weight"].reshape(HK, 2 * r, D)
  taps = hf["conv1d.weight"][:, 0, :].T
  return dict(wq=q, wk=k, wv=v, wz=z, wb=ba[:, :r].reshape(-1, D).T,
              wa=ba[:, r:].reshape(-1, D).T, conv_q=taps[:, :HK * DK],
              conv_k=taps[:, HK * DK:2 * HK * DK], conv_v=taps[:, 2 * HK * DK:],
              dt_bias=hf["dt_bias"], a_log=hf["A_log"], out_norm=hf["norm.weight"],
              wo=hf["out_proj.weight"].T)


def test_gated_deltanet_matches_transformers(hf_reference, tmp_path):
  """Over 150 tokens (chunks of 64, the last one partial), two value heads per key head:
  moejax's output is transformers' within fp32 rounding; read as transformers' in_proj_qkvz
  split into q, k, v, z blocks (not per key head) it is not."""
  rng = np.random.default_rng(0)
  hf = hf_weights(rng)
  x_BxSxD = rng.normal(size=(2, 150, D)).astype(np.float32)
  np.savez(tmp_path / "w.npz", **hf)
  np.save(tmp_path / "x.npy", x_BxSxD)
  out = str(tmp_path / "y.npy")
  hf_reference.call("gated_delta_net", config=CONFIG, weights=str(tmp_path / "w.npz"),
                    inputs=str(tmp_path / "x.npy"), out=out)
  want = np.load(out)
  net = GatedDeltaNet(D, key_heads=HK, value_heads=HV, key_dim=DK, value_dim=DV,
                      conv_taps=TAPS, norm_eps=1e-6, init_std=0.02, rngs=nnx.Rngs(0))

  graphdef, state = nnx.split(net)
  forward = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))

  def run(params):
    nnx.replace_by_pure_dict(state, {k: jnp.asarray(v) for k, v in params.items()})
    return np.asarray(forward(state, jnp.asarray(x_BxSxD)))

  params = moejax_params(hf)
  got = run(params)
  scale = np.abs(want).max()
  assert np.abs(got - want).max() < 1e-5 * scale, (np.abs(got - want).max(), scale)
  w = hf["in_proj_qkvz.weight"]      # blocks in order rather than grouped by key head
  kw, vw = HK * DK, HV * DV
  ungrouped = dict(params, wq=w[:kw].T, wk=w[kw:2 * kw].T, wv=w[2 * kw:2 * kw + vw].T,
                   wz=w[2 * kw + vw:].T)
  assert np.abs(run(ungrouped) - want).max() > 1e-2 * scale
