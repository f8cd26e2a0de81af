"""The quantization_config of an FP8 checkpoint, shared by the torch reference
(tests/convert/hf_reference.py, run in .venv311) and the tests without torch: no imports beyond
the standard library."""
from __future__ import annotations


def quantization_config(strategy: str | None, block: tuple[int, int]) -> dict:
  """transformers' fine-grained FP8 in `block`s (`strategy` None), or compressed-tensors'
  float-quantized format with that weight strategy (tensor, channel, group: block[1] columns,
  block), weights only, as llm-compressor writes it."""
  if strategy is None:
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block)}
  weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
             "dynamic": False}
  if strategy == "group":
    weights["group_size"] = block[1]
  if strategy == "block":
    weights["block_structure"] = list(block)
  return {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
