"""The quantization_config of an FP8 checkpoint, shared by the torch reference
(tests/convert/hf_reference.py, run in .venv311) and the tests without torch: no imports beyond
the standard library."""
from __future__ import annotations


def quantization_config(strategy: str | None, block: tuple[int, int], int_bits: int = 0) -> dict:
  """transformers' fine-grained FP8 in `block`s (`strategy` None), or compressed-tensors'
  float-quantized format (FP8) or, with `int_bits`, pack-quantized one (symmetric integers) with
  that weight strategy (tensor, channel, group: block[1] columns, block), weights only, as
  llm-compressor writes it."""
  if strategy is None:      # block (0, 0): one scale per tensor, weight_block_size null
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": list(block) if any(block) else None}
  weights = {"num_bits": int_bits or 8, "type": "int" if int_bits else "float",
             "symmetric": True, "strategy": strategy, "dynamic": False}
  if strategy == "group":
    weights["group_size"] = block[1]
  if strategy == "block":
    weights["block_structure"] = list(block)
  return {"quant_method": "compressed-tensors",
          "format": "pack-quantized" if int_bits else "float-quantized",
          "quantization_status": "compressed", "ignore": ["lm_head", "re:.*mlp.gate$"],
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
