"""Hugging Face import/export of every family against transformers itself (the reference runs in
.venv311).

Random models (tests/convert/hf_reference.py MODELS): OLMoE "a" saved in the Hub's per-expert
layout, sharded with an index, and "b" saved fused (transformers >= 5, save_original_format=False)
in one file; "mixtral" (grouped-query, head_dim != hidden/heads, a sliding window of 6 over every layer, Hub
names w1/w3/w2 under block_sparse_moe, sharded), "qwen2_moe" (qkv biases, gated shared expert, fused), "qwen3_moe"
(per-head QK-norm, one kv head; Qwen's dense layers: qwen2_moe's mlp_only_layers=[1] between
two MoE layers, qwen3_moe's decoder_sparse_step=2), "deepseek_v3" (latent attention with a q latent, two leading
dense layers, grouped sigmoid routing with a random score bias and routed scaling, fused) and
"deepseek_v3_b" (no q latent, no dense layers or groups, tied embeddings, sharded), "deepseek_v2"
(no q latent, a dense first layer, softmax top-k among the groups with the best expert, routed
scaling, per expert) and "glm4_moe" (grouped-query attention with q/k/v biases and per-head
QK-norm, half of each head rotated, a dense first layer, sigmoid top-k among the best groups with
a random score bias, per expert, sharded), "dots1" (per-head QK-norm, head width above
hidden/heads, a dense first layer, two shared experts, grouped sigmoid top-k not renormalized,
fused), "minimax_m2" (QK-norm over all heads' width, wider than hidden, two thirds of each head
rotated through its legacy rotary_dim field, sigmoid top-k with a random score bias beside the
gate, the Hub's block_sparse_moe names, sharded), "ernie4_5_moe" (neighbour-pair rotary, dense
layers between MoE ones, softmax top-k with a [1, E] selection bias, tied embeddings),
"glm4_moe_lite" (latent attention with a q latent, GLM's router, transformers' defaults for the
dense first layer, the shared expert and routed scaling; per expert, sharded), "solar_open"
(grouped-query attention with q/k/v biases, experts in every layer, GLM's router; per expert,
sharded), "minicpm5_moe" (grouped-query attention with a sigmoid output gate in the q
projection, two leading dense layers from first_k_dense_replace, GLM's router; the Hub's layout), "hy_v3"
(per-head QK-norm, dense layers from mlp_layer_types, two shared experts, a sigmoid router with
a random score bias under the Hub's names mlp.router.gate / mlp.expert_bias / mlp.shared_mlp,
per expert, sharded), "exaone_moe" (layers sliding within 3 of the 16 tokens from
sliding_window_pattern, the others unrotated, grouped sigmoid routing; per expert), "granitemoe"
(Granite's four multipliers, tied embeddings, the Hub's
fused experts input_linear / output_linear and router.layer) and "granitemoeshared" (a shared
MLP fused the same way; saved in transformers' fused names, sharded), "sarvam_moe" (GLM-4.5 under
Sarvam's Hub names: q/k/v and their biases fused in attention.query_key_value, and its original
config's field names; per expert), "param2moe" (tied; fused, sharded) and "flex_olmo" (norms on
the sublayers' outputs, QK-norm over all heads' width with grouped-query attention),
"hunyuan_v1_moe" (QK-norm after RoPE, a shared MLP, NTK-alpha RoPE, per-layer lists), "afmoe"
(sandwich norms, the output gate's own projection, sliding and unrotated layers from
global_attn_every_n_layers, the embedding scaled by mup_enabled, two shared experts) and
"mellum" (RoPE per layer type: the sliding layers' plain RoPE of their own base, the full
layer's YaRN; a dense layer between MoE ones from mlp_layer_types), "granitemoe_swa" (attention
sinks, a RoPE base per layer: one unrotated, the sliding layers' own; Granite's multipliers and
shared MLP; its own fused names) and "flint" (sinks under the Hub's softmax_offset, sliding
layers rotated and the global ones not, two dense layers, sigmoid top-k without a bias, an
ungated shared expert), "kolibri1" (sandwich norms under the Hub's post_attn_norm / post_ffn_norm,
unrotated global layers, the score bias added to the logits, under the Hub's
moe.router.expert_bias), "gpt_oss" (biases on q, k, v, o, the router and the experts,
sinks, alternate sliding layers, its config class's YaRN, the clamped SwiGLU, gate and up
interleaved; and an MXFP4 copy of its experts, as the Hub's gpt-oss checkpoints are stored),
"cohere2_moe" (parallel blocks, LayerNorm, neighbour-pair rotary, NoPE global MoE layers beside a
rotated dense one, softmax top-k, a shared expert averaged in, logit_scale, tied) and
"cohere2_moe_b" (RMSNorm, q/k/v/o biases, unrotated dense layers, sigmoid top-k not
renormalized, shared experts summed; fused), "llama4" (dense layers between MoE ones,
chunked rotated layers with Llama 3's scaling and the unscaled QK-norm, an unrotated one with the
queries' temperature, sigmoid top-2 on the experts' inputs, a shared expert; gate and up halves
of one [in, out] tensor). They
differ
in layers, heads, kv heads, head width, experts, top-k, expert and shared widths, latent ranks,
RoPE base, norm epsilon and top-k renormalization; "b", "qwen3_moe", "deepseek_v2" and
"deepseek_v3" scale RoPE by YaRN (attention factor from the factor, given, and from DeepSeek's
two mscales, equal and not). FP8 copies of "qwen3_moe" (8 x 4 blocks), "minimax_m2" (4 x 4) and
"deepseek_v3_b" (2 x 2), stored as the Hub's FP8 checkpoints are (float8 e4m3 projections beside
per-block weight_scale_inv), and of "mixtral" and "glm4_moe" in compressed-tensors' format (one
weight_scale per row), against what transformers computes from them; an INT4 copy of
"qwen3_moe" (compressed-tensors' pack-quantized, a bf16 scale per 8 columns of a row) against
compressed-tensors' own unpacking.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from moejax.convert import __main__ as cli
from moejax.convert import hf_config_from, hf_names, load_hf, read_hf_config, save_hf
from moejax.convert.hf_config import FAMILY_SPECS
from moejax.errors import CheckpointError
from moejax.layers.linear_attention import GatedDeltaNet
from moejax.models import olmoe
from moejax.sharding import hook
from moejax.sharding.mesh import make_mesh
from moejax.train import checkpoint as train_checkpoint
from moejax.train.optim import make_optimizer
from moejax.train.state import state_layout

MODELS = ("a", "b", "mixtral", "qwen2_moe", "qwen3_moe", "minimax_m2", "ernie4_5_moe", "glm4_moe",
          "dots1", "deepseek_v2", "deepseek_v3", "deepseek_v3_b", "deepseek_v32", "glm_moe_dsa",
          "glm4_moe_lite", "solar_open",
          "minicpm5_moe", "hy_v3", "exaone_moe", "granitemoe", "granitemoeshared", "sarvam_moe",
          "param2moe", "flex_olmo", "hunyuan_v1_moe", "afmoe", "mellum",
          "granitemoe_swa", "flint", "kolibri1", "gpt_oss", "cohere2_moe", "cohere2_moe_b",
          "qwen3_next", "granitemoehybrid", "llama4")
SAVED_FUSED = ("b", "qwen2_moe", "dots1", "deepseek_v3", "glm_moe_dsa", "granitemoeshared",
               "param2moe", "cohere2_moe_b")
FP8_MODELS = ("qwen3_moe_fp8", "minimax_m2_fp8", "deepseek_v3_b_fp8", "mixtral_ct_fp8",
              "glm4_moe_ct_fp8", "qwen3_moe_int4")


@functools.cache
def _fp32_forward(cfg):
  """One compiled forward per config: the quantized copies share their base model's."""
  gather = functools.partial(hook.local_gather, dtype=jnp.float32)
  return jax.jit(lambda p, t: olmoe.forward(cfg, p, t, gather=gather, remat="none")[0])


def fp32_logits(cfg, params, tokens):
  return np.asarray(_fp32_forward(cfg)(params, tokens))


def assert_logits_close(got, want, rel=1e-5):
  scale = float(np.max(np.abs(want)))
  diff = float(np.max(np.abs(got - want)))
  assert diff < rel * scale, f"max |logit diff| {diff:.3g} >= {rel:g} * max |logit| {scale:.3g}"


def bits(x) -> np.ndarray:
  x = np.asarray(x)
  assert x.dtype == np.float32, x.dtype
  return x.view(np.uint32)


def assert_same_bits(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.shape == y.shape, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(bits(x), bits(y), err_msg=jax.tree_util.keystr(path))


def read_all(hf_dir) -> dict[str, np.ndarray]:
  out = {}
  for fname in sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")):
    with safe_open(os.path.join(hf_dir, fname), "numpy") as f:
      out.update({k: f.get_tensor(k) for k in f.keys()})
  return out


@pytest.fixture(scope="module")
def imported(hf_models):
  return {name: load_hf(hf_models[name][0]) for name in (*MODELS, *FP8_MODELS)}


@pytest.mark.parametrize("name", MODELS)
def test_logits_match_transformers_fp32(name, hf_models, imported):
  _, tokens, want = hf_models[name]
  cfg, params = imported[name]
  # Gated DeltaNet's chunks solve (I + L) u = ... by one triangular solve where transformers
  # inverts (I + L) row by row: fp32 rounding the solve can amplify (qwen3_next: 1.7e-5 of the
  # largest logit at this seed, below 1e-5 at the seed it had before granitemoehybrid joined)
  gdn = cfg.model.linear_layers and cfg.model.linear_kind == "gated_deltanet"
  assert_logits_close(fp32_logits(cfg, params, tokens), want, rel=3e-5 if gdn else 1e-5)
  # Each option's counter-check (the option off, the logits move past the bound) runs on the
  # first model that has it in the session: it shows the comparison is sensitive to the option;
  # every later model's own logits are checked above (the counter-checks of every model with
  # the option cost this file 6 s more, -n 0).
  _LOGITS_CHECKED.add(name)
  for option, changed, rel in (
      # YaRN moves these logits: plain RoPE would fail above
      ("yarn", cfg.model.rope_scaling != "none" and _model(cfg, rope_scaling="none"), 1e-2),
      # the bias on the scores would choose other experts
      ("score bias on logits", cfg.moe.score_bias_on_logits and _moe(
          cfg, score_bias_on_logits=False), 1e-2),
      # the clamp binds: unclamped moves the logits
      ("swiglu clamp", cfg.moe.activation == "swiglu_clamped" and _moe(cfg, swiglu_limit=1e9),
       1e-2),
      # Qwen3-Next's norms scale by 1 + w
      ("zero-centered norms", cfg.model.norm_kind == "rms_zero_centered" and _model(
          cfg, norm_kind="rms"), 1e-2),
      # the sliding layers' own RoPE moves them too (within a window of 3 by at most two
      # positions' rotation: a smaller move than YaRN's)
      ("sliding rope theta", cfg.model.sliding_rope_theta and _model(
          cfg, sliding_rope_theta=0.0), 1e-4)):
    if changed and option not in _COUNTER_CHECKED:
      _COUNTER_CHECKED.add(option)
      with pytest.raises(AssertionError):
        assert_logits_close(fp32_logits(changed, params, tokens), want, rel=rel)


_COUNTER_CHECKED: set = set()
_LOGITS_CHECKED: set = set()
COUNTER_CHECKS = {"yarn", "score bias on logits", "swiglu clamp", "zero-centered norms",
                  "sliding rope theta"}


def test_every_option_was_counter_checked_once():
  """After the models above (in this file's order): each option some model has was switched off
  once and moved the logits past the bound."""
  if _LOGITS_CHECKED != set(MODELS):
    pytest.skip("only part of test_logits_match_transformers_fp32 ran")
  assert _COUNTER_CHECKED == COUNTER_CHECKS


def _model(cfg, **changes):
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


def _moe(cfg, **changes):
  return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **changes))


@pytest.mark.parametrize("name", FP8_MODELS)
def test_fp8_checkpoints_import_as_transformers_dequantizes_them(name, hf_models, imported):
  """FP8 imports to transformers' own dequantized weights bit for bit, and to its logits; INT4
  to compressed-tensors' unpacking times the scales (transformers keeps those experts in bf16,
  rounded) and transformers' logits from them. Quantization moved those logits well past the
  bound, so the scales were applied."""
  hf_dir, tokens, want = hf_models[name]
  base = name.removesuffix("_fp8").removesuffix("_int4").removesuffix("_ct")
  cfg, params = imported[name]
  dequantized_cfg, dequantized = load_hf(hf_dir + "_dequantized")
  assert cfg == dequantized_cfg == imported[base][0]
  assert_same_bits(params, dequantized)
  assert_logits_close(fp32_logits(cfg, params, tokens), want)
  unquantized = hf_models[base][2]
  assert np.max(np.abs(unquantized - want)) > 1e-2 * np.max(np.abs(want))


def test_mxfp4_experts_import_as_transformers_dequantizes_them(hf_models, imported,
                                                              hf_reference, tmp_path,
                                                              monkeypatch):
  """gpt-oss as the Hub stores it: each expert projection as MXFP4 blocks and scales
  (quant_method "mxfp4"), the rest unquantized. moejax's import equals transformers' logits from
  the same file (its own dequantizing load), which quantization moved far from the unquantized
  model's, dequantizing each expert's block once (gate and up, interleaved in one tensor, were
  read whole for each); the experts read dequantized into ep shards (3 of 6 a device) as on the
  host; the export is unquantized and reads back bit for bit."""
  from collections import Counter
  from moejax.convert.safetensors_io import TensorReader
  from tests.convert.test_mxfp4 import quantize_mxfp4
  from safetensors.numpy import save_file
  hf_dir, tokens, unquantized = hf_models["gpt_oss"]
  out = str(tmp_path / "gpt_oss_mxfp4")
  tensors = {}
  for name, value in read_all(hf_dir).items():
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(value)
    else:
      tensors[name] = value
  os.makedirs(out)
  save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  hf = dict(read_hf_config(hf_dir), quantization_config={
      "quant_method": "mxfp4", "modules_to_not_convert": [
          "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
          "lm_head"]})
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f)
  np.save(str(tmp_path / "tokens.npy"), tokens)
  reply = hf_reference.call("logits", hf_dir=out, tokens=str(tmp_path / "tokens.npy"),
                            out=str(tmp_path / "logits.npy"))
  assert reply["loading_info"] == {}, reply["loading_info"]
  want = np.load(str(tmp_path / "logits.npy"))
  reads, dequantize = Counter(), TensorReader._read_mxfp4

  def counted(reader, name, index):
    reads[name] += 1
    return dequantize(reader, name, index)

  monkeypatch.setattr(TensorReader, "_read_mxfp4", counted)
  cfg, params = load_hf(out)
  monkeypatch.setattr(TensorReader, "_read_mxfp4", dequantize)
  experts = cfg.moe.num_experts
  assert len(reads) == 2 * cfg.model.num_layers and set(reads.values()) == {experts}, reads
  assert cfg == imported["gpt_oss"][0]
  assert_logits_close(fp32_logits(cfg, params, tokens), want)
  assert np.max(np.abs(unquantized - want)) > 1e-2 * np.max(np.abs(want))
  ep = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, placement="ep"))
  mesh = make_mesh((1, 2), jax.devices()[:2])      # 6 experts: 3 a device
  shardings = state_layout(ep, mesh, make_optimizer(ep)).shardings.params
  _, sharded = load_hf(out, shardings=shardings)
  assert_same_bits(jax.device_get(sharded), params)
  save_hf(params, cfg, str(tmp_path / "export"))
  assert "quantization_config" not in read_hf_config(str(tmp_path / "export"))
  assert_same_bits(load_hf(str(tmp_path / "export"))[1], params)


def test_kimi_k2_reads_as_deepseek_v3(hf_models, imported, tmp_path):
  """Kimi-K2's config.json names its own model_type over DeepSeek-V3's architecture (its README:
  frameworks without "kimi_k2" read it as "deepseek_v3"): the same config and weights; an
  export says deepseek_v3 and keeps the checkpoint's other fields."""
  import shutil
  kimi = str(tmp_path / "kimi")
  shutil.copytree(hf_models["deepseek_v3_b"][0], kimi)
  hf = read_hf_config(kimi)
  hf.update(model_type="kimi_k2", max_position_embeddings=777,
            auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
  with open(os.path.join(kimi, "config.json"), "w") as f:
    json.dump(hf, f)
  cfg, params = load_hf(kimi)
  assert cfg == imported["deepseek_v3_b"][0]
  assert_same_bits(params, imported["deepseek_v3_b"][1])
  exported = hf_config_from(cfg, hf)
  assert exported["model_type"] == "deepseek_v3" and "auto_map" not in exported
  assert exported["max_position_embeddings"] == 777
  # a workdir fine-tuned from it exports with these fields too
  from moejax.convert import checkpoint_io
  found = checkpoint_io._init_from_hf_config(dataclasses.replace(cfg, init_from=kimi))
  assert found is not None and found["max_position_embeddings"] == 777


# Multimodal checkpoints as the Hub publishes them: the family whose text model they hold, the
# outer config's fields, the vision tensors beside the text model's.
MULTIMODAL = {
    "llama4": ("llama4", dict(architectures=["Llama4ForConditionalGeneration"], model_type="llama4",
                              vision_config={"model_type": "llama4_vision_model"}),
               ("vision_model.patch_embedding.linear.weight",
                "multi_modal_projector.linear_1.weight")),
    # Kimi-K2.5: a DeepSeek-V3 text model (text_config model_type kimi_k2), its LM head untied
    # by the outer config's tie_word_embeddings
    "kimi_k25": ("deepseek_v3", dict(architectures=["KimiK25ForConditionalGeneration"],
                                     model_type="kimi_k25", tie_word_embeddings=False,
                                     vision_config={"model_type": "kimi_k25_vision"}),
                 ("vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight")),
}


@pytest.mark.parametrize("wrapper", sorted(MULTIMODAL))
def test_a_multimodal_checkpoint_reads_its_text_model(hf_models, imported, tmp_path, wrapper):
  """Llama 4 and Kimi-K2.5 as the Hub publishes them (Llama4ForConditionalGeneration,
  KimiK25ForConditionalGeneration): the text model's tensors under language_model. beside the
  vision encoder's, its config.json the text_config of the multimodal config. The import is the
  text model's own, bit for bit, the vision tensors left; an export writes the text model with
  the checkpoint's fields; a missing text tensor is named with its prefix."""
  from safetensors.numpy import save_file
  family, outer, vision_names = MULTIMODAL[wrapper]
  hf_dir = hf_models[family][0]
  wrapped = str(tmp_path / wrapper)
  os.makedirs(wrapped)
  tensors = {f"language_model.{k}": v for k, v in read_all(hf_dir).items()}
  for name in vision_names:
    tensors[name] = np.ones((4, 3), np.float32)
  save_file(tensors, os.path.join(wrapped, "model.safetensors"))
  with open(os.path.join(hf_dir, "config.json")) as f:
    text = json.load(f)
  if wrapper == "kimi_k25":
    text["model_type"] = "kimi_k2"          # as Kimi-K2.5's text_config names it
  with open(os.path.join(wrapped, "config.json"), "w") as f:
    json.dump(dict(outer, text_config=dict(text, max_position_embeddings=555)), f)
  cfg, params = load_hf(wrapped)
  assert cfg == imported[family][0]
  assert_same_bits(params, imported[family][1])
  exported = hf_config_from(cfg, read_hf_config(wrapped))
  assert (exported["model_type"], exported["max_position_embeddings"]) == (
      FAMILY_SPECS[family].model_type, 555)
  del tensors["language_model.model.norm.weight"]
  save_file(tensors, os.path.join(wrapped, "model.safetensors"))
  with pytest.raises(CheckpointError, match="'language_model.model.norm.weight' is missing"):
    load_hf(wrapped)


# Multimodal models transformers built and saved (hf_reference.MULTIMODAL_MODELS): the family of
# their text model
MULTIMODAL_SAVED = {"qwen3_vl_moe": "qwen3_moe", "glm4v_moe": "glm4_moe",
                    "qwen3_5_moe": "qwen3_5_moe"}


@pytest.mark.parametrize("name", sorted(MULTIMODAL_SAVED))
def test_a_multimodal_model_reads_as_transformers_runs_it(name, hf_models, tmp_path):
  """Qwen3-VL-MoE, GLM-4.5V and Qwen3.5-MoE as transformers saves them (Qwen3VLMoe-,
  Glm4vMoe- and Qwen3_5MoeForConditionalGeneration): read as their text model, whose logits on
  text are transformers'; the export is the text model's family's checkpoint without the
  multimodal RoPE's keys, read back as the same model bit for bit; a missing text tensor is
  named as the checkpoint names it."""
  from safetensors.numpy import save_file
  from moejax.convert.hf_config import config_from_hf
  hf_dir, tokens, want = hf_models[name]
  cfg, params = load_hf(hf_dir)
  assert cfg.model.family == MULTIMODAL_SAVED[name] and not cfg.model.tie_embeddings
  assert_logits_close(fp32_logits(cfg, params, tokens), want)
  exported = hf_config_from(cfg, read_hf_config(hf_dir))
  assert exported["model_type"] == FAMILY_SPECS[cfg.model.family].model_type
  assert "mrope" not in json.dumps(exported)
  assert config_from_hf(exported).model == cfg.model
  text = str(tmp_path / "text")
  save_hf(params, cfg, text)
  again_cfg, again = load_hf(text)
  assert again_cfg.model == cfg.model
  assert_same_bits(again, params)
  broken = str(tmp_path / "broken")
  os.makedirs(broken)
  tensors = read_all(hf_dir)
  del tensors["model.language_model.norm.weight"]
  save_file(tensors, os.path.join(broken, "model.safetensors"))
  shutil.copy(os.path.join(hf_dir, "config.json"), broken)
  with pytest.raises(CheckpointError, match="'model.language_model.norm.weight' is missing"):
    load_hf(broken)


def test_qwen3_vl_moe_experts_read_in_either_layout(hf_models, tmp_path):
  """Qwen3-VL-MoE's fused experts as the Hub holds them ([in, out]) and as transformers 5 saves
  them ([out, in]), told apart by shape as transformers does, import bit for bit alike; its
  router renormalizes the top-k though the config has no norm_topk_prob."""
  from safetensors.numpy import save_file
  hf_dir = hf_models["qwen3_vl_moe"][0]
  cfg, params = load_hf(hf_dir)
  assert cfg.moe.renormalize      # (its logits, transformers' on a top-3 of 6: the test above)
  hub = str(tmp_path / "hub")
  os.makedirs(hub)
  tensors = read_all(hf_dir)
  experts = [n for n in tensors if ".mlp.experts." in n]
  assert experts and all(n.startswith("model.language_model.") for n in experts)
  tensors.update({n: np.ascontiguousarray(np.swapaxes(tensors[n], 1, 2)) for n in experts})
  save_file(tensors, os.path.join(hub, "model.safetensors"))
  shutil.copy(os.path.join(hf_dir, "config.json"), hub)
  hub_cfg, hub_params = load_hf(hub)
  assert hub_cfg == cfg
  assert_same_bits(hub_params, params)


def test_kimi_k25_ties_its_lm_head_by_the_outer_config():
  """transformers ties Kimi-K2.5's LM head by the multimodal config's tie_word_embeddings
  (default true), whatever its text_config says; a text_config of another family is refused."""
  from moejax.convert.hf_config import config_from_hf
  text = dict(model_type="kimi_k2", vocab_size=64, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, intermediate_size=64, kv_lora_rank=16, q_lora_rank=None,
              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
              n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False)
  for outer, tied in (({}, True), ({"tie_word_embeddings": False}, False),
                      ({"tie_word_embeddings": True}, True)):
    cfg = config_from_hf(dict(outer, model_type="kimi_k25", text_config=text))
    assert (cfg.model.family, cfg.model.tie_embeddings) == ("deepseek_v3", tied)
  with pytest.raises(CheckpointError, match="text_config.model_type='qwen3_moe'"):
    config_from_hf({"model_type": "kimi_k25", "text_config": dict(text, model_type="qwen3_moe")})


def test_an_import_reports_its_progress(hf_models, imported, monkeypatch):
  """A long import (Scout and Maverick read about 220-800 GB) says how far it is: parameters read,
  the share and an ETA every so often, and the total at the end; on the host and into shards
  (there by leaf), the same parameters either way."""
  from moejax.convert import hf as hf_lib
  monkeypatch.setattr(hf_lib.ReadProgress, "__init__", functools.partialmethod(
      hf_lib.ReadProgress.__init__, every_s=0.0))         # report at every block
  hf_dir = hf_models["llama4"][0]
  lines = []
  cfg, params = load_hf(hf_dir, progress=lines.append)
  assert_same_bits(params, imported["llama4"][1])
  total = sum(x.size for x in jax.tree.leaves(params))
  shares = [int(line.split("(")[1].split("%")[0]) for line in lines[:-1]]
  assert len(shares) > 10 and shares == sorted(shares) and shares[-1] < 100
  assert all(f"of {total:,} parameters" in line and "ETA" in line for line in lines[:-1])
  assert lines[-1].startswith(f"moejax: read {total:,} parameters from {hf_dir} in ")
  sharded_lines = []
  mesh = make_mesh((1, 2), jax.devices()[:2])
  shardings = state_layout(cfg, mesh, make_optimizer(cfg)).shardings.params
  _, sharded = load_hf(hf_dir, shardings=shardings, progress=sharded_lines.append)
  assert_same_bits(jax.device_get(sharded), params)
  assert sharded_lines[-1].rsplit(" in ", 1)[0] == lines[-1].rsplit(" in ", 1)[0]


def test_config_mapping(hf_models, imported):
  cfg, _ = imported["b"]
  m, moe = cfg.model, cfg.moe
  assert (m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.head_dim) == (80, 48, 3, 3, 16)
  assert (m.rope_theta, m.norm_eps, m.init_std) == (500000.0, 1e-6, 0.1)
  assert (m.rope_scaling, m.rope_factor, m.rope_original_max_len, m.rope_attention_factor) == (
      "yarn", 4.0, 64, 0.0)
  assert imported["a"][0].model.rope_scaling == "none"
  assert (moe.num_experts, moe.top_k, moe.expert_hidden) == (6, 3, 40)
  assert moe.renormalize and moe.score == "softmax" and moe.aux_loss_weight == 0.02
  assert not imported["a"][0].moe.renormalize
  assert (m.family, m.qk_norm, m.num_kv_heads, m.qkv_bias) == ("olmoe", "full", 0, False)
  m, moe = imported["mixtral"][0].model, imported["mixtral"][0].moe
  assert (m.family, m.qk_norm, m.num_heads, m.num_kv_heads, m.head_dim) == ("mixtral", "none", 4,
                                                                           2, 12)
  assert (moe.num_experts, moe.renormalize, moe.shared_expert_hidden) == (5, True, 0)
  assert (m.sliding_window, m.sliding_layers) == (6, (0, 1))
  m, moe = imported["qwen2_moe"][0].model, imported["qwen2_moe"][0].moe
  assert (m.family, m.qk_norm, m.qkv_bias, m.num_kv_heads) == ("qwen2_moe", "none", True, 2)
  assert (moe.expert_hidden, moe.shared_expert_hidden, moe.shared_expert_gate) == (20, 44, True)
  assert not moe.renormalize
  assert (m.dense_layers, m.dense_hidden) == ((1,), 52)
  m, moe = imported["qwen3_moe"][0].model, imported["qwen3_moe"][0].moe
  assert (m.family, m.qk_norm, m.num_kv_heads, m.head_dim) == ("qwen3_moe", "head", 1, 16)
  assert (m.dense_layers, m.dense_hidden) == ((0,), 48)
  assert (moe.num_experts, moe.top_k, moe.expert_hidden, moe.renormalize) == (10, 4, 24, True)
  assert (m.rope_factor, m.rope_original_max_len, m.rope_truncate, m.rope_attention_factor,
          m.rope_beta_fast, m.rope_beta_slow) == (6.0, 40, False, 1.25, 24.0, 2.0)
  m, moe = imported["glm4_moe"][0].model, imported["glm4_moe"][0].moe
  assert (m.family, m.head_dim, m.rotary_dim, m.qk_norm, m.qkv_bias, m.num_kv_heads) == (
      "glm4_moe", 12, 6, "head", True, 2)
  assert (m.dense_layers, m.dense_hidden, moe.shared_expert_hidden, moe.shared_expert_gate) == (
      (0,), 48, 16, False)
  assert (moe.score, moe.score_bias, moe.renormalize, moe.expert_groups, moe.top_groups,
          moe.group_score, moe.routed_scale) == ("sigmoid", True, True, 3, 2, "top2", 2.5)
  m, moe = imported["minimax_m2"][0].model, imported["minimax_m2"][0].moe
  assert (m.family, m.head_dim, m.rotary_dim, m.qk_norm, m.num_kv_heads, m.dense_layers) == (
      "minimax_m2", 24, 16, "full", 2, ())
  assert (moe.score, moe.score_bias, moe.renormalize, moe.shared_expert_hidden) == (
      "sigmoid", True, True, 0)
  m, moe = imported["ernie4_5_moe"][0].model, imported["ernie4_5_moe"][0].moe
  assert (m.family, m.rotary_interleaved, m.dense_layers, m.dense_hidden, m.tie_embeddings) == (
      "ernie4_5_moe", True, (0, 2), 36, True)
  assert (moe.top_k, moe.score, moe.score_bias, moe.renormalize, moe.shared_expert_hidden) == (
      3, "softmax", True, True, 40)
  m, moe = imported["dots1"][0].model, imported["dots1"][0].moe
  assert (m.family, m.head_dim, m.rotary_dim, m.qk_norm, m.qkv_bias, m.dense_layers) == (
      "dots1", 20, 0, "head", False, (0,))
  assert (moe.shared_expert_hidden, moe.score, moe.score_bias, moe.renormalize,
          moe.expert_groups, moe.top_groups, moe.routed_scale) == (
      24, "sigmoid", True, False, 4, 2, 1.5)


def test_deepseek_config_mapping(imported):
  m, moe = imported["deepseek_v3"][0].model, imported["deepseek_v3"][0].moe
  assert (m.family, m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
          m.v_head_dim, m.head_dim) == ("deepseek_v3", 20, 24, 12, 6, 10, 18)
  assert (m.num_layers, m.dense_layers, m.dense_hidden, m.tie_embeddings) == (
      4, (0, 1), 56, False)
  assert (moe.num_experts, moe.top_k, moe.expert_hidden, moe.shared_expert_hidden) == (
      12, 3, 16, 32)
  assert (m.rope_scaling, m.rope_factor, m.rope_mscale, m.rope_mscale_all_dim) == (
      "yarn", 8.0, 0.9, 0.7)
  assert (moe.score, moe.score_bias, moe.expert_groups, moe.top_groups, moe.routed_scale,
          moe.renormalize) == ("sigmoid", True, 3, 2, 1.7, True)
  m, moe = imported["deepseek_v2"][0].model, imported["deepseek_v2"][0].moe
  assert (m.family, m.q_lora_rank, m.kv_lora_rank, m.dense_layers, m.dense_hidden) == (
      "deepseek_v2", 0, 18, (0,), 44)
  assert (moe.score, moe.score_bias, moe.renormalize, moe.expert_groups, moe.top_groups,
          moe.group_score, moe.routed_scale, moe.shared_expert_hidden, moe.aux_loss_weight) == (
      "softmax", False, False, 3, 2, "max", 2.0, 32, 0.004)
  assert (m.rope_scaling, m.rope_factor, m.rope_mscale, m.rope_mscale_all_dim) == (
      "yarn", 16.0, 0.707, 0.707)
  m, moe = imported["deepseek_v3_b"][0].model, imported["deepseek_v3_b"][0].moe
  assert (m.q_lora_rank, m.dense_layers, m.tie_embeddings, moe.expert_groups) == (0, (), True, 1)
  assert "lm_head" not in imported["deepseek_v3_b"][1]


def test_configs_hf_presets_any_checkpoint_from_its_config_json(hf_models, imported):
  """`--config configs/hf.py:DIR`: the model and routing of the checkpoint at DIR, init_from set
  to it, so the weights' check finds nothing to refuse."""
  import configs.hf as hf_preset
  from moejax.config import from_config_dict
  from moejax.train.loop import _first_mismatch
  for name in ("qwen3_moe", "minimax_m2", "glm4_moe", "deepseek_v2"):
    cfg = from_config_dict(hf_preset.get_config(hf_models[name][0]))
    want = imported[name][0]
    # The presets' training choices: no z-loss (none of these has one), the score bias moving
    # where there is one; aux-loss-free GLM's transformers default of no aux loss.
    assert cfg.model == want.model and cfg.moe == dataclasses.replace(
        want.moe, z_loss_weight=0.0, score_bias_rate=1e-3 if want.moe.score_bias else 0.0), name
    assert cfg.init_from == hf_models[name][0] and cfg.data.tokenizer == "init_from"
    assert _first_mismatch(want, cfg) is None
  assert imported["glm4_moe"][0].moe.aux_loss_weight == 0.0


def test_export_reimport_is_bit_exact(hf_models, imported, tmp_path):
  for name in MODELS:
    hf_dir = hf_models[name][0]
    cfg, params = imported[name]
    out = str(tmp_path / name)
    files = save_hf(params, cfg, out, max_shard_bytes=40_000, hf_config_base=read_hf_config(hf_dir))
    assert "model.safetensors.index.json" in files and len(files) > 3
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg
    assert_same_bits(params, params2)


@pytest.mark.parametrize("name", MODELS)
def test_export_writes_the_hub_tensors_bit_for_bit(name, hf_models, imported, tmp_path):
  """A model saved per expert: the export holds the same tensors, names, shapes and bits. A model
  saved fused: its per-expert export matches the fused tensors' halves."""
  cfg, params = imported[name]
  save_hf(params, cfg, str(tmp_path / name))
  original, exported = read_all(hf_models[name][0]), read_all(str(tmp_path / name))
  if name in SAVED_FUSED and cfg.model.family in hf_names.HUB_FUSED_EXPERTS:
    # Granite's Hub layout is fused too, under its own names.
    gate_up, down_name = hf_names.HUB_FUSED_EXPERTS[cfg.model.family]
    for i in range(cfg.model.num_layers):
      prefix = f"model.layers.{i}.block_sparse_moe"
      for fused, hub in (("experts.gate_up_proj", gate_up), ("experts.down_proj", down_name),
                         ("router.weight", "router.layer.weight")):
        original[f"{prefix}.{hub}"] = original.pop(f"{prefix}.{fused}")
  elif name in SAVED_FUSED:
    if cfg.model.family in hf_names.HUB_ATTENTION_NAMES:    # Sarvam's names (Param2's too)
      module, qkv, out, q_norm, k_norm = hf_names.HUB_ATTENTION_NAMES[cfg.model.family]
      original[hf_names.HUB_EMBED_NAME[cfg.model.family]] = original.pop(
          "model.embed_tokens.weight")
      for i in range(cfg.model.num_layers):
        attn = f"model.layers.{i}.self_attn"
        original[f"model.layers.{i}.{module}.{qkv}.weight"] = np.concatenate(
            [original.pop(f"{attn}.{p}_proj.weight") for p in "qkv"])
        for hub, fused in ((out, "o_proj"), (q_norm, "q_norm"), (k_norm, "k_norm")):
          original[f"model.layers.{i}.{module}.{hub}.weight"] = original.pop(
              f"{attn}.{fused}.weight")
        if i not in cfg.model.dense_layers:
          original[f"model.layers.{i}.mlp.gate.expert_bias"] = original.pop(
              f"model.layers.{i}.mlp.gate.e_score_correction_bias")
    f = cfg.moe.expert_hidden
    moe_module, (gate, up, down_name) = hf_names.HUB_EXPERT_NAMES[cfg.model.family]
    for i in sorted(set(range(cfg.model.num_layers)) - set(cfg.model.dense_layers)):
      gate_up = original.pop(f"model.layers.{i}.mlp.experts.gate_up_proj")
      down = original.pop(f"model.layers.{i}.mlp.experts.down_proj")
      original[f"model.layers.{i}.{moe_module}.gate.weight"] = original.pop(
          f"model.layers.{i}.mlp.gate.weight")
      for e in range(cfg.moe.num_experts):
        prefix = f"model.layers.{i}.{moe_module}.experts.{e}"
        for hf_name, want in ((gate, gate_up[e, :f]), (up, gate_up[e, f:]), (down_name, down[e])):
          original[f"{prefix}.{hf_name}.weight"] = want
  assert sorted(original) == sorted(exported)
  for k in original:
    np.testing.assert_array_equal(bits(exported[k]), bits(original[k]), err_msg=k)


def test_transformers_loads_the_export(hf_models, imported, hf_reference, tmp_path):
  # Each with its own config.json as the base (transformers 5's rope_parameters), and DeepSeek's
  # YaRN once without one (transformers 4's rope_scaling, which transformers 5 still reads).
  for name in (*MODELS, "deepseek_v3:no_base"):
    name, no_base = name.split(":")[0], name.endswith(":no_base")
    hf_dir, tokens, want = hf_models[name]
    cfg, params = imported[name]
    out = str(tmp_path / name) + ("_no_base" if no_base else "")
    save_hf(params, cfg, out, max_shard_bytes=30_000 if name in SAVED_FUSED else 10**9,
            hf_config_base=None if no_base else read_hf_config(hf_dir))
    assert ("rope_scaling" if no_base else "rope_parameters") in read_hf_config(out)
    np.save(str(tmp_path / f"{name}.tokens.npy"), tokens)
    reply = hf_reference.call("logits", hf_dir=out, tokens=str(tmp_path / f"{name}.tokens.npy"),
                              out=str(tmp_path / f"{name}.logits.npy"))
    assert reply["loading_info"] == {}, reply["loading_info"]   # no missing/unexpected keys
    got = np.load(str(tmp_path / f"{name}.logits.npy"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("name,placement,mesh_shape", [("a", "ep", (2, 4)), ("a", "fsdp", (1, 8)),
                                                       ("b", "fsdp", (2, 4)),
                                                       ("qwen2_moe", "fsdp", (1, 8)),
                                                       ("qwen3_moe_fp8", "fsdp", (1, 8)),
                                                       ("minimax_m2_fp8", "ep", (2, 4)),
                                                       ("qwen3_moe_int4", "fsdp", (2, 4))])
def test_load_straight_into_shards(name, placement, mesh_shape, hf_models, imported):
  """On 8 devices: each leaf lands with the train state's sharding and the same bits as the
  host load (model b reads fused gate/up halves block by block; the FP8 model's device blocks
  cut through its 8 x 4 scale blocks)."""
  assert jax.device_count() == 8
  cfg, host_params = imported[name]
  cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, placement=placement))
  mesh = make_mesh(mesh_shape)
  shardings = state_layout(cfg, mesh, make_optimizer(cfg)).shardings.params
  _, params = load_hf(hf_models[name][0], shardings=shardings)
  leaves = zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(shardings),
               jax.tree.leaves(host_params))
  for (path, x), want_sharding, host in leaves:
    assert x.sharding == want_sharding, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(bits(x), bits(host), err_msg=jax.tree_util.keystr(path))
  if placement == "ep":   # experts really are split: each device holds E / 8 of them
    w_gate = params["layers"]["moe"]["w_gate"]
    assert {s.data.shape[1] for s in w_gate.addressable_shards} == {cfg.moe.num_experts // 8}


def test_quantized_starts_say_the_weights_were_dequantized(hf_models, imported, tmp_path,
                                                         capsys):
  """from-hf and a run's init_from name the quantization they read through."""
  from moejax.train.loop import Trainer, init_from
  hf_dir, (cfg, params) = hf_models["qwen3_moe_int4"][0], imported["qwen3_moe_int4"]
  ckpt = str(tmp_path / "ckpt")
  assert cli.main(["from-hf", hf_dir, ckpt]) == 0
  said = "(weights INT4 per 8 columns of a row, dequantized to fp32)"
  assert f"; {said[1:]}" in capsys.readouterr().out
  assert_same_bits(train_checkpoint.load_params(ckpt), params)
  state = init_from(Trainer(cfg, mesh=make_mesh((1, -1), jax.devices()[:1])), hf_dir)
  assert f"moejax: initialized from {hf_dir} {said}" in capsys.readouterr().out
  assert_same_bits(jax.device_get(state.params), params)


def test_cli_from_hf_then_to_hf(hf_models, imported, tmp_path, capsys):
  hf_dir = hf_models["a"][0]
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
  assert cli.main(["from-hf", hf_dir, ckpt]) == 0
  assert "wrote" in capsys.readouterr().out
  cfg, params = imported["a"]
  # What a training run reads back.
  assert train_checkpoint.load_config(ckpt) == cfg
  assert_same_bits(train_checkpoint.load_params(ckpt), params)
  assert cli.main(["to-hf", ckpt, out, "--max-shard-size", "64KB"]) == 0
  original, exported = read_all(hf_dir), read_all(out)
  assert sorted(original) == sorted(exported)
  for k in original:
    np.testing.assert_array_equal(bits(exported[k]), bits(original[k]), err_msg=k)
  with open(os.path.join(hf_dir, "config.json")) as f:
    want = json.load(f)
  with open(os.path.join(out, "config.json")) as f:
    got = json.load(f)
  for key in ("vocab_size", "hidden_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
              "rms_norm_eps", "eos_token_id", "pad_token_id", "max_position_embeddings"):
    assert got[key] == want[key], key


# Gated DeltaNet against transformers' Qwen3-Next linear attention layer (Qwen3NextGatedDeltaNet):
# width, key heads, value heads, key and value head widths, taps
GDN = (24, 2, 4, 8, 6, 4)


def _gdn_hf_weights(rng) -> dict[str, np.ndarray]:
  d, hk, hv, dk, dv, taps = GDN
  normal = lambda *shape, std=0.3: (std * rng.normal(size=shape)).astype(np.float32)  # noqa: E731
  return {"in_proj_qkvz.weight": normal(2 * hk * dk + 2 * hv * dv, d),
          "in_proj_ba.weight": normal(2 * hv, d),
          "conv1d.weight": normal(2 * hk * dk + hv * dv, 1, taps, std=0.5),
          "dt_bias": normal(hv, std=1.0),
          "A_log": np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32),
          "norm.weight": 1.0 + normal(dv, std=0.2),
          "out_proj.weight": normal(d, hv * dv)}


def _gdn_moejax_params(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """transformers' tensors as moejax's: in_proj_qkvz's rows are, per key head, its q, its k,
  then its value heads' v and z; in_proj_ba's its value heads' b then a."""
  d, hk, hv, dk, dv, _ = GDN
  r, kw = hv // hk, hk * dk
  qkvz = hf["in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, d)
  bounds = np.cumsum([0, dk, dk, r * dv, r * dv])
  q, k, v, z = (qkvz[:, a:b].reshape(-1, d).T for a, b in zip(bounds[:-1], bounds[1:]))
  ba = hf["in_proj_ba.weight"].reshape(hk, 2 * r, d)
  taps = hf["conv1d.weight"][:, 0, :].T
  return dict(wq=q, wk=k, wv=v, wz=z, wb=ba[:, :r].reshape(-1, d).T,
              wa=ba[:, r:].reshape(-1, d).T, conv_q=taps[:, :kw], conv_k=taps[:, kw:2 * kw],
              conv_v=taps[:, 2 * kw:], dt_bias=hf["dt_bias"], a_log=hf["A_log"],
              out_norm=hf["norm.weight"], wo=hf["out_proj.weight"].T)


def test_gated_deltanet_matches_transformers(hf_reference, tmp_path):
  """Over 150 tokens (chunks of 64, the last one partial), two value heads per key head, fp32:
  moejax's layer's output is transformers' within rounding; read as transformers'
  in_proj_qkvz split into q, k, v, z blocks (not per key head) it is not."""
  d, hk, hv, dk, dv, taps = GDN
  rng = np.random.default_rng(0)
  hf = _gdn_hf_weights(rng)
  x_BxSxD = rng.normal(size=(2, 150, d)).astype(np.float32)
  np.savez(tmp_path / "w.npz", **hf)
  np.save(tmp_path / "x.npy", x_BxSxD)
  out = str(tmp_path / "y.npy")
  config = dict(hidden_size=d, linear_num_key_heads=hk, linear_num_value_heads=hv,
                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=taps,
                rms_norm_eps=1e-6, hidden_act="silu", num_hidden_layers=1,
                layer_types=["linear_attention"])
  hf_reference.call("gated_delta_net", config=config, weights=str(tmp_path / "w.npz"),
                    inputs=str(tmp_path / "x.npy"), out=out)
  want = np.load(out)
  net = GatedDeltaNet(d, key_heads=hk, value_heads=hv, key_dim=dk, value_dim=dv,
                      conv_taps=taps, norm_eps=1e-6, init_std=0.02, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(net)
  forward = jax.jit(lambda params, x: nnx.merge(graphdef, params)(x))

  def run(params):
    nnx.replace_by_pure_dict(state, {k: jnp.asarray(v) for k, v in params.items()})
    return np.asarray(forward(state, jnp.asarray(x_BxSxD)))

  params = _gdn_moejax_params(hf)
  scale = np.abs(want).max()
  assert np.abs(run(params) - want).max() < 1e-5 * scale
  w = hf["in_proj_qkvz.weight"]      # blocks in order rather than grouped by key head
  kw, vw = hk * dk, hv * dv
  ungrouped = dict(params, wq=w[:kw].T, wk=w[kw:2 * kw].T, wv=w[2 * kw:2 * kw + vw].T,
                   wz=w[2 * kw + vw:].T)
  assert np.abs(run(ungrouped) - want).max() > 1e-2 * scale
