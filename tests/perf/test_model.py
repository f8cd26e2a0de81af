"""The iteration-time model against hand computations (no jax, nothing compiled)."""
import dataclasses

import numpy as np
import pytest

from moejax.perf import compute as cp
from moejax.perf import loads as ld
from moejax.perf.collectives import Net
from moejax.perf.hardware import GPU, LAUNCH_S, Cluster, Link, get_cluster
from moejax.perf.model import Calibration, Run
from moejax.perf.schedule import Program, simulate
from moejax.perf.shapes import SHAPES, ModelShape, shape_of
from moejax.perf.step import step_time
from moejax.perf.systems import get_system

GPU_T = GPU("test", "a100", 1e12, 1e12, 80e9, "round numbers")
CLUSTER_T = Cluster("test", GPU_T, 2, Link("nv", "intra", 1e9, 0.0, ""),
                    Link("net", "inter", 1e8, 0.0, ""), "two GPUs, one node")
CAL_T = Calibration(gpu_eff=(("a100", 0.5),), link_eff=(("intra", 1.0), ("inter", 1.0)))
TWO_LAYERS = ModelShape("two-layer", d_model=8, num_layers=2, vocab_size=16, num_heads=2,
                        head_dim=4, num_experts=2, top_k=1, expert_hidden=8)


def test_two_layer_fsdp_step_by_hand():
  """moejax fsdp (prefetch one unit ahead, fp32 reduce-scatter) on 2 GPUs, without remat."""
  t, s = 1e5, 10
  # Weights: attention 4 x 8x8 = 256, norms 16, router 16, experts 2 x 3 x 8x8 = 384 -> 672 per
  # layer (4 groups); embedding and lm head 16 x 8 = 128 each.
  # Gathers (W=2: each GPU receives half of the bf16 buffer at 1e9 B/s; LAUNCH_S per group).
  ag_layer = 4 * LAUNCH_S + 0.5 * 2 * 672 / 1e9
  ag_emb = LAUNCH_S + 0.5 * 2 * 128 / 1e9
  rs_layer = LAUNCH_S + 0.5 * 4 * 672 / 1e9
  rs_emb = LAUNCH_S + 0.5 * 4 * 128 / 1e9
  # Forward FLOPs per token of a layer: attention 2*256 + S*H*(4+4) = 672, router 2*16 = 32,
  # one expert 2*3*8*8 = 384 -> 1088; head 2*16*8 = 256. At 0.5 x 1e12 FLOP/s:
  c_layer = t * 1088 / 5e11
  c_head = t * 256 / 5e11
  opt = 30 * (2 * 672 + 2 * 128 + 8) / 2 / 1e12
  # The critical path: embed and layer-0 gathers, then compute-bound (the next gathers hide
  # behind compute), the head's backward gather, the backward chain, the last two
  # reduce-scatters (layer 0, embedding) after the last compute, the optimizer.
  expected = (ag_emb + ag_layer + 2 * c_layer + c_head + ag_emb + 2 * c_head + 2 * 2 * c_layer
              + rs_layer + rs_emb + opt)
  got = step_time(TWO_LAYERS, CLUSTER_T, Run(2, t, s, remat=False), "fsdp", CAL_T)
  assert got.seconds == pytest.approx(expected, rel=1e-9)
  assert got.exposed["ag"] == pytest.approx(2 * ag_emb + ag_layer, rel=1e-9)
  assert got.exposed["rs"] == pytest.approx(rs_layer + rs_emb, rel=1e-9)
  # Every unit's gradient, and a layer's of zeros as the backward scan starts (hidden here).
  assert got.busy["rs"] == pytest.approx(3 * rs_layer + 2 * rs_emb, rel=1e-9)
  # In place (XLA:CPU's order): each unit's backward waits for the reduce-scatter of the unit
  # after it, so all four are on the critical path, and none of zeros is sent.
  in_place = step_time(TWO_LAYERS, CLUSTER_T, Run(2, t, s, remat=False), "fsdp-rs-in-place",
                       CAL_T)
  assert in_place.exposed["rs"] == pytest.approx(2 * rs_layer + 2 * rs_emb, rel=1e-9)
  assert in_place.busy["rs"] == pytest.approx(2 * rs_layer + 2 * rs_emb, rel=1e-9)
  assert in_place.seconds == pytest.approx(expected + rs_layer + rs_emb, rel=1e-9)
  assert got.exposed["compute"] == pytest.approx(3 * c_head + 6 * c_layer, rel=1e-9)
  assert sum(got.exposed.values()) == pytest.approx(got.seconds, rel=1e-12)


def test_zero3_is_sequential_and_pays_the_framework_per_tensor():
  cal = CAL_T.replace(**{"host_s.deepspeed": 1e-3})
  run = Run(2, 1e5, 10, remat=False)
  wide = dataclasses.replace(TWO_LAYERS, d_model=512, head_dim=128, expert_hidden=256,
                             vocab_size=256)
  z = step_time(wide, CLUSTER_T, run, "zero3", cal)
  # Tensors fetched one by one: 4 attention matrices and 6 expert matrices per layer, the
  # embedding and the head (norms and the 1024-element router stay unpartitioned: under 1e5).
  tensors = 2 * 10 + 2
  assert step_time(TWO_LAYERS, CLUSTER_T, run, "zero3", cal).exposed.get("host", 0) == 0
  # fetched in the forward and the backward, reduced once: 3 framework costs per tensor
  assert z.busy["host"] == pytest.approx(3 * tensors * 1e-3, rel=1e-9)
  # all on the critical path but the last reduce hook, which overlaps the previous
  # reduce-scatter
  assert z.exposed["host"] == pytest.approx((3 * tensors - 1) * 1e-3, rel=1e-9)
  # fetched on demand: no gather overlaps compute (moejax's prefetched gathers do)
  assert z.exposed["ag"] == pytest.approx(z.busy["ag"], rel=1e-9)
  f = step_time(wide, CLUSTER_T, run, "fsdp", cal)
  assert f.exposed["ag"] < 0.5 * f.busy["ag"]
  # every unit gathered once per pass: layers 4 x 512 x (2 x 128) + 2 x 512 + 512 x 2
  # + 2 x 3 x 512 x 256 values
  ag_layer = 4 * LAUNCH_S + 0.5 * 2 * 1_312_768 / 1e9
  ag_emb = LAUNCH_S + 0.5 * 2 * 256 * 512 / 1e9
  assert f.busy["ag"] == pytest.approx(2 * (2 * ag_layer + 2 * ag_emb), rel=1e-9)


def test_collectives_by_hand():
  c = get_cluster("ciera-a100")
  net = Net(c, 16, intra_eff=0.5, inter_eff=0.25)      # 150 GB/s NVLink, 6.25 GB/s per node
  full = 1e9
  ring = LAUNCH_S + 15 * c.inter.latency + 15 / 16 * full / (25e9 * 0.25)
  assert net.all_gather(full) == pytest.approx(ring)
  hier = (LAUNCH_S + 7 * c.intra.latency + c.inter.latency
          + 0.5 * full / 6.25e9 + 7 / 8 * full / 150e9)
  assert net.all_gather(full, "hierarchical") == pytest.approx(hier)
  one_node = Net(c, 8, intra_eff=0.5)
  assert one_node.all_gather(full) == pytest.approx(LAUNCH_S + 7 * 1e-6 + 7 / 8 * full / 150e9)
  # all-to-all: 16 GPUs each send 1 MB to every other GPU; a node sends 8 x 8 MB across.
  m = np.full((16, 16), 1e6)
  np.fill_diagonal(m, 0)
  t, even = net.all_to_all(m)
  assert t == pytest.approx(LAUNCH_S + 1e-6 + 5e-6 + max(64e6 / 6.25e9, 8e6 / (6.25e9 / 8)))
  assert even == pytest.approx(t)
  hot = m.copy()
  hot[:, 3] *= 4
  t_hot, even_hot = net.all_to_all(hot)
  assert t_hot > even_hot > t


def test_flops_closed_form_and_shapes():
  s = SHAPES["OLMoE-1B-7B"]
  assert s.total_params() == 6_919_161_856        # the published count (moejax num_params)
  assert cp.expert_flops(s) == 2 * 3 * 2048 * 1024
  assert cp.attention_flops(s, 1024) == 2 * 4 * 2048 * 2048 + 1024 * 16 * 256
  # Half of the 16 layers sliding within 256 keys: a sliding query sees 256 - 256 * 255 / 2048
  # keys on average where a full one sees 512 (the core's 1024 counts 2 FLOPs a key).
  slides = dataclasses.replace(s, sliding_window=256, sliding_layers=8)
  sliding = 2 * (256 - 256 * 255 / 2048)
  assert cp.attention_flops(slides, 1024) == pytest.approx(
      2 * 4 * 2048 * 2048 + (1024 + sliding) / 2 * 16 * 256)
  # The gated q projection counts twice (MiniCPM5-MoE).
  gated = dataclasses.replace(s, attention_gate=True)
  assert cp.attention_flops(gated, 1024) - cp.attention_flops(s, 1024) == 2 * 2048 * 2048
  assert SHAPES["DeepSeek-V3"].total_params() == pytest.approx(671e9, rel=0.01)
  assert SHAPES["Mixtral-8x7B"].total_params() == pytest.approx(46.7e9, rel=0.01)
  from configs.olmoe import get_config
  from moejax.config import from_config_dict
  got = shape_of(from_config_dict(get_config("1b7b")))
  keep = ("d_model", "num_layers", "vocab_size", "num_heads", "head_dim", "num_experts",
          "top_k", "expert_hidden", "qk_norm", "tied_embeddings")
  assert {k: getattr(got, k) for k in keep} == {k: getattr(s, k) for k in keep}
  # Llama 4 Scout's record is its preset's shape; its chunked layers' core is the chunk's
  import configs.llama4
  scout = shape_of(from_config_dict(configs.llama4.get_config("scout")))
  assert dataclasses.replace(scout, name="", source="") == dataclasses.replace(
      SHAPES["Llama-4-Scout-17B-16E"], name="", source="")
  unchunked = dataclasses.replace(scout, attention_chunk=0, chunked_layers=0)
  long = 4 * 8192
  core = lambda shape: cp.attention_flops(shape, long) - 2 * shape.attention_params()  # noqa: E731
  # three layers of four see 4097 keys on average instead of 16384: 0.25 + 0.75 * 8193 / 32768
  assert core(scout) / core(unchunked) == pytest.approx(0.25 + 0.75 * 8193 / 32768)
  # DeepSeek-V3.2's is V3's plus its indexer: projections, each head's q.k and weight per key,
  # and, training it by its loss, those scores and the attention's q.k again
  import configs.deepseek
  import configs.deepseek_v32
  v3 = shape_of(from_config_dict(configs.deepseek.get_config("v3")))
  v32 = shape_of(from_config_dict(configs.deepseek_v32.get_config("v32")))
  assert v32.indexer_params() == 1536 * 64 * 128 + 7168 * (128 + 64) + 2 * 128
  assert v32.total_params() - v3.total_params() == 61 * v32.indexer_params()
  extra = 2 * v32.indexer_params() + 4096 * (2 * 64 * 129 + 128 * 192)
  assert cp.attention_flops(v32, 4096) - cp.attention_flops(v3, 4096) == pytest.approx(extra)


def test_schedule_overlap_and_critical_path():
  p = Program()
  a = p.add("compute", "compute", 3.0)
  g = p.add("ag", "comm", 2.0)              # overlaps a
  b = p.add("compute", "compute", 1.0, (a, g))
  r = p.add("rs", "comm", 4.0, b)           # exposed: nothing after it on compute
  p.add("optimizer", "compute", 0.5, (b, r))
  res = simulate(p)
  assert res.seconds == 8.5
  assert res.exposed == {"compute": 4.0, "rs": 4.0, "optimizer": 0.5}
  assert res.busy["ag"] == 2.0


def test_dispatch_replicas_balance_and_straggler():
  counts = np.array([[3, 1], [3, 1]])            # 2 devices, 2 experts, expert 0 hot
  owner = ld.even_owners(2, 2)
  load, traffic = ld.dispatch(counts, ld.owner_holders(owner, 2), 2)
  assert load.tolist() == [6.0, 2.0]
  assert traffic.tolist() == [[3.0, 1.0], [3.0, 1.0]]
  holders = ld.plan_replicas(counts.sum(0).astype(float), owner, 2, 2, slots=1, overlap=1,
                             method="lpt")
  load, traffic = ld.dispatch(counts, holders, 2)
  assert load.tolist() == [4.0, 4.0]
  assert traffic[1, 1] == 3.0                    # device 1 keeps its own tokens of expert 0


def test_synthetic_trace_shape_and_skew():
  tr = ld.deepseek_v3_trace(16, tokens_per_device=512, steps=6, layers=2, seed=3)
  assert tr.shape == (6, 2, 16, 256)
  assert (tr.sum(-1) == 512 * 8).all()
  assert (tr <= 512).all()                       # a token picks k distinct experts
  p = tr.sum((0, 2)).astype(float)
  cv = (p.std(1) / p.mean(1)).mean()
  assert 0.5 < cv < 0.9                          # the Gamma spread (CV 0.69) plus sampling
  again = ld.deepseek_v3_trace(16, tokens_per_device=512, steps=6, layers=2, seed=3)
  assert (again == tr).all()


def test_ep_step_hand_straggler_split():
  """Two GPUs, two experts: ep's expert time is the busy device's; its excess over the mean
  is reported as straggler wait, and uniform has none."""
  shape = dataclasses.replace(TWO_LAYERS, num_layers=1)
  trace = np.zeros((7, 1, 2, 2), np.int64)
  trace[...] = [[300, 100], [300, 100]]          # 400 assignments per device, expert 0 hot
  run = Run(2, 400, 10, remat=False)
  ep = step_time(shape, CLUSTER_T, run, "ep", CAL_T, trace)
  uni = step_time(shape, CLUSTER_T, run, "uniform", CAL_T, trace)
  assert ep.extra["straggler"] == pytest.approx(1.5)
  assert uni.extra["straggler"] == pytest.approx(1.0)
  expert = 384 / 5e11
  assert ep.exposed["straggler"] >= (600 - 400) * expert * 3 * 0.999   # fwd + bwd (2x)
  assert "straggler" not in uni.exposed or uni.exposed["straggler"] == 0


def test_sparse_gather_bytes_themis_routes_once_per_node_moejax_from_the_owner():
  """One expert owned by GPU 0 (node 0 of 2 x 4), replicated on all of node 1: Themis carries it
  into node 1 once and broadcasts it there; moejax sends each replica from the owner, so the
  owner's link and node 0's NICs carry it four times (what `fssdp.owner_sends` bounds), and a
  replica its device kept goes as a patch."""
  from moejax.perf.expert_parallel import _spag_bytes
  holders = np.zeros((2, 8), bool)
  holders[0, [0, 4, 5, 6, 7]] = True
  holders[1, 1] = True                         # expert 1: its owner only
  owner = np.array([0, 1])
  assert _spag_bytes(holders, owner, 4, 10.0) == (10.0, 10.0)
  assert _spag_bytes(holders, owner, 4, 10.0, direct=True) == (40.0, 40.0)
  kept = np.zeros_like(holders)
  kept[0, 4] = True
  assert _spag_bytes(holders, owner, 4, 10.0, kept, 0.5, direct=True) == (35.0, 35.0)
  assert _spag_bytes(holders, owner, 4, 10.0, kept, 0.5) == (10.0, 10.0)   # not all kept


def test_dispatch_in_pieces_by_hand():
  """moejax's `moe.dispatch_chunks` in the model: the exchange in k pieces pays the exchange's
  fixed cost (here LAUNCH_S: no link latency) per piece, and piece j's exchange runs beside
  piece j - 1's experts. Two GPUs, uniform loads, one layer, no remat: with each piece's exchange
  (a = (A - LAUNCH_S) / 2 + LAUNCH_S) longer than its experts (x), a pass goes from dispatch +
  experts + combine (2A + X) to 4a = 2A + 2 LAUNCH_S, forward and backward alike."""
  shape = dataclasses.replace(TWO_LAYERS, num_layers=1)
  trace = np.full((7, 1, 2, 2), 200, np.int64)
  run = Run(2, 400, 10, remat=False)
  whole = step_time(shape, CLUSTER_T, run, "uniform", CAL_T, trace)
  system = dataclasses.replace(get_system("uniform"), dispatch_chunks=2)
  pieces = step_time(shape, CLUSTER_T, run, system, CAL_T, trace)
  x = 400 * 384 / 5e11                       # the experts' forward: 400 rows of 384 FLOPs
  a2a = LAUNCH_S + 200 * 16 / 1e9            # half the rows to the other GPU, 16 B each
  assert (a2a + LAUNCH_S) / 2 > cp.BACKWARD * x / 2        # (each piece's exchange the longer)
  assert pieces.seconds - whole.seconds == pytest.approx(4 * LAUNCH_S - (1 + cp.BACKWARD) * x)
  assert pieces.busy["a2a"] - whole.busy["a2a"] == pytest.approx(4 * LAUNCH_S)   # 4 exchanges
  assert pieces.busy["compute"] == pytest.approx(whole.busy["compute"])
  same = dataclasses.replace(get_system("uniform"), dispatch_chunks=1)
  assert step_time(shape, CLUSTER_T, run, same, CAL_T, trace).seconds == whole.seconds
