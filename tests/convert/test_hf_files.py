"""Hugging Face checkpoint files without torch: what import refuses and how it says so, dtypes,
sharding of the export, the config mapping, the command line's exit code."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from moejax.convert import __main__ as cli
from moejax.convert import hf_names, safetensors_io
from moejax.convert import config_from_hf, hf_config_from, load_hf, save_hf
from moejax.convert.hf_config import MODEL_TYPES, quantization_summary, weight_scales
from moejax.families import FAMILIES
from moejax.errors import CheckpointError
from moejax.models import olmoe
from moejax.config import from_config_dict
from tests.convert import fp8_configs
from tests.helpers import FAMILY_CONFIGS, REPO, tiny_config

SINGLE = "model.safetensors"


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(**{"model.vocab_size": 96, "model.d_model": 32, "moe.expert_hidden": 16,
                       "model.num_heads": 2})
  params = jax.tree.map(np.asarray, jax.jit(lambda k: olmoe.init_params(cfg, k))(jax.random.key(0)))
  return cfg, params


@pytest.fixture
def hf_dir(model, tmp_path):
  cfg, params = model
  path = str(tmp_path / "hf")
  save_hf(params, cfg, path)
  return path


def edit_config(path, **changes):
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  hf.update(changes)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)


def edit_tensors(path, edit):
  tensors = load_file(os.path.join(path, SINGLE))
  edit(tensors)
  save_file(tensors, os.path.join(path, SINGLE), metadata={"format": "pt"})


def load_error(path) -> str:
  with pytest.raises(CheckpointError) as info:
    load_hf(path)
  message = str(info.value)
  assert "\n" not in message
  return message


@pytest.mark.parametrize("changes,expected", [
    (dict(model_type="llama"), "model_type='llama' cannot be converted (valid: 'olmoe'"),
    (dict(clip_qkv=8.0), "clip_qkv=8.0 is not supported"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 is not supported: must divide"),
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "layer_types='sliding_attention' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling.rope_type='linear'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(num_experts_per_tok=99), "moe.top_k=99"),
    (dict(num_hidden_layers="2"), "num_hidden_layers='2' should be int"),
])
def test_refuses_configs_moejax_does_not_model(hf_dir, changes, expected):
  edit_config(hf_dir, **changes)
  assert expected in load_error(hf_dir)


def test_swish_is_silu(hf_dir):
  """transformers maps hidden_act "swish" to SiLU: the same model, loaded alike."""
  cfg_silu = load_hf(hf_dir)[0]
  edit_config(hf_dir, hidden_act="swish")
  assert load_hf(hf_dir)[0] == cfg_silu


def test_refuses_what_is_not_a_checkpoint(hf_dir, tmp_path):
  assert "not a directory" in load_error(str(tmp_path / "nowhere"))
  os.remove(os.path.join(hf_dir, SINGLE))
  assert f"no {SINGLE} or model.safetensors.index.json" in load_error(hf_dir)
  os.remove(os.path.join(hf_dir, "config.json"))
  assert "config.json: missing" in load_error(hf_dir)


def test_truncated_file(hf_dir):
  path = os.path.join(hf_dir, SINGLE)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  assert f"{SINGLE}: cannot read as safetensors" in load_error(hf_dir)


def test_missing_shard(model, tmp_path):
  cfg, params = model
  path = str(tmp_path / "hf")
  files = save_hf(params, cfg, path, max_shard_bytes=20_000)
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 2
  os.remove(os.path.join(path, shards[1]))
  message = load_error(path)
  assert shards[1] in message and "is missing" in message


def test_missing_and_unexpected_tensors(hf_dir):
  name = "model.layers.1.mlp.experts.3.up_proj.weight"
  edit_tensors(hf_dir, lambda t: t.pop(name))
  assert f"tensor {name!r} is missing" in load_error(hf_dir)
  edit_tensors(hf_dir, lambda t: t.update({
      name: np.zeros((16, 32), np.float32),
      "model.layers.0.self_attn.q_proj.bias": np.zeros((32,), np.float32)}))
  assert "'model.layers.0.self_attn.q_proj.bias' has no place" in load_error(hf_dir)


def test_shape_mismatch_names_tensor_and_both_shapes(hf_dir):
  name = "model.layers.0.self_attn.k_proj.weight"
  edit_tensors(hf_dir, lambda t: t.update({name: np.zeros((32, 31), np.float32)}))
  message = load_error(hf_dir)
  assert f"tensor {name!r} has shape (32, 31), but config.json implies (32, 32)" in message


@pytest.mark.parametrize("dtype,label", [(np.float64, "F64"), (np.int32, "I32")])
def test_refuses_dtypes_fp32_cannot_hold(hf_dir, dtype, label):
  name = "model.norm.weight"
  edit_tensors(hf_dir, lambda t: t.update({name: t[name].astype(dtype)}))
  message = load_error(hf_dir)
  assert f"tensor {name!r} has dtype {label}" in message and "BF16" in message


def test_bfloat16_and_float16_checkpoints_read_exactly(model, tmp_path):
  cfg, params = model
  path = str(tmp_path / "bf16")
  save_hf(params, cfg, path, dtype="bfloat16")
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == "bfloat16"
  _, loaded = load_hf(path)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
    assert y.dtype == np.float32
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
  edit_tensors(path, lambda t: t.update({k: v.astype(np.float32).astype(np.float16)
                                         for k, v in t.items()}))
  _, loaded16 = load_hf(path)
  emb = load_file(os.path.join(path, SINGLE))["model.embed_tokens.weight"]
  np.testing.assert_array_equal(loaded16["embed"], emb.astype(np.float32))


FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
ST_DTYPES = {np.dtype(np.float32): "F32", FP8: "F8_E4M3", E8M0: "F8_E8M0",
             np.dtype(np.int32): "I32", np.dtype(ml_dtypes.bfloat16): "BF16"}


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
  """safetensors' numpy writer has no float8: the format written by hand."""
  header, offset = {}, 0
  for name, x in tensors.items():
    header[name] = {"dtype": ST_DTYPES[x.dtype], "shape": list(x.shape),
                    "data_offsets": [offset, offset + x.nbytes]}
    offset += x.nbytes
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw)
    for x in tensors.values():
      f.write(np.ascontiguousarray(x).tobytes())


def quantize_blocks(w, block, power_of_two=False, int_bits=0):
  """(values, fp32 scales) of a 2-D weight in blocks of `block`, the grid rounded up: float8
  e4m3 values, or symmetric `int_bits`-bit integers; `power_of_two`: each scale rounded up to
  one (DeepSeek's "ue8m0" scale format)."""
  (rows, cols), (bm, bn) = w.shape, block
  top = 448.0 if not int_bits else 2 ** (int_bits - 1) - 1
  q = np.empty(w.shape, FP8 if not int_bits else np.int32)
  scales = np.empty((-(-rows // bm), -(-cols // bn)), np.float32)
  for i in range(scales.shape[0]):
    for j in range(scales.shape[1]):
      part = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
      scales[i, j] = np.abs(part).max() / top
      if power_of_two:
        scales[i, j] = 2.0 ** np.ceil(np.log2(scales[i, j]))
      scaled = part / scales[i, j]
      q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = (
          scaled.astype(FP8) if not int_bits else np.clip(np.round(scaled), -top - 1, top))
  return q, scales


def pack_ints(q, bits):
  """Row by row, value k at bits [k * bits, (k + 1) * bits) of the int32 words, plus
  2**(bits - 1): compressed-tensors' layout, written element by element."""
  per_word = 32 // bits
  words = np.zeros((q.shape[0], -(-q.shape[1] // per_word)), np.uint32)
  for r in range(q.shape[0]):
    for k in range(q.shape[1]):
      words[r, k // per_word] |= np.uint32(int(q[r, k]) + 2 ** (bits - 1)) << np.uint32(
          (k % per_word) * bits)
  return words.view(np.int32)


def dequantize_blocks(q, scales, block):
  """The reference: each block's values times its scale, block by block."""
  out, (bm, bn) = np.empty(q.shape, np.float32), block
  for i in range(scales.shape[0]):
    for j in range(scales.shape[1]):
      part = (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
      out[part] = q[part].astype(np.float32) * scales[i, j]
  return out


def fp8_copy(hf_dir, out_dir, block, scale_dtype=np.float32, strategy=None, int_bits=0):
  """out_dir: hf_dir with its projections quantized in `block`s (0: a whole dimension), stored
  as transformers' fine-grained FP8 (`strategy` None: weight_scale_inv, fp32 or E8M0 scales), or
  as compressed-tensors' float-quantized format (FP8) or, with `int_bits`, its pack-quantized
  one (weight_packed, weight_shape) with that weights `strategy` (weight_scale as llm-compressor
  shapes it); returns the dequantized values."""
  os.makedirs(out_dir)
  tensors, stored, dequantized = load_file(os.path.join(hf_dir, SINGLE)), {}, {}
  for name, w in tensors.items():
    if w.ndim == 2 and "proj" in name:
      size = tuple(n if b == 0 else b for n, b in zip(w.shape, block))
      q, scales = quantize_blocks(w, size, scale_dtype == E8M0, int_bits)
      suffix = "_scale_inv" if strategy is None else "_scale"
      if int_bits:
        stored[name + "_packed"] = pack_ints(q, int_bits)
        stored[name + "_shape"] = np.array(w.shape, np.int32)
      else:
        stored[name] = q
      scales = scales.astype(scale_dtype)           # what the reader sees (bf16: rounded)
      stored[name + suffix] = scales.reshape((1,) if strategy == "tensor" else scales.shape)
      dequantized[name] = dequantize_blocks(q, scales.astype(np.float32), size)
      if strategy is not None and scales.dtype.itemsize == 2:
        # compressed-tensors multiplies in the scale's dtype (x_q.to(scale.dtype) * scale)
        dequantized[name] = dequantized[name].astype(scale_dtype).astype(np.float32)
    else:
      stored[name] = w
  write_safetensors(os.path.join(out_dir, SINGLE), stored)
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf = json.load(f)
  hf["quantization_config"] = fp8_configs.quantization_config(strategy, block, int_bits)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f)
  return dequantized


@pytest.mark.parametrize("block,scale_dtype,strategy,int_bits", [
    ((3, 5), np.float32, None, 0), ((3, 5), E8M0, None, 0), ((0, 0), np.float32, None, 0),
    ((0, 0), np.float32, "tensor", 0), ((1, 0), np.float32, "channel", 0),
    ((1, 0), ml_dtypes.bfloat16, "channel", 0),
    ((1, 5), np.float32, "group", 0), ((3, 5), np.float32, "block", 0),
    ((1, 5), ml_dtypes.bfloat16, "group", 4), ((1, 0), np.float32, "channel", 8)])
def test_fp8_blocks_that_do_not_divide_the_weight(hf_dir, tmp_path, block, scale_dtype, strategy,
                                                  int_bits):
  """3 x 5 blocks over 32 x 32 and 16 x 32 projections (the scale grid rounded up, as DeepSeek-V3's
  576-row kv_a_proj_with_mqa in 128-row blocks), scales in fp32 or E8M0, or one per tensor
  (weight_block_size null); compressed-tensors' strategies (one scale per tensor, row (fp32 or
  bf16, the product then rounded to bf16 as compressed-tensors rounds it), 5 columns of a row,
  3 x 5 block); and its packed 4-bit (bf16 scales per 5 columns, as Kimi-K2-Thinking's per 32)
  and 8-bit integers: import equals the unquantized checkpoint of the block-by-block dequantized
  values, bit for bit, read whole and read in 8 devices' blocks (4 columns wide: half a word of
  4-bit values)."""
  fp8_dir, plain_dir = str(tmp_path / "fp8"), str(tmp_path / "plain")
  dequantized = fp8_copy(hf_dir, fp8_dir, block, scale_dtype, strategy, int_bits)
  assert len(dequantized) > 10
  os.makedirs(plain_dir)
  tensors = load_file(os.path.join(hf_dir, SINGLE))
  save_file({**tensors, **dequantized}, os.path.join(plain_dir, SINGLE))
  with open(os.path.join(hf_dir, "config.json")) as f, \
      open(os.path.join(plain_dir, "config.json"), "w") as g:
    g.write(f.read())
  cfg, got = load_hf(fp8_dir)
  plain_cfg, plain = load_hf(plain_dir)
  assert (cfg, jax.tree.structure(got)) == (plain_cfg, jax.tree.structure(plain))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))
  assert not np.array_equal(got["layers"]["attn"]["wq"],     # quantization moved the weights
                            load_hf(hf_dir)[1]["layers"]["attn"]["wq"])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
  # Parameters hold the Hugging Face tensors transposed: their last axis is its rows. Blocks of
  # 16 x 8 (or fewer) against 3 x 5 scale blocks; then all 8 devices over its columns, 4 wide,
  # so a device's columns start mid-word of 4-bit values.
  for axes in (("a", "b"), (("a", "b"), None)):
    def spec(x, axes=axes):
      ways = [2 * 4 if isinstance(a, tuple) else {"a": 2, "b": 4}.get(a, 1) for a in axes]
      if x.ndim < 2 or x.shape[-2] % ways[0] or x.shape[-1] % ways[1]:
        return jax.sharding.PartitionSpec()
      return jax.sharding.PartitionSpec(*([None] * (x.ndim - 2)), *axes)
    shardings = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, spec(x)), got)
    _, sharded = load_hf(fp8_dir, shardings=shardings)
    for x, y in zip(jax.tree.leaves(sharded), jax.tree.leaves(got)):
      np.testing.assert_array_equal(np.asarray(x).view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("block,scale_shape,int_bits", [
    ((3, 5), (3, 4, 3), 0), ((0, 0), (3,), 0), ((1, 4), (3, 10, 3), 4), ((1, 0), (3, 10, 1), 8)])
def test_quantized_reads_of_any_block_of_a_stacked_weight(tmp_path, block, scale_shape, int_bits):
  """A weight with a leading expert axis (transformers 5's fused layout): FP8 in 3 x 5 blocks or
  one scale per expert, packed 4-bit integers (every nibble value) per 4 columns, 8-bit per
  row: every index import may pass (ints, negative ones too, empty and clipped slices, blocks
  crossing scale blocks and words) reads as that index of the whole dequantized weight."""
  rng = np.random.default_rng(0)
  size = tuple(n if b == 0 else b for n, b in zip((10, 12), block))
  if int_bits:
    q = rng.integers(-2 ** (int_bits - 1), 2 ** (int_bits - 1), (3, 10, 12)).astype(np.int32)
    scales = rng.uniform(0.5, 2.0, (3, *scale_shape[1:])).astype(np.float32)
    stored = {"w.weight_packed": np.stack([pack_ints(q[e], int_bits) for e in range(3)]),
              "w.weight_shape": np.array(q.shape, np.int32)}
  else:
    w = rng.normal(size=(3, 10, 12)).astype(np.float32)
    parts = [quantize_blocks(w[e], size) for e in range(3)]
    q = np.stack([p[0] for p in parts])
    scales = np.stack([p[1] for p in parts])
    stored = {"w.weight": q}
  grid = (-(-10 // size[0]), -(-12 // size[1]))
  whole = np.stack([dequantize_blocks(q[e], scales[e].reshape(grid), size) for e in range(3)])
  stored["w.weight_scale"] = scales.reshape(scale_shape)
  write_safetensors(str(tmp_path / SINGLE), stored)
  reader = safetensors_io.TensorReader(str(tmp_path), scales=safetensors_io.WeightScales(
      "_scale", (block,), (int_bits,) if int_bits else ()))
  assert reader.shapes == {"w.weight": (3, 10, 12)}
  cases = [(), (1,), (-1,), (slice(0, 2), slice(2, 9), slice(4, 11)), (2, 7, slice(None)),
           (0, slice(None), -3), (slice(1, 3), slice(8, 20), slice(0, 5)),
           (slice(0, 1), slice(3, 3), slice(None)), (slice(None), slice(None), slice(12, 12))]
  for _ in range(40):
    cut = [sorted(rng.integers(0, n + 1, 2)) for n in q.shape]
    cases.append(tuple(slice(int(a), int(b)) for a, b in cut))
  for index in cases:
    np.testing.assert_array_equal(reader.read("w.weight", index), whole[index], err_msg=index)
  with pytest.raises(IndexError, match="out of bounds for axis 0"):
    reader.read("w.weight", (3,))


def test_packed_weights_that_do_not_hold_together(tmp_path):
  words = pack_ints(np.zeros((4, 3), np.int32), 8)           # 3 values: one word at 4 or 8 bits
  ok = {"w.weight_packed": words, "w.weight_shape": np.array([4, 3], np.int32),
        "w.weight_scale": np.ones((4, 1), np.float32)}
  int8 = safetensors_io.WeightScales("_scale", ((1, 0),), (8,))

  def error(tensors, scales=int8):
    write_safetensors(str(tmp_path / SINGLE), tensors)
    with pytest.raises(CheckpointError) as info:
      safetensors_io.TensorReader(str(tmp_path), scales=scales)
    assert "\n" not in str(info.value)
    return str(info.value)

  write_safetensors(str(tmp_path / SINGLE), ok)
  assert safetensors_io.TensorReader(str(tmp_path), scales=int8).shapes == {"w.weight": (4, 3)}
  assert "packed weights are I32 words" in error(
      {**ok, "w.weight_packed": words.astype(np.float32)})
  assert "declares no compressed-tensors pack-quantized group" in error(ok, scales=None)
  assert "needs 'w.weight_shape' beside it" in error(
      {k: v for k, v in ok.items() if k != "w.weight_shape"})
  assert "packs (4, 3) as 4 or 8-bit integers alike" in error(
      ok, safetensors_io.WeightScales("_scale", ((1, 0),), (4, 8)))
  assert "does not pack (4, 40) as 8-bit integers" in error(
      {**ok, "w.weight_shape": np.array([4, 40], np.int32)})
  assert "'w.weight_g_idx' holds an activation-order permutation" in error(
      {**ok, "w.weight_g_idx": np.zeros((3,), np.int32)})
  assert "'w.weight_zero_point' holds zero points" in error(
      {**ok, "w.weight_zero_point": np.zeros((4, 1), np.int32)})


def test_a_scale_shape_two_strategies_could_mean_is_refused(tmp_path):
  """Scales [4] of a [4, 32] weight, under a config with per-row and 4 x 8 block groups: one
  per row or one per block of columns; read exactly ([1, 4]) it is the blocks."""
  q = np.zeros((4, 32), FP8)
  config = safetensors_io.WeightScales("_scale", ((1, 0), (4, 8)))
  write_safetensors(str(tmp_path / SINGLE), {"w.weight": q,
                                            "w.weight_scale": np.ones((4,), np.float32)})
  with pytest.raises(CheckpointError, match=r"'w.weight_scale' has shape \(4,\), which reads as "
                     r"more than one .* \(\[1, 32\], \[4, 8\]\)"):
    safetensors_io.TensorReader(str(tmp_path), scales=config)
  write_safetensors(str(tmp_path / SINGLE), {
      "w.weight": np.ones((4, 32), np.float32).astype(FP8),
      "w.weight_scale": np.array([[1, 2, 3, 4]], np.float32)})
  read = safetensors_io.TensorReader(str(tmp_path), scales=config).read("w.weight")
  np.testing.assert_array_equal(read[0], np.repeat([1.0, 2.0, 3.0, 4.0], 8))


def test_fp8_checkpoints_that_do_not_hold_together(hf_dir, tmp_path):
  fp8_dir = str(tmp_path / "fp8")
  fp8_copy(hf_dir, fp8_dir, (4, 8))
  name = "model.layers.0.self_attn.q_proj.weight"
  path = os.path.join(fp8_dir, SINGLE)

  def rewrite(edit):
    tensors = {}
    header_len = int.from_bytes(open(path, "rb").read(8), "little")
    header = json.loads(open(path, "rb").read(8 + header_len)[8:])
    data = np.fromfile(path, np.uint8, offset=8 + header_len)
    for k, v in header.items():
      dtype = {label: dtype for dtype, label in ST_DTYPES.items()}[v["dtype"]]
      tensors[k] = data[v["data_offsets"][0]:v["data_offsets"][1]].view(dtype).reshape(v["shape"])
    edit(tensors)
    write_safetensors(path, tensors)

  edit_config(fp8_dir, quantization_config={"quant_method": "fp8", "weight_block_size": [8, 8]})
  first = "model.layers.0.mlp.experts.0.down_proj.weight"     # the first FP8 tensor by name
  assert f"{first}_scale_inv' has shape (8, 2); {first} (32, 16) needs (4, 2) (blocks of " \
      "[8, 8]) as config.json's quantization_config declares" in load_error(fp8_dir)
  edit_config(fp8_dir, quantization_config=None)
  assert f"tensor {first!r} is F8_E4M3 but config.json declares no FP8 quantization_config" in \
      load_error(fp8_dir)
  edit_config(fp8_dir, quantization_config={"quant_method": "fp8", "weight_block_size": [4, 8]})
  assert load_hf(fp8_dir)[0] is not None
  rewrite(lambda t: t.pop(name + "_scale_inv"))
  assert f"tensor {name!r} is F8_E4M3 without its scales {name + '_scale_inv'!r}" in \
      load_error(fp8_dir)
  rewrite(lambda t: t.update({name: t[name].astype(np.float32),
                              name + "_scale_inv": np.ones((8, 4), np.float32)}))
  assert f"tensor {name + '_scale_inv'!r} scales {name!r}, which is not stored quantized" in \
      load_error(fp8_dir)


def test_bfloat16_export_keeps_a_biased_router_in_float32(tmp_path):
  """Where a score bias picks the experts (DeepSeek-V3, GLM, ...), the router and the bias stay
  float32 in a bfloat16 export, as transformers keeps them; everything else is bfloat16."""
  cfg = tiny_config("glm4_moe")
  params = jax.tree.map(np.asarray, olmoe.init_params(cfg, jax.random.key(0)))
  path = str(tmp_path / "bf16")
  save_hf(params, cfg, path, dtype="bfloat16", max_shard_bytes=20_000)
  from safetensors import safe_open
  dtypes = {}
  for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
    with safe_open(os.path.join(path, fname), "np") as f:
      dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
  kept = {k for k, d in dtypes.items() if d == "F32"}
  assert kept == {k for k in dtypes if k.endswith(("mlp.gate.weight",
                                                   "mlp.gate.e_score_correction_bias"))}
  assert kept and set(dtypes.values()) == {"F32", "BF16"}
  _, loaded = load_hf(path)
  np.testing.assert_array_equal(loaded["layers"]["moe"]["router"],
                                params["layers"]["moe"]["router"])


def test_export_shards_and_index(model, tmp_path):
  cfg, params = model
  path = str(tmp_path / "hf")
  files = save_hf(params, cfg, path, max_shard_bytes=30_000)
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    index = json.load(f)
  shards = sorted(f for f in files if f.endswith(".safetensors"))
  assert sorted(set(index["weight_map"].values())) == shards
  assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
  sizes = [os.path.getsize(os.path.join(path, s)) for s in shards]
  largest_tensor = 4 * 96 * 32
  assert max(sizes) <= 30_000 + largest_tensor + 4096      # + header
  n_params = sum(x.size for x in jax.tree.leaves(params))
  assert index["metadata"]["total_size"] == 4 * n_params
  # a second export into the same directory is refused, unless asked to overwrite
  with pytest.raises(CheckpointError, match="already holds a checkpoint"):
    save_hf(params, cfg, path)
  save_hf(params, cfg, path, overwrite=True)
  assert sorted(f for f in os.listdir(path) if "safetensors" in f) == [SINGLE]


def test_export_refuses_what_hf_olmoe_cannot_hold(model, tmp_path):
  cfg, params = model
  bad = dict(params, lm_head=params["lm_head"][:, :95])
  with pytest.raises(CheckpointError, match=r"'lm_head' has shape \(32, 95\), but the config "
                                            r"implies \(32, 96\)"):
    save_hf(bad, cfg, str(tmp_path / "a"))
  sigmoid = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, score="sigmoid"))
  with pytest.raises(CheckpointError, match="sigmoid"):
    save_hf(params, sigmoid, str(tmp_path / "b"))


# What each family's config.json may not ask for, and the field the one-line refusal names.
# compressed-tensors' float-quantized format as llm-compressor writes it (FP8 per channel,
# activations quantized dynamically per token)
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "ignore": ["lm_head"],
          "config_groups": {"group_0": {
              "targets": ["Linear"],
              "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                          "strategy": "channel", "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                    "strategy": "token", "dynamic": True}}}}

def ct_group(**changes) -> dict:
  """CT_FP8 with its one config group changed."""
  return dict(CT_FP8, config_groups={"group_0": {**CT_FP8["config_groups"]["group_0"], **changes}})


FAMILY_REFUSALS = [
    ("deepseek_v3", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64}),
     "rope_type='llama3' is not supported: moejax's latent attention takes YaRN's softmax scale"),
    ("mixtral", dict(sliding_window=0), "sliding_window=0 is not supported: expected a positive "
     "number of tokens"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 is not supported"),
    ("qwen2_moe", dict(mlp_only_layers=[0, 1]), "config.model.dense_layers=(0, 1): must be"),
    ("qwen2_moe", dict(mlp_only_layers=[5]), "mlp_only_layers=[5] is not supported"),
    ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0 is not supported"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0 is not supported"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    ("qwen3_moe", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("deepseek_v3", dict(rope_interleave=False), "rope_interleave=False is not supported"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "bitsandbytes"}),
     "quantization_config={'quant_method': 'bitsandbytes'} is not supported: moejax "
     "dequantizes FP8, MXFP4 experts and symmetric integer weights only"),
    ("glm4_moe", dict(quantization_config=ct_group(format="marlin-24")),
     "quantization_config.config_groups.group_0.format='marlin-24' is not supported"),
    ("qwen3_moe", dict(quantization_config=ct_group(format="pack-quantized", weights={
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
        "group_size": 128})),
     "quantization_config.config_groups.group_0.weights={'num_bits': 4, 'type': 'int', "
     "'symmetric': False, 'strategy': 'group', 'group_size': 128} is not supported: moejax "
     "reads symmetric 8-bit float (float-quantized) or 4- and 8-bit integer"),
    ("mixtral", dict(quantization_config=ct_group(
        input_activations={"num_bits": 8, "type": "float", "dynamic": False})),
     "input_activations={'num_bits': 8, 'type': 'float', 'dynamic': False} is not supported"),
    ("olmoe", dict(quantization_config=ct_group(
        weights={"num_bits": 8, "type": "float", "strategy": "block"})),
     "strategy 'block' needs its block_structure [rows, cols]"),
    ("mixtral", dict(quantization_config=dict(CT_FP8, transform_config={"config_groups": {}})),
     "quantization_config.transform_config={'config_groups': {}} is not supported: moejax reads "
     "weights stored as they are used"),
    ("olmoe", dict(quantization_config=ct_group(input_activations="dynamic")),
     "input_activations='dynamic' is not supported"),
    ("qwen3_moe", dict(quantization_config=ct_group(format="pack-quantized", weights={
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
        "group_size": 32, "actorder": "group"})),
     "weights.actorder='group' is not supported: moejax reads weights stored in their own "
     "column order"),
    ("mixtral", dict(quantization_config=dict(CT_FP8, sparsity_config={"format": "sparse-24"})),
     "quantization_config.sparsity_config={'format': 'sparse-24'} is not supported"),
    ("olmoe", dict(quantization_config=ct_group(weights="fp8")),
     "weights='fp8' is not supported: expected compressed-tensors' weights scheme"),
    ("qwen3_moe", dict(quantization_config={"quant_method": "fp8", "activation_scheme": "static"}),
     "quantization_config.activation_scheme='static' is not supported"),
    ("mixtral", dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}),
     "quantization_config.fmt='e5m2' is not supported"),
    ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported"),
    ("deepseek_v3", dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    ("deepseek_v3", dict(rope_scaling={"rope_type": "yarn", "factor": 40.0},
                         max_position_embeddings=None),
     "yarn needs original_max_position_embeddings, a positive integer (got None)"),
    ("qwen3_moe", dict(rope_scaling={"rope_type": "yarn", "factor": "4",
                                     "original_max_position_embeddings": 32768}),
     "rope_scaling: yarn's factor='4' should be a number"),
    ("qwen3_moe", dict(rope_scaling={"rope_type": "yarn", "factor": 0.5,
                                     "original_max_position_embeddings": 32768}),
     "config.model.rope_factor=0.5: YaRN's context extension factor, >= 1"),
    ("olmoe", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0,
                                 "beta_slow": 2.0, "original_max_position_embeddings": 4096}),
     "config.model.rope_beta_fast=1.0, rope_beta_slow=2.0: YaRN needs"),
    ("mixtral", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "truncate": "no",
                                   "original_max_position_embeddings": 4096}),
     "truncate='no' should be true or false"),
    ("deepseek_v3", dict(n_group=3), "moe.expert_groups=3"),
    ("qwen3_moe", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported: "
     "Qwen3MoeForCausalLM rotates whole heads (needs 1.0)"),
    ("glm4_moe", dict(partial_rotary_factor=0.3125), "partial_rotary_factor=0.3125 is not "
     "supported: rotates 5 of head_dim=16"),
    ("glm4_moe", dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    ("glm4_moe", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
     "quantization_config.weight_block_size=[128] is not supported: expected [rows, cols]"),
    ("dots1", dict(sliding_window=8, layer_types=["sliding_attention"]),
     "layer_types=['sliding_attention'] is not supported: expected num_hidden_layers=3 entries"),
    ("exaone_moe", dict(sliding_window=8, layer_types=None, sliding_window_pattern="LLLG"),
     "sliding_window_pattern='LLLG' should be int"),
    ("glm4_moe", dict(layer_types=["full_attention", "sliding_attention", "full_attention"]),
     "layer_types='sliding_attention' is not supported: Glm4MoeForCausalLM attends to the "
     "whole sequence"),
    ("dots1", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("minimax_m2", dict(attn_type_list=[1, 0]), "attn_type_list=[1, 0] is not supported"),
    ("ernie4_5_moe", dict(use_bias=True), "use_bias=True is not supported"),
    ("ernie4_5_moe", dict(moe_layer_interval=0), "moe_layer_interval=0 is not supported"),
    ("ernie4_5_moe", dict(moe_norm_min=0.9), "moe_norm_min=0.9 is not supported"),
    ("minimax_m2", dict(use_qk_norm=False), "use_qk_norm=False is not supported"),
    ("minimax_m2", dict(shared_intermediate_size=512), "shared_intermediate_size=512 is not "
     "supported"),
    ("deepseek_v3", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not "
     "supported: DeepseekV3ForCausalLM rotates whole heads"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported"),
    ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=True is not supported: "
     "transformers' DeepseekV2 never renormalizes"),
    ("deepseek_v2", dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
    ("deepseek_v2", dict(scoring_func="sigmoid"), "scoring_func='sigmoid' is not supported"),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=None),
     "field 'n_group' is null"),
    ("glm4_moe_lite", dict(mlp_layer_types=["dense", "moe", "sparse"]),
     "mlp_layer_types=['dense', 'moe', 'sparse'] is not supported: expected "
     "num_hidden_layers=3 entries, each 'dense' or 'sparse'"),
    ("glm4_moe_lite", dict(head_dim=128), "head_dim=128 is not supported: transformers reads it "
     "as qk_rope_head_dim"),
    ("glm4_moe_lite", dict(rope_interleave=False), "rope_interleave=False is not supported"),
    ("glm4_moe_lite", dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
    ("minicpm5_moe", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("minicpm5_moe", dict(use_gated_attention=False), "use_gated_attention=False is not "
     "supported: transformers' MiniCPM5-MoE always gates"),
    ("minicpm5_moe", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not "
     "supported: MiniCPM5MoeForCausalLM rotates whole heads"),
    ("hy_v3", dict(mlp_bias=True), "mlp_bias=True is not supported"),
    ("granitemoe", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("flex_olmo", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("hunyuan_v1_moe", dict(use_cla=True), "use_cla=True is not supported"),
    ("hunyuan_v1_moe", dict(moe_topk=[2, 3]), "moe_topk=[2, 3] is not supported: moejax's layers "
     "are alike"),
    ("hunyuan_v1_moe", dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling.rope_type='dynamic' is not supported"),
    ("sarvam_moe", dict(num_shared_experts=0), "n_shared_experts=0 is not supported"),
    ("param2moe", dict(partial_rotary_factor=0.3125), "partial_rotary_factor=0.3125 is not "
     "supported: rotates 5 of head_dim=16 dims"),
    ("granitemoe", dict(logits_scaling=None), "field 'logits_scaling' is null"),
    ("hy_v3", dict(num_shared_experts=0), "num_shared_experts=0 is not supported"),
    ("afmoe", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("mellum", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0} is not supported: "
     "expected one RoPE dict for each layer type"),
    ("mellum", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                              "original_max_position_embeddings": 64}}),
     "rope_parameters.sliding_attention.rope_type='yarn' is not supported"),
    ("mellum", dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6,
                           "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters.full_attention.partial_rotary_factor=0.5 is not supported"),
    ("mellum", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("granitemoe_swa", dict(layer_rope_theta=[0, 1e4, 2e4, 1e4]), "layer_rope_theta=[0, "
     "10000.0, 20000.0, 10000.0] is not supported: moejax's layers of one kind"),
    ("granitemoe_swa", dict(layer_rope_theta=[0, 1e4]), "expected num_hidden_layers=4 numbers"),
    ("flint", dict(attention_bias=True), "attention_bias=True is not supported"),
    ("kolibri1", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("granitemoe_swa", dict(layer_rope_theta=[1e6, 1e4, 1e4, 1e4], rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0,
        "original_max_position_embeddings": 64}),
     "not a scaled one of their own"),
    ("afmoe", dict(sliding_window=None), "sliding_window=None is not supported: "
     "AfmoeForCausalLM's sliding layers need a number of tokens"),
    ("afmoe", dict(layer_types=None, global_attn_every_n_layers=0),
     "global_attn_every_n_layers=0 is not supported"),
]


@pytest.mark.parametrize("family,changes,expected", FAMILY_REFUSALS)
def test_refuses_what_a_family_asks_for_and_moejax_does_not_model(family, changes, expected):
  hf = dict(hf_config_from(tiny_config(family)), **changes)
  with pytest.raises(CheckpointError) as info:
    config_from_hf(hf)
  assert expected in str(info.value) and "\n" not in str(info.value)


ALIASED_EXPERTS = {"olmoe": "num_local_experts", "mixtral": "num_experts",
                   "qwen3_moe": "num_local_experts", "minimax_m2": "num_experts",
                   "ernie4_5_moe": "num_experts", "glm4_moe": "num_local_experts",
                   "dots1": "num_local_experts", "deepseek_v3": "num_local_experts",
                   "glm4_moe_lite": "num_local_experts", "solar_open": "num_local_experts",
                   "minicpm5_moe": "num_local_experts", "hy_v3": "num_local_experts",
                   "sarvam_moe": "num_experts", "param2moe": "num_local_experts",
                   "flex_olmo": "num_local_experts", "mellum": "num_experts",
                   "kolibri1": "num_experts"}
DEFAULT_KV_HEADS = {"mixtral": 8, "qwen3_moe": 4, "minimax_m2": 8, "ernie4_5_moe": 4,
                    "glm4_moe": 8, "solar_open": 8, "minicpm5_moe": 2, "hy_v3": 8,
                    "granitemoe": None, "sarvam_moe": 4, "param2moe": 8, "olmoe": None,
                    "qwen2_moe": None, "afmoe": None, "mellum": 4, "flint": 4, "kolibri1": 4}


@pytest.mark.parametrize("family", sorted(ALIASED_EXPERTS))
def test_an_experts_alias_wins_as_transformers_lets_it(family):
  """Where transformers' attribute_map sends the alias to the experts field, a config.json that
  gives both builds the alias's count (checked against each config class in transformers
  5.25); export writes the field alone."""
  hf = hf_config_from(tiny_config(family))
  assert ALIASED_EXPERTS[family] not in hf
  assert config_from_hf(dict(hf, **{ALIASED_EXPERTS[family]: 16})).moe.num_experts == 16


@pytest.mark.parametrize("family", sorted(DEFAULT_KV_HEADS))
def test_absent_kv_heads_read_as_the_config_class_default(family):
  """No num_key_value_heads: the config class's default (transformers 5.25), else as many as the
  query heads; null: as many as the query heads."""
  hf = dict(hf_config_from(tiny_config(family)), num_attention_heads=16, hidden_size=128,
            head_dim=8)
  hf.pop("num_key_value_heads")
  want = DEFAULT_KV_HEADS[family]
  assert config_from_hf(hf).model.num_kv_heads == (want or 0)
  assert config_from_hf(dict(hf, num_key_value_heads=None)).model.num_kv_heads == 0


def test_a_null_field_reads_as_transformers_reads_it():
  """transformers declares norm_topk_prob `bool | None` and tests its truth: null is off (it was
  refused as "missing"); a null field moejax needs a value of says null, not missing."""
  cfg = tiny_config("deepseek_v3")
  assert cfg.moe.renormalize
  hf = dict(hf_config_from(cfg), norm_topk_prob=None)
  assert config_from_hf(hf).moe.renormalize is False
  with pytest.raises(CheckpointError, match="field 'hidden_size' is null"):
    config_from_hf(dict(hf, hidden_size=None))


YARN = {"model.rope_scaling": "yarn", "model.rope_factor": 4.0, "model.rope_original_max_len": 96,
        "model.rope_beta_fast": 16.0, "model.rope_mscale": 0.5, "model.rope_mscale_all_dim": 0.25,
        "model.rope_attention_factor": 1.5, "model.rope_truncate": False}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rope", ["plain", "yarn"])
def test_every_family_config_round_trips(family, rope):
  yarn = dict(YARN)
  if family == "mellum":     # transformers truncates Mellum's per-type YaRN always
    yarn["model.rope_truncate"] = True
  cfg = tiny_config(family, **{"moe.aux_loss_weight": 0.03, "model.rope_theta": 5e5},
                    **(yarn if rope == "yarn" else {}))
  hf = hf_config_from(cfg)
  assert MODEL_TYPES[hf["model_type"]] == family     # (Llama 4's text model: llama4_text)
  assert config_from_hf(hf, base=cfg) == cfg
  # in transformers 5's layout too (rope_parameters, kept when the base config has it)
  v5 = hf_config_from(cfg, base={**hf, "rope_parameters": {"rope_type": "default"}})
  assert "rope_parameters" in v5 and config_from_hf(v5, base=cfg) == cfg


def test_glm45_air_published_config_reads_as_the_air_preset():
  """GLM-4.5-Air's config.json as the Hub has it gives the air preset's model and routing; its
  multi-token-prediction layer (layer 46) is left out as transformers leaves it."""
  air = from_config_dict(FAMILY_CONFIGS["glm4_moe"].get_config("air"))
  hub = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
         "attention_bias": True, "attention_dropout": 0.0, "pad_token_id": 151329,
         "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
         "hidden_size": 4096, "partial_rotary_factor": 0.5, "initializer_range": 0.02,
         "intermediate_size": 10944, "max_position_embeddings": 131072,
         "moe_intermediate_size": 1408, "norm_topk_prob": True, "num_attention_heads": 96,
         "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
         "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
         "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
         "rope_scaling": None, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
         "use_qk_norm": False, "vocab_size": 151552}
  got = config_from_hf(hub, base=air)
  assert got.model == air.model and got.moe == air.moe
  from moejax.convert.hf_names import is_ignored
  assert is_ignored("model.layers.46.mlp.experts.3.up_proj.weight", got)
  assert not is_ignored("model.layers.45.mlp.experts.3.up_proj.weight", got)


def test_minimax_m2_published_config_reads_as_the_m2_preset():
  """MiniMax-M2's config.json fields (its legacy rotary_dim for the rotated width, the Hub code's
  routing and MTP fields) give the m2 preset's model and routing."""
  m2 = from_config_dict(FAMILY_CONFIGS["minimax_m2"].get_config("m2"))
  hub = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
         "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536,
         "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
         "head_dim": 128, "max_position_embeddings": 196608, "num_local_experts": 256,
         "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True,
         "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1,
         "use_qk_norm": True, "qk_norm_type": "per_layer", "rotary_dim": 64,
         "rope_theta": 5000000, "rms_norm_eps": 1e-06, "shared_intermediate_size": 0,
         "attn_type_list": [1] * 62, "router_aux_loss_coef": 0.001, "hidden_act": "silu",
         "tie_word_embeddings": False}
  got = config_from_hf(hub, base=m2)
  assert got.model == m2.model and got.moe == m2.moe
  # transformers' MiniMaxM2Config defaults (found by review: RoPE base 1e4 here was 0.55 of the
  # largest logit off, and a missing head_dim was refused on shapes)
  bare = {k: v for k, v in hub.items() if k not in ("rope_theta", "head_dim",
                                                     "router_aux_loss_coef")}
  got = config_from_hf(bare, base=m2)
  assert got.model == m2.model and got.moe == m2.moe
  # its export says it carries no MTP modules and no remote code
  out = hf_config_from(got, base=dict(hub, auto_map={"AutoConfig": "configuration.X"}))
  assert (out["use_mtp"], out["num_mtp_modules"], "auto_map" in out) == (False, 0, False)


def test_ernie_published_config_reads_as_the_a3b_preset():
  """ERNIE-4.5-21B-A3B's config.json fields give the a3b preset's model and routing; its
  multi-token-prediction tensors (names with "mtp") are left out as transformers leaves them."""
  a3b = from_config_dict(FAMILY_CONFIGS["ernie4_5_moe"].get_config("a3b"))
  hub = {"architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe",
         "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 12288,
         "max_position_embeddings": 131072, "num_attention_heads": 20,
         "num_key_value_heads": 4, "num_hidden_layers": 28, "rms_norm_eps": 1e-05,
         "vocab_size": 103424, "rope_theta": 500000, "use_bias": False,
         "tie_word_embeddings": True, "moe_num_experts": 64, "moe_num_shared_experts": 2,
         "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_layer_interval": 1,
         "moe_intermediate_size": 1536, "moe_k": 6, "num_nextn_predict_layers": 1}
  got = config_from_hf(hub, base=a3b)
  assert got.model == a3b.model and got.moe == a3b.moe
  # Found by review: transformers' attribute_map sends num_experts_per_tok to moe_k, so with both
  # given its value is used (moe_k's was: 0.13 of the largest logit off); no shared expert
  # exports; an export says it holds no MTP layer.
  assert config_from_hf(dict(hub, num_experts_per_tok=8)).moe.top_k == 8
  no_shared = config_from_hf(dict(hub, moe_num_shared_experts=0))
  out = hf_config_from(no_shared, base=hub)
  assert (out["moe_num_shared_experts"], out["num_nextn_predict_layers"]) == (0, None)
  assert config_from_hf(out) == no_shared
  from moejax.convert.hf_names import is_ignored
  assert is_ignored("model.mtp_block.0.self_attn.q_proj.weight", got)
  assert not is_ignored("model.layers.5.self_attn.q_proj.weight", got)


def test_dots1_published_config_reads_as_the_142b_preset():
  """dots.llm1's config.json fields (its null n_group / topk_group: no grouping) give the 142b
  preset's model and routing."""
  dots = from_config_dict(FAMILY_CONFIGS["dots1"].get_config("142b"))
  hub = {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "hidden_size": 4096,
         "num_hidden_layers": 62, "intermediate_size": 10944, "num_attention_heads": 32,
         "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "vocab_size": 152064,
         "first_k_dense_replace": 1, "moe_intermediate_size": 1408, "n_routed_experts": 128,
         "n_shared_experts": 2, "num_experts_per_tok": 6, "norm_topk_prob": True,
         "routed_scaling_factor": 2.5, "max_position_embeddings": 32768,
         "rope_theta": 10000000, "scoring_func": "sigmoid", "attention_bias": False,
         "tie_word_embeddings": False, "n_group": None, "topk_group": None,
         "sliding_window": None, "hidden_act": "silu"}
  got = config_from_hf(hub, base=dots)
  assert got.model == dots.model and got.moe == dots.moe
  # An export says which layers slide, whatever the base said: transformers' defaults (window
  # 4096 from layer 62 on) would make every layer past the 62nd slide.
  deep = dataclasses.replace(got, model=dataclasses.replace(got.model, num_layers=64))
  for base in (None, dict(hub, sliding_window=4096, max_window_layers=62)):
    out = hf_config_from(deep, base=base)
    assert out["sliding_window"] is None and set(out["layer_types"]) == {"full_attention"}
  # dots.llm1's rule for absent layer_types: from max_window_layers on, within sliding_window.
  slides = config_from_hf(dict(hub, sliding_window=512, max_window_layers=60))
  assert (slides.model.sliding_window, slides.model.sliding_layers) == (512, (60, 61))
  # sliding_window absent is Dots1Config's 4096, from max_window_layers (62) on; null is none
  deep_hub = dict({k: v for k, v in hub.items() if k != "sliding_window"}, num_hidden_layers=64)
  assert config_from_hf(deep_hub).model.sliding_layers == (62, 63)
  assert config_from_hf(dict(deep_hub, sliding_window=None)).model.sliding_layers == ()
  out = hf_config_from(slides)
  assert out["sliding_window"] == 512 and out["layer_types"][59:] == [
      "full_attention", "sliding_attention", "sliding_attention"]
  assert config_from_hf(out).model == slides.model


def test_glm47_flash_published_config_reads_as_the_flash_preset():
  """GLM-4.7-Flash's config.json (zai-org/GLM-4.7-Flash) gives the flash preset's model and
  routing: the dense first layer from transformers' mlp_layer_types default (the published
  first_k_dense_replace is what vLLM reads); no groups."""
  flash = from_config_dict(FAMILY_CONFIGS["glm4_moe_lite"].get_config("flash"))
  published = {
      "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite",
      "vocab_size": 154880, "hidden_size": 2048, "intermediate_size": 10240,
      "moe_intermediate_size": 1536, "num_hidden_layers": 47, "num_attention_heads": 20,
      "num_key_value_heads": 20, "hidden_act": "silu", "rms_norm_eps": 1e-5,
      "attention_dropout": 0.0, "attention_bias": False, "max_position_embeddings": 202752,
      "rope_theta": 1000000.0, "rope_scaling": None, "partial_rotary_factor": 1.0,
      "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
      "v_head_dim": 256, "n_routed_experts": 64, "n_shared_experts": 1, "num_experts_per_tok": 4,
      "norm_topk_prob": True, "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1,
      "topk_method": "noaux_tc", "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
      "tie_word_embeddings": False, "dtype": "bfloat16", "pad_token_id": 154820,
      "eos_token_id": [154820, 154827, 154829]}
  got = config_from_hf(published, base=flash)
  assert got.model == flash.model and got.moe == flash.moe
  # Dense layers anywhere import (transformers' list); an export needs them leading, as the
  # first_k_dense_replace it writes beside the list says.
  other = config_from_hf(dict(published, num_hidden_layers=3,
                              mlp_layer_types=["sparse", "dense", "sparse"]))
  assert other.model.dense_layers == (1,)
  with pytest.raises(CheckpointError, match="its dense layers lead"):
    hf_config_from(other)
  exported = hf_config_from(got, published)
  assert exported["mlp_layer_types"] == ["dense"] + ["sparse"] * 46
  assert exported["first_k_dense_replace"] == 1 and exported["num_nextn_predict_layers"] == 0


def test_solar_open_config_reads_as_the_open100b_preset():
  """transformers' SolarOpenConfig defaults (its docstring's upstage/Solar-Open-100B) give the
  open100b preset; experts in every layer whatever first_k_dense_replace says (transformers'
  SolarOpen has no such field), and an export neither writes it nor takes dense layers."""
  preset = from_config_dict(FAMILY_CONFIGS["solar_open"].get_config("open100b"))
  published = {
      "architectures": ["SolarOpenForCausalLM"], "model_type": "solar_open",
      "vocab_size": 196608, "hidden_size": 4096, "num_hidden_layers": 48,
      "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
      "moe_intermediate_size": 1280, "n_routed_experts": 128, "num_experts_per_tok": 8,
      "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
      "norm_topk_prob": True, "attention_bias": False, "hidden_act": "silu",
      "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
      "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
  got = config_from_hf(published, base=preset)
  assert got.model == preset.model and got.moe == preset.moe
  assert config_from_hf(dict(published, first_k_dense_replace=3)).model.dense_layers == ()
  exported = hf_config_from(got, dict(published, first_k_dense_replace=3, intermediate_size=7))
  assert "first_k_dense_replace" not in exported and "intermediate_size" not in exported
  dense = dataclasses.replace(got, model=dataclasses.replace(got.model, dense_layers=(0,),
                                                             dense_hidden=64))
  with pytest.raises(CheckpointError, match=r"model.dense_layers=\(0,\): .* needs \(\) \(experts "
                     "in every layer"):
    hf_config_from(dense)


def test_minicpm5_config_reads_as_the_15b_a2b_preset():
  """transformers' MiniCPM5MoeConfig defaults (its docstring's openbmb/MiniCPM5-15B-A2.5B) give
  the 15b_a2b preset: the output gate always on, the dense layers from mlp_layer_types, else
  from first_k_dense_replace (default 1) as its config class reads them; an export writes the
  list."""
  preset = from_config_dict(FAMILY_CONFIGS["minicpm5_moe"].get_config("15b_a2b"))
  published = {
      "architectures": ["MiniCPM5MoeForCausalLM"], "model_type": "minicpm5_moe",
      "vocab_size": 130560, "hidden_size": 2048, "intermediate_size": 8192,
      "num_hidden_layers": 28, "num_attention_heads": 32, "num_key_value_heads": 2,
      "head_dim": 128, "max_position_embeddings": 524288, "rms_norm_eps": 1e-6,
      "n_routed_experts": 160, "routed_scaling_factor": 3.66, "num_experts_per_tok": 16,
      "moe_intermediate_size": 512, "n_shared_experts": 1, "norm_topk_prob": True,
      "n_group": 1, "topk_group": 1, "hidden_act": "silu", "attention_bias": False,
      "tie_word_embeddings": False, "pad_token_id": 1, "eos_token_id": [1, 130073],
      "rope_parameters": {"rope_theta": 5000000.0, "rope_type": "default"}}
  got = config_from_hf(published, base=preset)
  assert got.model == preset.model and got.moe == preset.moe
  assert got.model.attention_gate and got.model.dense_layers == (0,)
  # routed_scaling_factor absent: MiniCPM5MoeConfig's 3.66, not GLM-4.5's 1.0
  unscaled = {k: v for k, v in published.items() if k != "routed_scaling_factor"}
  assert config_from_hf(unscaled).moe.routed_scale == 3.66
  assert config_from_hf(dict(published, first_k_dense_replace=3)).model.dense_layers == (0, 1, 2)
  listed = ["sparse"] * 27 + ["dense"]
  assert config_from_hf(dict(published, first_k_dense_replace=3,
                             mlp_layer_types=listed)).model.dense_layers == (27,)
  exported = hf_config_from(got, published)
  assert exported["mlp_layer_types"] == ["dense"] + ["sparse"] * 27
  # The Hub's checkpoints keep q_proj (twice as wide); transformers' fused layout q_gate_proj.
  assert hf_names.expected_shapes(got)["model.layers.0.self_attn.q_proj.weight"] == (
      2 * 32 * 128, 2048)
  fused = hf_names.expected_shapes(got, hf_names.FUSED)
  assert fused["model.layers.0.self_attn.q_gate_proj.weight"] == (2 * 32 * 128, 2048)
  ungated = dataclasses.replace(got, model=dataclasses.replace(got.model, attention_gate=False))
  with pytest.raises(CheckpointError, match="model.attention_gate=False: .* needs True"):
    hf_config_from(ungated)
  with pytest.raises(CheckpointError, match="model.attention_gate=True: .* needs False"):
    hf_config_from(tiny_config("qwen3_moe", **{"model.attention_gate": True}))


def test_hy3_config_reads_as_the_preview_preset():
  """transformers' HYV3Config defaults (its docstring's tencent/Hy3-preview) give the preview
  preset: the shared experts and routed scaling under Hy3's own names, always renormalized, no
  expert groups (n_group is not a Hy3 field: one given is not read, as transformers does not),
  the dense layers from mlp_layer_types (absent: the first); the multi-token-prediction layer
  after the last is not read; an export writes Hy3's names only."""
  preset = from_config_dict(FAMILY_CONFIGS["hy_v3"].get_config("preview"))
  published = {
      "architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3", "vocab_size": 120832,
      "hidden_size": 4096, "intermediate_size": 13312, "num_hidden_layers": 80,
      "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
      "hidden_act": "silu", "max_position_embeddings": 131072, "initializer_range": 0.006,
      "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False,
      "mlp_bias": False, "num_experts": 192, "num_experts_per_tok": 8,
      "num_shared_experts": 1, "moe_intermediate_size": 1536, "router_scaling_factor": 2.826,
      "enable_moe_fp32_combine": True,
      "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"}}
  got = config_from_hf(published, base=preset)
  assert got.model == preset.model and got.moe == preset.moe
  assert config_from_hf(dict(published, n_group=8, topk_group=4)).moe.expert_groups == 1
  exported = hf_config_from(got, published)
  assert exported["num_shared_experts"] == 1 and exported["router_scaling_factor"] == 2.826
  assert exported["mlp_layer_types"] == ["dense"] + ["sparse"] * 79
  assert not {"n_group", "topk_group", "n_shared_experts", "routed_scaling_factor"} & set(exported)
  assert hf_names.is_ignored("model.layers.80.mlp.router.gate.weight", got)
  assert not hf_names.is_ignored("model.layers.79.mlp.router.gate.weight", got)
  grouped = dataclasses.replace(got, moe=dataclasses.replace(got.moe, expert_groups=2))
  with pytest.raises(CheckpointError, match="moe.expert_groups=2: .* needs 1 \\(no expert groups"):
    hf_config_from(grouped)


def test_sliding_windows_read_as_each_family_slides():
  """Mixtral's sliding_window covers every layer (its export writes the window alone, and
  refuses a window over some layers only); EXAONE-MoE's layers slide as layer_types says, else
  all but every sliding_window_pattern-th, and with a window its full layers are unrotated
  (transformers' NoPE), without one every layer is rotated and none slides; a family transformers
  never slides refuses a window."""
  mixtral = config_from_hf(dict(hf_config_from(tiny_config("mixtral")), sliding_window=64))
  assert (mixtral.model.sliding_window, mixtral.model.sliding_layers) == (64, (0, 1))
  assert "layer_types" not in hf_config_from(mixtral)
  some = dataclasses.replace(mixtral, model=dataclasses.replace(mixtral.model,
                                                                sliding_layers=(1,)))
  with pytest.raises(CheckpointError, match=r"model.sliding_layers=\(1,\): .* needs \(0, 1\) "
                     r"\(its sliding window covers every layer"):
    hf_config_from(some)
  hf = dict(hf_config_from(tiny_config("exaone_moe")), num_hidden_layers=9, layer_types=None,
            mlp_layer_types=None, sliding_window=16, sliding_window_pattern=4)
  got = config_from_hf(hf).model
  assert (got.sliding_window, got.sliding_layers, got.nope_layers) == (
      16, (0, 1, 2, 4, 5, 6, 8), (3, 7))
  listed = ["full_attention", "sliding_attention"] * 4 + ["full_attention"]
  got = config_from_hf(dict(hf, layer_types=listed)).model
  assert (got.sliding_layers, got.nope_layers) == ((1, 3, 5, 7), (0, 2, 4, 6, 8))
  assert hf_config_from(dataclasses.replace(tiny_config("exaone_moe"), model=got))[
      "layer_types"] == listed
  # No layer slides: every layer unrotated (transformers' NoPE keys on the window's presence,
  # and EXAONE's config always has one: absent 4096, null refused); the export says so again.
  full = dict(hf, layer_types=["full_attention"] * 9)
  plain = config_from_hf(full).model
  assert (plain.sliding_window, plain.sliding_layers, plain.nope_layers) == (
      0, (), tuple(range(9)))
  out = hf_config_from(dataclasses.replace(tiny_config("exaone_moe"), model=plain), full)
  assert out["sliding_window"] == 16 and config_from_hf(out).model == plain
  absent = {k: v for k, v in hf.items() if k != "sliding_window"}
  assert config_from_hf(absent).model.sliding_window == 4096
  with pytest.raises(CheckpointError, match="sliding_window=None is not supported: "
                     "ExaoneMoeForCausalLM's sliding layers need a number"):
    config_from_hf(dict(hf, sliding_window=None))
  rotated = dataclasses.replace(tiny_config("exaone_moe"), model=dataclasses.replace(
      got, nope_layers=()))
  with pytest.raises(CheckpointError, match="model.nope_layers=\\(\\): .* needs \\(0, 2, 4, 6, 8\\)"):
    hf_config_from(rotated)
  with pytest.raises(CheckpointError, match="model.sliding_window=64: .* needs 0 \\(no sliding"):
    hf_config_from(dataclasses.replace(mixtral, model=dataclasses.replace(
        mixtral.model, family="qwen3_moe", qk_norm="head")))


def test_sarvam_and_param2_configs_read_as_their_presets():
  """transformers' SarvamMoEConfig and Param2MoeConfig defaults give the 30b and 17b_a2b
  presets: QK-norm on and whole heads rotated when the fields are absent (GLM-4.5 would read
  neither so), Param2 tied; Sarvam's original field names (num_experts, num_shared_experts,
  use_qkv_bias) win over the fields as transformers' attribute_map lets them, and exports
  write the fields alone."""
  sarvam = from_config_dict(FAMILY_CONFIGS["sarvam_moe"].get_config("30b"))
  published = {
      "architectures": ["SarvamMoEForCausalLM"], "model_type": "sarvam_moe",
      "vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 8192,
      "num_hidden_layers": 19, "num_attention_heads": 64, "num_key_value_heads": 4,
      "head_dim": 64, "initializer_range": 0.006, "rms_norm_eps": 1e-6,
      "moe_intermediate_size": 1024, "num_experts_per_tok": 6, "num_experts": 128,
      "num_shared_experts": 1, "use_qkv_bias": False, "routed_scaling_factor": 2.5,
      "first_k_dense_replace": 1, "hidden_act": "silu", "rope_theta": 8000000.0}
  got = config_from_hf(published, base=sarvam)
  assert got.model == sarvam.model and got.moe == sarvam.moe
  aliased = config_from_hf(dict(published, n_routed_experts=64, n_shared_experts=3,
                                use_qkv_bias=True, attention_bias=False))
  assert (aliased.moe.num_experts, aliased.moe.shared_expert_hidden // 1024,
          aliased.model.qkv_bias) == (128, 1, True)
  exported = hf_config_from(got, published)
  assert not {"num_experts", "num_shared_experts", "use_qkv_bias"} & set(exported)
  assert (exported["n_routed_experts"], exported["architectures"]) == (
      128, ["Glm4MoeForCausalLM"])
  param2 = from_config_dict(FAMILY_CONFIGS["param2moe"].get_config("17b_a2b"))
  got = config_from_hf({"model_type": "param2moe", "vocab_size": 128000, "hidden_size": 2048,
                        "intermediate_size": 9216, "num_hidden_layers": 21,
                        "num_attention_heads": 32, "moe_intermediate_size": 2048,
                        "n_routed_experts": 64, "num_experts_per_tok": 6}, base=param2)
  assert got.model == param2.model and got.moe == param2.moe


def test_hunyuan_reads_its_rope_lists_and_shared_mlp():
  """Hunyuan-A13B: NTK-alpha RoPE ("dynamic" with a fixed alpha) is plain RoPE of base
  theta * alpha^(d / (d - 2)), per-layer lists of one value read as it, the shared MLP as wide
  as the experts (both intermediate_size), QK-norm after RoPE; an export writes one value each
  and needs the shared MLP the experts' width."""
  hf = dict(hf_config_from(tiny_config("hunyuan_v1_moe")), num_experts=8, moe_topk=[2, 2],
            moe_intermediate_size=[64, 64], num_shared_expert=[1, 1],
            rope_scaling={"type": "dynamic", "alpha": 1000.0, "factor": 1.0})
  hf.pop("rope_parameters", None)
  got = config_from_hf(hf)
  assert got.model.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14))
  assert (got.moe.top_k, got.moe.shared_expert_hidden, got.model.qk_norm_after_rope) == (
      2, 64, True)
  out = hf_config_from(got, hf)
  assert (out["moe_topk"], out["moe_intermediate_size"], out["num_shared_expert"]) == (2, 64, 1)
  narrow = dataclasses.replace(got, moe=dataclasses.replace(got.moe, shared_expert_hidden=32))
  with pytest.raises(CheckpointError, match="moe.shared_expert_hidden=32: .* needs 64"):
    hf_config_from(narrow)
  with pytest.raises(CheckpointError, match="model.qk_norm_after_rope=True: .* needs False"):
    hf_config_from(tiny_config("qwen3_moe", **{"model.qk_norm_after_rope": True}))


def test_norm_positions_are_each_family_s_own():
  """FlexOlmo's norms sit on the sublayers' outputs (post_attention_ and
  post_feedforward_layernorm); another family's pre-norms cannot export as FlexOlmo, nor
  FlexOlmo's post-norms as another family."""
  cfg = config_from_hf(hf_config_from(tiny_config("flex_olmo")))
  assert cfg.model.norm_position == "post"
  names = hf_names.expected_shapes(cfg)
  assert {"model.layers.0.post_attention_layernorm.weight",
          "model.layers.0.post_feedforward_layernorm.weight"} <= set(names)
  assert "model.layers.0.input_layernorm.weight" not in names
  with pytest.raises(CheckpointError, match="model.norm_position='pre': .* needs 'post'"):
    hf_config_from(tiny_config("flex_olmo", **{"model.norm_position": "pre"}))
  with pytest.raises(CheckpointError, match="model.norm_position='post': .* needs 'pre'"):
    hf_config_from(tiny_config("olmoe", **{"model.norm_position": "post"}))


def test_afmoe_reads_its_names_pattern_and_mup():
  """AfMoE: sandwich norms (input_ / pre_mlp_layernorm in, post_attention_ / post_mlp_layernorm
  out), the gate's own gate_proj, the router's router.gate and expert_bias, num_dense_layers,
  num_shared_experts, route_scale; absent layer_types, every global_attn_every_n_layers-th layer
  global and unrotated; mup_enabled scales the embedding by sqrt(hidden_size), and an export
  takes only that scale or none."""
  cfg = tiny_config("afmoe", **{"moe.routed_scale": 1.5})
  hf = hf_config_from(cfg)
  assert (hf["num_dense_layers"], hf["num_shared_experts"], hf["route_scale"],
          hf["mup_enabled"]) == (1, 2, 1.5, False)
  assert "first_k_dense_replace" not in hf and "n_shared_experts" not in hf
  names = set(hf_names.expected_shapes(cfg))
  layer = "model.layers.1"
  assert {f"{layer}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm",
                                          "pre_mlp_layernorm", "post_mlp_layernorm",
                                          "self_attn.gate_proj", "mlp.router.gate")} <= names
  assert f"{layer}.mlp.expert_bias" in names
  assert hf_names.expected_shapes(cfg)[f"{layer}.self_attn.q_proj.weight"] == (64, 64)
  six = dict(hf, num_hidden_layers=6, layer_types=None, global_attn_every_n_layers=2,
             sliding_window=16, mup_enabled=True)
  got = config_from_hf(six).model
  assert (got.sliding_window, got.sliding_layers, got.nope_layers) == (16, (0, 2, 4), (1, 3, 5))
  assert got.embed_scale == 8.0 and (got.norm_position, got.attention_gate_own) == (
      "sandwich", True)
  back = hf_config_from(dataclasses.replace(cfg, model=got))
  assert back["mup_enabled"] is True and config_from_hf(back).model == got
  with pytest.raises(CheckpointError, match=r"model.embed_scale=2.0: .* sqrt\(d_model\)"):
    hf_config_from(tiny_config("afmoe", **{"model.embed_scale": 2.0}))
  with pytest.raises(CheckpointError, match="model.attention_gate_own=False: .* needs True"):
    hf_config_from(tiny_config("afmoe", **{"model.attention_gate_own": False}))
  with pytest.raises(CheckpointError, match="model.norm_position='post': .* needs 'sandwich'"):
    hf_config_from(tiny_config("afmoe", **{"model.norm_position": "post"}))
  with pytest.raises(CheckpointError, match="model.attention_gate_own=True: .* needs False"):
    hf_config_from(tiny_config("minicpm5_moe", **{"model.attention_gate_own": True}))


def test_mellum_reads_rope_per_layer_type_and_dense_layers_anywhere():
  """Mellum's rope_parameters hold one dict per layer type: the full layers' RoPE is the model's
  (YaRN too), the sliding layers' plain RoPE of its own base is model.sliding_rope_theta (the
  same dict as the full layers': 0, one RoPE); absent, its config class's bases 500000 and
  10000. Its dense layers sit anywhere (mlp_layer_types, absent: none); exports write both
  back, and no MTP layer."""
  cfg = tiny_config("mellum")
  hf = hf_config_from(cfg)
  assert hf["rope_parameters"] == {
      "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
  assert "rope_theta" not in hf and hf["num_local_experts"] == 8
  assert (hf["mlp_layer_types"], hf["intermediate_size"]) == (
      ["sparse", "dense", "sparse", "sparse"], 128)
  assert hf["num_nextn_predict_layers"] is None and config_from_hf(hf, base=cfg) == cfg
  default = {k: v for k, v in hf.items() if k not in ("rope_parameters", "mlp_layer_types")}
  got = config_from_hf(default).model
  assert (got.rope_theta, got.sliding_rope_theta, got.dense_layers) == (500000.0, 10000.0, ())
  same = dict(hf, rope_parameters={t: {"rope_type": "default", "rope_theta": 1e6}
                                   for t in ("full_attention", "sliding_attention")})
  assert config_from_hf(same).model.sliding_rope_theta == 0.0
  yarn = tiny_config("mellum", **{"model.sliding_rope_theta": 0.0, **YARN,
                                  "model.rope_truncate": True})
  out = hf_config_from(yarn)["rope_parameters"]
  assert out["sliding_attention"] == out["full_attention"]
  assert out["full_attention"]["rope_type"] == "yarn" and config_from_hf(
      hf_config_from(yarn), base=yarn) == yarn
  full_only = dict(hf, layer_types=None, rope_parameters={
      "full_attention": {"rope_type": "default", "rope_theta": 1e6}, "sliding_attention": None})
  got = config_from_hf(full_only).model
  assert (got.sliding_layers, got.sliding_rope_theta, got.rope_theta) == ((), 0.0, 1e6)
  # transformers takes YaRN's original context from the type's dict (never the top level) and
  # always truncates (it reads truncate from the outer dict)
  yarn_hf = dict(hf, original_max_position_embeddings=4, rope_parameters={
      "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                         "original_max_position_embeddings": 64, "truncate": False},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
  got = config_from_hf(yarn_hf).model
  assert (got.rope_original_max_len, got.rope_truncate, got.sliding_rope_theta) == (64, True, 1e4)
  with pytest.raises(CheckpointError, match="model.rope_truncate=False: .* needs True"):
    hf_config_from(tiny_config("mellum", **YARN))
  with pytest.raises(CheckpointError, match="model.sliding_rope_theta=10000.0: .* needs 0.0"):
    hf_config_from(tiny_config("exaone_moe", **{"model.sliding_rope_theta": 10000.0}))


def test_granite_swa_reads_a_rope_base_per_layer_and_sinks():
  """Granite SWA: layer_rope_theta's global layers' base is the model's, the sliding layers'
  their own (the same: 0), 0 unrotated (any layer); absent, the RoPE dict's for all; absent
  layer_types, every 4th layer from 0 global; sinks always, exported with the per-layer list."""
  cfg = tiny_config("granitemoe_swa")
  hf = hf_config_from(cfg)
  assert hf["layer_rope_theta"] == [0.0, 10000.0, 10000.0, 10000.0]
  assert hf["layer_types"] == ["full_attention"] + ["sliding_attention"] * 3
  assert config_from_hf(hf, base=cfg) == cfg
  assert "model.layers.3.self_attn.sinks" in hf_names.expected_shapes(cfg)
  six = dict(hf, num_hidden_layers=6, layer_types=None,
             layer_rope_theta=[5e5, 1e4, 0, 1e4, 5e5, 1e4])
  got = config_from_hf(six).model
  assert (got.sliding_layers, got.nope_layers, got.rope_theta, got.sliding_rope_theta) == (
      (1, 2, 3, 5), (2,), 5e5, 1e4)
  assert hf_config_from(dataclasses.replace(cfg, model=got))["layer_rope_theta"] == [
      5e5, 1e4, 0.0, 1e4, 5e5, 1e4]
  plain = config_from_hf({k: v for k, v in six.items() if k != "layer_rope_theta"}).model
  assert (plain.nope_layers, plain.sliding_rope_theta) == ((), 0.0)
  with pytest.raises(CheckpointError, match="model.attention_sinks=False: .* needs True"):
    hf_config_from(tiny_config("granitemoe_swa", **{"model.attention_sinks": False}))
  # transformers scales every layer's base by the model's YaRN: no plain base of their own for
  # rotated sliding layers; no sliding layer at all still writes a window (its model builds the
  # sliding mask whatever the layers)
  with pytest.raises(CheckpointError, match="model.sliding_rope_theta=5000.0: .* needs 0.0"):
    hf_config_from(tiny_config("granitemoe_swa", **YARN, **{"model.sliding_rope_theta": 5e3}))
  none_slide = tiny_config("granitemoe_swa", **{"model.sliding_window": 0,
                                                "model.sliding_layers": ()})
  assert hf_config_from(none_slide)["sliding_window"] == 128
  with pytest.raises(CheckpointError, match="model.attention_sinks=True: .* needs False"):
    hf_config_from(tiny_config("granitemoeshared", **{"model.attention_sinks": True}))


def test_flint_reads_its_layer_rules_sinks_and_ungated_shared_expert():
  """Flint: absent layer_types, layers 0, 1, every 4th from 1 and the last global, unrotated,
  the rest sliding and rotated; no window, every layer global and unrotated (transformers
  rotates only where a layer slides); absent or null mlp_only_layers, the first two dense;
  the Hub's sinks are self_attn.softmax_offset; the shared expert has no gate; the router is
  kept in float32, as transformers keeps it."""
  from moejax.models import olmoe
  from moejax.sharding import axes
  cfg = tiny_config("flint")
  hf = hf_config_from(cfg)
  assert config_from_hf(hf).moe.router_float32
  assert olmoe.param_meta(cfg)["layers"]["moe"]["router"].group == axes.ROUTER_FP32
  assert olmoe.param_meta(tiny_config("qwen3_moe"))["layers"]["moe"]["router"].group == (
      axes.ROUTER)
  assert hf["mlp_only_layers"] == [0, 1] and "shared_expert_intermediate_size" in hf
  assert config_from_hf(hf, base=cfg) == cfg
  names = hf_names.expected_shapes(cfg)
  assert "model.layers.2.self_attn.softmax_offset" in names
  assert "model.layers.2.mlp.shared_expert.gate_proj.weight" in names
  assert not any("shared_expert_gate" in n for n in names)
  nine = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_only_layers")}
  nine.update(num_hidden_layers=9, sliding_window=16)
  got = config_from_hf(nine).model
  assert (got.sliding_layers, got.nope_layers, got.dense_layers) == (
      (2, 3, 4, 6, 7), (0, 1, 5, 8), (0, 1))
  assert config_from_hf(dict(nine, mlp_only_layers=[])).model.dense_layers == ()
  unwindowed = config_from_hf(dict(nine, sliding_window=None)).model
  assert (unwindowed.sliding_layers, unwindowed.nope_layers) == ((), tuple(range(9)))
  # FlintConfig types the window int: the export gives one, its layers all global
  back = hf_config_from(dataclasses.replace(cfg, model=unwindowed))
  assert back["sliding_window"] == 513 and config_from_hf(back).model == unwindowed
  with pytest.raises(CheckpointError, match="moe.shared_expert_gate=True: .* needs False"):
    hf_config_from(tiny_config("flint", **{"moe.shared_expert_gate": True}))


def test_kolibri_reads_its_layer_rule_names_and_logit_bias():
  """Kolibri: absent layer_types, every 5th layer global and unrotated; without a window no layer
  slides and every layer rotates; the Hub's output norms post_attn_norm / post_ffn_norm and its
  score bias moe.router.expert_bias (transformers' post_self_attn_layernorm, post_mlp_layernorm,
  mlp.gate.e_score_correction_bias); the bias joins the logits, which an export requires."""
  cfg = tiny_config("kolibri1")
  hf = hf_config_from(cfg)
  assert config_from_hf(hf, base=cfg) == cfg and cfg.moe.score_bias_on_logits
  hub, fused = hf_names.expected_shapes(cfg), hf_names.expected_shapes(cfg, hf_names.FUSED)
  for name in ("post_attn_norm.weight", "post_ffn_norm.weight", "moe.router.expert_bias",
               "post_attention_layernorm.weight"):
    assert f"model.layers.1.{name}" in hub
  for name in ("post_self_attn_layernorm.weight", "post_mlp_layernorm.weight",
               "mlp.gate.e_score_correction_bias"):
    assert f"model.layers.1.{name}" in fused
  ten = dict(hf, num_hidden_layers=10, layer_types=None, sliding_window=64)
  got = config_from_hf(ten).model
  assert (got.sliding_layers, got.nope_layers) == ((0, 1, 2, 3, 5, 6, 7, 8), (4, 9))
  plain = config_from_hf(dict(ten, sliding_window=None)).model
  assert (plain.sliding_layers, plain.nope_layers) == ((), ())
  # ... which transformers cannot run (its model builds the sliding mask whatever the layers),
  # nor export: with a window and every layer global, every layer is unrotated
  with pytest.raises(CheckpointError, match=r"model.nope_layers=\(\): .* needs \(0, 1, "):
    hf_config_from(dataclasses.replace(cfg, model=plain))
  global_only = config_from_hf(dict(ten, layer_types=["full_attention"] * 10)).model
  assert (global_only.sliding_layers, global_only.nope_layers) == ((), tuple(range(10)))
  back = hf_config_from(dataclasses.replace(cfg, model=global_only))
  assert back["sliding_window"] == 513 and config_from_hf(back).model == global_only
  with pytest.raises(CheckpointError, match="moe.score_bias_on_logits=False: .* needs True"):
    hf_config_from(tiny_config("kolibri1", **{"moe.score_bias_on_logits": False}))
  with pytest.raises(CheckpointError, match="moe.score_bias_on_logits=True: .* needs False"):
    hf_config_from(tiny_config("deepseek_v3", **{"moe.score_bias_on_logits": True}))


# gpt-oss-20b's config.json as the Hub has it (openai/gpt-oss-20b)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {
        "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


def test_gpt_oss_reads_its_biases_layer_rule_default_yarn_and_mxfp4():
  """gpt-oss: the Hub's 20b config.json reads as the 20b preset (its MXFP4 experts declared;
  its router_aux_loss_coef 0.9 taken as given); attention_bias biases q, k, v and o alike
  (off: none); absent layer_types, every other layer from 0 slides; absent RoPE dicts, its config
  class's YaRN (x32 from 4096, untruncated, base 150000); absent swiglu_alpha / swiglu_limit,
  1.702 / 7.0; the tensors under transformers' names, gate and up interleaved [in, out]; an
  export of plain RoPE says so (no dict would read as the class's YaRN); and the options no other
  family holds are refused on their export."""
  preset = from_config_dict(FAMILY_CONFIGS["gpt_oss"].get_config("20b"))
  got = config_from_hf(GPT_OSS_20B, base=preset)
  assert got.model == preset.model
  assert got.moe == dataclasses.replace(preset.moe, aux_loss_weight=0.9)
  assert weight_scales(GPT_OSS_20B) is safetensors_io.MXFP4_SCALES
  assert quantization_summary(GPT_OSS_20B) == "MXFP4 experts (FP4 per 32 values)"
  assert "quantization_config" not in hf_config_from(got)
  # exported onto the Hub's config.json: its copy of the top-k follows the model's
  two = dataclasses.replace(got, moe=dataclasses.replace(got.moe, top_k=2))
  assert hf_config_from(two, GPT_OSS_20B)["experts_per_token"] == 2
  cfg = tiny_config("gpt_oss")
  # no layer slides: a window all the same (transformers' GptOssModel builds the sliding mask
  # whatever the layers, and fails on a null window)
  unwindowed = tiny_config("gpt_oss", **{"model.sliding_window": 0, "model.sliding_layers": ()})
  back = hf_config_from(unwindowed)
  assert back["sliding_window"] == 128 and set(back["layer_types"]) == {"full_attention"}
  assert config_from_hf(back, base=unwindowed) == unwindowed
  hf = hf_config_from(cfg)
  assert hf["attention_bias"] and config_from_hf(hf, base=cfg) == cfg
  unbiased = config_from_hf(dict(hf, attention_bias=False)).model
  assert not unbiased.qkv_bias and not unbiased.attention_out_bias
  six = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters",
                                                   "rope_scaling", "rope_theta",
                                                   "swiglu_alpha", "swiglu_limit")}
  six["num_hidden_layers"] = 6
  got = config_from_hf(six)
  assert got.model.sliding_layers == (0, 2, 4) and got.model.nope_layers == ()
  assert (got.model.rope_scaling, got.model.rope_factor, got.model.rope_original_max_len,
          got.model.rope_truncate, got.model.rope_theta) == ("yarn", 32.0, 4096, False, 150000.0)
  assert (got.moe.swiglu_alpha, got.moe.swiglu_limit) == (1.702, 7.0)
  plain = tiny_config("gpt_oss", **{"model.rope_scaling": "none", "model.rope_factor": 1.0,
                                    "model.rope_original_max_len": 0,
                                    "model.rope_truncate": True})
  back = hf_config_from(plain)
  assert back["rope_parameters"]["rope_type"] == "default" and back["rope_scaling"] is None
  assert config_from_hf(back, base=plain) == plain
  shapes = hf_names.expected_shapes(cfg)
  e, d, f = cfg.moe.num_experts, cfg.model.d_model, cfg.moe.expert_hidden
  assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (e, d, 2 * f)
  assert shapes["model.layers.1.mlp.experts.gate_up_proj_bias"] == (e, 2 * f)
  assert shapes["model.layers.1.mlp.experts.down_proj"] == (e, f, d)
  assert shapes["model.layers.1.mlp.experts.down_proj_bias"] == (e, d)
  for name in ("mlp.router.weight", "mlp.router.bias", "self_attn.o_proj.bias",
               "self_attn.sinks"):
    assert f"model.layers.1.{name}" in shapes
  assert shapes == hf_names.expected_shapes(cfg, hf_names.FUSED)
  for family, field, value, why in (
      ("gpt_oss", "moe.activation", "swiglu", "needs 'swiglu_clamped'"),
      ("gpt_oss", "model.attention_out_bias", False, "needs True"),
      ("olmoe", "moe.expert_bias", True, "needs False"),
      ("qwen2_moe", "moe.router_bias", True, "needs False"),
      ("qwen2_moe", "model.attention_out_bias", True, "needs False")):
    with pytest.raises(CheckpointError, match=f"config.{field}={value!r}: .* {why}"):
      hf_config_from(tiny_config(family, **{field: value}))


def test_cohere2_reads_its_layer_rules_norms_router_and_combination():
  """Cohere2-MoE: absent layer_types and mlp_layer_types, the first first_k_dense_replace layers
  dense, sliding but every prefix_dense_sliding_window_pattern-th, the rest but every
  sliding_window_pattern-th; the full layers unrotated but the dense ones where the prefix
  pattern is 1; LayerNorm unless rms_norm_eps; softmax always renormalized (over the top-k
  logits), sigmoids where norm_topk_prob says; the shared experts averaged (0.5 and 0.5) or
  summed; logit_scale as a divisor; what an export cannot say is refused."""
  cfg = tiny_config("cohere2_moe")
  hf = hf_config_from(cfg)
  assert config_from_hf(hf, base=cfg) == cfg
  assert hf["rms_norm_eps"] is None and hf["logit_scale"] == 1 / 4
  assert hf["shared_expert_combination_strategy"] == "average"
  names = hf_names.expected_shapes(cfg)
  assert "model.layers.1.input_layernorm.weight" in names
  assert not any("post_attention_layernorm" in n for n in names)
  eight = {k: v for k, v in hf.items() if k not in ("layer_types", "mlp_layer_types")}
  eight.update(num_hidden_layers=8, first_k_dense_replace=2, sliding_window_pattern=4,
               prefix_dense_sliding_window_pattern=1)
  got = config_from_hf(eight).model
  assert (got.dense_layers, got.sliding_layers, got.nope_layers) == (
      (0, 1), (2, 3, 4, 6, 7), (5,))
  got = config_from_hf(dict(eight, prefix_dense_sliding_window_pattern=2)).model
  assert (got.sliding_layers, got.nope_layers) == ((0, 2, 3, 4, 6, 7), (1, 5))
  rms = config_from_hf(dict(hf, rms_norm_eps=1e-6)).model
  assert (rms.norm_kind, rms.norm_eps) == ("rms", 1e-6)
  assert config_from_hf(dict(hf, layer_norm_eps=1e-3)).model.norm_eps == 1e-3
  summed = config_from_hf(dict(hf, shared_expert_combination_strategy="sum")).moe
  assert (summed.routed_scale, summed.shared_expert_scale) == (1.0, 1.0)
  alone = config_from_hf(dict(hf, num_shared_experts=0)).moe
  assert (alone.routed_scale, alone.shared_expert_scale, alone.shared_expert_hidden) == (
      1.0, 1.0, 0)
  assert config_from_hf(dict(hf, norm_topk_prob=False)).moe.renormalize
  sig = config_from_hf(dict(hf, expert_selection_fn="sigmoid", norm_topk_prob=False)).moe
  assert (sig.score, sig.renormalize) == ("sigmoid", False)
  for changes, expected in ((dict(expert_selection_fn="relu"), "expert_selection_fn='relu'"),
                            (dict(shared_expert_combination_strategy="max"),
                             "shared_expert_combination_strategy='max'"),
                            (dict(logit_scale=0.0), "logit_scale=0.0")):
    with pytest.raises(CheckpointError, match=expected):
      config_from_hf(dict(hf, **changes))
  # the dense layer global and unrotated: the export says prefix pattern 2
  unrotated = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                 nope_layers=(0, 3)))
  back = hf_config_from(unrotated)
  assert back["prefix_dense_sliding_window_pattern"] == 2
  assert config_from_hf(back, base=unrotated) == unrotated
  # no layer slides: a window all the same (transformers builds the sliding mask whatever the
  # layers, and fails on a null window)
  unwindowed = dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, sliding_window=0, sliding_layers=(), nope_layers=(1, 2, 3)))
  back = hf_config_from(unwindowed)
  assert back["sliding_window"] == 4096 and set(back["layer_types"]) == {"full_attention"}
  assert config_from_hf(back, base=unwindowed) == unwindowed
  # a logit scale whose reciprocal is inexact reads back as written, both ways
  for divisor in (49.0, 3.0, 0.3):
    scaled = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, logit_divisor=divisor))
    assert config_from_hf(hf_config_from(scaled), base=scaled) == scaled
  assert config_from_hf(dict(hf, logit_scale=0.3)).model.logit_divisor * 0.3 == pytest.approx(1)
  assert hf_config_from(config_from_hf(dict(hf, logit_scale=0.3)))["logit_scale"] == 0.3
  with pytest.raises(CheckpointError, match="prefix_dense_intermediate_size=0"):
    config_from_hf(dict(hf, prefix_dense_intermediate_size=0))
  # its config class keeps rope_scaling apart and runs rope_parameters alone (found by review:
  # a YaRN export without a base wrote rope_scaling only, which transformers ran as plain RoPE)
  yarn = tiny_config("cohere2_moe", **{"model.rope_scaling": "yarn", "model.rope_factor": 4.0,
                                        "model.rope_original_max_len": 64})
  out = hf_config_from(yarn)
  assert out["rope_parameters"]["rope_type"] == "yarn" and config_from_hf(out, base=yarn) == yarn
  ignored = dict(out, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  assert config_from_hf(ignored).model.rope_scaling == "none"
  for family, overrides, match in (
      ("cohere2_moe", {"moe.shared_expert_scale": 1.0}, "routed_scale=0.5, shared_expert_scale"),
      ("cohere2_moe", {"model.nope_layers": (1, 3)}, r"model.nope_layers=\(1, 3\)"),
      ("olmoe", {"model.norm_kind": "layer"}, "model.norm_kind='layer'"),
      ("qwen2_moe", {"moe.shared_expert_scale": 0.5}, "moe.shared_expert_scale=0.5"),
      ("olmoe", {"model.norm_position": "parallel"}, "model.norm_position='parallel'")):
    with pytest.raises(CheckpointError, match=match):
      hf_config_from(tiny_config(family, **overrides))


def test_granite_multipliers_read_and_write():
  """Granite's embedding_multiplier, residual_multiplier, attention_multiplier (the softmax
  scale itself) and logits_scaling, 1.0 each when absent as transformers reads them; an export
  of moejax's default softmax scale writes it as 1/sqrt(head_dim); shared_intermediate_size is
  granitemoeshared's ungated shared MLP (0: none); another family holds no multiplier."""
  hf = hf_config_from(tiny_config("granitemoe"))
  assert (hf["embedding_multiplier"], hf["residual_multiplier"], hf["attention_multiplier"],
          hf["logits_scaling"]) == (4.0, 0.5, 0.0625, 2.0)
  for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
              "logits_scaling"):
    hf.pop(key)
  m = config_from_hf(hf).model
  assert (m.embed_scale, m.residual_scale, m.attention_scale, m.logit_divisor) == (1, 1, 1, 1)
  default = tiny_config("granitemoe", **{"model.attention_scale": 0.0})
  assert hf_config_from(default)["attention_multiplier"] == 16 ** -0.5
  shared = config_from_hf(hf_config_from(tiny_config("granitemoeshared"))).moe
  assert (shared.shared_expert_hidden, shared.shared_expert_gate) == (64, False)
  hf = hf_config_from(tiny_config("granitemoeshared"))
  assert config_from_hf(dict(hf, shared_intermediate_size=0)).moe.shared_expert_hidden == 0
  with pytest.raises(CheckpointError, match="model.residual_scale=0.5: .* needs 1.0 \\(no such "
                     "multiplier"):
    hf_config_from(tiny_config("mixtral", **{"model.residual_scale": 0.5}))
  with pytest.raises(CheckpointError, match="moe.shared_expert_hidden=64: .*granitemoe.* needs 0"):
    hf_config_from(tiny_config("granitemoe", **{"moe.shared_expert_hidden": 64}))


def test_partial_rotary_exports_read_back_as_the_same_width():
  """rotary_dim / head_dim can sit just below the factor transformers reads back as that width
  (int(100 * 0.58) = 57: it rotated 57 dims, and moejax refused its own export); found by
  review."""
  for head_dim, rotary_dim in ((100, 58), (44, 30), (16, 8)):
    cfg = tiny_config("glm4_moe", **{"model.head_dim": head_dim, "model.rotary_dim": rotary_dim})
    hf = hf_config_from(cfg)
    assert int(head_dim * hf["partial_rotary_factor"]) == rotary_dim
    assert config_from_hf(hf).model.rotary_dim == rotary_dim


def test_deepseek_v2_lite_published_config_reads_as_the_lite_preset():
  """DeepSeek-V2-Lite's config.json as the Hub has it (transformers 4 names, the Hub code's
  routing fields) gives the lite preset's model and routing."""
  lite = from_config_dict(FAMILY_CONFIGS["deepseek_v2"].get_config("lite"))
  hub = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
         "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
         "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
         "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
         "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
         "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
         "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
         "scoring_func": "softmax", "aux_loss_alpha": 0.001, "seq_aux": True,
         "hidden_act": "silu", "max_position_embeddings": 163840, "initializer_range": 0.02,
         "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 10000,
         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                          "type": "yarn"},
         "attention_bias": False, "attention_dropout": 0.0, "torch_dtype": "bfloat16"}
  got = config_from_hf(hub, base=lite)
  assert got.model == lite.model and got.moe == lite.moe


def test_rope_fields_read_and_written_as_transformers_5_reads_them():
  """Found by review, each a silent RoPE different from transformers': a transformers 5 config
  with YaRN added under rope_scaling (transformers reads rope_scaling first: it ran plain RoPE
  here, 0.81 of the largest logit off); a null truncate (false there, true here: 0.56 off); an
  export over a base whose max_position_embeddings is the original context (transformers < 4.54
  takes the factor from their ratio); DeepSeek-V2's other name for its expert count."""
  cfg = tiny_config("qwen3_moe")
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
  v5 = dict(hf_config_from(cfg, base={"model_type": "qwen3_moe",
                                      "rope_parameters": {"rope_type": "default"}}))
  got = config_from_hf(dict(v5, rope_scaling=yarn)).model
  assert (got.rope_scaling, got.rope_factor, got.rope_truncate) == ("yarn", 4.0, True)
  assert not config_from_hf(dict(v5, rope_scaling={**yarn, "truncate": None})).model.rope_truncate
  scaled = config_from_hf(dict(v5, rope_scaling=yarn, max_position_embeddings=64))
  out = hf_config_from(scaled, base=dict(v5, rope_scaling=yarn, max_position_embeddings=64))
  # both fields say the same YaRN: transformers 5 reads rope_scaling first, transformers 4 (and
  # readers of its fields) only it (an export said nothing there, which read as plain RoPE)
  assert out["rope_parameters"]["rope_type"] == "yarn"
  assert out["rope_scaling"] == {k: v for k, v in out["rope_parameters"].items()
                                 if k != "rope_theta"}
  assert out["max_position_embeddings"] == 256
  assert config_from_hf(out) == scaled
  v2 = hf_config_from(tiny_config("deepseek_v2"))
  del v2["n_routed_experts"]
  assert config_from_hf(dict(v2, num_experts=16)).moe.num_experts == 16


def test_deepseek_v3_published_yarn_reads_as_the_v3_preset():
  """DeepSeek-V3's config.json RoPE fields (transformers 4's rope_scaling with "type") give the
  v3 preset's, with its quantization_config (FP8 in 128 x 128 blocks) read as such."""
  v3 = from_config_dict(FAMILY_CONFIGS["deepseek_v3"].get_config("v3"))
  hf = dict(hf_config_from(v3), rope_theta=10000, max_position_embeddings=163840, rope_scaling={
      "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096, "type": "yarn"})
  got = config_from_hf(hf, base=v3)
  assert got.model == v3.model
  fp8 = dict(hf, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3",
                                      "quant_method": "fp8", "weight_block_size": [128, 128]})
  assert config_from_hf(fp8, base=v3) == got
  assert weight_scales(fp8).blocks == ((128, 128),) and weight_scales(hf) is None
  # llm-compressor's FP8_DYNAMIC: per-row weight scales, activations quantized only at inference
  ct = weight_scales(dict(hf, quantization_config=CT_FP8))
  assert (ct.suffix, ct.blocks) == ("_scale", ((1, 0),))
  # what a run started from them says
  assert quantization_summary(fp8) == "FP8 in 128 x 128 blocks"
  assert quantization_summary(hf) is None
  assert quantization_summary(dict(hf, quantization_config=CT_FP8)) == "FP8 per row"
  int4 = fp8_configs.quantization_config("group", (1, 32), 4)
  assert quantization_summary(dict(hf, quantization_config=int4)) == "INT4 per 32 columns of a row"
  per_tensor = fp8_configs.quantization_config(None, (0, 0))
  assert quantization_summary(dict(hf, quantization_config=per_tensor)) == (
      "FP8 one scale per tensor")
  # older llm-compressor output names a dense (not sparse-compressed) layout: read as it is
  dense = dict(CT_FP8, sparsity_config={"format": "dense", "targets": []})
  assert weight_scales(dict(hf, quantization_config=dense)).blocks == ((1, 0),)
  # transformers' rules: a null factor is max_position_embeddings / original; a top-level
  # original_max_position_embeddings wins over the rope dict's.
  no_factor = dict(hf, rope_scaling={**hf["rope_scaling"], "factor": None})
  assert config_from_hf(no_factor).model.rope_factor == 40.0
  top = config_from_hf(dict(hf, original_max_position_embeddings=8192)).model
  assert top.rope_original_max_len == 8192


@pytest.mark.parametrize("family,field,value", [
    ("mixtral", "model.qk_norm", "full"), ("mixtral", "moe.renormalize", False),
    ("olmoe", "model.qkv_bias", True), ("qwen3_moe", "moe.shared_expert_hidden", 32),
    ("qwen2_moe", "moe.shared_expert_gate", False), ("olmoe", "moe.score", "sigmoid"),
    ("mixtral", "moe.routed_scale", 2.0), ("qwen3_moe", "moe.expert_groups", 2),
    ("deepseek_v3", "moe.score", "softmax"), ("deepseek_v3", "moe.shared_expert_hidden", 96),
    ("deepseek_v3", "model.dense_layers", (1,)), ("mixtral", "model.dense_layers", (0,)),
    ("deepseek_v3", "moe.group_score", "max"), ("deepseek_v2", "moe.group_score", "top2"),
    ("deepseek_v2", "moe.renormalize", True), ("deepseek_v2", "moe.score", "sigmoid"),
    ("qwen3_moe", "model.rotary_dim", 8), ("glm4_moe", "moe.score", "softmax"),
    ("glm4_moe", "model.qk_norm", "full"), ("minimax_m2", "moe.score", "softmax"),
    ("minimax_m2", "model.qk_norm", "head"), ("ernie4_5_moe", "model.dense_layers", (1,)),
    ("qwen3_moe", "model.rotary_interleaved", True)])
def test_export_refuses_options_the_family_cannot_hold(family, field, value):
  overrides = {field: value}
  if field == "moe.shared_expert_gate":
    overrides["moe.shared_expert_hidden"] = 32
  if field == "model.dense_layers":
    overrides["model.dense_hidden"] = 32
  with pytest.raises(CheckpointError) as info:
    hf_config_from(tiny_config(family, **overrides))
  assert f"config.{field}=" in str(info.value) and family in str(info.value)


def test_config_round_trip_and_hub_fields():
  cfg = tiny_config(**{"moe.renormalize": True, "moe.aux_loss_weight": 0.03,
                       "model.rope_theta": 5e5, "model.norm_eps": 1e-6})
  assert config_from_hf(hf_config_from(cfg), base=cfg) == cfg
  # A config.json as the Hub's OLMoE-1B-7B has it (transformers 4 field names).
  hub = {"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
         "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
         "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
         "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-05, "clip_qkv": None,
         "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
         "initializer_range": 0.02, "hidden_act": "silu", "attention_bias": False}
  got = config_from_hf(hub)
  assert (got.model.d_model, got.model.head_dim, got.moe.num_experts, got.moe.top_k) == (
      2048, 128, 64, 8)
  assert not got.moe.renormalize and got.moe.aux_loss_weight == 0.01
  # transformers 5 keeps the RoPE base in rope_parameters.
  v5 = dict(hub, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
  del v5["rope_theta"], v5["rope_scaling"]
  assert config_from_hf(v5).model.rope_theta == 5e5


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
  assert cli.main(["to-hf", str(tmp_path / "no_ckpt"), str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1
  run = subprocess.run([sys.executable, "-m", "moejax.convert", "from-hf", str(tmp_path / "none"),
                        str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                       timeout=120, check=False)
  assert run.returncode == 2, run.stderr
  assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
  assert "not a directory" in run.stderr
  # train.py with configs/hf.py on a directory that is not a checkpoint
  run = subprocess.run([sys.executable, "train.py", "--config",
                        f"configs/hf.py:{tmp_path / 'none'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=False)
  assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
  assert f"{tmp_path / 'none'}: not a directory" in run.stderr
  # An output path that is a file, refused before anything is read.
  (tmp_path / "afile").write_text("x")
  for argv in (["to-hf", str(tmp_path / "no_ckpt"), str(tmp_path / "afile")],
               ["from-hf", str(tmp_path / "none"), str(tmp_path / "afile")]):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'afile'}: is a file" in err, err


def test_cli_from_hf_refuses_a_used_directory(hf_dir, tmp_path, capsys, monkeypatch):
  out = tmp_path / "used"
  out.mkdir()
  (out / "something").write_text("x")

  def no_read(*args, **kwargs):   # refused before any weight is read into host memory
    raise AssertionError("a tensor was read before the output directory was checked")

  monkeypatch.setattr(safetensors_io.TensorReader, "read", no_read)
  assert cli.main(["from-hf", hf_dir, str(out)]) == 2
  assert "not empty" in capsys.readouterr().err


def test_a_directory_with_a_single_file_and_an_index_reads_the_file_as_transformers(model,
                                                                                   tmp_path):
  """transformers' from_pretrained takes model.safetensors where an index sits beside it; moejax
  read the index: one directory, two sets of weights. Now both read the single file."""
  cfg, params = model
  both, single = tmp_path / "both", tmp_path / "single"
  save_hf(params, cfg, str(both), max_shard_bytes=20_000)
  assert os.path.exists(both / "model.safetensors.index.json")
  save_hf({**params, "lm_head": np.zeros_like(params["lm_head"])}, cfg, str(single))
  shutil.copyfile(single / "model.safetensors", both / "model.safetensors")
  _, loaded = load_hf(str(both))
  assert not np.any(loaded["lm_head"]) and np.array_equal(loaded["embed"], params["embed"])


def test_cli_from_hf_writes_nothing_it_would_then_refuse(model, tmp_path, capsys):
  """A tokenizer.json that does not load (or holds more ids than the model's vocabulary), or
  weights holding a NaN: the whole checkpoint was written before the tokenizer failed (and a
  NaN trained ten steps, then was blamed on the learning rate). Now refused first, nothing
  written; the output directory is free for the next try."""
  cfg, params = model
  bad_tokenizer = tmp_path / "tok"
  save_hf(params, cfg, str(bad_tokenizer))
  (bad_tokenizer / "tokenizer.json").write_text('{"version": "1.0", "model": {')
  nan = tmp_path / "nan"
  embed = np.array(params["embed"], copy=True)
  embed[0, 0] = np.nan
  save_hf({**params, "embed": embed}, cfg, str(nan))
  for source, message in ((bad_tokenizer, "tokenizer.json: not a valid tokenizer.json"),
                          (nan, "parameter ['embed'] holds NaN or infinite values")):
    out = tmp_path / f"out_{source.name}"
    assert cli.main(["from-hf", str(source), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists() or not os.listdir(out)


# Llama-4-Scout-17B-16E's config.json as the Hub has it (a multimodal Llama 4 config; the vision
# config shortened to its model_type)
LLAMA4_SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080,
    "model_type": "llama4", "vision_config": {"model_type": "llama4_vision_model"},
    "text_config": {
        "attention_bias": False, "attention_chunk_size": 8192, "attention_dropout": 0.0,
        "attn_scale": 0.1, "attn_temperature_tuning": 4, "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008], "floor_scale": 8192,
        "for_llm_compressor": False, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "interleave_moe_layer_step": 1, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "max_position_embeddings": 262144,
        "model_type": "llama4_text", "moe_layers": list(range(48)),
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
        "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
        "num_key_value_heads": 8, "num_local_experts": 16, "output_router_logits": False,
        "pad_token_id": 200018, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16", "use_cache": True, "use_qk_norm": True,
        "vocab_size": 202048}}


def test_llama4_reads_its_text_model_layer_rules_and_llama3_rope():
  """Llama 4: Scout's multimodal config.json reads as its text model, the scout preset (its
  attn_temperature_tuning 4 is on); Maverick's fields (experts every other layer, no QK-norm, no
  RoPE scaling) as the maverick preset; absent lists, transformers' rules (every 4th layer
  unrotated, the rotated ones chunked; MoE every interleave_moe_layer_step-th); an export reads
  back as it was, the tensors under feed_forward with gate and up the halves of one [in, out]
  tensor; what it cannot read or write is refused, one line naming the field."""
  scout = from_config_dict(FAMILY_CONFIGS["llama4"].get_config("scout"))
  got = config_from_hf(LLAMA4_SCOUT, base=scout)
  assert got.model == scout.model and got.moe == scout.moe
  maverick = from_config_dict(FAMILY_CONFIGS["llama4"].get_config("maverick"))
  text = dict(LLAMA4_SCOUT["text_config"], interleave_moe_layer_step=2, use_qk_norm=False,
              num_local_experts=128, rope_scaling=None, max_position_embeddings=1048576)
  del text["moe_layers"], text["no_rope_layers"]
  got = config_from_hf(text, base=maverick)
  assert got.model == maverick.model and got.moe == maverick.moe
  cfg = tiny_config("llama4")
  hf = hf_config_from(cfg)
  assert hf["model_type"] == "llama4_text" and hf["architectures"] == ["Llama4ForCausalLM"]
  assert (hf["moe_layers"], hf["interleave_moe_layer_step"], hf["no_rope_layers"]) == (
      [1, 3], 2, [1, 1, 1, 0])
  assert hf["rope_scaling"]["rope_type"] == "llama3" and hf["floor_scale"] == 8
  assert config_from_hf(hf, base=cfg) == cfg
  bare = {k: v for k, v in hf.items() if k not in ("layer_types", "no_rope_layers",
                                                   "moe_layers")}
  assert config_from_hf(bare, base=cfg) == cfg     # the same from transformers' rules
  # an empty list is transformers' rule too (Scout's first config.json had one), a longer one
  # read to the model's layers; absent top-k is 1, absent original context the maximum
  assert config_from_hf(dict(bare, no_rope_layers=[]), base=cfg) == cfg
  assert config_from_hf(dict(hf, no_rope_layers=hf["no_rope_layers"] + [0]), base=cfg) == cfg
  assert config_from_hf({k: v for k, v in hf.items() if k != "num_experts_per_tok"}).moe.top_k == 1
  rope = {k: v for k, v in hf["rope_scaling"].items() if k != "original_max_position_embeddings"}
  got = config_from_hf(dict(hf, rope_scaling=rope, max_position_embeddings=96)).model
  assert got.rope_original_max_len == 96
  # another family's options do not carry over from the base (found by review)
  mixtral = tiny_config("mixtral")
  assert config_from_hf(hf_config_from(mixtral), base=cfg).model == mixtral.model
  unchunked = config_from_hf(dict(bare, attention_chunk_size=None)).model
  assert (unchunked.attention_chunk, unchunked.chunked_layers) == (0, ())
  cold = config_from_hf(dict(hf, attn_temperature_tuning=False)).model
  assert cold.nope_temperature == 0.0
  shapes = hf_names.expected_shapes(cfg)
  e, d, f = cfg.moe.num_experts, cfg.model.d_model, cfg.moe.expert_hidden
  assert shapes["model.layers.1.feed_forward.experts.gate_up_proj"] == (e, d, 2 * f)
  assert shapes["model.layers.1.feed_forward.experts.down_proj"] == (e, f, d)
  assert shapes["model.layers.1.feed_forward.router.weight"] == (e, d)
  assert shapes["model.layers.1.feed_forward.shared_expert.up_proj.weight"] == (f, d)
  assert shapes["model.layers.0.feed_forward.down_proj.weight"] == (d, cfg.model.dense_hidden)
  assert not any("q_norm" in name for name in shapes)
  for changes, match in (
      (dict(layer_types=["sliding_attention"] * 4), "layer_types="),
      (dict(layer_types=["chunked_attention"] * 4, attention_chunk_size=None),
       "chunked layers need attention_chunk_size"),
      (dict(floor_scale=2.5), "floor_scale=2.5"),
      (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
       "llama3 needs low_freq_factor"),
      (dict(moe_layers=[7]), "moe_layers="),
      (dict(no_rope_layers=[1, 0]), "no_rope_layers=")):
    with pytest.raises(CheckpointError, match=match):
      config_from_hf(dict(hf, **changes))
  with pytest.raises(CheckpointError, match="needs text_config"):
    config_from_hf({"model_type": "llama4"})
  # latent attention's families read yarn only, so they export it only (found by review)
  with pytest.raises(CheckpointError, match="config.model.rope_scaling='llama3': .* yarn only"):
    hf_config_from(tiny_config("deepseek_v3", **{"model.rope_scaling": "llama3",
                                                 "model.rope_factor": 8.0,
                                                 "model.rope_original_max_len": 64}))
  for family, field, value, why in (
      ("llama4", "moe.weights_on_input", False, "needs True"),
      ("llama4", "moe.renormalize", True, "needs False"),
      ("llama4", "moe.shared_expert_hidden", 0, "needs 64"),
      ("olmoe", "moe.weights_on_input", True, "needs False"),
      ("olmoe", "model.attention_chunk", 8, "needs 0")):
    overrides = {field: value}
    if field == "model.attention_chunk":
      overrides["model.chunked_layers"] = (0,)
    with pytest.raises(CheckpointError, match=f"config.{field}={value!r}: .* {why}"):
      hf_config_from(tiny_config(family, **overrides))


def test_deepseek_v32_indexer_converts_only_as_its_family():
  """DeepSeek-V3.2's indexer exports as DeepSeek-V3.2 (or GLM-5) only, which always has one; its
  layer_types name every layer indexed, its indexer needs the q latent, and num_experts stands
  for n_routed_experts as in transformers' config classes."""
  with pytest.raises(CheckpointError, match=r"config.model.index_topk=8: .* needs 0 \(no "
                     r"sparse-attention indexer\)"):
    hf_config_from(tiny_config("deepseek_v3", **{"model.index_topk": 8, "model.index_heads": 2,
                                                 "model.index_head_dim": 8}))
  with pytest.raises(CheckpointError, match="config.model.index_topk=0: .* DeepSeek sparse "
                     "attention in every layer"):
    hf_config_from(tiny_config("deepseek_v32", **{"model.index_topk": 0,
                                                  "model.index_heads": 0,
                                                  "model.index_head_dim": 0}))
  hf = hf_config_from(tiny_config("deepseek_v32"))
  for key, bad in (("layer_types", ["full_attention"] * 3), ("q_lora_rank", None)):
    with pytest.raises(CheckpointError, match=f"{key}="):
      config_from_hf(dict(hf, **{key: bad}))
  # transformers' configs of both take num_experts for n_routed_experts, it winning (review)
  for family in ("deepseek_v32", "glm_moe_dsa"):
    base = hf_config_from(tiny_config(family))
    assert config_from_hf(dict(base, num_experts=16)).moe.num_experts == 16
    assert "num_experts" not in hf_config_from(tiny_config(family), dict(base, num_experts=16))
  # GLM-5: every layer runs its own indexer, rotated in neighbour pairs; a layer reusing the
  # previous one's selection ("shared", as transformers derives it) is refused
  glm = hf_config_from(tiny_config("glm_moe_dsa"))
  assert config_from_hf(glm).model.index_rotary_interleaved
  assert config_from_hf(dict(glm, indexer_types=["full"] * 3)) == config_from_hf(glm)
  for changes, key in (({"indexer_types": ["full", "shared", "full"]}, "indexer_types"),
                       ({"index_topk_pattern": "FSF"}, "index_topk_pattern"),
                       ({"index_topk_freq": 2}, "index_topk_freq")):
    with pytest.raises(CheckpointError, match=f"{key}=.* every layer's own indexer"):
      config_from_hf(dict(glm, **changes))
  with pytest.raises(CheckpointError, match="config.model.index_rotary_interleaved=False: .* "
                     "needs True"):
    hf_config_from(tiny_config("glm_moe_dsa", **{"model.index_rotary_interleaved": False}))


def test_multimodal_configs_read_their_text_model_as_transformers_does():
  """GLM-4.5V ties its head when an older save says so inside text_config (transformers 5
  forwards it to the outer config); Qwen3-VL-MoE's text config class defaults to tied, but only
  the outer flag (default false) ties it. A Qwen3.5-MoE export keeps no multi-token-prediction
  layer its base config counted."""
  text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, hidden_act="silu")
  glm = dict(text, model_type="glm4v_moe_text", n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, intermediate_size=64, n_group=1,
             topk_group=1, partial_rotary_factor=0.5)
  for outer, inner, tied in ((None, None, False), (None, True, True), (False, True, True),
                             (True, None, True), (False, False, False)):
    hf = {"model_type": "glm4v_moe", "text_config": dict(glm)}
    if outer is not None:
      hf["tie_word_embeddings"] = outer
    if inner is not None:
      hf["text_config"]["tie_word_embeddings"] = inner
    assert config_from_hf(hf).model.tie_embeddings is tied, (outer, inner)
  qwen = dict(text, model_type="qwen3_vl_moe_text", num_experts=4, num_experts_per_tok=2,
              tie_word_embeddings=True)
  assert not config_from_hf({"model_type": "qwen3_vl_moe", "text_config": qwen}
                            ).model.tie_embeddings
  cfg = tiny_config("qwen3_5_moe")
  assert hf_config_from(cfg, dict(hf_config_from(cfg), mtp_num_hidden_layers=1))[
      "mtp_num_hidden_layers"] == 0


def test_export_names_the_eos_the_run_ended_documents_with(tmp_path):
  """A run trained from scratch exports its tokenizer's EOS in config.json, so transformers'
  generation stops there; an imported model keeps its source's token ids, even none."""
  from tests.data.conftest import SENTENCES, word_level
  cfg = tiny_config()
  assert hf_config_from(cfg)["eos_token_id"] is None
  assert hf_config_from(cfg, eos_token_id=256)["eos_token_id"] == 256
  for source in (7, None):
    base = hf_config_from(cfg, eos_token_id=source)
    assert hf_config_from(cfg, base, eos_token_id=256)["eos_token_id"] == source
  path = tmp_path / "tokenizer.json"
  word_level(SENTENCES).save(str(path))
  eos = json.loads(path.read_text())["model"]["vocab"]["<|endoftext|>"]
  assert cli._eos_id(str(path), cfg) == eos
  assert cli._eos_id(None, cfg) == 256                               # the byte tokenizer's
  assert cli._eos_id(None, tiny_config(**{"data.tokenizer": "gone.json"})) is None


def test_moejax_weights_named_where_a_hugging_face_directory_is_expected(tmp_path):
  """configs/hf.py, from-hf and load_hf on a from-hf output or a workdir say what it holds
  and what reads it, not only that config.json is missing."""
  from moejax.convert.hf import _read_config_json
  empty, workdir, from_hf = (tmp_path / d for d in ("empty", "w", "imported"))
  for d in (empty, workdir / "checkpoints", from_hf):
    d.mkdir(parents=True)
  (from_hf / "hf_config.json").write_text("{}")
  with pytest.raises(CheckpointError, match=r"config.json: missing \(not a Hugging Face "
                                            r"checkpoint directory\)$"):
    _read_config_json(str(empty))
  for d in (workdir, from_hf):
    with pytest.raises(CheckpointError, match=rf"config.json: missing: {d} holds moejax weights, "
                                              r"not a Hugging Face checkpoint \(start from them "
                                              r"with its family's preset and --config.init_from"):
      _read_config_json(str(d))


def test_an_overwritten_export_of_a_bytes_run_keeps_no_stale_tokenizer(trained, tmp_path, capsys):
  """--overwrite replaced the weights of an export that had a tokenizer.json and left that file:
  transformers and configs/hf.py then read it as the bytes-trained weights' tokenizer."""
  out = tmp_path / "exported"
  assert cli.main(["to-hf", str(trained), str(out)]) == 0
  assert not (out / "tokenizer.json").exists()
  (out / "tokenizer.json").write_text('{"stale": true}')        # as another export left it
  assert cli.main(["to-hf", str(trained), str(out), "--overwrite"]) == 0
  assert not (out / "tokenizer.json").exists()
  assert "no tokenizer.json: the run trained on UTF-8 bytes" in capsys.readouterr().out
  # config.json says so, and generate / evaluate read the export, and a from-hf of it, as bytes
  # (they asked for a tokenizer.json to copy there, which a run on bytes never had)
  from moejax.convert import checkpoint_io
  assert json.loads((out / "config.json").read_text())["moejax_tokenizer"] == "bytes"
  assert checkpoint_io.load_model(str(out))[2] == "bytes"
  assert cli.main(["from-hf", str(out), str(tmp_path / "back")]) == 0
  assert checkpoint_io.load_model(str(tmp_path / "back"))[2] == "bytes"
  # an export from it of a run on another tokenizer does not inherit the key from its base
  from moejax.convert import hf_config
  cfg, _, base = checkpoint_io.load_params(str(tmp_path / "back"))
  assert base["moejax_tokenizer"] == "bytes"
  assert hf_config.TOKENIZER_KEY not in hf_config.hf_config_from(cfg, base)
  config = json.loads((out / "config.json").read_text())
  del config["moejax_tokenizer"]                 # an export that names no tokenizer
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"no tokenizer.json beside these Hugging Face "
                     r"weights; .* \(--tokenizer bytes for a model trained on UTF-8 bytes\)$"):
    checkpoint_io.load_model(str(out))
