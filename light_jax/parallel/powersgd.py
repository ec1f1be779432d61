"""PowerSGD (Vogels et al., NeurIPS 2019): each weight gradient sent as a rank-r product, with error feedback.

A gradient tensor is viewed as a matrix M of n x m (a conv kernel HWIO as (H*W*I) x O). One step of power
iteration from the previous step's Q (m x r, warm start) finds the r directions that carry most of the
sum of M over the devices:

  P = sum_devices M_d Q          one all-reduce of n x r numbers
  P^ = orthonormal basis of P    (QR)
  Q' = sum_devices M_d^T P^      one all-reduce of m x r numbers
  sum_devices M_d ~= P^ Q'^T     (exact when the summed gradient has rank <= r)

With error feedback each device keeps e_d = M_d - P^ Q'^T / devices (the paper's form: its equal share of
the approximation applied) and adds it to the next step's gradient; sum_d e_d + P^ Q'^T = sum_d M_d, nothing
is lost, not even what a bfloat16 wire rounded off Q' (Q' as it arrived is what is applied and subtracted).
An orthonormal basis of Q' is the next step's Q (the same span, better conditioned).

Here the P and Q of every compressed tensor are packed into one flat buffer each, and the two buffers are
summed with the hierarchical all-reduce (reduce-scatter over ``local``, all-reduce over ``node``,
all-gather over ``local``): the power iteration is linear in M, so summing P over all devices
hierarchically is the same sum, and only 1/local of the small P and Q crosses the slow link per device.
Vectors (biases, BatchNorm) and matrices that would not shrink ((n + m) r >= n m) or are smaller than
``min_compress_elements`` go dense in the P buffer. The algorithm: docs/techniques.md section 12.

``PowerSGDReducer`` has the interface of ``reducer.GradientReducer`` (reduce, init_state,
bytes_per_step, bucket_plan), so the train step does not know which one it holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from light_jax.parallel import collectives, compression, strategies
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import per_device, this_device
from light_jax.parallel.strategies import CommBytes

PyTree = Any
NAME = "powersgd"


class Memory(NamedTuple):
  """A device's PowerSGD state for one matrix: what it did not send yet, and the warm-start Q."""

  residual: jax.Array | None  # (n, m); None without error feedback (an empty node: no memory, nothing saved)
  q: jax.Array  # (m, r)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
  """The n x m matrix a tensor is compressed as: every dimension but the last (a conv's H, W, I) as rows."""
  return math.prod(shape[:-1]), shape[-1]


@dataclasses.dataclass(frozen=True)
class PowerSGDReducer:
  """Mean gradient over all devices with PowerSGD of rank ``rank`` (``comm.strategy="powersgd"``).

  Attributes:
    nodes, local: the mesh shape.
    rank: r, the columns of P and Q (``comm.rank``).
    error_feedback: keep what the rank-r approximation missed and add it to the next step's gradient.
    min_compress_elements: smaller matrices go dense.
    wire_dtype: dtype of P, Q and the dense tensors on the wire (accumulated in float32).
    local_clip_norm: as GradientReducer's (DGC's local clipping), before compression.
  """

  nodes: int
  local: int
  rank: int = 4
  error_feedback: bool = True
  min_compress_elements: int = 512
  wire_dtype: str = "float32"
  local_clip_norm: float = 0.0
  strategy: str = NAME
  updates_parameters = False

  @property
  def compression(self) -> str:
    return f"PowerSGD rank {self.rank}"

  def at_density(self, density: float) -> PowerSGDReducer:
    """Itself: its compression is the rank, not a top-k density (which a density warm-up varies)."""
    return self

  def is_compressed(self, shape: tuple[int, ...]) -> bool:
    if len(shape) < 2:
      return False
    n, m = matrix_shape(shape)
    return n * m >= self.min_compress_elements and (n + m) * self.rank < n * m

  def _split(self, leaves) -> tuple[list[int], list[int]]:
    """(indices of the compressed leaves, indices of the dense ones)."""
    compressed = [i for i, x in enumerate(leaves) if self.is_compressed(tuple(x.shape))]
    return compressed, [i for i, x in enumerate(leaves) if not self.is_compressed(tuple(x.shape))]

  # --- state -------------------------------------------------------------------------------------
  def init_state(self, params: PyTree) -> dict[str, Memory]:
    """Per compressed tensor: a zero residual (None without error feedback) and a random normal Q (the same on
    every device), each with leading dims (nodes, local)."""
    leaves = jax.tree.leaves(params)
    state = {}
    for i in self._split(leaves)[0]:
      n, m = matrix_shape(tuple(leaves[i].shape))
      q = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), (m, self.rank), jnp.float32)
      per_device = lambda x: jnp.broadcast_to(x, (self.nodes, self.local, *x.shape))  # noqa: E731
      residual = per_device(jnp.zeros((n, m), jnp.float32)) if self.error_feedback else None
      state[_key(i)] = Memory(residual, per_device(q))
    return state

  # --- the reduction (inside shard_map) ----------------------------------------------------------
  def reduce(self, local_grads: PyTree, comm_state: dict[str, Memory]) -> tuple[PyTree, dict[str, Memory]]:
    if self.local_clip_norm:
      local_grads = compression.clip_local(local_grads, self.local_clip_norm, self.nodes * self.local)
    leaves, treedef = jax.tree.flatten(local_grads)
    compressed, dense = self._split(leaves)
    wire = jnp.dtype(self.wire_dtype)
    memory = {i: this_device(comm_state[_key(i)]) for i in compressed}
    matrices = {}
    for i in compressed:
      m = leaves[i].reshape(matrix_shape(leaves[i].shape)).astype(jnp.float32)
      matrices[i] = m + memory[i].residual if self.error_feedback else m

    # All-reduce 1: every P, with the dense tensors in the same buffer.
    ps = [matrices[i] @ memory[i].q for i in compressed]
    summed = _hierarchical_sum(ps + [leaves[i] for i in dense], wire)
    p_hats = {i: jnp.linalg.qr(p)[0] for i, p in zip(compressed, summed)}
    # All-reduce 2: every Q = M^T P^.
    local_qs = {i: matrices[i].T @ p_hats[i] for i in compressed}
    qs = dict(zip(compressed, _hierarchical_sum([local_qs[i] for i in compressed], wire)))

    devices = self.nodes * self.local
    out: list[jax.Array | None] = [None] * len(leaves)
    new_state = {}
    for i in compressed:
      out[i] = (p_hats[i] @ qs[i].T).reshape(leaves[i].shape).astype(leaves[i].dtype)
      # This device's share of the approximation applied: from the summed Q as it arrived, not the local Q, so the
      # residuals also keep what a bfloat16 wire rounded off (their sum is exactly what was not applied).
      residual = matrices[i] - p_hats[i] @ (qs[i] / devices).T if self.error_feedback else None
      # The next step starts from Q's span; an orthonormal basis of it keeps M Q well conditioned (Q' itself
      # has columns scaled by M's singular values, and float32 loses the small ones).
      next_q = jnp.linalg.qr(qs[i])[0]
      new_state[_key(i)] = per_device(Memory(residual, next_q))
    for i, g in zip(dense, summed[len(compressed) :]):
      out[i] = g.astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, [g / devices for g in out]), new_state

  # --- accounting (static, from shapes) ----------------------------------------------------------
  def bucket_plan(self, params: PyTree) -> list[tuple[str, int, int]]:
    """The step's two collectives as (strategy, elements, k): hierarchical all-reduces of the P buffer
    (with the dense tensors) and of the Q buffer."""
    leaves = jax.tree.leaves(params)
    compressed, dense = self._split(leaves)
    shapes = [matrix_shape(tuple(leaves[i].shape)) for i in compressed]
    p_elements = sum(n * self.rank for n, _ in shapes) + sum(leaves[i].size for i in dense)
    q_elements = sum(m * self.rank for _, m in shapes)
    return [("hierarchical", n, 0) for n in (p_elements, q_elements) if n]

  def bytes_per_step(self, params: PyTree) -> CommBytes:
    itemsize = jnp.dtype(jax.tree.leaves(params)[0].dtype).itemsize
    wire = jnp.dtype(self.wire_dtype).itemsize
    total = CommBytes()
    for name, n, _ in self.bucket_plan(params):
      total += strategies.get(name).bytes(strategies.Buffer(n, itemsize, self.nodes, self.local, 0, wire))
    return total


def _hierarchical_sum(arrays: list[jax.Array], wire_dtype) -> list[jax.Array]:
  """Each array summed over every device, all in one packed hierarchical all-reduce."""
  if not arrays:
    return []
  flat = fusion_lib.pack([a.astype(jnp.float32) for a in arrays])
  return fusion_lib.unpack(collectives.hierarchical_allreduce(flat, wire_dtype), arrays)


def _key(leaf: int) -> str:
  return f"tensor_{leaf:03d}"
