"""The model families moejax imports from and exports to Hugging Face.

A family names a Hugging Face architecture (`model_type` in config.json; Llama 4's is its text
model's, `llama4_text`, or a `llama4` config's `text_config`; a `kimi_k25` config's text model is
DeepSeek-V3's, a `qwen3_vl_moe` config's Qwen3-MoE's, a `glm4v_moe` config's GLM-4.5's; Qwen3.5-MoE's
is its own `qwen3_5_moe_text`, in a `qwen3_5_moe` config); the decoder is one
(`moejax.models.olmoe`) and reads only the config's options, so a family decides the tensor
names and config.json fields of `moejax.convert`, and which options that architecture can hold.
"""
from __future__ import annotations

FAMILIES = ("olmoe", "mixtral", "qwen2_moe", "qwen3_moe", "minimax_m2", "ernie4_5_moe",
            "glm4_moe", "dots1", "deepseek_v2", "deepseek_v3", "deepseek_v32",
            "glm_moe_dsa", "glm4_moe_lite", "solar_open",
            "minicpm5_moe", "hy_v3", "exaone_moe", "granitemoe", "granitemoeshared", "sarvam_moe",
            "param2moe", "flex_olmo", "hunyuan_v1_moe", "afmoe",
            "granitemoe_swa", "flint", "kolibri1",
            "mellum", "gpt_oss", "cohere2_moe", "qwen3_next", "qwen3_5_moe",
            "granitemoehybrid", "llama4")

# The config file of each family's presets (configs/NAME.py), where it is not the family's name.
_CONFIG_NAMES = {"deepseek_v3": "deepseek"}


def config_file(family: str) -> str:
  """configs/NAME.py holding `family`'s presets, relative to the repository root."""
  return f"configs/{_CONFIG_NAMES.get(family, family)}.py"
