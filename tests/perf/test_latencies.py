"""moejax's latencies for XLA:GPU's scheduler (`moejax.perf.latencies`) against hand
computations on a small module in XLA:GPU's printed form (nothing compiled here; a compiled
program's pricing: tests/sharding/test_overlap.py; the train step scheduled by them:
tests/train/test_latency_profile.py)."""
import re

import pytest

from moejax.perf import latencies
from moejax.perf.collectives import Net
from moejax.perf.hardware import GPU, LAUNCH_S, Cluster, Link

GPU_T = GPU("test", "a100", 1e12, 1e11, 80e9, "round numbers")
NET_T = Net(Cluster("test", GPU_T, 8, Link("nv", "intra", 1e9, 1e-6, ""),
                    Link("net", "inter", 1e8, 5e-6, ""), "8 GPUs a node"), 8)
EFF = 0.5

# One layer loop of 3 iterations: the next weights' all-gather started before a matmul fusion
# and done after it, then a synchronous reduce-scatter of the matmul's output.
MODULE = """HloModule jit_step, is_scheduled=true

%fused_dot (p0: bf16[64,128], p1: bf16[128,32]) -> f32[64,32] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,32]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%fused_scale (q0: f32[8,32]) -> f32[8,32] {
  %q0 = f32[8,32]{1,0} parameter(0)
  %two = f32[] constant(2)
  %bcast = f32[8,32]{1,0} broadcast(%two), dimensions={}
  ROOT %mul = f32[8,32]{1,0} multiply(%q0, %bcast)
}

%body (arg: (s32[], bf16[64,128], bf16[16,32])) -> (s32[], bf16[64,128], bf16[16,32]) {
  %arg = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = bf16[64,128]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[16,32]{1,0} get-tuple-element(%arg), index=2
  %ag-start = ((bf16[16,32]{1,0}), bf16[128,32]{1,0}) all-gather-start(%w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, metadata={op_name="jit(step)/while/body/gather/all_gather" source_file="moejax/sharding/prefetch.py" source_line=1}
  %gemm_fusion = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/while/body/experts/dot_general"}
  %ag-done = bf16[128,32]{1,0} all-gather-done(%ag-start)
  %rs = f32[8,32]{1,0} reduce-scatter(%gemm_fusion), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %scaled = f32[8,32]{1,0} fusion(%rs), kind=kLoop, calls=%fused_scale
  ROOT %next = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) tuple(%i, %x, %w)
}

%cond (carg: (s32[], bf16[64,128], bf16[16,32])) -> pred[] {
  %carg = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%carg), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %three), direction=LT
}

ENTRY %main (x0: bf16[64,128], w0: bf16[16,32]) -> (s32[], bf16[64,128], bf16[16,32]) {
  %x0 = bf16[64,128]{1,0} parameter(0)
  %w0 = bf16[16,32]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) tuple(%zero, %x0, %w0)
  ROOT %loop = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def _kernel(flops, bytes_):
  return max(flops / (GPU_T.peak_flops * EFF), bytes_ / GPU_T.hbm_bandwidth) + \
      latencies.KERNEL_LAUNCH_S


def test_each_instruction_priced_by_hand():
  costs = latencies.instruction_costs(MODULE, GPU_T, NET_T, EFF)
  gemm = _kernel(2 * 64 * 32 * 128, 64 * 32 * 4 + 64 * 128 * 2 + 16 * 32 * 2)
  assert costs["gemm_fusion"] == pytest.approx(gemm)
  # The gather's result (its done's shape, not the start's tuple) over 8 GPUs of one node:
  # 7 ring steps, 7/8 of 8 KiB at 1 GB/s.
  gather = LAUNCH_S + 7 * 1e-6 + 7 / 8 * 128 * 32 * 2 / 1e9
  assert costs["ag-start"] == pytest.approx(gather)
  assert costs["ag-done"] == 0
  # reduce-scatter: its input (8 x the result) is the buffer the ring moves.
  assert costs["rs"] == pytest.approx(LAUNCH_S + 7 * 1e-6 + 7 / 8 * 8 * 8 * 32 * 4 / 1e9)
  scale = _kernel(0, 2 * 8 * 32 * 4)
  assert costs["scaled"] == pytest.approx(scale)
  for free in ("i", "x", "w", "next", "x0", "zero", "init"):
    assert costs[free] == 0, free
  # The loop: 3 iterations of its body, one after another.
  assert costs["loop"] == pytest.approx(3 * (gather + gemm + costs["rs"] + scale))
  # Fused computations run as their fusion's one kernel: nothing inside them is priced.
  assert not {"dot.1", "p0", "mul", "bcast"} & set(costs)


def test_the_schedule_prices_what_compute_leaves_uncovered():
  costs = latencies.instruction_costs(MODULE, GPU_T, NET_T, EFF)
  priced = latencies.schedule_time(MODULE, costs)
  # Per iteration: the gather hides behind the matmul as far as it lasts; the reduce-scatter
  # is synchronous, exposed whole.
  uncovered = max(costs["ag-start"] - costs["gemm_fusion"], 0.0)
  assert costs["ag-start"] > costs["gemm_fusion"] > 0       # partly covered, here
  assert priced.compute == pytest.approx(3 * (costs["gemm_fusion"] + costs["scaled"]))
  assert priced.collectives == pytest.approx(3 * (costs["ag-start"] + costs["rs"]))
  assert priced.exposed == pytest.approx(3 * (uncovered + costs["rs"]))
  assert priced.step == pytest.approx(priced.compute + priced.exposed)
  # Each collective's share, most exposed first: the synchronous reduce-scatter whole, the
  # gather what the matmul left; named by instruction and by the jax op it came from.
  rs, ag = priced.exposures
  assert (rs.name, rs.exposed, rs.seconds) == ("rs", pytest.approx(3 * costs["rs"]),
                                               pytest.approx(3 * costs["rs"]))
  assert (ag.name, ag.exposed, ag.seconds) == ("ag-start", pytest.approx(3 * uncovered),
                                               pytest.approx(3 * costs["ag-start"]))
  assert ag.op_name == "jit(step)/while/body/gather/all_gather" and rs.op_name == ""
  assert priced.as_ms(6)["exposed"] == round(priced.exposed * 1e3, 6)
  # compute by part, where a namer is given (here the op_name itself; the scale has none)
  parts = latencies.schedule_time(MODULE, costs, lambda op_name: op_name or "unnamed")
  assert parts.compute_by_part == {
      "jit(step)/while/body/experts/dot_general": pytest.approx(3 * costs["gemm_fusion"]),
      "unnamed": pytest.approx(3 * costs["scaled"])}
  assert priced.compute_by_part == {} and priced.compute_by_line == {}
  # and by source line, from a table by instruction name (here only the matmul's)
  lines = latencies.schedule_time(MODULE, costs, line_of={"gemm_fusion": "moejax/a.py:7"})
  assert lines.compute_by_line == {"moejax/a.py:7": pytest.approx(3 * costs["gemm_fusion"]),
                                   "?": pytest.approx(3 * costs["scaled"])}
  assert [e["name"] for e in priced.most_exposed(1, 6)] == ["rs"]


def test_profile_text_is_xla_s_profile_in_microseconds():
  text = latencies.profile_text({"gemm_fusion": 1.5e-4, "ag-start": 2e-6})
  entries = re.findall(r'costs \{ name: "([^"]+)" cost_us: ([0-9.]+) \}', text)
  assert entries == [("ag-start", "2.000"), ("gemm_fusion", "150.000")]
  assert len(text.splitlines()) == 2


@pytest.mark.parametrize("groups, size", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4),
    ("replica_groups=[4,2]<=[8]", 2),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", 4),
    ("replica_groups=mesh['node'=2,'device'=4] {'device'}", 4),
    ("replica_groups=mesh['node'=2,'device'=4] {'node','device'}", 8),
    ("replica_groups={}", 8),
])
def test_replica_groups_in_each_printed_form(groups, size):
  assert latencies.group_size(f"%x = f32[8]{{0}} all-reduce(%y), {groups}, to_apply=%add",
                              8) == size


def test_grouped_matmul_kernels_priced_by_their_routed_flops():
  """The Hopper kernels' custom calls (`mosaic_gpu`: group sizes, rows, the expert stack) in
  both forms; a custom call of another shape is priced by its bytes."""
  comp = latencies.parse_module("""HloModule k

ENTRY %main (gs: s32[8], x: bf16[1024,256], w: bf16[8,256,512], dy: bf16[1024,512]) -> f32[] {
  %gs = s32[8]{0} parameter(0)
  %x = bf16[1024,256]{1,0} parameter(1)
  %w = bf16[8,256,512]{2,1,0} parameter(2)
  %dy = bf16[1024,512]{1,0} parameter(3)
  %fwd = bf16[1024,512]{1,0} custom-call(%gs, %x, %w), custom_call_target="mosaic_gpu_v2"
  %dw = bf16[8,256,512]{2,1,0} custom-call(%gs, %x, %dy), custom_call_target="mosaic_gpu_v2"
  %other = bf16[1024,256]{1,0} custom-call(%x), custom_call_target="something"
  ROOT %r = f32[] constant(0)
}
""")["main"]
  shapes = {i.name: i.shape for i in comp}
  by_name = {i.name: i for i in comp}
  flops = 2 * 1024 * 256 * 512
  assert latencies._grouped_matmul_flops(by_name["fwd"], shapes) == flops
  assert latencies._grouped_matmul_flops(by_name["dw"], shapes) == flops
  assert latencies._grouped_matmul_flops(by_name["other"], shapes) == 0


def test_shapes_of_every_form():
  assert latencies.shape_bytes("(bf16[16,32]{1,0}, u32[8,3632]{1,0:S(1)})") == (
      16 * 32 * 2 + 8 * 3632 * 4)
  assert latencies.shape_bytes("pred[]") == 1
  assert latencies.shape_bytes("(s32[], token[])") == 4
  assert latencies.shape_bytes("s4[6]{0}") == 3


def test_a_group_across_nodes_is_priced_on_the_network():
  """Groups by their devices, not their size: {0, 8} on nodes of 8 crosses the network, {0, 1}
  stays on NVLink; the iota and mesh forms give the same devices as the list."""
  net = Net(Cluster("two nodes", GPU_T, 8, Link("nv", "intra", 1e9, 1e-6, ""),
                    Link("net", "inter", 1e8, 5e-6, ""), "2 x 8"), 16)
  assert latencies.group_devices("replica_groups=[8,2]<=[2,8]T(1,0)", 16) == [0, 8]
  assert latencies.group_devices("replica_groups=mesh['node'=2,'device'=8] {'node'}", 16) == [0, 8]
  assert latencies.group_devices("replica_groups=[8,2]<=[16]", 16) == [0, 1]

  def gather(groups):
    module = f"""HloModule m

ENTRY %main (x: f32[1024]) -> f32[2048] {{
  %x = f32[1024]{{0}} parameter(0)
  ROOT %ag = f32[2048]{{0}} all-gather(%x), replica_groups={groups}, dimensions={{0}}
}}
"""
    return latencies.instruction_costs(module, GPU_T, net, EFF)["ag"]

  across, within = gather("{{0,8},{1,9}}"), gather("{{0,1},{2,3}}")
  assert within == pytest.approx(LAUNCH_S + 1e-6 + 0.5 * 8192 / 1e9)
  assert across == pytest.approx(LAUNCH_S + 5e-6 + 0.5 * 8192 / 1e8)


def test_sliced_and_updated_in_place_arrays_count_what_moves():
  """A layer's weights read out of a stacked array count the slice, not the stack; a
  dynamic-update-slice writes its update in place, also as an async fusion; a cuBLAS call's workspace is not data; cuDNN's
  attention is priced by its FLOPs."""
  module = """HloModule m

%fused_take (s0: bf16[16,256,256], i0: s32[]) -> bf16[1,256,256] {
  %s0 = bf16[16,256,256]{2,1,0} parameter(0)
  %i0 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = bf16[1,256,256]{2,1,0} dynamic-slice(%s0, %i0, %z, %z), dynamic_slice_sizes={1,256,256}
}

%fused_put (u0: f32[16,256,256], u1: f32[1,256,256], u2: s32[]) -> f32[16,256,256] {
  %u0 = f32[16,256,256]{2,1,0} parameter(0)
  %u1 = f32[1,256,256]{2,1,0} parameter(1)
  %u2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[16,256,256]{2,1,0} dynamic-update-slice(%u0, %u1, %u2, %zero, %zero)
}

ENTRY %main (w: bf16[16,256,256], g: f32[16,256,256], i: s32[], d: f32[1,256,256], a: bf16[64,256], b: bf16[256,256], q: bf16[2,128,4,64], k: bf16[2,128,4,64]) -> f32[] {
  %w = bf16[16,256,256]{2,1,0} parameter(0)
  %g = f32[16,256,256]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %d = f32[1,256,256]{2,1,0} parameter(3)
  %a = bf16[64,256]{1,0} parameter(4)
  %b = bf16[256,256]{1,0} parameter(5)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(6)
  %k = bf16[2,128,4,64]{3,2,1,0} parameter(7)
  %take = bf16[1,256,256]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_take
  %put = f32[16,256,256]{2,1,0} fusion(%g, %d, %i), kind=kLoop, calls=%fused_put
  %put-start = ((f32[16,256,256]{2,1,0}, f32[1,256,256]{2,1,0}, s32[]), f32[16,256,256]{2,1,0}, u32[]) fusion-start(%g, %d, %i), kind=kLoop, calls=%fused_put
  %put-done = f32[16,256,256]{2,1,0} fusion-done(%put-start)
  %gemm = (bf16[64,256]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %att = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %k), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  ROOT %r = f32[] constant(0)
}
"""
  costs = latencies.instruction_costs(module, GPU_T, NET_T, EFF)
  assert costs["take"] == pytest.approx(_kernel(0, 2 * 256 * 256 * 2 + 4))
  assert costs["put"] == pytest.approx(_kernel(0, 2 * 256 * 256 * 4 + 4))
  # the same kernel as an async fusion (XLA:GPU's start / done pair): priced as the kernel
  assert costs["put-start"] == costs["put"] and costs["put-done"] == 0
  assert costs["gemm"] == pytest.approx(_kernel(2 * 64 * 256 * 256,
                                                2 * (64 * 256 + 64 * 256 + 256 * 256)))
  flops = 4 * 2 * 128 * 4 * 128 * 64 / 2                # causal
  assert costs["att"] == pytest.approx(_kernel(flops, 2 * 4 * 2 * 128 * 4 * 64))


def test_a_loop_covers_a_collective_in_flight_over_it():
  module = MODULE.replace('''  ROOT %loop = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}''', '''  %pre-start = ((bf16[16,32]{1,0}), bf16[128,32]{1,0}) all-gather-start(%w0), channel_id=9, replica_groups=[1,8]<=[8], dimensions={0}
  %loop = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %pre-done = bf16[128,32]{1,0} all-gather-done(%pre-start)
  ROOT %out = (s32[], bf16[64,128]{1,0}, bf16[16,32]{1,0}) tuple(%zero, %x0, %w0)''')
  costs = latencies.instruction_costs(module, GPU_T, NET_T, EFF)
  base = latencies.schedule_time(MODULE, latencies.instruction_costs(MODULE, GPU_T, NET_T, EFF))
  priced = latencies.schedule_time(module, costs)
  assert costs["loop"] > costs["pre-start"]
  assert priced.exposed == pytest.approx(base.exposed)        # all of it under the loop
  assert priced.collectives == pytest.approx(base.collectives + costs["pre-start"])


def test_a_dot_in_a_nested_fusion_is_counted():
  module = MODULE.replace('''  %gemm_fusion = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot''', '''  %gemm_fusion = f32[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%outer''').replace(
      '''%add (a: f32[], b: f32[]) -> f32[] {''', '''%outer (o0: bf16[64,128], o1: bf16[128,32]) -> f32[64,32] {
  %o0 = bf16[64,128]{1,0} parameter(0)
  %o1 = bf16[128,32]{1,0} parameter(1)
  ROOT %inner = f32[64,32]{1,0} fusion(%o0, %o1), kind=kCustom, calls=%fused_dot
}

%add (a: f32[], b: f32[]) -> f32[] {''')
  nested = latencies.instruction_costs(module, GPU_T, NET_T, EFF)
  flat = latencies.instruction_costs(MODULE, GPU_T, NET_T, EFF)
  assert nested["gemm_fusion"] == pytest.approx(flat["gemm_fusion"])
  assert "inner" not in nested                 # inside the kernel: not scheduled on its own


def test_synchronous_collectives_are_exposed_whole_summed_as_the_collectives_are():
  module = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %r1 = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %r2 = f32[8]{0} all-reduce(%r1), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %r3 = f32[8]{0} all-reduce(%r2), channel_id=3, replica_groups={{0,1}}, to_apply=%add
  ROOT %r4 = f32[8]{0} all-reduce(%r3), channel_id=4, replica_groups={{0,1}}, to_apply=%add
}
"""
  # (summed largest first, 0.1 + 0.2 + 0.3 would come out 0.6, not 0.6000000000000001)
  priced = latencies.schedule_time(module, {"r1": 0.1, "r2": 0.2, "r3": 0.3, "r4": 0.0})
  assert priced.exposed == priced.collectives and priced.compute == 0
  assert [e.name for e in priced.exposures[:3]] == ["r3", "r2", "r1"]
