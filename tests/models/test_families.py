"""The family presets (configs/FAMILY.py): they build, count their parameters exactly and match
the published sizes. (Each family's tiny preset trains sharded and on one device in
tests/train/test_families.py.)"""
from __future__ import annotations

import math

import jax
import pytest

from moejax import config as config_lib
from moejax.models import olmoe
from moejax.families import FAMILIES
from moejax.sharding import axes
from tests.helpers import FAMILY_CONFIGS, tiny_config

CASES = [(family, preset) for family in FAMILIES for preset in FAMILY_CONFIGS[family].PRESETS]
PUBLISHED = [(family, preset) for family in FAMILIES
             for preset in FAMILY_CONFIGS[family].PUBLISHED]
# Published active counts stated to two significant digits: the exact count must read as that
# figure when cut or rounded to two digits, as each publisher does (cut: Qwen2-57B-A14B 14.25B is
# "14B", Qwen3-30B-A3B 3.35B "3.3B", DeepSeek-MoE-16B 2.83B "2.8B", DeepSeek-V3 37.55B "37B";
# rounded: OLMoE-1B-7B 1.28B "1.3B").
TWO_DIGITS = {("qwen2_moe", "57b_a14b", "active"): "cut",
              ("qwen3_moe", "30b_a3b", "active"): "cut",
              ("deepseek_v3", "moe_16b", "active"): "cut",
              ("deepseek_v3", "v3", "active"): "cut",
              ("olmoe", "1b7b", "active"): "rounded",
              ("deepseek_v2", "lite", "active"): "cut",
              ("deepseek_v2", "v2", "active"): "cut",
              ("glm4_moe", "air", "active"): "cut",
              ("glm4_moe", "glm45", "active"): "cut",
              ("minimax_m2", "m2", "active"): "cut",
              ("ernie4_5_moe", "a3b", "total"): "cut",     # 21.83B is "21B"
              ("ernie4_5_moe", "a3b", "active"): "cut1",   # 3.35B is "3B": one digit
              ("glm4_moe_lite", "flash", "active"): "cut1",   # 3.58B is "A3B"
              ("llama4", "maverick", "active"): "cut",      # 17.18B is "17B"
              ("glm_moe_dsa", "glm5", "active"): "cut",     # 40.83B is "40B"
              ("qwen3_next", "80b_a3b", "active"): "cut1",  # 3.87B is "A3B"
              ("qwen3_5_moe", "35b_a3b", "active"): "cut1"}  # 3.45B is "A3B"
# Published active counts that leave the input embedding out (DeepSeek-V2-Lite's 2.4B: 2.45B
# without its 0.21B embedding, 2.66B with it; GLM-4.5-Air's 12B: 12.80B without, 13.42B with;
# GLM-4.5's 32B: 32.86B without; GLM-5's 40B: 40.83B without; V2's 21B and V3's 37B count it).
WITHOUT_EMBEDDING = {("deepseek_v2", "lite"), ("glm4_moe", "air"), ("glm4_moe", "glm45"),
                     ("minimax_m2", "m2"), ("glm4_moe_lite", "flash"), ("minicpm5_moe", "15b_a2b"),
                     ("gpt_oss", "20b"), ("gpt_oss", "120b"), ("glm_moe_dsa", "glm5")}


def preset_config(family: str, preset: str) -> config_lib.Config:
  return config_lib.from_config_dict(FAMILY_CONFIGS[family].get_config(preset))


def test_every_family_has_a_config_file():
  assert sorted(FAMILY_CONFIGS) == sorted(FAMILIES)
  for family in FAMILIES:
    assert "tiny" in FAMILY_CONFIGS[family].PRESETS


@pytest.mark.parametrize("family,preset", CASES)
def test_num_params_equals_the_parameter_leaves(family, preset):
  cfg = preset_config(family, preset)
  assert cfg.model.family == family
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  metas = jax.tree.leaves(olmoe.param_meta(cfg), is_leaf=lambda v: isinstance(v, axes.ParamMeta))
  routed = sum(math.prod(m.shape) for m in metas if axes.EXPERT in m.axes)
  counts = config_lib.num_params(cfg)
  assert counts["total"] == total
  # Active: every parameter but the routed experts, and top_k of the num_experts of those.
  assert counts["active"] * cfg.moe.num_experts == (
      (total - routed) * cfg.moe.num_experts + routed * cfg.moe.top_k)


def _matches(count: int, published: float, two_digits: str | None) -> bool:
  if two_digits:
    unit = 10 ** (math.floor(math.log10(published)) - (0 if two_digits == "cut1" else 1))
    digits = count / unit if two_digits in ("cut", "cut1") else count / unit + 0.5
    return math.floor(digits) * unit == pytest.approx(published)
  return abs(count - published) <= 0.01 * published


@pytest.mark.parametrize("family,preset", PUBLISHED)
def test_presets_have_the_published_sizes(family, preset):
  total_published, active_published, source = FAMILY_CONFIGS[family].PUBLISHED[preset]
  assert source
  cfg = preset_config(family, preset)
  counts = config_lib.num_params(cfg)
  if (family, preset) in WITHOUT_EMBEDDING:
    counts["active"] -= cfg.model.vocab_size * cfg.model.d_model
  for what, published in (("total", total_published), ("active", active_published)):
    assert _matches(counts[what], published, TWO_DIGITS.get((family, preset, what))), (
        what, counts[what], published)


@pytest.mark.parametrize("family,preset", CASES)
def test_the_perf_models_shape_counts_the_same_parameters(family, preset):
  from moejax.perf.shapes import shape_of
  cfg = preset_config(family, preset)
  assert shape_of(cfg).total_params() == config_lib.num_params(cfg)["total"]


def test_the_perf_models_shape_counts_an_own_gate_without_bias():
  """AfMoE's gate has its own weight and no bias: with q/k/v biases, the q bias is H*Dh wide."""
  from moejax.perf.shapes import shape_of
  cfg = tiny_config("afmoe", **{"model.qkv_bias": True})
  assert shape_of(cfg).total_params() == config_lib.num_params(cfg)["total"]
  leaves = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
      lambda: olmoe.init_params(cfg, jax.random.key(0)))))
  assert leaves == config_lib.num_params(cfg)["total"]


def test_sinks_are_float32_replicated_and_undecayed():
  """Attention sinks (one softmax logit per head): their own group, gathered or cast in float32
  (Flint keeps them so), without weight decay, and on no sharded axis."""
  from moejax.sharding import layout
  cfg = tiny_config("granitemoe_swa")
  meta = olmoe.param_meta(cfg)["layers"]["attn"]["sinks"]
  assert (meta.group, meta.axes[-1]) == (axes.SINKS, axes.HEAD)
  assert axes.SINKS in axes.FLOAT32_GROUPS and axes.SINKS in axes.NO_DECAY
  for placement in ("fsdp", "ep", "fssdp"):
    assert layout.layout_for(meta, layout.RULES[placement], 8).kind == layout.REPLICATE
