"""Evaluation over the (node, local) mesh, and what the host reads back from the devices' training state.

``make_eval_step`` is one jitted ``shard_map`` step that sums top-1, top-5 and loss over a batch; ``evaluate``
runs it over a whole split, the BatchNorm statistics averaged over the mesh once (``mesh_batch_stats``).
``epoch_mean_loss`` and ``global_mean`` read per-device values that may live on other processes' devices
(collectives: every process calls them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from light_jax import data as data_lib
from light_jax import liveness
from light_jax.parallel.mesh import AXES, BATCH_SPEC
from light_jax.train_step import TrainState, normalize

PyTree = Any


@jax.jit
def mesh_batch_stats(batch_stats: PyTree) -> PyTree:
  """The BatchNorm running statistics evaluation uses: the mean over the devices (the leading (nodes, local)
  dims) of ``TrainState.batch_stats``. The running average being linear, this is exactly the running average
  of the devices' averaged batch statistics (train_step.py)."""
  return jax.tree.map(lambda x: jnp.mean(x, axis=(0, 1)), batch_stats)


def make_eval_step(model: nn.Module, mesh: jax.sharding.Mesh, info: data_lib.DatasetInfo) -> Callable:
  """Returns ``eval_step(params, batch_stats, images, labels, mask) -> {top1, top5, loss, count}`` summed over
  the batch; ``batch_stats``: the mesh's (``mesh_batch_stats``).

  Padding rows (mask 0) count for nothing, so every example of the split counts exactly once.
  """

  def device_eval(params, batch_stats, images, labels, mask):
    logits = model.apply(
      {"params": params, "batch_stats": batch_stats}, normalize(images, info.mean, info.std), train=False
    )
    # Ties go to the lower class index (lax.top_k's order, as torch.topk's): a model whose logits are all equal
    # scores the share of classes 0-4 in top-5, not 100%.
    top5 = lax.top_k(logits, min(5, info.num_classes))[1]
    hits = top5 == labels[:, None]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    sums = {"top1": hits[:, 0], "top5": hits.any(axis=1), "loss": loss, "count": jnp.ones_like(loss)}
    return {k: lax.psum(jnp.sum(v * mask), AXES) for k, v in sums.items()}

  sharded = jax.shard_map(
    device_eval, mesh=mesh, in_specs=(P(), P(), BATCH_SPEC, BATCH_SPEC, BATCH_SPEC), out_specs=P(), check_vma=False
  )
  return jax.jit(sharded)


def evaluate(
  eval_step: Callable,
  state: TrainState,
  batches: data_lib.EvalBatches,
  sharding: NamedSharding,
  read_threads: int = 1,
  workers: int = 0,
  buffer: int = 4,
) -> dict[str, float]:
  """Top-1, top-5 and mean loss over the whole split (``read_threads``, ``workers``, ``buffer``: grain's).

  A batch that cannot be read (a damaged chunk of the split) raises ``InputFailed`` in every process: they agree on
  each batch before its step, since the others would wait for the failed one in the step's collectives."""
  totals = None
  batch_stats = mesh_batch_stats(state.batch_stats)  # once per evaluation (a collective across the mesh)
  host_batches = batches.iterator(read_threads, buffer=buffer, workers=workers)
  with contextlib.closing(data_lib.DevicePrefetcher(host_batches, sharding)) as prefetcher:  # closed on an error too
    while True:
      batch, error = _next_batch(prefetcher)
      failed, ended = liveness.from_every_process([error is not None, batch is None and error is None]).T
      if failed.any():
        raise data_lib.InputFailed(
          error or liveness.PeerLost(f"process {np.argmax(failed)} could not read its evaluation batches (see its log)")
        ) from error
      if ended.any():
        if not ended.all():  # each has as many batches (same_settings.check_data compared the splits)
          raise data_lib.DataError(f"processes {np.flatnonzero(ended)} ran out of evaluation batches before the others")
        break
      sums = eval_step(state.params, batch_stats, batch["images"], batch["labels"], batch["mask"])
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
      # One evaluation step in flight at a time. On 8 simulated CPU devices two 28-epoch runs hung in an
      # epoch end's evaluation, 6 of 8 device threads waiting in its all-reduce for the other 2 (one for 10
      # minutes, when XLA aborted it), while the split's steps were all dispatched ahead
      # (light_jax/xla_flags.py). This is our guard against it; a guess, as the hang does not come on demand.
      jax.block_until_ready(totals)
  if totals is None:
    raise data_lib.DataError("the eval split has no examples: give data.dataset an eval split with images in it")
  totals = jax.device_get(totals)
  count = float(totals["count"])
  return {
    "eval_top1": float(totals["top1"]) / count,
    "eval_top5": float(totals["top5"]) / count,
    "eval_loss": float(totals["loss"]) / count,
    "eval_examples": int(count),
  }


def with_own_errors(evaluate: Callable[[TrainState], dict[str, float]]) -> Callable[[TrainState], dict[str, float]]:
  """``evaluate``, raising a read error as this process met it (or the ``PeerLost`` naming the process that did),
  not wrapped in ``InputFailed``: for an evaluation whose failure saves nothing (a resumed run's, of what it
  restored)."""

  def unwrapped(state: TrainState) -> dict[str, float]:
    try:
      return evaluate(state)
    except data_lib.InputFailed as e:
      error = e.error
    raise error  # outside the except: its own context and cause, as it came

  return unwrapped


def _next_batch(batches) -> tuple[dict | None, Exception | None]:
  """(the next batch, None), (None, None) at the end, or (None, the error) where it cannot be read."""
  try:
    return next(batches), None
  except StopIteration:
    return None, None
  except Exception as e:
    return None, e


def epoch_mean_loss(state: TrainState) -> float:
  """Mean training loss of the current epoch's steps so far, over all devices (a collective: all call it)."""
  total, count = (np.sum(multihost_utils.process_allgather(x, tiled=True)) for x in (state.loss_sum, state.loss_count))
  return float(total / count) if count else float("nan")


def global_mean(per_device_values) -> float:
  """Mean of per-device arrays that may live on other processes' devices too (a collective: all call it).

  Non-finite values (a skipped step's loss, when the loss itself overflowed) are left out.
  """
  values = np.asarray(multihost_utils.process_allgather(per_device_values, tiled=True))
  return float(np.mean(values[np.isfinite(values)])) if np.isfinite(values).any() else float("nan")
