"""--config.init_from: start a new run from existing weights, and refuse mismatched shapes."""
import jax
import numpy as np
import pytest

from moejax.errors import ConfigError
from moejax.sharding.mesh import make_mesh
from moejax.train import checkpoint
from moejax.train.loop import Trainer, init_from
from tests.helpers import canonical_config


def test_init_from_a_checkpoint(trained, trainer_for):
  src = str(trained)            # the canonical run's workdir (tests/train/conftest.py)
  trainer = trainer_for(canonical_config(), 4)     # another mesh than the run's 8 devices
  state = init_from(trainer, src)
  assert int(state.step) == 0
  expected = checkpoint.load_params(src)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(jax.device_get(state.params))):
    np.testing.assert_array_equal(a, b)
  other = Trainer(canonical_config(**{"model.d_model": 32, "model.head_dim": 8}),
                  mesh=make_mesh((1, -1), jax.devices()[:1]))
  with pytest.raises(ConfigError, match=r"init_from=.*config.model.d_model=32, but the weights "
                                        r"have 64"):
    init_from(other, src)
  # Weights holding a NaN: refused at once (they trained ten steps, then the NaN was blamed on
  # the learning rate). Read through the real loader, one value made NaN.
  real = checkpoint.load_params

  def with_nan(*args, **kwargs):
    params = real(*args, **kwargs)
    embed = params["embed"]
    return {**params, "embed": embed.at[0, 0].set(np.nan)}

  import unittest.mock
  with unittest.mock.patch.object(checkpoint, "load_params", with_nan):
    with pytest.raises(ConfigError, match=r"init_from=.*: the weights hold NaN or infinite"):
      init_from(trainer, src)
  with pytest.raises(ConfigError) as e:    # named the path only, not the field
    init_from(trainer, src + "/nowhere")
  assert str(e.value) == (f"config.init_from={src + '/nowhere'!r}: no such directory (a Hugging "
                          "Face model folder with config.json, or a moejax workdir or checkpoint)")


def test_a_mismatch_is_found_before_any_weight_is_read(trained, monkeypatch):
  """Weights of another family's layout (qk norms the checkpoint lacks) stop with the one line
  naming the field, not with the first tensor the preset's layout misses."""
  def no_read(*args, **kwargs):
    raise AssertionError("weights were read before the config was checked")

  monkeypatch.setattr(checkpoint, "load_params", no_read)
  qwen3 = Trainer(canonical_config(**{"model.family": "qwen3_moe", "model.qk_norm": "head"}),
                  mesh=make_mesh((1, -1), jax.devices()[:1]))
  with pytest.raises(ConfigError, match=r"init_from=.*config.model.qk_norm='head', but the "
                                        r"weights have 'full'"):
    init_from(qwen3, str(trained))


def test_a_mismatch_names_any_option_that_changes_what_the_weights_compute():
  from moejax.train.loop import _first_mismatch
  from tests.helpers import tiny_config
  weights = tiny_config()                            # num_kv_heads 0: as many as query heads
  assert _first_mismatch(weights, tiny_config(**{"model.num_kv_heads": 4})) is None
  assert _first_mismatch(weights, tiny_config(**{"model.rope_theta": 1e6})) == (
      "config.model.rope_theta=1000000.0, but the weights have 10000.0")
  assert "config.moe.renormalize=True" in _first_mismatch(
      weights, tiny_config(**{"moe.renormalize": True}))
  qwen = tiny_config("qwen2_moe", **{"model.num_kv_heads": 4})
  # Another family's weights: the family first, with the first field and how many more differ
  assert _first_mismatch(weights, qwen) == (
      "config.model.family='qwen2_moe', but the weights are 'olmoe' (config.model.qk_norm="
      "'none', but the weights have 'full' and 3 more field(s)): train them with a preset of "
      "configs/olmoe.py of their size, or as their own config (--config configs/hf.py:DIR)")
  # RoPE scaling: extending plain weights' context is allowed; weights trained scaled compute
  # something else under another scaling, or none.
  yarn = {"model.rope_scaling": "yarn", "model.rope_factor": 4.0,
          "model.rope_original_max_len": 64}
  assert _first_mismatch(weights, tiny_config(**yarn)) is None
  assert _first_mismatch(tiny_config(**yarn), weights) == (
      "config.model.rope_scaling='none', but the weights were trained with 'yarn'")
  # DeepSeek-V2's groups scored by their best expert route the same weights differently from
  # V3's two best (reviewed: 1.46 of the largest logit); without groups the score is not read.
  v2 = tiny_config("deepseek_v2")
  assert _first_mismatch(v2, tiny_config("deepseek_v2", **{"moe.group_score": "top2"})) == (
      "config.moe.group_score='top2', but the weights have 'max'")
  # rotary_dim 0 is the whole head: the same as naming its width (found by review)
  glm = tiny_config("glm4_moe", **{"model.rotary_dim": 0})
  assert _first_mismatch(glm, tiny_config("glm4_moe", **{"model.rotary_dim": 16})) is None
  assert _first_mismatch(glm, tiny_config("glm4_moe")) == (
      "config.model.rotary_dim=8, but the weights have 16")
  # Llama 4's options change what its weights compute (found by review): the weights' place on
  # the experts' side, the chunks, the NoPE layers' temperature
  llama4 = tiny_config("llama4")
  assert _first_mismatch(llama4, tiny_config("llama4", **{"moe.weights_on_input": False})) == (
      "config.moe.weights_on_input=False, but the weights have True")
  assert "config.model.attention_chunk=8" in _first_mismatch(llama4, tiny_config(
      "llama4", **{"model.attention_chunk": 8}))
  assert "config.model.nope_temperature_floor=2" in _first_mismatch(llama4, tiny_config(
      "llama4", **{"model.nope_temperature_floor": 2}))
  cold = tiny_config("llama4", **{"model.nope_temperature": 0.0})
  assert _first_mismatch(cold, tiny_config("llama4", **{"model.nope_temperature": 0.0,
                                                         "model.nope_temperature_floor": 2})) is None
  ungrouped = {"moe.expert_groups": 1, "moe.top_groups": 1}
  assert _first_mismatch(tiny_config("deepseek_v2", **ungrouped), tiny_config(
      "deepseek_v2", **ungrouped, **{"moe.group_score": "top2"})) is None
  assert _first_mismatch(tiny_config(**yarn), tiny_config(**{
      **yarn, "model.rope_factor": 8.0})) == ("config.model.rope_factor=8.0, but the weights were "
                                      "trained with 4.0 (model.rope_scaling='yarn')")


def test_a_sequence_past_the_weights_positions_is_noted(trained, trainer_for, tmp_path, capsys):
  """Hugging Face weights trained to max_position_embeddings=16, fine-tuned at seq_len 64: the
  run says so at the start (it trained on silently)."""
  import json
  from moejax.convert.hf import save_hf
  cfg = canonical_config()
  save_hf(checkpoint.load_params(str(trained)), cfg, str(tmp_path / "hf"))
  with open(tmp_path / "hf" / "config.json") as f:
    hf = json.load(f)
  hf["max_position_embeddings"] = 16
  with open(tmp_path / "hf" / "config.json", "w") as f:
    json.dump(hf, f)
  capsys.readouterr()
  init_from(trainer_for(cfg, 4), str(tmp_path / "hf"))
  assert (f"moejax: note: config.seq_len={cfg.seq_len} is past the weights' "
          "max_position_embeddings=16: positions beyond it were never trained"
          in capsys.readouterr().out)
  # The same weights with YaRN in the run: a context extension, said as such.
  yarn = canonical_config(**{"model.rope_scaling": "yarn", "model.rope_factor": 4.0,
                             "model.rope_original_max_len": 16})
  init_from(trainer_for(yarn, 4), str(tmp_path / "hf"))
  out = capsys.readouterr().out
  assert ("moejax: note: the weights were trained with plain RoPE and this run scales it "
          "(model.rope_scaling='yarn', rope_factor=4.0, rope_original_max_len=16): a context "
          "extension") in out and "never trained" not in out


def test_a_tokenizer_larger_than_the_weights_vocabulary_names_the_weights(trained, tmp_path):
  """The advice to raise config.model.vocab_size led to a second refusal (init_from's weights
  have their own vocabulary): with init_from the line says the weights need their tokenizer."""
  from moejax.errors import DataError
  from moejax.train.loop import run
  from tests.data.conftest import word_level
  path = tmp_path / "big" / "tokenizer.json"
  path.parent.mkdir()
  word_level([" ".join(f"w{i}" for i in range(400))]).save(str(path))
  cfg = canonical_config(**{"init_from": str(trained), "data.tokenizer": str(path)})
  with pytest.raises(DataError, match=r"tokenizer vocab_size 402 exceeds the 320 rows of "
                                      r"config.init_from's embedding: the weights were trained "
                                      r"with another tokenizer"):
    run(cfg, str(tmp_path / "w"))
