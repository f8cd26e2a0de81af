"""The whole 8-device train step lowers for CUDA on this CPU machine (`lowering_platforms`), so a
GPU session's time is not spent on an error only the GPU branches have: the platform-chosen
paths (`ragged_all_to_all` for the ep / fssdp exchange, SparseAllGather and its coded form in
chunks, and the codec's payload; `ragged_dot` for the experts) in the composed step. Lowering
only: nothing compiles.

At OLMoE-1B-7B's shapes (16 layers, 64 experts of 2048 x 1024, 6.9e9 parameters; a batch of 8
sequences of 64 tokens), so a count that passes int32 at a real model's size fails here: the
codec's metrics divided a jnp count by the model's value count as a Python int, which could not
enter jax without x64 (OverflowError while tracing an fsdp codec run of this size, whose codec
sees the experts' 6.4e9 values; under fssdp it sees the rest alone). The fsdp codec step also
traces at DeepSeek-V3's size (671B parameters), where one device's share of a layer's expert
stack passes 2^31 bits."""
from configs import deepseek as deepseek_configs
from configs import olmoe as olmoe_configs
from moejax.config import from_config_dict
from moejax.train import step as step_lib

# One composed case holds every GPU branch: fssdp's exchange is ep's plus SparseAllGather (plain
# for the calibration's late gather, coded for the planned one), and the non-expert parameters
# go through the codec's payload. (Cases for fsdp + codec and for ep alone lowered nothing more:
# 7 s each.) The exchanges' GPU forms also run, emulated, in tests/placement/test_fssdp.py and
# test_dispatch.py, and the codec's in tests/codec/test_gather.py.
COMPOSED = {"moe.placement": "fssdp", "codec.mode": "element", "codec.warmup_steps": 2,
            "fssdp.replica_codec": "delta", "routing.admission": "reroute"}
# (the same trace and lowerings take about as long as the tiny preset's: the layers are scanned)
SIZE = {"batch_size": 8, "seq_len": 64, "mesh.shape": (2, 4),
        "moe.dispatch_capacity_factor": 0.0}


def _1b7b(**overrides):
  cd = olmoe_configs.get_config("1b7b")
  cd.update_from_flattened_dict({**SIZE, **overrides})
  return from_config_dict(cd)


def test_the_composed_train_step_lowers_for_cuda_at_olmoe_1b7b_size(trainer_for, monkeypatch):
  """With the exchange's packed buffers, which a mesh of GPUs takes (`state.packs_exchange`:
  here the CPU mesh is told it packs; XLA:CPU could not compile it)."""
  from moejax.train import state
  monkeypatch.setattr(state, "packs_exchange", lambda cfg, mesh: True)
  trainer = trainer_for(_1b7b(**COMPOSED))
  assert trainer.layout.gatherer.enabled and trainer.layout.placement.dispatch.packed
  # (packed buffers send uncapped and grow what a device receives: a GrowingStep, which traces
  # as the step at its capacity, as scripts/device_check.py's schedule8 traces it on a GPU)
  traced = trainer.train_step.trace(*trainer.abstract_inputs())
  cpu = traced.lower().as_text()
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  # The variable-volume collectives and the grouped matmul are the GPU's: the sparse
  # collectives' static forms on CPU, ragged on GPU (the packed exchange is ragged on both).
  assert cuda.count("ragged_all_to_all") > cpu.count("ragged_all_to_all") > 0
  assert "ragged_dot" in cuda and "ragged_dot" not in cpu


def test_the_codec_step_of_every_parameter_traces_at_deepseek_v3_size(trainer_for):
  """fsdp: the codec gathers the experts too, 6.7e11 values in all, 3.8e9 bits of one device's
  share of a layer's expert stack (tracing alone: Python ints past int32 could not enter jax)."""
  cd = deepseek_configs.get_config("v3")
  cd.update_from_flattened_dict({**SIZE, "codec.mode": "element", "codec.select": False,
                                 "codec.warmup_steps": 2})
  trainer = trainer_for(from_config_dict(cd))
  values = sum(v for v, _ in step_lib.codec_denominators(trainer.layout).values())
  assert values > 2**31
  trainer.train_step.trace(*trainer.abstract_inputs())
