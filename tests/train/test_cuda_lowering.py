"""The whole 8-device train step lowers for CUDA on this CPU machine (`lowering_platforms`), so a
GPU session's time is not spent on an error only the GPU branches have: the platform-chosen
paths (`ragged_all_to_all` for the ep / fssdp exchange, SparseAllGather and its coded form in
chunks, and the codec's payload; `ragged_dot` for the experts) in the composed step. Lowering
only: nothing compiles."""
from tests.helpers import tiny_config

# One composed case holds every GPU branch: fssdp's exchange is ep's plus SparseAllGather (plain
# for the calibration's late gather, coded for the planned one), and the non-expert parameters
# go through the codec's payload. (Cases for fsdp + codec and for ep alone lowered nothing more:
# 7 s each.) The exchanges' GPU forms also run, emulated, in tests/placement/test_fssdp.py and
# test_dispatch.py, and the codec's in tests/codec/test_gather.py.
COMPOSED = {"moe.placement": "fssdp", "codec.mode": "element", "codec.warmup_steps": 2,
            "fssdp.replica_codec": "delta", "routing.admission": "reroute"}


def test_the_composed_train_step_lowers_for_cuda(trainer_for):
  trainer = trainer_for(tiny_config(**COMPOSED), 8)
  traced = trainer.train_step.trace(*trainer.abstract_inputs())
  cpu = traced.lower().as_text()
  cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
  # The variable-volume collectives are the GPU's alone; the CPU keeps static buffers.
  assert "ragged_all_to_all" in cuda and "ragged_all_to_all" not in cpu
  assert "ragged_dot" in cuda and "ragged_dot" not in cpu
