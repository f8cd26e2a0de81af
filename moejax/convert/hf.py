"""Hugging Face checkpoints of every family (`moejax.families`) in and out, one tensor (or one
block of one) at a time.

`load_hf(dir)` -> (Config, params): params is the nested dict `olmoe.init_params` returns (fp32,
layer parameters stacked on a leading axis). Without `shardings` every leaf is one preallocated
host (numpy) array filled tensor by tensor, so the host holds one copy of the model and a tensor
at a time besides. With `shardings` (a pytree of `jax.sharding.Sharding` like params, e.g. the
train state's parameter shardings) each leaf is built by `jax.make_array_from_callback`, and each
device's shard reads only its own block of each Hugging Face tensor: no host ever holds a whole
parameter.

`save_hf(params, cfg, dir)` writes config.json and safetensors shards (with an index when more than
one), tensor by tensor, in the per-expert layout of the family's Hub checkpoints (the name table is
in `moejax.convert.hf_names`). fp32 export followed by import gives back every parameter bit for
bit. Quantized checkpoints (quantization_config quant_method "fp8", or compressed-tensors'
float-quantized FP8 and pack-quantized integer formats) import dequantized to fp32
(`safetensors_io.WeightScales`); exports are unquantized.
"""
from __future__ import annotations

import datetime
import glob
import itertools
import json
import math
import os
import time

import jax
import numpy as np

from moejax.config import Config
from moejax.convert import hf_config, hf_names
from moejax.convert.safetensors_io import INDEX_FILE, TensorReader, write_tensors
from moejax.errors import CheckpointError

CONFIG_FILE = "config.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000     # transformers' default max_shard_size, "5GB"


def read_hf_config(hf_dir: str) -> dict:
  """config.json of `hf_dir`: its text model's where it is a multimodal config
  (`hf_config.text_model_config`: Llama 4's, Kimi-K2.5's, Qwen3-VL-MoE's)."""
  return hf_config.text_model_config(_read_config_json(hf_dir),
                                     os.path.join(hf_dir, CONFIG_FILE))


def _read_config_json(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, CONFIG_FILE)
  if not os.path.isdir(hf_dir):
    raise CheckpointError(f"{hf_dir}: not a directory (a Hugging Face checkpoint directory with "
                          f"{CONFIG_FILE} and safetensors files is expected)")
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    from moejax import weights
    # a workdir, or a from-hf output (checkpoint_io.HF_CONFIG_FILE: that module imports this one)
    if os.path.isdir(os.path.join(hf_dir, weights.SUBDIR)) or os.path.isfile(
        os.path.join(hf_dir, "hf_config.json")):
      raise CheckpointError(
          f"{path}: missing: {hf_dir} holds moejax weights, not a Hugging Face checkpoint "
          "(start from them with its family's preset and --config.init_from=DIR, or name the "
          "Hugging Face directory they came from, or export them with `python -m "
          "moejax.convert to-hf`)") from None
    raise CheckpointError(f"{path}: missing (not a Hugging Face checkpoint directory)") from None
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path}: not readable JSON ({e})") from None


def _expert_layout(reader: TensorReader, cfg: Config, wrapper, layout) -> str:
  """How the checkpoint holds its experts (`hf_names`' layouts): by their names, and for a
  multimodal config whose fused experts may be [in, out] (Qwen3-VL-MoE's Hub layout), by the
  first layer's shapes as transformers tells them apart (per tensor: [out, in] where the shape is
  that): [out, in] where both gate_up_proj and down_proj are so shaped (a square gate_up_proj,
  hidden = 2 x intermediate, is told by down_proj)."""
  experts = hf_names.detect_expert_layout(reader.names())
  if experts != hf_names.FUSED or wrapper is None or not wrapper.in_out_experts:
    return experts
  out_in = hf_names.expected_shapes(cfg, hf_names.FUSED, layout)
  gate_up = next((n for n in out_in if n.endswith(".experts.gate_up_proj")), None)
  if gate_up is None:
    return experts
  first = (gate_up, gate_up[:-len("gate_up_proj")] + "down_proj")   # one layer's pair
  if all(reader.shapes.get(n) == out_in.get(n) for n in first):
    return experts
  return hf_names.IN_OUT_HALVES


def _check_tensors(reader: TensorReader, cfg: Config, experts: str,
                   layout: hf_names.TextLayout) -> None:
  expected = hf_names.expected_shapes(cfg, experts, layout)
  for name, shape in expected.items():
    if name not in reader.shapes:
      raise CheckpointError(f"{reader.directory}: tensor {name!r} is missing (config.json implies "
                            f"it, with shape {shape})")
    if reader.shapes[name] != shape:
      raise CheckpointError(f"{reader.directory}: tensor {name!r} has shape {reader.shapes[name]}, "
                            f"but config.json implies {shape}")
    reader.check_dtype(name)
  unexpected = sorted(n for n in reader.shapes
                      if n not in expected and not hf_names.is_ignored(n, cfg, layout))
  if unexpected:
    raise CheckpointError(f"{reader.directory}: tensor {unexpected[0]!r} has no place in a moejax "
                          f"{cfg.model.family} model as config.json describes it "
                          f"({len(unexpected)} such tensors)")


def _read_source(reader: TensorReader, src: hf_names.Source, tail_slices: list) -> np.ndarray:
  if src.whole:         # row groups or a unit axis: the tensor read whole, then cut
    return src.block_of(reader.read(src.name, src.prefix))[tuple(tail_slices)]
  hf_slices = list(tail_slices[::-1] if src.transpose else tail_slices)
  if src.row_offset:
    first = hf_slices[0]
    hf_slices[0] = slice(first.start + src.row_offset, first.stop + src.row_offset)
  if src.by_column:      # the columns the block's take, every stride-th, read as one range
    columns = src.columns(hf_slices[-1].start, hf_slices[-1].stop)
    hf_slices[-1] = slice(columns.start, columns.stop)
  block = reader.read(src.name, (*src.prefix, *hf_slices))
  if src.stride > 1:
    block = block[..., ::src.stride]
  return block.T if src.transpose else block


class ReadProgress:
  """Progress of an import, by parameters read: `report(line)` at most every `every_s`
  seconds, and once at the end where it took that long (a Scout or Maverick import reads about
  220-800 GB)."""

  def __init__(self, total: int, report, where: str, every_s: float = 10.0):
    self.total, self.report, self.where, self.every_s = total, report, where, every_s
    self.done, self.start = 0, time.monotonic()
    self.last = self.start

  def add(self, count: int) -> None:
    self.done += count
    now = time.monotonic()
    if now - self.last >= self.every_s and self.done < self.total:
      self.last = now
      elapsed = now - self.start
      eta = elapsed * (self.total - self.done) / max(self.done, 1)
      self.report(f"moejax: read {_count(self.done)} of {_count(self.total)} parameters "
                  f"({100 * self.done / self.total:.0f}%) from {self.where}, ETA "
                  f"{datetime.timedelta(seconds=int(eta))}")

  def finish(self) -> None:
    """The closing line, where the import took long enough to have reported along the way."""
    elapsed = time.monotonic() - self.start
    if elapsed >= self.every_s:
      self.report(f"moejax: read {_count(self.total)} parameters from {self.where} in "
                  f"{datetime.timedelta(seconds=int(elapsed))}")


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _read_block(reader: TensorReader, leaf: hf_names.LeafMap, index: tuple,
                progress: ReadProgress | None = None) -> np.ndarray:
  """`leaf[index]` (index: one step-1 slice per axis, as make_array_from_callback passes)."""
  index = tuple(index) + (slice(None),) * (len(leaf.shape) - len(index))
  ranges = [range(*s.indices(n)) for s, n in zip(index, leaf.shape)]
  if any(r.step != 1 for r in ranges):
    raise ValueError(f"block index {index} of {'.'.join(leaf.path)} is not contiguous")
  out = np.empty([len(r) for r in ranges], np.float32)
  tail_slices = [slice(r.start, r.stop) for r in ranges[leaf.lead:]]
  leads = itertools.product(*(enumerate(r) for r in ranges[:leaf.lead]))
  for pairs in _by_layer(reader, leads, layer_of=lambda pairs: pairs[0][1]):
    local = tuple(p[0] for p in pairs)
    source = leaf.sources[tuple(p[1] for p in pairs)]
    out[local] = _read_source(reader, source, tail_slices)
    if progress is not None:
      progress.add(out[local].size)
  return out


def _by_layer(reader: TensorReader, leads, layer_of):
  """`leads` in order, the reader's mapped pages released at each new layer (`layer_of(lead)`),
  so at most one layer's source pages stay mapped."""
  layer = None
  for lead in leads:
    if lead and layer_of(lead) != layer:
      reader.release()
      layer = layer_of(lead)
    yield lead


def _column_groups(maps: list) -> list[list]:
  """`maps` in order, leaves whose every block is a column selection of the same tensor block
  as another leaf's grouped (gpt-oss's gate and up, every other column of gate_up_proj; Llama
  4's halves of it), and leaves cut from the same whole tensors (Qwen3-Next's q, k, v and z of
  in_proj_qkvz): a group is read together, each tensor block once."""
  groups, index = [], {}
  for leaf in maps:
    sources = leaf.sources.values()
    key = None
    columns = all(s.by_column and not s.transpose and not s.row_offset for s in sources)
    if leaf.lead and (columns or all(s.whole for s in sources)):
      key = (columns, leaf.shape[:leaf.lead],
             tuple(sorted((lead, s.name, s.prefix) for lead, s in leaf.sources.items())))
    if key is not None and key in index:
      groups[index[key]].append(leaf)
      continue
    if key is not None:
      index[key] = len(groups)
    groups.append([leaf])
  return groups


def _read_columns_together(reader: TensorReader, group: list,
                           progress: ReadProgress | None = None) -> list[np.ndarray]:
  """Each leaf of a `_column_groups` group, whole, reading each tensor block once (a quantized
  one dequantized once: gpt-oss's interleaved MXFP4 gate_up_proj was read whole for gate and
  again for up; Qwen3-Next's in_proj_qkvz four times)."""
  first = group[0]
  outs = [np.empty(leaf.shape, np.float32) for leaf in group]
  leads = itertools.product(*(range(n) for n in first.shape[:first.lead]))
  for lead in _by_layer(reader, leads, layer_of=lambda lead: lead[0]):
    src = first.sources[lead]
    block = reader.read(src.name, src.prefix)
    for leaf, out in zip(group, outs):
      own = leaf.sources[lead]
      out[lead] = (own.block_of(block) if own.whole
                   else block[..., own.columns(0, leaf.shape[-1])])
      if progress is not None:
        progress.add(out[lead].size)
  return outs


def _set_path(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get_path(tree, path: tuple, what: str):
  node = tree
  for depth, key in enumerate(path):
    if not isinstance(node, dict) or key not in node:
      raise CheckpointError(f"{what}: parameter {'.'.join(path[:depth + 1])!r} is missing")
    node = node[key]
  return node


def load_hf(hf_dir: str, *, shardings=None, base: Config | None = None,
            progress=None) -> tuple[Config, dict]:
  """Reads a Hugging Face checkpoint directory (any family) into (Config, params).

  `shardings`: optional pytree of `jax.sharding.Sharding` with the structure of params (or one
  Sharding for all); each leaf is then a global `jax.Array` laid out so, built shard by shard.
  `base`: the Config whose non-model fields (training, data, mesh...) the result keeps.
  `progress`: a callable given a line every 10 s (parameters read, ETA) and at the end where it
  took that long.
  """
  raw = _read_config_json(hf_dir)
  where = os.path.join(hf_dir, CONFIG_FILE)
  hf = hf_config.text_model_config(raw, where)
  wrapper = hf_config.text_wrapper(raw)        # a multimodal checkpoint's text model
  layout = hf_names.TEXT_MODEL if wrapper is None else wrapper.layout
  cfg = hf_config.config_from_hf(hf, base, where=where)
  params: dict = {}
  with TensorReader(hf_dir, scales=hf_config.weight_scales(hf, where)) as reader:
    experts = _expert_layout(reader, cfg, wrapper, layout)
    _check_tensors(reader, cfg, experts, layout)
    maps = hf_names.leaf_maps(cfg, experts, layout)
    counter = None if progress is None else ReadProgress(
        sum(math.prod(leaf.shape) for leaf in maps), progress, hf_dir)
    if shardings is None:        # on the host: leaves sharing tensor blocks read together
      for group in _column_groups(maps):
        values = (_read_columns_together(reader, group, counter) if len(group) > 1
                  else [_read_block(reader, group[0], (), counter)])
        for leaf, value in zip(group, values):
          _set_path(params, leaf.path, value)
        reader.release()
    else:
      for leaf in maps:         # each device's shard reads its own block
        sharding = (shardings if isinstance(shardings, jax.sharding.Sharding)
                    else _get_path(shardings, leaf.path, "shardings"))
        value = jax.make_array_from_callback(
            leaf.shape, sharding, lambda index, leaf=leaf: _read_block(reader, leaf, index))
        _set_path(params, leaf.path, value)
        reader.release()
        if counter is not None:    # (by leaf: shards of a replicated leaf are read again)
          counter.add(math.prod(leaf.shape))
    if counter is not None:
      counter.finish()
  return cfg, params


class _HostBlocks:
  """Host copies of `leaf[i]` for the layer being written (one cached layer per leaf)."""

  def __init__(self):
    self._cache: dict[tuple, tuple[int, np.ndarray]] = {}

  def get(self, path: tuple, x, lead: tuple) -> np.ndarray:
    if not lead:
      return np.asarray(x)
    layer = lead[0]
    cached = self._cache.get(path)
    if cached is None or cached[0] != layer:
      cached = (layer, np.asarray(x[layer]))
      self._cache[path] = cached
    return cached[1][lead[1:]] if len(lead) > 1 else cached[1]


def _check_params(params, cfg: Config, maps: list[hf_names.LeafMap]) -> None:
  known = {leaf.path for leaf in maps}
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    if names not in known:
      raise CheckpointError(f"params: {'.'.join(names)!r} is not a parameter of this "
                            f"{cfg.model.family} model")
  for leaf in maps:
    x = _get_path(params, leaf.path, "params")
    if tuple(x.shape) != leaf.shape:
      raise CheckpointError(f"params: {'.'.join(leaf.path)!r} has shape {tuple(x.shape)}, but the "
                            f"config implies {leaf.shape}")
    if not np.issubdtype(np.dtype(x.dtype), np.floating):
      raise CheckpointError(f"params: {'.'.join(leaf.path)!r} has dtype {x.dtype}, expected float")
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      raise CheckpointError(f"params: {'.'.join(leaf.path)!r} spans several processes; export "
                            "from one process that can address every shard")


def _existing_checkpoint_files(out_dir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(out_dir, "*.safetensors"))
                + glob.glob(os.path.join(out_dir, INDEX_FILE)))


def check_out_dir(out_dir: str, overwrite: bool = False) -> list[str]:
  """The checkpoint files `save_hf` would replace in `out_dir`, or a CheckpointError when it
  is a file, or holds a checkpoint and not `overwrite`."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise CheckpointError(f"{out_dir}: is a file, not a directory; choose a directory for the "
                          "Hugging Face checkpoint")
  existing = _existing_checkpoint_files(out_dir)
  if existing and not overwrite:
    raise CheckpointError(f"{out_dir}: already holds a checkpoint ({os.path.basename(existing[0])})"
                          "; choose an empty directory, or overwrite (--overwrite)")
  return existing


def save_hf(params, cfg: Config, out_dir: str, *, dtype: str = "float32",
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, hf_config_base: dict | None = None,
            overwrite: bool = False, eos_token_id: int | None = None,
            bytes_tokenizer: bool = False) -> list[str]:
  """Writes params as a Hugging Face checkpoint of `cfg.model.family` (config.json +
  safetensors) in `out_dir`.

  `dtype`: "float32" (exact) or "bfloat16" (rounded to nearest even). `hf_config_base`: a
  config.json to keep fields moejax does not model from (token ids, maximum length);
  `eos_token_id` without one (`hf_config.hf_config_from`); `bytes_tokenizer`: the weights read
  UTF-8 bytes (no tokenizer.json), said in config.json for `load_model`. Refuses a
  directory that already holds safetensors files unless `overwrite`, which removes them first.
  Returns the files written.
  """
  hf = hf_config.hf_config_from(cfg, hf_config_base, dtype=dtype, eos_token_id=eos_token_id)
  if bytes_tokenizer:
    hf[hf_config.TOKENIZER_KEY] = "bytes"
  maps = hf_names.leaf_maps(cfg, hf_names.PER_EXPERT)
  _check_params(params, cfg, maps)
  existing = check_out_dir(out_dir, overwrite)
  for path in existing:
    os.remove(path)

  # Layer-major order, as the Hub's checkpoints: embedding, layer 0, layer 1, ..., norm, head.
  # A tensor several blocks make up (Granite's fused experts) is written once, from all of them.
  shapes = hf_names.expected_shapes(cfg, hf_names.PER_EXPERT)
  by_layer: dict[int | None, list] = {}
  lookup: dict[str, list] = {}
  for leaf in maps:
    for lead, src in leaf.sources.items():
      if src.name not in lookup:
        by_layer.setdefault(hf_names.hf_layer_of(src.name), []).append(
            (src.name, shapes[src.name]))
      lookup.setdefault(src.name, []).append((leaf, lead, src))
  first = by_layer.pop(None)
  ordered = first[:1] + [e for i in sorted(by_layer) for e in by_layer[i]] + first[1:]
  blocks = _HostBlocks()

  def block_of(leaf, lead, src) -> np.ndarray:
    block = blocks.get(leaf.path, _get_path(params, leaf.path, "params"), lead)
    return block.T if src.transpose else block

  def produce(name: str) -> np.ndarray:
    parts = lookup[name]
    if len(parts) == 1 and not (parts[0][2].row_offset or parts[0][2].by_column
                                or parts[0][2].whole):
      leaf, lead, src = parts[0]
      block = block_of(leaf, lead, src)
      return np.reshape(block, shapes[name]) if src.prefix else block
    out = None
    for leaf, lead, src in parts:
      block = block_of(leaf, lead, src)
      out = np.zeros(shapes[name], block.dtype) if out is None else out
      if src.whole:
        src.into_tensor(out[src.prefix], block)
      elif src.by_column:
        out[src.prefix][..., src.columns(0, block.shape[-1])] = block
      else:
        out[src.prefix][src.row_offset:src.row_offset + block.shape[0]] = block
    return out

  os.makedirs(out_dir, exist_ok=True)
  # A router with a score bias chooses experts by small margins: kept float32 beside the bias,
  # as moejax gathers them and transformers keeps them (_keep_in_fp32_modules_strict).
  fp32 = {name for name, parts in lookup.items()
          if cfg.moe.score_bias and parts[0][0].path[-1] in ("router", "score_bias")}
  files = write_tensors(out_dir, ordered, produce,
                        dtype=dtype, max_shard_bytes=max_shard_bytes,
                        keep_fp32=fp32.__contains__)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(hf, f, indent=2)
    f.write("\n")
  return files + ([INDEX_FILE] if len(files) > 1 else []) + [CONFIG_FILE]
