"""Alpha-beta times of the collectives, per link tier, with ring and hierarchical algorithms.

A `Net` is a cluster with calibrated link efficiencies: the bandwidth a collective reaches on a
tier is `Link.bandwidth * efficiency[tier]`. All sizes are bytes; W ranks in G nodes of Dn.

  all_gather / reduce_scatter  every rank ends with (W-1)/W of the full buffer (or sends it).
    ring          one ring over all W ranks: bound by a GPU's NVLink and, across nodes, by the
                  node's NICs, which carry (W-1)/W of the buffer into the node;
                  (W-1) ring steps of latency.
    hierarchical  across nodes among same-local-rank peers (the node's NICs carry (G-1)/G of the
                  buffer), then inside each node; (G-1) + (Dn-1) steps.
  all_reduce      reduce-scatter then all-gather (ring).
  all_to_all      from a matrix of bytes [W, W] (source, destination): the busiest GPU's NVLink
                  traffic, the busiest node's NIC traffic (in or out), and the busiest GPU's
                  inter-node traffic over its 1/Dn share of the node's NICs (rail-aligned
                  NICs); one step of latency.
  sparse          SparseAllGather / SparseReduceScatter: bytes each GPU receives over NVLink
                  and each node over its NICs (a chunk crosses into a node once, then spreads
                  inside it; Themis Sec. 3.3).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from moejax.perf.hardware import LAUNCH_S, Cluster


@dataclasses.dataclass(frozen=True)
class Net:
  cluster: Cluster
  gpus: int
  intra_eff: float = 1.0
  inter_eff: float = 1.0

  @property
  def per_node(self) -> int:
    return self.cluster.per_node(self.gpus)

  @property
  def nodes(self) -> int:
    return self.cluster.nodes(self.gpus)

  @property
  def b_intra(self) -> float:
    """Bytes/s one GPU moves over NVLink, per direction."""
    return self.cluster.intra.bandwidth * self.intra_eff

  @property
  def b_inter(self) -> float:
    """Bytes/s a node moves over its NICs, per direction."""
    return self.cluster.inter.bandwidth * self.inter_eff

  def _lat(self, steps_intra: int, steps_inter: int) -> float:
    return (LAUNCH_S + steps_intra * self.cluster.intra.latency
            + steps_inter * self.cluster.inter.latency)

  # ------------------------------------------------------------------ gathers
  def all_gather(self, full_bytes: float, algo: str = "ring", group: int | None = None) -> float:
    """Time for every rank of a group (default: all GPUs) to hold the full buffer."""
    w = self.gpus if group is None else group
    if w <= 1 or full_bytes <= 0:
      return 0.0
    dn = min(w, self.per_node)
    g = -(-w // dn)
    frac = (w - 1) / w
    if g == 1:
      return self._lat(w - 1, 0) + frac * full_bytes / self.b_intra
    if algo == "ring":
      return (self._lat(0, w - 1)
              + max(frac * full_bytes / self.b_intra, frac * full_bytes / self.b_inter))
    if algo == "hierarchical":
      inter = (g - 1) / g * full_bytes / self.b_inter
      intra = (dn - 1) / dn * full_bytes / self.b_intra
      return self._lat(dn - 1, g - 1) + inter + intra
    raise ValueError(f"unknown algorithm {algo!r} (valid: ring, hierarchical)")

  def reduce_scatter(self, full_bytes: float, algo: str = "ring",
                     group: int | None = None) -> float:
    return self.all_gather(full_bytes, algo, group)

  def all_reduce(self, bytes_: float, group: int | None = None) -> float:
    return 2 * self.all_gather(bytes_, "ring", group)

  def intra_node_all_gather(self, full_bytes: float) -> float:
    """All-gather inside each node only (ZeRO++ hpZ secondary partition)."""
    return self.all_gather(full_bytes, "ring", group=self.per_node)

  # --------------------------------------------------------------- all-to-all
  def all_to_all(self, bytes_NxN: np.ndarray) -> tuple[float, float]:
    """(time, time if the same total were spread evenly): the second is the balanced part,
    the difference what the busiest GPU or node adds (reported as straggler wait)."""
    m = np.asarray(bytes_NxN, np.float64)
    n = m.shape[0]
    if n <= 1 or m.sum() <= 0:
      return 0.0, 0.0
    t = self._a2a_time(m)
    even = np.full((n, n), m.sum() / (n * (n - 1)))
    np.fill_diagonal(even, 0.0)
    return t, min(t, self._a2a_time(even))

  def _a2a_time(self, m: np.ndarray) -> float:
    n, dn = m.shape[0], self.per_node
    node = np.arange(n) // dn
    same = node[:, None] == node[None, :]
    off = m * ~np.eye(n, dtype=bool)
    intra = off * same
    inter = off * ~same
    t_intra = max(intra.sum(1).max(), intra.sum(0).max()) / self.b_intra
    t_inter = 0.0
    if self.nodes > 1:
      g = node.max() + 1
      out_g = np.bincount(node, weights=inter.sum(1), minlength=g)
      in_g = np.bincount(node, weights=inter.sum(0), minlength=g)
      # the node's NICs together, and each GPU's own share of them (rail-aligned NICs: a
      # GPU's inter-node tokens leave and enter through its NIC)
      per_gpu = max(inter.sum(1).max(), inter.sum(0).max()) / (self.b_inter / dn)
      t_inter = max(max(out_g.max(), in_g.max()) / self.b_inter, per_gpu)
    steps_inter = 1 if self.nodes > 1 else 0
    return self._lat(1, steps_inter) + max(t_intra, t_inter)

  def uniform_all_to_all(self, bytes_per_gpu: float) -> float:
    """Each GPU sends `bytes_per_gpu` spread evenly over all GPUs (itself included)."""
    n = self.gpus
    if n <= 1:
      return 0.0
    m = np.full((n, n), bytes_per_gpu / n)
    return self._a2a_time(m)

  # ------------------------------------------------------------------- sparse
  def sparse(self, recv_gpu_bytes: float, recv_node_bytes: float) -> float:
    """SparseAllGather (or its transpose): the busiest GPU receives `recv_gpu_bytes` over
    NVLink, the busiest node `recv_node_bytes` over its NICs."""
    if recv_gpu_bytes <= 0 and recv_node_bytes <= 0:
      return 0.0
    t = recv_gpu_bytes / self.b_intra
    if self.nodes > 1:
      t = max(t, recv_node_bytes / self.b_inter)
    return self._lat(1, 1 if self.nodes > 1 else 0) + t

  def broadcast_all(self, bytes_: float) -> float:
    """One buffer from one GPU to all others (FasterMoE's shadowed experts): a pipelined ring
    or tree in which every link carries the buffer once."""
    if self.gpus <= 1 or bytes_ <= 0:
      return 0.0
    bw = self.b_intra if self.nodes == 1 else min(self.b_intra, self.b_inter)
    return self._lat(1, 1 if self.nodes > 1 else 0) + bytes_ / bw
