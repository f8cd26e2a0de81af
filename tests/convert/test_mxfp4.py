"""MXFP4 expert weights (OpenAI gpt-oss): `TensorReader` reads each P_blocks + P_scales pair as P,
bit for bit as transformers' `convert_moe_packed_tensors` dequantizes it, any block of it alone,
and refuses pairs that do not hold together. `quantize_mxfp4` writes such pairs from fp32 weights
(for other tests: `from tests.convert.test_mxfp4 import quantize_mxfp4`)."""
from __future__ import annotations

import json
import os
import subprocess

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from moejax.convert import safetensors_io
from moejax.convert.safetensors_io import MXFP4_SCALES, TensorReader
from moejax.errors import CheckpointError
from tests.convert.conftest import TORCH_PYTHON, torch_env_problem

FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])    # codes 0-7; 8-15 their negatives
GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"


def quantize_mxfp4(w_LxCxR: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """A dequantized-layout weight [*lead, C, R] (C a multiple of 32) as MXFP4 (blocks
  [*lead, R, C/32, 16], scales [*lead, R, C/32], both uint8): each run of 32 values along C
  shares the smallest power-of-two scale under which none of them exceeds FP4's 6 (so none is
  clipped; byte 0, 2**-127, for an all-zero run), each value rounded to the nearest FP4 value
  (ties to the even code, as hardware rounds)."""
  w = np.swapaxes(np.asarray(w_LxCxR, np.float64), -1, -2)            # [*lead, R, C]
  if w.shape[-1] % 32:
    raise ValueError(f"quantize_mxfp4: C = {w.shape[-1]} is not a multiple of 32")
  runs = w.reshape(*w.shape[:-1], -1, 32)                              # [*lead, R, G, 32]
  amax = np.abs(runs).max(axis=-1)
  mantissa, exponent = np.frexp(amax / 6.0)          # amax / 6 = m * 2**k, m in [0.5, 1)
  exponent = np.where(mantissa == 0.5, exponent - 1, exponent)         # ceil(log2(amax / 6))
  exponent = np.where(amax == 0, -127, exponent)
  exponent = exponent + (amax / np.ldexp(1.0, exponent) > 6.0)        # amax / 6 rounded down
  if exponent.max(initial=-127) > 127:
    raise ValueError("quantize_mxfp4: a value needs a scale above 2**127")
  exponent = np.maximum(exponent, -127)
  y = np.abs(runs) / np.ldexp(1.0, exponent)[..., None]               # exact: power-of-two scale
  upper = np.minimum(np.searchsorted(FP4_GRID, y), 7)
  lower = np.maximum(upper - 1, 0)
  to_lower, to_upper = y - FP4_GRID[lower], FP4_GRID[upper] - y
  magnitude = np.where((to_lower < to_upper) | ((to_lower == to_upper) & (lower % 2 == 0)),
                       lower, upper)
  codes = (magnitude | (np.signbit(runs) << 3)).astype(np.uint8)
  blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                 # low nibble: even value
  # contiguous: safetensors' numpy writer stores a strided array's buffer as it lies
  return (np.ascontiguousarray(blocks, np.uint8),
          np.ascontiguousarray(exponent + 127, np.uint8))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """The weight [*lead, C, R] that MXFP4 blocks and scales hold, in fp32 (straight from the
  format, apart from the reader's code)."""
  table = np.concatenate([FP4_GRID, -FP4_GRID])
  codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*scales.shape, 32)
  values = table[codes] * np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
  return np.swapaxes(values.reshape(*scales.shape[:-1], -1), -1, -2).astype(np.float32)


def random_pair(rng, shape, exponents=(110, 140)):
  """Random MXFP4 bytes: blocks `shape` [E, R, G, 16], scale bytes in `exponents`."""
  return (rng.integers(0, 256, shape, dtype=np.uint8),
          rng.integers(*exponents, shape[:-1], dtype=np.uint8))


def write(directory, tensors: dict[str, np.ndarray], shards: list[list[str]] | None = None):
  """`tensors` as model.safetensors, or as shards holding the names of each `shards` entry."""
  os.makedirs(directory, exist_ok=True)
  tensors = {n: np.ascontiguousarray(x) for n, x in tensors.items()}   # see quantize_mxfp4
  if shards is None:
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map = {}
  for k, names in enumerate(shards):
    fname = safetensors_io.shard_file_name(k + 1, len(shards))
    save_file({n: tensors[n] for n in names}, os.path.join(directory, fname),
              metadata={"format": "pt"})
    weight_map.update({n: fname for n in names})
  with open(os.path.join(directory, safetensors_io.INDEX_FILE), "w") as f:
    json.dump({"weight_map": weight_map}, f)


def checkpoint(rng) -> dict[str, np.ndarray]:
  """gpt-oss's experts in miniature (E=3, D=64, 2F=8, F=4) and two plain tensors beside them."""
  gate_up = random_pair(rng, (3, 8, 2, 16))            # gate_up_proj [3, 64, 8]
  down = random_pair(rng, (3, 64, 1, 16))              # down_proj [3, 32, 64]
  return {GATE_UP + "_blocks": gate_up[0], GATE_UP + "_scales": gate_up[1],
          DOWN + "_blocks": down[0], DOWN + "_scales": down[1],
          GATE_UP + "_bias": rng.normal(size=(3, 8)).astype(ml_dtypes.bfloat16),
          "model.layers.0.self_attn.q_proj.weight": rng.normal(size=(8, 64)).astype(np.float32)}


# transformers' function on the pairs of an .npz, asked for float32 (its default is bfloat16)
TRANSFORMERS_SCRIPT = """
import sys
import numpy as np
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
pairs = np.load(sys.argv[1])
out = {}
for name in sorted(pairs.files):
  if name.endswith("_blocks"):
    p = name[:-len("_blocks")]
    out[p] = convert_moe_packed_tensors(torch.from_numpy(pairs[name]),
                                        torch.from_numpy(pairs[p + "_scales"]),
                                        dtype=torch.float32).numpy()
np.savez(sys.argv[2], **out)
"""


def transformers_dequantized(tmp_path, pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  problem = torch_env_problem()
  if problem:
    pytest.skip(problem)
  np.savez(tmp_path / "pairs.npz", **pairs)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  done = subprocess.run([TORCH_PYTHON, "-c", TRANSFORMERS_SCRIPT, str(tmp_path / "pairs.npz"),
                         str(tmp_path / "expected.npz")], capture_output=True, text=True, env=env,
                        check=False)
  if done.returncode:
    pytest.fail(f"transformers' convert_moe_packed_tensors failed:\n{done.stderr[-3000:]}")
  with np.load(tmp_path / "expected.npz") as expected:
    return dict(expected)


def test_reads_as_transformers_dequantizes_bit_for_bit(tmp_path):
  """Random pairs (one single-file checkpoint, one sharded with a pair split across shards), and
  one of every byte under the extreme scales (2**-127, a subnormal; 2**127, which overflows to
  inf times 2 and more), read whole: the bits transformers' float32 dequantization gives."""
  rng = np.random.default_rng(0)
  tensors = checkpoint(rng)
  every_byte = np.arange(256, dtype=np.uint8).reshape(2, 2, 4, 16)
  extremes = np.array([0, 1, 126, 127, 128, 200, 253, 254], np.uint8).reshape(2, 2, 2)
  tensors["model.layers.1.mlp.experts.down_proj_blocks"] = every_byte
  tensors["model.layers.1.mlp.experts.down_proj_scales"] = np.repeat(extremes, 2, axis=-1)
  pairs = {n: x for n, x in tensors.items() if n.endswith(("_blocks", "_scales"))}
  expected = transformers_dequantized(tmp_path, pairs)
  write(str(tmp_path / "one"), tensors)
  names = sorted(tensors)
  write(str(tmp_path / "sharded"), tensors, [[n for n in names if n != DOWN + "_scales"],
                                             [DOWN + "_scales"]])
  for directory in ("one", "sharded"):
    with TensorReader(str(tmp_path / directory), scales=MXFP4_SCALES) as reader:
      for name, want in expected.items():
        got = reader.read(name)
        assert got.dtype == np.float32 and got.shape == want.shape == reader.shapes[name]
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32),
                                      err_msg=f"{directory}: {name}")
  assert np.isinf(expected["model.layers.1.mlp.experts.down_proj"]).any()


def test_lists_each_pair_as_one_fp32_tensor_and_the_rest_as_before(tmp_path):
  rng = np.random.default_rng(1)
  tensors = checkpoint(rng)
  write(str(tmp_path), tensors)
  with TensorReader(str(tmp_path), scales=MXFP4_SCALES) as reader:
    assert reader.names() == sorted([DOWN, GATE_UP, GATE_UP + "_bias",
                                     "model.layers.0.self_attn.q_proj.weight"])
    assert reader.shapes[GATE_UP] == (3, 64, 8) and reader.shapes[DOWN] == (3, 32, 64)
    assert reader.dtypes[GATE_UP] == reader.dtypes[DOWN] == "MXFP4"
    assert reader.dtypes[GATE_UP + "_bias"] == "BF16"
    reader.check_dtype(GATE_UP)
    np.testing.assert_array_equal(reader.read(GATE_UP + "_bias"),
                                  tensors[GATE_UP + "_bias"].astype(np.float32))
    np.testing.assert_array_equal(reader.read("model.layers.0.self_attn.q_proj.weight", (2,)),
                                  tensors["model.layers.0.self_attn.q_proj.weight"][2])
    np.testing.assert_array_equal(
        reader.read(GATE_UP), dequantize_mxfp4(tensors[GATE_UP + "_blocks"],
                                               tensors[GATE_UP + "_scales"]))


def test_reads_any_block_as_that_block_of_the_whole(tmp_path, monkeypatch):
  """Ints (negative ones too), slices crossing 32-value blocks, clipped and empty slices: each
  reads as that block of the whole, from the experts and rows it covers only."""
  rng = np.random.default_rng(2)
  blocks, scales = random_pair(rng, (3, 10, 3, 16))       # P [3, 96, 10]
  write(str(tmp_path), {"w_blocks": blocks, "w_scales": scales})
  reader = TensorReader(str(tmp_path), scales=MXFP4_SCALES)
  whole = reader.read("w")
  np.testing.assert_array_equal(whole, dequantize_mxfp4(blocks, scales))
  cases = [(1,), (-1,), (0, 5), (2, slice(None), -3), (slice(1, 3), slice(30, 70), slice(2, 9)),
           (1, slice(31, 33), 4), (slice(0, 1), slice(64, 200)), (slice(2, 2),),
           (slice(None), slice(40, 40), slice(None)), (0, slice(None), slice(9, 10))]
  for _ in range(30):
    cases.append(tuple(slice(*sorted(int(i) for i in rng.integers(0, n + 1, 2)))
                       for n in whole.shape))
  for index in cases:
    np.testing.assert_array_equal(reader.read("w", index), whole[index], err_msg=str(index))
  with pytest.raises(IndexError, match="out of bounds for axis 0"):
    reader.read("w", (3,))
  with pytest.raises(ValueError, match="not contiguous"):
    reader.read("w", (slice(0, 3, 2),))
  asked = []
  stored = reader._read_stored
  monkeypatch.setattr(reader, "_read_stored",
                      lambda fname, name, index: asked.append((name, index)) or stored(
                          fname, name, index))
  reader.read("w", (1, slice(40, 50), slice(2, 4)))
  assert asked == [(n, (slice(1, 2), slice(2, 4), slice(1, 2))) for n in ("w_blocks", "w_scales")]


def test_quantize_mxfp4_reads_back_within_fp4_rounding(tmp_path):
  """Runs of 32 values of very different sizes (one all zero): the reader gives the numpy
  dequantization of quantize_mxfp4's pair, each value the FP4 value nearest w under its run's
  scale, which is the smallest power of two that clips nothing."""
  rng = np.random.default_rng(3)
  w = rng.normal(size=(2, 64, 5)) * np.exp2(rng.integers(-20, 20, (2, 2, 5)))[:, [0] * 32 +
                                                                                [1] * 32]
  w[0, :32, 0] = 0.0
  w[1, :32, 1] = np.linspace(-6, 6, 32)       # ties and exact grid values under scale 1
  w = w.astype(np.float32)
  blocks, scales = quantize_mxfp4(w)
  assert blocks.shape == (2, 5, 2, 16) and scales.shape == (2, 5, 2)
  assert scales[0, 0, 0] == 0 and scales[1, 1, 0] == 127
  write(str(tmp_path), {"w_blocks": blocks, "w_scales": scales})
  got = TensorReader(str(tmp_path), scales=MXFP4_SCALES).read("w")
  np.testing.assert_array_equal(got.view(np.uint32), dequantize_mxfp4(blocks, scales).view(
      np.uint32))
  scale = np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=-1).swapaxes(-1, -2)
  y = np.abs(w) / scale
  assert (y <= 6).all()
  run_max = np.abs(w).reshape(2, 2, 32, 5).max(axis=2)
  assert ((run_max / (scale[:, ::32] / 2) > 6) | (scales.swapaxes(-1, -2) == 0)).all()
  nearest = np.abs(y[..., None] - FP4_GRID).min(axis=-1) * scale
  np.testing.assert_array_equal(np.abs(got - w.astype(np.float64)), nearest)


def refused(tmp_path, tensors, scales=MXFP4_SCALES, read=None) -> str:
  write(str(tmp_path), tensors)
  with pytest.raises(CheckpointError) as e:
    reader = TensorReader(str(tmp_path), scales=scales)
    if read:
      reader.read(read)
  assert "\n" not in str(e.value)
  return str(e.value)


def pair(shape=(2, 4, 1, 16)):
  return dict(zip(("w_blocks", "w_scales"), random_pair(np.random.default_rng(4), shape)))


FP8_SCALES = safetensors_io.WeightScales("_scale_inv", ((128, 128),))


@pytest.mark.parametrize("change,scales,read,expected", [
    (lambda t: t.pop("w_scales"), MXFP4_SCALES, None,
     "tensor 'w_blocks' holds MXFP4 blocks without their scales 'w_scales'"),
    (lambda t: t.pop("w_blocks"), MXFP4_SCALES, None,
     "tensor 'w_scales' holds MXFP4 scales without their blocks 'w_blocks'"),
    (lambda t: t.update(w_blocks=t["w_blocks"].view(np.int8)), MXFP4_SCALES, None,
     "tensor 'w_blocks' has dtype I8; MXFP4 blocks and scales are U8"),
    (lambda t: t.update(w_scales=t["w_scales"].astype(np.float32)), MXFP4_SCALES, None,
     "tensor 'w_scales' has dtype F32; MXFP4 blocks and scales are U8"),
    (lambda t: t.update(w_blocks=t["w_blocks"][..., :8], w_scales=t["w_scales"]), MXFP4_SCALES,
     None, "tensor 'w_blocks' has shape (2, 4, 1, 8); MXFP4 blocks are [experts, rows, blocks "
     "of 32 values, 16 bytes]"),
    (lambda t: t.update(w_blocks=t["w_blocks"][0], w_scales=t["w_scales"][0]), MXFP4_SCALES,
     None, "tensor 'w_blocks' has shape (4, 1, 16); MXFP4 blocks are [experts"),
    (lambda t: t.update(w_scales=t["w_scales"][:, :3]), MXFP4_SCALES, None,
     "tensor 'w_scales' has shape (2, 3, 1); w_blocks (2, 4, 1, 16) needs one scale per block, "
     "(2, 4, 1)"),
    (lambda t: t.update(w=np.zeros((2, 32, 4), np.float32)), MXFP4_SCALES, None,
     "tensor 'w' is stored beside its MXFP4 blocks 'w_blocks'; a checkpoint holds one or the "
     "other"),
    (lambda t: None, None, None, "tensors 'w_blocks' and 'w_scales' hold MXFP4 weights, but "
     "config.json declares no quantization_config with quant_method 'mxfp4'"),
    (lambda t: None, FP8_SCALES, None, "tensors 'w_blocks' and 'w_scales' hold MXFP4 weights, "
     "but config.json declares no quantization_config with quant_method 'mxfp4'"),
    (lambda t: t["w_scales"].__setitem__((1, 2, 0), 255), MXFP4_SCALES, "w",
     "tensor 'w_scales' holds the E8M0 NaN scale (byte 255) at [1, 2, 0]; valid scales are "
     "bytes 0 to 254"),
    (lambda t: t.update({"x.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn).view(np.uint8)}),
     MXFP4_SCALES, "x.weight", "tensor 'x.weight' has dtype U8; moejax keeps fp32 parameters"),
])
def test_refuses_pairs_that_do_not_hold_together(tmp_path, change, scales, read, expected):
  tensors = pair()
  change(tensors)
  message = refused(tmp_path, tensors, scales, read)
  assert expected in message and message.startswith(str(tmp_path)), message
