"""The two-level device mesh: ``node`` (machines, slow links) x ``local`` (devices in a machine, fast links).

Every collective in light_jax is written against these two axis names, so a strategy can treat the
fast and the slow level differently (e.g. reduce-scatter over ``local`` before anything crosses ``node``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)
# Batch dimension split over every device: node-major, so a node's devices hold contiguous rows.
BATCH_SPEC = P(AXES)


# How a MeshError names the two counts: the config's fields, or a benchmark's own flags ("--nodes", "--local").
CONFIG_NAMES = ("mesh.nodes", "mesh.local")


def this_device(tree):
  """Inside shard_map: this device's part of per-device state (leaves with leading dims (nodes, local), each
  1 here)."""
  return jax.tree.map(lambda x: x[0, 0], tree)


def per_device(tree):
  """Inside shard_map: ``this_device``'s inverse, the leaves given their leading (nodes, local) dims back."""
  return jax.tree.map(lambda x: x[None, None], tree)


class MeshError(ValueError):
  """The requested mesh does not fit the devices; the message says what to change."""


def resolve_mesh_shape(
  nodes: int, local: int, num_devices: int, num_processes: int = 1, names: tuple[str, str] = CONFIG_NAMES
) -> tuple[int, int]:
  """Fills -1 entries of (nodes, local) from the device count and checks the product.

  With both -1 a process is a node: (num_processes, num_devices // num_processes). ``names``: what the
  errors call the two counts, the settings the user changes.
  """
  n, l = names  # noqa: E741
  if nodes == 0 or local == 0 or nodes < -1 or local < -1:
    raise MeshError(f"{n}={nodes}, {l}={local}: each must be a positive int or -1 (fill).")
  if nodes == -1 and local == -1:
    if num_devices % num_processes:  # say where the node count came from: the user set neither
      raise MeshError(
        f"{n}=-1 and {l}=-1 make each of the {num_processes} processes a node, but {num_processes} does not "
        f"divide the {num_devices} devices; set {n} and {l} so that their product is {num_devices}."
      )
    nodes = num_processes
  if nodes == -1:
    if num_devices % local:
      raise MeshError(
        f"{l}={local} does not divide the {num_devices} devices; set {l} to one of {_divisors(num_devices)}."
      )
    nodes = num_devices // local
  if local == -1:
    if num_devices % nodes:
      raise MeshError(
        f"{n}={nodes} does not divide the {num_devices} devices; set {n} to one of {_divisors(num_devices)}."
      )
    local = num_devices // nodes
  if nodes * local != num_devices:
    raise MeshError(
      f"mesh {nodes} x {local} = {nodes * local} devices, but {num_devices} are available; set {n} and {l} "
      f"so that their product is {num_devices}" + (" (or use -1 for one of them)." if names == CONFIG_NAMES else ".")
    )
  per_process = num_devices // num_processes
  if num_processes > 1 and per_process % local:  # a node's collectives inside one machine: its fast links
    raise MeshError(
      f"{l}={local} would put one node's devices in two processes ({per_process} devices per process); choose "
      f"{l} dividing {per_process}."
    )
  return nodes, local


def _divisors(n: int) -> str:
  return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def make_mesh(nodes: int = -1, local: int = -1, devices=None, names: tuple[str, str] = CONFIG_NAMES) -> Mesh:
  """Builds the (node, local) mesh over ``devices`` (default: all devices of all processes).

  In a multi-process run where each process is one machine (the usual case) the mesh comes from
  ``create_hybrid_device_mesh`` so that ``local`` follows each machine's fast interconnect and ``node``
  crosses machines. Any other split that keeps a node's devices inside one process is allowed too
  (e.g. 2 processes x 4 devices as a 4 x 2 mesh); in a single process the split is free. ``names``: as
  ``resolve_mesh_shape``'s.
  """
  devices = list(jax.devices() if devices is None else devices)
  processes = sorted({d.process_index for d in devices})
  per_process = len(devices) // len(processes)
  nodes, local = resolve_mesh_shape(nodes, local, len(devices), len(processes), names)
  if len(processes) > 1 and (nodes, local) == (len(processes), per_process):
    grid = mesh_utils.create_hybrid_device_mesh(
      (1, per_process), (len(processes), 1), devices=devices, process_is_granule=True
    )
  else:
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered, dtype=object).reshape(nodes, local)
  return Mesh(grid, AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a batch: leading dimension split over all devices, node-major."""
  return NamedSharding(mesh, BATCH_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def describe(mesh: Mesh) -> str:
  nodes, local = mesh.devices.shape
  kind = mesh.devices.flat[0].platform
  return f"mesh node x local = {nodes} x {local} ({mesh.size} {kind} devices, {jax.process_count()} process(es))"
