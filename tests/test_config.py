"""Config presets parse and build; every bad input gives one clear message."""
import dataclasses

import jax
import pytest

import configs.olmoe as olmoe_configs
from moejax import config as config_lib
from moejax import placement
from moejax.codec import gather as codec_gather
from moejax.codec import replicas as codec_replicas
from moejax.codec import word as codec_word
from moejax.data import DataSpec, check_vocab, load_tokenizer, make_data
from moejax.data import sources as data_sources
from moejax.errors import ConfigError, DataError
from moejax.routing import admission, router
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


def _flat(tree, prefix=""):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


# What each preset resolves to where it matters, and every field where it differs from the typed
# defaults (the presets set nothing else).
PRESET_DIFFERENCES = {
    "tiny": {},
    "1b7b": {"model.vocab_size": 50304, "model.d_model": 2048, "model.num_layers": 16,
             "model.num_heads": 16, "model.head_dim": 128, "moe.num_experts": 64, "moe.top_k": 8,
             "moe.expert_hidden": 1024, "data.tokenizer": "init_from", "optim.lr": 1e-5,
             "optim.warmup_steps": 100, "checkpoint.every": 500, "steps": 2000,
             "batch_size": 64, "seq_len": 4096},
}


@pytest.mark.parametrize("preset", olmoe_configs.PRESETS)
def test_preset_values(preset):
  cfg = _flat(dataclasses.asdict(config_lib.from_config_dict(olmoe_configs.get_config(preset))))
  defaults = _flat(dataclasses.asdict(config_lib.Config()))
  assert {k: v for k, v in cfg.items() if v != defaults[k]} == PRESET_DIFFERENCES[preset]
  expected = {"tiny": {"checkpoint.every": 100, "model.d_model": 64, "moe.num_experts": 8,
                       "moe.dispatch_capacity_factor": 2.0, "moe.dispatch_overflow": "grow",
                       "routing.admission_capacity_factor": 1.25,
                       "routing.admission_capacity_factor_warmup": 2.0, "steps": 200},
              "1b7b": {"checkpoint.every": 500, "model.d_model": 2048, "moe.top_k": 8,
                       "moe.dispatch_capacity_factor": 2.0,
                       "routing.admission_capacity_factor": 1.25, "steps": 2000}}[preset]
  assert {k: cfg[k] for k in expected} == expected


def test_overrides_are_type_checked():
  cd = olmoe_configs.get_config("tiny")
  with pytest.raises(TypeError):
    cd.moe.top_k = "2"
  cd.moe.dispatch_capacity_factor = 1   # int -> float, as absl config_flags does
  assert config_lib.from_config_dict(cd).moe.dispatch_capacity_factor == 1.0


RENAMES = [("moe.capacity_factor", "moe.dispatch_capacity_factor"),
           ("routing.capacity_factor", "routing.admission_capacity_factor"),
           ("routing.capacity_factor_warmup", "routing.admission_capacity_factor_warmup")]


@pytest.mark.parametrize("old,new", RENAMES)
def test_renamed_field_in_a_dict(old, new):
  with pytest.raises(ConfigError, match=rf"^config\.{old} was renamed: use config\.{new} \("):
    tiny_config(**{old: 1.0})


def test_a_config_saved_before_the_renames_reads_under_the_new_names():
  from moejax.config import from_config_dict, upgrade_saved
  from moejax.weights import config_to_dict
  saved = config_to_dict(tiny_config(**{"moe.dispatch_capacity_factor": 1.5,
                                        "routing.admission_capacity_factor": 2.5}))
  saved["moe"]["capacity_factor"] = saved["moe"].pop("dispatch_capacity_factor")
  saved["routing"]["capacity_factor"] = saved["routing"].pop("admission_capacity_factor")
  cfg = from_config_dict(upgrade_saved(saved))
  assert cfg.moe.dispatch_capacity_factor == 1.5
  assert cfg.routing.admission_capacity_factor == 2.5
  assert "capacity_factor" in saved["moe"]          # the saved dict itself is left alone


@pytest.mark.parametrize("old,new", [(True, "full"), (False, "none")])
def test_a_config_saved_with_a_boolean_remat_reads_as_its_mode(old, new):
  from moejax.config import from_config_dict, upgrade_saved
  from moejax.weights import config_to_dict
  saved = config_to_dict(tiny_config())
  saved["remat"] = old
  assert from_config_dict(upgrade_saved(saved)).remat == new


@pytest.mark.parametrize("old,new", RENAMES)
@pytest.mark.parametrize("form", ["=", " "])
def test_renamed_field_on_the_command_line(old, new, form, capsys):
  import train  # defines train.py's absl flags; parse_flags stops before absl parses them
  override = [f"--config.{old}=1.0"] if form == "=" else [f"--config.{old}", "1.0"]
  with pytest.raises(SystemExit) as exit_info:
    train.parse_flags(["train.py", "--config", "configs/olmoe.py:tiny", *override])
  assert exit_info.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f"error: config.{old} was renamed: use config.{new} ("), lines


def test_choices_come_from_the_owning_modules():
  assert config_lib.PLACEMENTS is placement.PLACEMENTS
  assert config_lib.ADMISSIONS is admission.POLICIES
  assert config_lib.SCORES is router.SCORE_FUNCTIONS
  assert config_lib.DATA_SOURCES is data_sources.SOURCES
  assert config_lib.DETECTORS is codec_gather.DETECTORS
  assert config_lib.DELTA_BITS is codec_word.DELTA_BITS
  assert config_lib.REPLICA_CODECS is codec_replicas.REPLICA_CODECS
  with pytest.raises(ConfigError) as e:
    tiny_config(**{"codec.mode": "zip"})
  assert str(e.value) == ("config.codec.mode='zip': must be one of "
                          + ", ".join(codec_gather.MODES + ("auto",)))
  with pytest.raises(ConfigError) as e:
    tiny_config(**{"codec.delta_bits": 5})
  assert str(e.value) == ("config.codec.delta_bits=5: must be one of "
                          + ", ".join(map(str, codec_word.DELTA_BITS)))
  with pytest.raises(ConfigError, match=r"config.codec.detect='md5': must be one of exact, hash"):
    tiny_config(**{"codec.detect": "md5"})
  with pytest.raises(ConfigError,
                     match=r"config.codec.transport='ragged': must be one of auto, single, cond"):
    tiny_config(**{"codec.transport": "ragged"})


def test_unknown_preset():
  with pytest.raises(ValueError, match="unknown preset 'huge'.*tiny, 1b7b"):
    olmoe_configs.get_config("huge")


@pytest.mark.parametrize("overrides,message", [
    ({"moe.foo": 1}, r"unknown config field config.moe.foo"),
    ({"moe.top_k": "2"}, r"config.moe.top_k='2': expected an integer"),
    ({"optim.lr": "fast"}, r"config.optim.lr='fast': expected a number"),
    ({"remat": 1}, r"config.remat=1: expected a string"),
    ({"remat": "some"}, r"config.remat='some': must be one of full, minimal, none"),
    ({"scatter_ahead": "soon"},
     r"config.scatter_ahead='soon': must be one of auto, always, never"),
    ({"moe.dispatch_chunks": 0},
     r"config.moe.dispatch_chunks=0: must be at least 1"),
    ({"moe.receive_capacity_factor": -1.0},
     r"config.moe.receive_capacity_factor=-1.0: must be >= 0 \(0 = every received row\)"),
    ({"schedule_latencies": "measured"},
     r"config.schedule_latencies='measured': must be one of xla, model"),
    ({"moe.top_k": 9}, r"config.moe.top_k=9: must be at most moe.num_experts=8"),
    ({"moe.placement": "zero"}, r"config.moe.placement='zero': must be one of fsdp, ep"),
    ({"model.head_dim": 15}, r"config.model.head_dim=15: must be even"),
    ({"model.dense_layers": (0, 1), "model.dense_hidden": 8},
     r"config.model.dense_layers=\(0, 1\): must be ascending .* at least one MoE layer"),
    ({"model.dense_layers": (0,)}, r"config.model.dense_hidden=0: model.dense_layers=\(0,\)"),
    ({"model.residual_scale": 0.0}, r"config.model.residual_scale=0.0: must be > 0"),
    ({"model.norm_position": "middle"}, r"config.model.norm_position='middle'"),
    ({"model.attention_gate_own": True}, r"config.model.attention_gate_own=True: needs "
     "model.attention_gate=True"),
    ({"model.attention_sinks": True, "model.kv_lora_rank": 8, "model.qk_rope_head_dim": 8,
      "model.qk_nope_head_dim": 8, "model.v_head_dim": 16},
     r"config.model.attention_sinks=True: latent attention"),
    ({"moe.score_bias_on_logits": True}, r"config.moe.score_bias_on_logits=True needs "
     "moe.score_bias=True"),
    ({"model.sliding_rope_theta": 1e4}, r"config.model.sliding_rope_theta=10000.0: .* > 0 only "
     "with model.sliding_layers"),
    ({"model.qk_norm_after_rope": True}, r"config.model.qk_norm_after_rope=True needs "
     r"model.qk_norm='head' \(here 'full'\)"),
    ({"model.attention_scale": -1.0}, r"config.model.attention_scale=-1.0: must be >= 0"),
    ({"model.sliding_window": 8}, r"config.model.sliding_window=8 with model.sliding_layers=\(\): "
     "a window needs the layers it applies to"),
    ({"model.sliding_layers": (1,)}, r"config.model.sliding_window=0 with model.sliding_layers="),
    ({"model.sliding_window": 8, "model.sliding_layers": (1, 0)},
     r"config.model.sliding_layers=\(1, 0\): must be ascending distinct layer indices"),
    ({"model.nope_layers": (5,)}, r"config.model.nope_layers=\(5,\): must be ascending .* "
     r"\[0, model.num_layers=2\)"),
    ({"model.attention_gate": True, "model.kv_lora_rank": 8, "model.qk_norm": "none",
      "model.qk_rope_head_dim": 8, "model.qk_nope_head_dim": 8, "model.v_head_dim": 8},
     "config.model.attention_gate=True: latent attention .* has no output gate"),
    ({"model.kv_lora_rank": 8, "model.qk_rope_head_dim": 4, "model.v_head_dim": 8,
      "model.qk_norm": "none"}, r"config.model.head_dim=16: with multi-head latent attention"),
    ({"model.q_lora_rank": 8}, r"they need model.kv_lora_rank > 0"),
    ({"model.kv_lora_rank": 8, "model.qk_nope_head_dim": 13, "model.qk_rope_head_dim": 3,
      "model.v_head_dim": 8}, r"config.model.qk_rope_head_dim=3: multi-head latent attention "
                              r"\(model.kv_lora_rank > 0\) needs a positive even rotary width"),
    ({"model.kv_lora_rank": 8, "model.qk_nope_head_dim": 12, "model.qk_rope_head_dim": 4},
     r"config.model.v_head_dim=0: multi-head latent attention .* positive value head width"),
    ({"model.kv_lora_rank": -1}, r"config.model.kv_lora_rank=-1: must be >= 0"),
    ({"model.num_kv_heads": 3}, r"config.model.num_kv_heads=3: must divide model.num_heads=4"),
    ({"moe.shared_expert_hidden": -8}, r"config.moe.shared_expert_hidden=-8: must be >= 0"),
    ({"moe.shared_expert_gate": True}, r"config.moe.shared_expert_gate=True needs "
                                       r"moe.shared_expert_hidden > 0"),
    ({"moe.routed_scale": 0.0}, r"config.moe.routed_scale=0.0: must be positive"),
    ({"data.tokenizer": ""}, r"config.data.tokenizer is empty: 'bytes', 'init_from' or a path"),
    ({"optim.eps": 0.0}, r"config.optim.eps=0.0: must be positive \(Adam divides by"),
    ({"model.dense_hidden": -5}, r"config.model.dense_hidden=-5: must be >= 0"),
    ({"fssdp.owner_sends": -2}, r"config.fssdp.owner_sends=-2: must be -1 \(= overlap_degree\)"),
    ({"fssdp.reshard_every": -1}, r"config.fssdp.reshard_every=-1: must be >= 0"),
    ({"fssdp.max_per_layer": 9}, r"config.fssdp.max_per_layer=9: must be in \[0, "
                                 r"moe.num_experts=8\]"),
    ({"data.val_fraction": 0.5}, r"config.data.val_fraction=0.5: must be in \[0, 0.5\)"),
    ({"optim.min_lr_ratio": 1.5}, r"config.optim.min_lr_ratio=1.5: must be in \[0, 1\]"),
    ({"optim.warmup_steps": -1}, r"config.optim.warmup_steps=-1: must be >= 0"),
    ({"optim.clip_norm": -1.0}, r"config.optim.clip_norm=-1.0: must be >= 0"),
    ({"moe.expert_groups": 3}, r"config.moe.expert_groups=3: must divide moe.num_experts=8"),
    ({"moe.expert_groups": 4, "moe.top_groups": 5}, r"config.moe.top_groups=5: must be in"),
    ({"moe.score_bias_rate": 0.001}, r"needs moe.score_bias=True"),
    ({"model.d_model": 0}, r"config.model.d_model=0: must be positive"),
    ({"data.source": "text"}, r"config.data.path is empty"),
    ({"data.source": "tokens"}, r"config.data.path is empty: data.source='tokens' needs the "
                                r"directory moejax.data.prepare wrote"),
    ({"mesh.shape": (-1, -1)}, r"config.mesh.shape"),
    ({"routing.admission": "maybe"}, r"config.routing.admission='maybe'"),
    ({"routing.warmup_steps": -5}, r"config.routing.warmup_steps=-5: must be >= 0"),
    ({"fssdp.replica_codec": "zstd"}, r"config.fssdp.replica_codec='zstd': must be one of "
                                      r"off, delta \(or '' to follow codec.mode\)"),
    ({"fssdp.replica_codec": "delta", "compute_dtype": "float32", "moe.placement": "fssdp"},
     r"config.fssdp.replica_codec='delta' needs compute_dtype='bfloat16'"),
    ({"reduce_dtype": "float16"}, r"config.reduce_dtype='float16': must be one of float32, "
                                  r"bfloat16"),
    ({"reduce_dtype": "bfloat16", "compute_dtype": "float32"},
     r"config.reduce_dtype='bfloat16' needs compute_dtype='bfloat16'"),
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
  # A checkpoints/ that cannot take files is found before training, not at the first save (a
  # save that failed there left Orbax threads that kept the process from exiting).
  run = tmp_path / "run"
  run.mkdir()
  (run / "checkpoints").write_text("not a directory")
  with pytest.raises(ConfigError, match=r"checkpoint directory '.*run/checkpoints' is a file, "
                                        r"not a folder; move the file away"):
    prepare_workdir(str(run))
  with pytest.raises(ConfigError, match=r"workdir '.*/file' is a file, not a folder; choose "
                                        r"another --workdir"):
    prepare_workdir(str(blocker))
  prepare_workdir(str(tmp_path / "fresh"))
  assert (tmp_path / "fresh" / "checkpoints").is_dir()


def test_tokenizer_init_from_reads_the_one_beside_the_weights(tmp_path):
  from moejax import weights
  from moejax.errors import CheckpointError
  with pytest.raises(ConfigError, match=r"config.init_from, which is empty"):
    weights.tokenizer_of(tiny_config(**{"data.tokenizer": "init_from"}))
  step_dir = tmp_path / "run" / "checkpoints" / "4"
  step_dir.mkdir(parents=True)
  cfg = tiny_config(**{"data.tokenizer": "init_from", "init_from": str(step_dir)})
  with pytest.raises(CheckpointError, match=r"no tokenizer.json beside config.init_from="):
    weights.tokenizer_of(cfg)
  (tmp_path / "run" / "tokenizer.json").write_text("{}")    # a workdir's, found from a step dir
  assert weights.tokenizer_of(cfg) == str(tmp_path / "run" / "tokenizer.json")
  assert weights.tokenizer_of(tiny_config()) == "bytes"


@pytest.mark.parametrize("field, value, message", [
    ("seed", 2 ** 64, "config.seed=18446744073709551616: must be in [0, 2^63)"),
    ("seed", -1, "config.seed=-1: must be in [0, 2^63)"),
    ("optim.lr", float("inf"), "config.optim.lr=inf: must be a finite number"),
    ("routing.threshold", float("nan"), "config.routing.threshold=nan: must be a finite number"),
    ("model.rope_theta", 0.0, "config.model.rope_theta=0.0: must be positive"),
    ("model.norm_eps", -1.0, "config.model.norm_eps=-1.0: must be positive"),
    ("model.init_std", -5.0, "config.model.init_std=-5.0: must be positive"),
    ("moe.aux_loss_weight", -100.0, "config.moe.aux_loss_weight=-100.0: must be >= 0"),
    ("optim.b1", 1.5, "config.optim.b1=1.5: an Adam decay rate, in [0, 1)")])
def test_values_that_would_train_wrong_or_end_in_nan_are_refused_by_name(field, value, message):
  """Each of these used to be accepted: b1=1.5 trained, init_std=-5 reached a loss of 108,
  rope_theta=0 and lr=inf stopped on a NaN loss blaming the learning rate, a seed past 64 bits
  ended in a traceback."""
  with pytest.raises(ConfigError) as e:
    tiny_config(**{field: value})
  assert str(e.value) == message


@pytest.mark.parametrize("overrides, message", [
    ({"model.rope_scaling": "ntk"},
     "config.model.rope_scaling='ntk': must be one of none, yarn, llama3"),
    ({"model.rope_scaling": "llama3"}, "config.model.rope_original_max_len=0: Llama 3's scaling "
     "needs the context the weights were pretrained on (original_max_position_embeddings), > 0"),
    ({"model.rope_scaling": "llama3", "model.rope_original_max_len": 64,
      "model.rope_low_freq_factor": 4.0, "model.rope_high_freq_factor": 1.0},
     "config.model.rope_low_freq_factor=4.0, rope_high_freq_factor=1.0: Llama 3's scaling needs "
     "high >= low > 0 (1 and 4 by default)"),
    ({"model.rotary_dim": 7}, "config.model.rotary_dim=7: an even width up to model.head_dim=16 "
     "(0 = the whole head)"),
    ({"model.rotary_dim": 32}, "config.model.rotary_dim=32: an even width up to "
     "model.head_dim=16 (0 = the whole head)"),
    ({"model.rope_scaling": "yarn"}, "config.model.rope_original_max_len=0: YaRN needs the "
     "context the weights were pretrained on (original_max_position_embeddings), > 0"),
    ({"model.rope_scaling": "yarn", "model.rope_original_max_len": 64, "model.rope_factor": 0.5},
     "config.model.rope_factor=0.5: YaRN's context extension factor, >= 1"),
    ({"model.rope_scaling": "yarn", "model.rope_original_max_len": 64,
      "model.rope_beta_slow": 40.0}, "config.model.rope_beta_fast=32.0, rope_beta_slow=40.0: "
     "YaRN needs rope_beta_fast > rope_beta_slow > 0 (rotations over the original context; 32 "
     "and 1 by default)"),
    ({"model.rope_scaling": "yarn", "model.rope_original_max_len": 64,
      "model.rope_mscale": -1.0}, "config.model.rope_mscale=-1.0: must be >= 0 (0: not set)")])
def test_yarn_settings_that_cannot_scale_are_refused_by_name(overrides, message):
  with pytest.raises(ConfigError) as e:
    tiny_config(**overrides)
  assert str(e.value) == message


def _notes(**overrides):
  """`unused_settings` of tiny_config(**overrides), but for the note on the dropless dispatch
  buffer that tiny_config sets under every placement (fsdp reads none)."""
  return [n for n in config_lib.unused_settings(tiny_config(**overrides))
          if not n.startswith("config.moe.dispatch_capacity_factor=0.0 ")]


def test_settings_that_do_nothing_here_are_named():
  """Accepted (one config serves its baselines too), but named once at the run's start: these
  were silently ignored (the fssdp, dispatch, admission, codec and dense-MLP fields found by an
  audit of every field)."""
  cases = [({"codec.mode": "delta", "codec.reselect_every": 10}, "codec.reselect_every=10"),
           ({"codec.cache_budget_bytes": 1000}, "codec.cache_budget_bytes=1000"),
           ({"codec.mode": "auto", "codec.capacity_fraction": 0.5}, "codec.capacity_fraction"),
           ({"codec.capacity_fraction": 0.5},
            "codec.capacity_fraction=0.5 has no effect: codec.mode='off' compresses nothing"),
           ({"moe.placement": "ep", "fssdp.replica_codec": "delta"}, "fssdp.replica_codec"),
           ({"moe.placement": "ep", "fssdp.replica_slots": 9, "fssdp.window": 3},
            "fssdp.replica_slots=9, config.fssdp.window=3 have"),
           ({"moe.dispatch_overflow": "drop"},
            "moe.dispatch_capacity_factor=0.0, config.moe.dispatch_overflow='drop' have"),
           ({"routing.threshold": 0.5}, "routing.threshold=0.5 has"),
           ({"routing.admission": "reroute", "moe.top_k": 8},
            "routing.admission='reroute' has no effect beyond 'strict': with moe.top_k=8 of "
            "moe.num_experts=8"),
           ({"moe.placement": "ep", "moe.dispatch_capacity_factor": 2.0,
             "moe.dispatch_overflow": "drop", "moe.receive_capacity_factor": 2.0},
            "moe.receive_capacity_factor=2.0 has"),
           ({"codec.delta_bits": 4, "codec.transport": "single"},
            "codec.delta_bits=4, config.codec.transport='single' have"),
           ({"codec.mode": "element", "codec.comm_model": "bytes"}, "codec.comm_model='bytes'"),
           ({"model.dense_hidden": 128}, "model.dense_hidden=128 has"),
           ({"model.rope_factor": 4.0, "model.rope_original_max_len": 64},
            "model.rope_factor=4.0, config.model.rope_original_max_len=64 have")]
  for overrides, field in cases:
    (note,) = _notes(**overrides)
    assert note.startswith(f"config.{field}") and "no effect" in note, note
  for overrides in ({"codec.mode": "auto", "codec.reselect_every": 10,
                     "codec.cache_budget_bytes": 1000, "codec.comm_model": "bytes"},
                    {"codec.mode": "element", "codec.select": True, "codec.reselect_every": 10},
                    {"codec.mode": "element", "codec.capacity_fraction": 0.5},
                    {"moe.placement": "fssdp", "fssdp.replica_codec": "off",
                     "fssdp.window": 3},
                    {"moe.placement": "ep", "moe.dispatch_overflow": "drop"},
                    {"moe.placement": "fssdp", "moe.dispatch_capacity_factor": 2.0,
                     "moe.receive_capacity_factor": 2.0},
                    # dropless here: it bounds what packed (GPU) buffers receive
                    {"moe.placement": "ep", "moe.receive_capacity_factor": 2.0},
                    {"routing.admission": "strict", "routing.threshold": 0.5},
                    {"model.rope_scaling": "yarn", "model.rope_factor": 4.0,
                     "model.rope_original_max_len": 64}, {}):
    assert _notes(**overrides) == [], overrides


def test_a_chosen_codec_that_never_chooses_in_this_run_is_named():
  for overrides in ({"codec.mode": "auto", "steps": 20},
                    {"codec.mode": "element", "codec.select": True, "steps": 30}):
    (note,) = _notes(**overrides)
    assert note == (f"config.codec.mode={overrides['codec.mode']!r} chooses its modes after "
                    f"codec.warmup_steps=30 steps, and this run ends at config.steps="
                    f"{overrides['steps']}: every gather stays plain (a smaller "
                    "codec.warmup_steps chooses sooner)")
  for overrides in ({"codec.mode": "auto", "steps": 31},
                    {"codec.mode": "auto", "steps": 20, "codec.warmup_steps": 5},
                    {"codec.mode": "element", "steps": 20}):   # fixed: no choice to wait for
    assert _notes(**overrides) == [], overrides


def test_fssdp_fields_bind_only_under_fssdp():
  """fssdp.replica_slots / overlap_degree must be at most num_experts under fssdp; an fsdp or
  ep model of 2 experts was refused for the fssdp defaults (overlap_degree=4)."""
  for placement in ("fsdp", "ep"):
    tiny_config(**{"moe.placement": placement, "moe.num_experts": 2, "moe.top_k": 1,
                   "batch_size": 8})
  with pytest.raises(ConfigError, match=r"fssdp\.overlap_degree=4"):
    tiny_config(**{"moe.placement": "fssdp", "moe.num_experts": 2, "moe.top_k": 1})
  with pytest.raises(ConfigError) as e:       # accepted before: a 3.5x slower step
    tiny_config(**{"moe.placement": "fssdp", "fssdp.replica_slots": 100})
  assert str(e.value) == ("config.fssdp.replica_slots=100: must be at most moe.num_experts=8 "
                          "(replicas are of distinct experts)")
  (note,) = _notes(**{"routing.locality_weight": 0.5})
  assert note.startswith("config.routing.locality_weight=0.5 has no effect")
  assert not config_lib.unused_settings(tiny_config(**{"routing.locality_weight": 0.5,
                                                        "moe.placement": "ep"}))
  (note,) = _notes(**{"schedule_cluster": "h200"})
  assert note.startswith("config.schedule_cluster='h200' has no effect")
  assert not _notes(**{"schedule_cluster": "h200", "schedule_latencies": "model"})


@pytest.mark.parametrize("overrides, message", [
    ({"model.attention_chunk": 8}, "config.model.attention_chunk=8 with model.chunked_layers=(): "
     "a chunk (> 0) needs the layers it applies to, and chunked layers a chunk > 0"),
    ({"model.attention_chunk": 8, "model.chunked_layers": (0,), "model.sliding_window": 4,
      "model.sliding_layers": (0, 1)}, "config.model.chunked_layers and model.sliding_layers "
     "share layers [0]: a layer's attention slides or stays within its chunk, not both"),
    ({"model.nope_temperature": 0.1}, "config.model.nope_temperature=0.1, "
     "nope_temperature_floor=8192: the scale must be >= 0 and finite (> 0 only with "
     "model.nope_layers, the layers it scales) and the floor > 0")])
def test_chunk_and_temperature_settings_are_refused_by_name(overrides, message):
  with pytest.raises(ConfigError) as e:
    tiny_config(**overrides)
  assert str(e.value) == message


def test_latent_attention_refuses_llama4s_query_options():
  """Latent attention has neither the unscaled QK-norm nor the query temperature: refused, not
  ignored (the temperature was, found by review)."""
  for overrides, field in (({"model.qk_norm": "l2"}, "qk_norm='l2'"),
                           ({"model.nope_layers": (1,), "model.nope_temperature": 0.5},
                            "nope_temperature=0.5")):
    with pytest.raises(ConfigError, match=f"config.model.{field}: latent attention"):
      tiny_config("deepseek_v3", **overrides)


@pytest.mark.parametrize("family, overrides, field", [
    ("deepseek_v3", {"model.index_topk": 8}, "config.model.index_heads=0, index_head_dim=0: "),
    ("deepseek_v32", {"model.index_head_dim": 6}, "config.model.index_heads=4, "
     "index_head_dim=6: "),          # narrower than the 8 rotated dims
    ("deepseek_v32", {"model.q_lora_rank": 0}, "config.model.index_topk=32: DeepSeek sparse "),
    ("deepseek_v32", {"model.index_topk": 0}, "config.model.index_heads=4, index_head_dim=16, "
     "index_rotary_interleaved=False: an indexer needs model.index_topk > 0"),
    ("deepseek_v32", {"model.sliding_window": 4, "model.sliding_layers": (1,)},
     "config.model.index_topk=32: DeepSeek sparse attention selects among all earlier keys"),
    ("olmoe", {"model.index_topk": 8, "model.index_heads": 2, "model.index_head_dim": 8},
     "config.model.index_topk=8: DeepSeek sparse attention's indexer reads latent attention's"),
])
def test_sparse_attention_settings_are_refused_by_name(family, overrides, field):
  """DeepSeek-V3.2's indexer options: refused with the field and what would be valid."""
  with pytest.raises(ConfigError) as e:
    tiny_config(family, **overrides)
  assert str(e.value).startswith(field), str(e.value)
