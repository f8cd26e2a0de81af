"""Config presets parse and build; every bad input gives one clear message."""
import jax
import numpy as np
import pytest

import configs.olmoe as olmoe_configs
from moejax import config as config_lib
from moejax.data import DataSpec, check_vocab, load_tokenizer, make_data
from moejax.errors import ConfigError, DataError
from moejax.sharding.mesh import make_mesh
from moejax.train.loop import prepare_workdir
from moejax.train.step import check_divisibility
from tests.helpers import tiny_config


@pytest.mark.parametrize("preset", olmoe_configs.PRESETS)
def test_presets_parse_and_build(preset):
  cfg = config_lib.from_config_dict(olmoe_configs.get_config(preset))
  from moejax.models import olmoe
  shapes = jax.eval_shape(lambda k: olmoe.init_params(cfg, k), jax.random.key(0))
  assert shapes["embed"].shape == (cfg.model.vocab_size, cfg.model.d_model)


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny, 1b7b"):
    olmoe_configs.get_config("huge")


@pytest.mark.parametrize("overrides,message", [
    ({"moe.foo": 1}, r"unknown config field config.moe.foo"),
    ({"moe.top_k": "2"}, r"config.moe.top_k='2': expected an integer"),
    ({"optim.lr": "fast"}, r"config.optim.lr='fast': expected a number"),
    ({"remat": 1}, r"config.remat=1: expected true or false"),
    ({"moe.top_k": 9}, r"config.moe.top_k=9: must be at most moe.num_experts=8"),
    ({"moe.placement": "zero"}, r"config.moe.placement='zero': must be one of fsdp, ep"),
    ({"model.head_dim": 15}, r"config.model.head_dim=15: must be even"),
    ({"model.d_model": 0}, r"config.model.d_model=0: must be positive"),
    ({"data.source": "text"}, r"config.data.path is empty"),
    ({"mesh.shape": (-1, -1)}, r"config.mesh.shape"),
    ({"routing.admission": "maybe"}, r"config.routing.admission='maybe'"),
])
def test_bad_config_values(overrides, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config(**overrides)


def test_indivisible_batch_and_experts():
  mesh = make_mesh((1, -1), jax.devices()[:8])
  with pytest.raises(ConfigError, match=r"config.batch_size=12 is not divisible by the 8"):
    check_divisibility(tiny_config(batch_size=12), mesh)
  with pytest.raises(ConfigError, match=r"config.moe.num_experts=6 is not divisible by the 8"):
    check_divisibility(tiny_config(**{"moe.placement": "ep", "moe.num_experts": 6}), mesh)
  with pytest.raises(ConfigError, match=r"config.mesh.shape=\(1, 4\) needs 4 devices, but 8"):
    make_mesh((1, 4), jax.devices()[:8])


def test_data_errors(tmp_path):
  with pytest.raises(DataError, match="missing.txt: file not found"):
    make_data(DataSpec("text", str(tmp_path / "missing.txt")), batch_size=2, seq_len=8)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(DataError, match="empty.jsonl: file is empty"):
    make_data(DataSpec("jsonl", str(empty)), batch_size=2, seq_len=8)
  with pytest.raises(DataError, match="tokenizer vocab_size 257 exceeds the model's vocab_size 100"):
    check_vocab(load_tokenizer("bytes"), 100)


def test_unwritable_workdir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(ConfigError, match=r"workdir '.*file/run' is not writable"):
    prepare_workdir(str(blocker / "run"))
