"""Device mesh and axis names.

The mesh has two axes: `node` (groups of devices that share a fast interconnect) and `device`
(devices within a node). Data, parameters (FSDP) and experts (EP) are all sharded over both axes
together (`DEVICES`); the split into nodes is what topology-aware placement and dispatch read.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from moejax.errors import ConfigError

NODE = "node"
DEVICE = "device"
DEVICES = (NODE, DEVICE)   # every collective over "all devices" names both axes


@dataclasses.dataclass(frozen=True)
class Topology:
  num_nodes: int
  devices_per_node: int

  @property
  def num_devices(self) -> int:
    return self.num_nodes * self.devices_per_node


def resolve_shape(shape: tuple, num_devices: int) -> tuple[int, int]:
  """Fills a -1 in (nodes, devices_per_node) and checks the product is the device count."""
  shape = tuple(shape)
  if -1 in shape:
    known = int(np.prod([s for s in shape if s != -1]))
    if num_devices % known:
      raise ConfigError(f"config.mesh.shape={shape}: {num_devices} devices are not divisible "
                        f"by {known}")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if int(np.prod(shape)) != num_devices:
    raise ConfigError(f"config.mesh.shape={shape} needs {int(np.prod(shape))} devices, "
                      f"but {num_devices} are available ((1, -1), the default, takes them all "
                      "as one node)")
  return shape


def make_mesh(shape: tuple = (1, -1), devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  nodes, per_node = resolve_shape(shape, len(devices))
  return Mesh(np.asarray(devices).reshape(nodes, per_node), DEVICES)


def topology(mesh: Mesh) -> Topology:
  return Topology(mesh.shape[NODE], mesh.shape[DEVICE])


def num_devices(mesh: Mesh) -> int:
  return mesh.shape[NODE] * mesh.shape[DEVICE]
