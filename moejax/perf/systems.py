"""The techniques the model compares, as data: baselines of the papers and moejax's modes.

Sharded family (every weight, experts included, is sliced over all GPUs and gathered per
layer; each GPU computes its own tokens):
  zero3           DeepSpeed ZeRO-3 as CIERA measured it: each weight tensor fetched on demand
                  (MoE invalidates ZeRO-3's prefetch trace), a framework cost per fetched and
                  per reduced tensor, bf16 all-gather and reduce-scatter, nothing overlapped
                  but the reduce-scatter.
  zero++          ZeRO-3 plus int8 forward all-gather (qwZ), backward all-gather from a
                  node-local secondary copy (hpZ), int4 hierarchical gradient reduction (qgZ),
                  with their quantize / dequantize passes.
  ciera-er        ZeRO-3 with CIERA's exponent reuse on every tensor, gathered per layer by
                  CIERA's rewritten path (prefetched), hash / pack / decode on the critical path.
  ciera-bsc       + benefit-driven selection: only tensors whose gain is positive (Sec. 3.2).
  ciera           + pipelining: hash and pack on a side stream; decode stays on the path.
  fsdp            moejax plain: one gather per parameter group and layer (bf16 bit patterns),
                  next layer's gather issued before this layer's compute, fp32 reduce-scatter.
  moejax-<mode>   fsdp with moejax's codec (element, block, word, delta, auto): the byte ratio
                  bench/codec.py measured (or a run's metrics), encode and decode on the GPU.
Expert-parallel family (experts stay whole on owners; tokens travel by all-to-all):
  ep              owners only (Megatron EP, Themis's baseline): non-expert weights data
                  parallel (gradient all-reduce overlapped with the backward).
  uniform         ep with a gate that spreads tokens evenly (Themis's reference).
  fastermoe       ep plus, after gating, a broadcast of the hottest experts to every GPU (as
                  many as its latency model finds worth it) and their gradients all-reduced.
  flexmoe         ep plus persistent replicas re-planned every 50 steps, replica gradients
                  all-reduced every step, moved replicas' weights and Adam state migrated.
  ep+het          ep on heterogeneous owners re-sharded every 100 steps (Themis Fig. 14b).
  themis          FSSDP as Themis runs it: heterogeneous owners, per-step replicas of the top-t
                  experts (Algorithm 1, t from its overlap rule) fetched by SparseAllGather
                  during attention, topology-aware dispatch (Algorithm 3).
  moejax-ep       moejax's ep: non-expert weights gathered fsdp-style, remat.
  moejax-fssdp    moejax's fssdp: replicas planned on the predicted load (LPT), re-planned after
                  gating (late fetch on the critical path), balanced dispatch, heterogeneous
                  owners, remat (the config defaults M=2, t=4; `-t16`: M=4, t=16); `+admit`
                  variants add capacity-limited admission (reroute, factor 1.25);
                  `+codec` the replica codec (a replica its device held last step travels as a
                  delta patch, `REPLICA_PATCH_RATIO` of its bytes).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class System:
  name: str
  family: str
  """"sharded" or "ep"."""
  framework: str = "xla"
  """"deepspeed": per-tensor fetch on demand with a framework cost; "xla": per-group gathers,
  prefetched one layer ahead."""
  codec: str = "off"
  """off, ciera, zero++, or a moejax mode (element, block, word, delta, auto)."""
  select: bool = True
  """CIERA BSC (only tensors whose gain is positive are compressed)."""
  overlap_codec: bool = True
  """CIERA CCP: hash and pack on a side stream (decode always on the critical path)."""
  rs_bytes: float = 2.0
  """Bytes per gradient value in the reduce-scatter (moejax: fp32)."""
  scatter_ahead: bool = True
  """xla: a unit's gradient reduce-scatter runs under the next unit's backward (moejax on GPU,
  config `scatter_ahead`, which also scatters one layer's gradient of zeros a step); False:
  the next unit's backward waits for it (moejax on XLA:CPU, and before `1188d58`)."""
  # expert-parallel family
  balance: str = "none"
  """none, uniform, fastermoe, flexmoe, replicas."""
  planner: str = "themis"
  """replicas: "themis" (Algorithm 1) or "lpt" (moejax's planner)."""
  calibrate: bool = False
  """replicas: re-plan after gating from the actual loads (the extra replicas are fetched on the
  critical path)."""
  balanced_dispatch: bool = False
  """Water-fill the holders' shares (moejax) instead of equal shares (Themis Algorithm 3)."""
  het_sharding: bool = False
  reshard_every: int = 100
  dense: str = "dp"
  """Non-expert weights: "dp" (replicated, gradients all-reduced) or "fsdp" (gathered)."""
  admission: str = "none"
  """none, strict, reroute (capacity-limited admission before dispatch)."""
  capacity_factor: float = 1.25
  replica_slots: int = 0
  """m replica slots per GPU and layer; 0: as many as the overlap degree (Themis, t <= m)."""
  overlap_degree: int = 0
  """t distinct experts replicated per layer; 0: Themis's rule floor(T_attn * bw / expert
  bytes)."""
  owner_sends: int = -1
  """planner="lpt": the most replicas one owner sends per layer (moejax's fssdp.owner_sends):
  -1 = t, its default; 0 = no bound. Themis's plan broadcasts within nodes instead."""
  replica_ratio: float = 1.0
  """Bytes of a replica its device held last step over a plain one (moejax's replica codec;
  1.0: none)."""
  dispatch_chunks: int = 1
  """The token exchange in this many pieces (moejax's moe.dispatch_chunks): piece j's dispatch
  and combine run on the comm stream beside piece j - 1's experts; each piece pays the
  exchange's fixed cost (launch and a hop's latency) again."""
  description: str = ""


REPLICA_PATCH_RATIO = 0.468
"""A kept replica's patch over its plain bytes: the expert weights' delta patch per forward
gather at the tiny preset's peak learning rate (`bench/codec.py --quick`: 0.469 when every
gather sent one, before the backward rebuilt its weights; the README codec table's 0.233 per
step is 2 x 0.466 over a step's 4 gathers, 2 of them rebuilt), the same step-to-step moves the
replica codec's delta formats code."""


def _s(name, **kw) -> System:
  return System(name, "sharded", **kw)


def _e(name, **kw) -> System:
  return System(name, "ep", **kw)


SYSTEMS: dict[str, System] = {s.name: s for s in (
    _s("zero3", framework="deepspeed", description="DeepSpeed ZeRO-3 (bf16)"),
    _s("zero++", framework="deepspeed", codec="zero++",
       description="ZeRO++: int8 all-gather, hpZ node replicas, int4 reduce-scatter"),
    _s("ciera-er", framework="deepspeed", codec="ciera", select=False, overlap_codec=False,
       description="ZeRO-3 + exponent reuse (all tensors)"),
    _s("ciera-bsc", framework="deepspeed", codec="ciera", select=True, overlap_codec=False,
       description="+ benefit-driven selection"),
    _s("ciera", framework="deepspeed", codec="ciera", select=True, overlap_codec=True,
       description="CIERA (+ pipelining)"),
    _s("fsdp", rs_bytes=4.0, description="moejax fsdp, plain bf16 gather"),
    _s("fsdp-rs-in-place", rs_bytes=4.0, scatter_ahead=False,
       description="moejax fsdp, each gradient reduce-scattered before the next layer's backward"),
    *[_s(f"moejax-{m}", codec=m, rs_bytes=4.0, description=f"moejax fsdp, codec {m}")
      for m in ("element", "block", "word", "delta", "auto")],
    _s("moejax-auto-bf16rs", codec="auto", rs_bytes=2.0,
       description="moejax fsdp, codec auto, gradients reduced in bf16 (reduce_dtype)"),
    _e("ep", description="expert parallel (owners only)"),
    _e("uniform", balance="uniform", description="ep with evenly spread tokens (reference)"),
    _e("fastermoe", balance="fastermoe", description="FasterMoE-style broadcast of hot experts"),
    _e("flexmoe", balance="flexmoe", description="FlexMoE-style persistent replicas"),
    _e("ep+het", het_sharding=True, description="ep on heterogeneous owners (re-shard 100)"),
    _e("themis", balance="replicas", planner="themis", het_sharding=True,
       description="Themis FSSDP (top-t replicas, topology-aware dispatch)"),
    _e("moejax-ep", dense="fsdp", description="moejax ep (dense weights gathered)"),
    _e("moejax-fssdp", balance="replicas", planner="lpt", calibrate=True,
       balanced_dispatch=True, het_sharding=True, dense="fsdp", replica_slots=2,
       overlap_degree=4, description="moejax fssdp (M=2, t=4, calibrated, balanced)"),
    _e("moejax-fssdp-t16", balance="replicas", planner="lpt", calibrate=True,
       balanced_dispatch=True, het_sharding=True, dense="fsdp", replica_slots=4,
       overlap_degree=16, description="moejax fssdp with fssdp.replica_slots=4, "
                                      "fssdp.overlap_degree=16"),
    _e("moejax-fssdp+admit", balance="replicas", planner="lpt", calibrate=True,
       balanced_dispatch=True, het_sharding=True, dense="fsdp", replica_slots=2,
       overlap_degree=4, admission="reroute",
       description="moejax fssdp + reroute admission (factor 1.25)"),
    _e("moejax-fssdp-t16+codec", balance="replicas", planner="lpt", calibrate=True,
       balanced_dispatch=True, het_sharding=True, dense="fsdp", replica_slots=4,
       overlap_degree=16, replica_ratio=REPLICA_PATCH_RATIO,
       description="moejax fssdp (M=4, t=16) with fssdp.replica_codec=delta"),
    _e("moejax-ep+admit", dense="fsdp", admission="reroute",
       description="moejax ep + reroute admission (factor 1.25)"),
)}


def get_system(name: str) -> System:
  if name not in SYSTEMS:
    raise ValueError(f"unknown system {name!r} (valid: {', '.join(SYSTEMS)})")
  return SYSTEMS[name]
