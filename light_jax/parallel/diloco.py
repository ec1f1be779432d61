"""Local steps across machines: DiLoCo (Douillard et al. 2023), ``comm.strategy="diloco"``.

Each machine (``node``) trains on its own for ``sync_every`` = H steps: its devices average their
gradients inside the machine only (one all-reduce over ``local``, the fast links) and the inner optimizer
(``optimizer.*``: SGD, LARS or LAMB with its schedule) updates the machine's own copy of the parameters.
Every H steps, at the end of every epoch and at the run's last step (so evaluations and checkpoints
see one model), the machines average how far they moved, the pseudo-gradient

  outer_grad = theta_outer - mean over machines of theta_machine,

and an outer optimizer, SGD with Nesterov momentum (``comm.outer_lr``, ``comm.outer_momentum``), applies
it to the shared parameters, from which every machine starts its next round. The slow link carries one
hierarchical all-reduce of the parameters every H steps instead of the gradients every step: about H
times fewer inter-node bytes. With H = 1, outer lr 1 and no outer momentum it is the synchronous run for an inner
optimizer linear in the gradient (SGD, with or without momentum; not LARS or LAMB, whose ratios come from each
machine's own gradient).

Layout in the train state: ``params`` and ``opt_state`` are the outer parameters and the outer
optimizer's state (replicated, what evaluation and checkpoints use); each device's ``comm_state`` holds
its machine's ``delta`` = theta_machine - theta_outer and the inner optimizer's state (equal on the
devices of one machine). The algorithm: docs/techniques.md section 13.
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from light_jax.parallel import collectives, strategies
from light_jax.parallel import fusion as fusion_lib
from light_jax.parallel.mesh import LOCAL, per_device, this_device
from light_jax.parallel.strategies import CommBytes

PyTree = Any
NAME = "diloco"


def mesh_error(nodes: int, local: int) -> str | None:
  """Why DiLoCo cannot run on a ``nodes`` x ``local`` mesh, or None if it can."""
  if nodes >= 2:
    return None
  return (
    f"comm.strategy='diloco' averages the machines' changes across nodes; the mesh {nodes} x {local} has one "
    "machine. There is nothing to average and no inter-node traffic to save: the outer step would only scale the "
    "machine's own change (by outer_lr x (1 + outer_momentum) at first). Use mesh.nodes >= 2, or another "
    "comm.strategy (hierarchical)."
  )


@dataclasses.dataclass(frozen=True)
class DiLoCo:
  """Inner steps inside each machine, an outer step across machines every ``sync_every`` steps.

  Attributes:
    nodes, local: the mesh shape.
    sync_every: H, inner steps between two outer steps.
    outer_lr, outer_momentum: the outer optimizer, SGD with Nesterov momentum.
    inner_tx: the inner optimizer (the config's ``optimizer``), given by ``reducer.reducer_from_config``.
    wire_dtype: dtype of the dense hops of the outer all-reduce.
    syncs_per_step: the outer steps per step over the whole run, for the byte accounting (``for_run``); None:
      1 / sync_every.
  """

  nodes: int
  local: int
  sync_every: int = 8
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  inner_tx: optax.GradientTransformation | None = None
  wire_dtype: str = "float32"
  syncs_per_step: fractions.Fraction | None = None
  strategy: str = NAME
  updates_parameters = True  # the train step calls apply, not the optimizer

  def __post_init__(self):
    error = mesh_error(self.nodes, self.local)
    if error:
      raise ValueError(error)

  @property
  def compression(self) -> str:
    return f"DiLoCo, an outer step every {self.sync_every} steps"

  def at_density(self, density: float) -> DiLoCo:
    """Itself: it has no top-k density."""
    return self

  def for_run(self, boundaries: tuple[int, ...], total_steps: int) -> DiLoCo:
    """This DiLoCo with its byte accounting for a run of ``total_steps`` with these boundaries (``after_step``'s
    ``record_boundaries``): it syncs after every H-th step and at each boundary, which is more often than every
    H steps where H does not divide an epoch (twice as often when H is two epochs)."""
    if total_steps <= 0:
      return self
    syncs = set(range(self.sync_every, total_steps + 1, self.sync_every))
    syncs |= {b for b in boundaries if 0 < b <= total_steps}
    return dataclasses.replace(self, syncs_per_step=fractions.Fraction(len(syncs), total_steps))

  @property
  def outer_tx(self) -> optax.GradientTransformation:
    return optax.sgd(self.outer_lr, momentum=self.outer_momentum or None, nesterov=bool(self.outer_momentum))

  # --- state -------------------------------------------------------------------------------------
  def init_optimizer_state(self, params: PyTree) -> PyTree:
    """The train state's ``opt_state``: the outer optimizer's."""
    return self.outer_tx.init(params)

  def init_state(self, params: PyTree) -> dict[str, PyTree]:
    """Per device, leading dims (nodes, local): the machine's delta (zero) and inner optimizer state."""
    if self.inner_tx is None:
      raise ValueError("DiLoCo needs its inner optimizer: DiLoCo(..., inner_tx=tx)")
    per_device = lambda x: jnp.broadcast_to(x, (self.nodes, self.local, *jnp.shape(x)))  # noqa: E731
    state = {"delta": jax.tree.map(jnp.zeros_like, params), "optimizer": self.inner_tx.init(params)}
    return jax.tree.map(per_device, state)

  # --- one step (inside shard_map) ---------------------------------------------------------------
  def machine_params(self, params: PyTree, comm_state: PyTree) -> PyTree:
    """This machine's parameters, where its forward and backward pass run."""
    return jax.tree.map(lambda p, d: p + d[0, 0], params, comm_state["delta"])

  def reduce(self, local_grads: PyTree, comm_state: PyTree) -> tuple[PyTree, PyTree]:
    """The mean gradient over this machine's devices: one packed all-reduce over ``local``."""
    leaves, treedef = jax.tree.flatten(local_grads)
    summed = lax.psum(fusion_lib.pack(leaves), LOCAL)
    return jax.tree.unflatten(treedef, [g / self.local for g in fusion_lib.unpack(summed, leaves)]), comm_state

  def apply(
    self,
    grads: PyTree,
    params: PyTree,
    opt_state: PyTree,
    comm_state: PyTree,
    step: jax.Array,
    record_boundaries: tuple[int, ...] = (),
  ) -> tuple[PyTree, PyTree, PyTree]:
    """The inner step on this machine's parameters: returns (outer params, outer optimizer state, comm_state), the
    outer ones unchanged (``after_step`` takes the outer step)."""
    delta, inner_opt = this_device(comm_state["delta"]), this_device(comm_state["optimizer"])
    updates, inner_opt = self.inner_tx.update(grads, inner_opt, self.machine_params(params, comm_state))
    delta = jax.tree.map(jnp.add, delta, updates)
    return params, opt_state, {"delta": per_device(delta), "optimizer": per_device(inner_opt)}

  def after_step(
    self,
    params: PyTree,
    opt_state: PyTree,
    comm_state: PyTree,
    step: jax.Array,
    record_boundaries: tuple[int, ...] = (),
  ) -> tuple[PyTree, PyTree, PyTree]:
    """The outer step across machines after every ``sync_every``-th step and at each epoch's end (``step``,
    counted from 0, is the one being taken; ``record_boundaries``: ``CompiledSteps.record_boundaries``), so
    evaluations and checkpoints see one model. After the train step's decision to keep or skip the inner step:
    a skipped sync step syncs the machines' changes so far. Returns (outer params, outer optimizer state,
    comm_state)."""
    done = step + 1
    sync = done % self.sync_every == 0
    if record_boundaries:
      sync = jnp.logical_or(sync, jnp.isin(done, jnp.asarray(record_boundaries[1:], jnp.int32)))
    delta = this_device(comm_state["delta"])

    def outer_step(params, opt_state, delta):
      # Every device of a machine holds the same delta: each sends 1/local of it across the slow link.
      leaves, treedef = jax.tree.flatten(delta)
      summed = collectives.machines_allreduce(fusion_lib.pack(leaves), jnp.dtype(self.wire_dtype))
      mean = fusion_lib.unpack(summed / self.nodes, leaves)
      outer_grad = jax.tree.map(jnp.negative, jax.tree.unflatten(treedef, mean))
      outer_updates, opt_state = self.outer_tx.update(outer_grad, opt_state, params)
      return optax.apply_updates(params, outer_updates), opt_state, jax.tree.map(jnp.zeros_like, delta)

    # lax.cond: the inter-node all-reduce runs only on sync steps (every device takes the same branch).
    params, opt_state, delta = lax.cond(sync, outer_step, lambda *a: a, params, opt_state, delta)
    return params, opt_state, dict(comm_state, delta=per_device(delta))

  # --- accounting (static, from shapes) ----------------------------------------------------------
  def bucket_plan(self, params: PyTree) -> list[tuple[str, int, int]]:
    """The collectives of a sync step: the all-reduce of the parameters' change across machines, costed as a
    hierarchical all-reduce (whose reduce-scatter inside the machine ``machines_allreduce`` does not make: the
    mesh lab moves only the inter-node time of a bucket from one link to another)."""
    return [("hierarchical", sum(x.size for x in jax.tree.leaves(params)), 0)]

  def bytes_per_step(self, params: PyTree) -> CommBytes:
    """Per step on average: the inner all-reduce over ``local`` every step, the outer one every H steps, or as
    often as the run syncs (``for_run``: at epoch ends too)."""
    leaves = jax.tree.leaves(params)
    elements = sum(x.size for x in leaves)
    itemsize = jnp.dtype(leaves[0].dtype).itemsize
    wire = jnp.dtype(self.wire_dtype).itemsize
    outer = strategies.hierarchical_bytes(strategies.Buffer(elements, itemsize, self.nodes, self.local, 0, wire))
    inner = strategies.ring_allreduce_bytes(elements * itemsize, self.local)
    rate = self.syncs_per_step if self.syncs_per_step is not None else fractions.Fraction(1, self.sync_every)
    # The outer all-reduce inside the machine is the hierarchical one's all-gather alone, half its bytes: each
    # device already holds the machine's change (collectives.machines_allreduce).
    outer_intra = outer.intra_node // 2
    return CommBytes(intra_node=inner + int(outer_intra * rate), inter_node=int(outer.inter_node * rate))
