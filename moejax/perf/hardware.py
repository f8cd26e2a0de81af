"""Clusters as data: GPU kinds, link tiers, and the clusters the papers measured on.

Every figure here is a datasheet or paper figure with its source; nothing is fitted. What the
calibration fits (`moejax.perf.calibrate.Calibration`) is one efficiency per GPU kind (the
fraction of peak bf16 FLOP/s that matmuls reach) and one per link tier (the fraction of the
nominal bandwidth a collective reaches): `intra` (NVLink / NVSwitch inside a node) and `inter`
(the network between nodes).

Bandwidths are per direction. `Link.bandwidth` is per GPU for `intra` and per NODE for `inter`
(all the node's NICs together): a ring or all-to-all that leaves the node shares them.
"""
from __future__ import annotations

import dataclasses

TIERS = ("intra", "inter")


@dataclasses.dataclass(frozen=True)
class GPU:
  name: str
  kind: str
  """Calibration key: one efficiency per kind (e.g. "a100")."""
  peak_flops: float
  """Dense bf16 FLOP/s (no sparsity)."""
  hbm_bandwidth: float
  """Bytes/s."""
  hbm_bytes: float
  source: str


@dataclasses.dataclass(frozen=True)
class Link:
  name: str
  tier: str
  """"intra" or "inter": the calibration key."""
  bandwidth: float
  """Bytes/s per direction: per GPU (intra) or per node (inter)."""
  latency: float
  """Seconds per step of a ring (one hop); a collective costs its steps' latency plus
  `LAUNCH_S`."""
  source: str
  measured_bus_bandwidth: float = 0.0
  """A collective's bus bandwidth the paper measured on this link (bytes/s; 0: none). Reported
  beside the calibrated figure, not used by the model."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  name: str
  gpu: GPU
  gpus_per_node: int
  intra: Link
  inter: Link
  source: str

  def nodes(self, num_gpus: int) -> int:
    return max(1, -(-num_gpus // self.gpus_per_node))

  def per_node(self, num_gpus: int) -> int:
    return min(num_gpus, self.gpus_per_node)


LAUNCH_S = 10e-6
"""Fixed cost of one NCCL collective (kernel launch and protocol set-up; nccl-tests report
10-20 us for small messages on NVSwitch)."""

A100 = GPU("A100-SXM4-80GB", "a100", 312e12, 2.039e12, 80e9,
           "NVIDIA A100 datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, 80 GB")
H100 = GPU("H100-SXM5-80GB", "h100", 989e12, 3.35e12, 80e9,
           "NVIDIA H100 datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GB")
H200 = GPU("H200-SXM-141GB", "h200", 989e12, 4.8e12, 141e9,
           "NVIDIA H200 datasheet: 989 TFLOP/s dense bf16, 4.8 TB/s HBM3e, 141 GB")
GPUS = {g.kind: g for g in (A100, H100, H200)}

NVLINK3 = Link("NVLink3/NVSwitch (A100)", "intra", 300e9, 1e-6,
               "600 GB/s bidirectional per GPU (CIERA Sec. 2 and 4.1; Themis Sec. 5.1)")
NVLINK4 = Link("NVLink4/NVSwitch (H100/H200)", "intra", 450e9, 1e-6,
               "900 GB/s bidirectional per GPU (Themis Sec. 5.1 for p5en; H100/H200 datasheets)")


def _gbps(x: float) -> float:
  return x * 1e9 / 8


CLUSTERS: dict[str, Cluster] = {}


def _add(c: Cluster) -> Cluster:
  CLUSTERS[c.name] = c
  return c


CIERA_A100 = _add(Cluster(
    "ciera-a100", A100, 8, NVLINK3,
    Link("HDR InfiniBand 200 Gb/s per node", "inter", _gbps(200), 5e-6,
         "CIERA Sec. 4.1: 200 Gbps HDR InfiniBand between nodes",
         measured_bus_bandwidth=8e9),
    "CIERA Sec. 2 and 4.1: nodes of 8 A100-80GB, NVSwitch 600 GB/s, 200 Gbps HDR IB (measured "
    "cross-node all-gather bus bandwidth about 8 GB/s); 4-GPU runs on one server"))
THEMIS_A = _add(Cluster(
    "themis-a", A100, 8, NVLINK3,
    Link("EFA 400 Gb/s per node (p4de)", "inter", _gbps(400), 15e-6,
         "Themis Sec. 5.1: AWS p4de.24xlarge, 400 Gbps inter-node network"),
    "Themis Sec. 5.1, cluster A: AWS p4de.24xlarge, 8 A100-80G, 600 GB/s NVSwitch, 400 Gbps"))
THEMIS_B = _add(Cluster(
    "themis-b", H200, 8, NVLINK4,
    Link("EFA 3200 Gb/s per node (p5en)", "inter", _gbps(3200), 15e-6,
         "Themis Sec. 5.1: AWS p5en.48xlarge, 3200 Gbps inter-node network"),
    "Themis Sec. 5.1, cluster B: AWS p5en.48xlarge, 8 H200-141G, 900 GB/s NVSwitch, 3200 Gbps"))
H100_NODE = _add(Cluster(
    "h100", H100, 8, NVLINK4,
    Link("InfiniBand NDR 8 x 400 Gb/s per node", "inter", _gbps(3200), 5e-6,
         "DGX H100: eight ConnectX-7 400 Gb/s NICs, one per GPU"),
    "A DGX/HGX H100 node of today: 8 H100-SXM5, NVLink4, 8 x 400 Gb/s InfiniBand"))
H200_NODE = _add(Cluster(
    "h200", H200, 8, NVLINK4,
    Link("InfiniBand NDR 8 x 400 Gb/s per node", "inter", _gbps(3200), 5e-6,
         "HGX H200: eight 400 Gb/s NICs, one per GPU"),
    "An HGX H200 node of today: 8 H200-SXM, NVLink4, 8 x 400 Gb/s InfiniBand"))


def get_cluster(name: str) -> Cluster:
  if name not in CLUSTERS:
    raise ValueError(f"unknown cluster {name!r} (valid: {', '.join(CLUSTERS)})")
  return CLUSTERS[name]
