"""Hugging Face checkpoints in and out, every family of `moejax.families` (streamed, straight
into shards).

  from moejax.convert import load_hf, save_hf
  cfg, params = load_hf("OLMoE-1B-7B-0924")             # numpy fp32, init_params' layout
  cfg, params = load_hf(path, shardings=param_shardings)  # global jax.Arrays, read shard by shard
  save_hf(params, cfg, "out_dir")                         # config.json + safetensors (+ index)

Command line: `python -m moejax.convert from-hf HF_DIR OUT_DIR` and
`python -m moejax.convert to-hf CKPT_DIR OUT_DIR` (see `moejax.convert.__main__`).
"""
from moejax.convert.hf import load_hf, read_hf_config, save_hf
from moejax.convert.hf_config import config_from_hf, hf_config_from, quantization_summary

__all__ = ["config_from_hf", "hf_config_from", "load_hf", "quantization_summary",
           "read_hf_config", "save_hf"]
