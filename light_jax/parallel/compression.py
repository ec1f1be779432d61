"""Top-k sparsification of gradients: selectors, error feedback, momentum correction and the pairs' wire format
(the density schedule is ``schedules.density_at``).

Selectors (``comm.topk_selector``) return exactly ``k`` (index, value) pairs of a flat vector, chosen
by magnitude, with static shapes (XLA needs them):

- ``exact``: ``lax.top_k`` of |x|. On GPU XLA lowers it to a full sort when k > 16.
- ``mstopk``: the sort-free approximate selector of the MSTopK paper (MLSys'21). Binary search a
  threshold on |x| with element-wise counting passes; keep every entry >= t1 (count k1 <= k) and fill
  the remaining k - k1 slots, in index order, from the entries in [t2, t1) (count(|x| >= t2) >= k).
  Guarantee: every kept entry >= t1 is in the exact top-k, and each filled entry is at least t2 while
  the exact entries it replaces are below t1, so

      L1(exact top-k) - L1(mstopk) <= (k - k1) * (t1 - t2) <= k * (hi - lo) * 2**-rounds,

  with lo the lower end of the search (the mean of |x|, or its minimum when fewer than k entries
  reach the mean) and hi its upper end, just above max|x|. ``rounds`` = 24 makes it negligible for float32 gradients.

Error feedback (Seide et al. 2014; Lin et al. 2018, DGC): what top-k does not send is kept in a
per-device residual and added to the next step's gradient, so no gradient mass is ever lost, only
delayed. ``apply_error_feedback`` is that bookkeeping for one flat vector. The residual holds summed
gradients; with ``comm.residual_units="update"`` the reducer rescales it by lr(t-1) / lr(t) before each
step (``GradientReducer.rescale_residuals``), so it holds learning-rate-weighted gradients instead.

Momentum correction (DGC, Lin et al. 2018): with momentum m, error feedback on the raw gradient
delays each entry's contribution to the momentum until it is sent, which is not the same as momentum
SGD. DGC moves the momentum before the selection, per device: u <- m u + g (velocity), v <- v + u
(what is accumulated and not yet sent), top-k of v; both u and v are zeroed where entries were sent
(momentum factor masking, so a sent entry's stale momentum does not push it again). With Nesterov
momentum, u <- m (u + g) and v <- v + u + g (``MomentumCorrection.step``). The optimizer then runs without
momentum. Masking loses gradient mass (heavy ball): an entry sent every step gets u = g, plain SGD, and one
sent every T steps gets sum_j (1 - m^j) / (1 - m) g over T steps instead of T g / (1 - m) (for m = 0.9: 2.4x less at
T = 10, 5.3x at T = 3). ``MomentumCorrection(masking=False)`` (``comm.momentum_masking``) zeroes only v:
u then follows the device's own momentum SGD, and what is sent plus v is exactly the sum of its momentum
SGD steps.
The per-device state is ``Memory(residual=v, velocity=u)`` instead of a bare residual; the buckets too small
to compress keep a velocity of their own and send their step whole.

EF21 (``comm.feedback="ef21"``, ``select_change``; Richtarik et al. 2021, with momentum as in Fatkhullin et al.
2023): instead of a residual, each sender keeps the estimate of its momentum step that its peers hold, sends
top-k of the change, and the reduction returns the sum of every sender's estimate: every entry moves every step,
by its last estimate. Its state is an ``Estimate`` (own, total, velocity). Measured 3 points worse than error
feedback at 0.1% on ``:large_batch_hitopk`` (docs/techniques.md section 11).

Compact pairs (``comm.compact_pairs``, ``pair_dtypes``): the (value, index) pairs cross the wire as a bfloat16
value and a uint16 index: 4 bytes instead of 8. What the rounding to bfloat16 drops stays in the residual
(``apply_error_feedback``), like an entry not sent, so error feedback still loses nothing; only the sums at the
receivers are in float32. A uint16 addresses 65,536 entries; in a longer vector each index is split into its
65,536-entry block and its offset there: the sender orders its pairs by index and sends the offsets (uint16)
with how many pairs fall in each block (one int32 per block, ``group_by_block``); the receiver rebuilds the
indices from the two (``indices_from_blocks``). The selection is unchanged, and so is the sum.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

MSTOPK_ROUNDS = 24
COMPACT_BLOCK = 2**16  # entries a uint16 index addresses: longer vectors send their pairs' blocks as counts
BLOCK_COUNT_BYTES = 4  # an int32 count of pairs per block


def pair_dtypes(compact: bool, value_dtype=jnp.float32) -> tuple[jnp.dtype, jnp.dtype]:
  """(value, index) dtypes of the top-k pairs on the wire: the gradient's ``value_dtype`` and int32, or
  compact: bfloat16 and uint16 (an offset inside its block where the vector is longer, ``index_blocks``)."""
  if not compact:
    return jnp.dtype(value_dtype), jnp.dtype(jnp.int32)
  return jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)


def index_blocks(unit: int, compact: bool) -> int:
  """How many 65,536-entry blocks' pair counts travel with compact pairs from a top-k unit of ``unit``
  entries: none where a uint16 indexes the whole unit (or the pairs are not compact)."""
  return -(-unit // COMPACT_BLOCK) if compact and unit > COMPACT_BLOCK else 0


def pair_bytes(k: int, unit: int, compact: bool, value_itemsize: int = 4) -> int:
  """Bytes of one device's k top-k pairs from a unit of ``unit`` entries on the wire, block counts included."""
  value, index = pair_dtypes(compact)
  value_bytes = value.itemsize if compact else value_itemsize  # uncompressed values keep the gradient's dtype
  return k * (value_bytes + index.itemsize) + index_blocks(unit, compact) * BLOCK_COUNT_BYTES


def sparse_sum_bytes(k: int, unit: int, compact: bool, senders: int, value_itemsize: int = 4) -> tuple[int, bool]:
  """(bytes per device, whether it goes dense) of summing ``senders`` devices' k pairs from a unit of ``unit``
  entries: an all-gather of the pairs ((n-1) x their bytes), or, where that costs more, a ring all-reduce of the
  unit with the pairs in place and zeros elsewhere (2 (n-1)/n x the unit's bytes). The same sum either way; the
  all-reduce wins above about 1/n of the entries (2/n with compact pairs): a density warm-up's first phases on
  many machines (DGC's 25% on 16 nodes sent 4x the dense reduction's bytes as pairs)."""
  if senders < 2:
    return 0, False
  pairs = (senders - 1) * pair_bytes(k, unit, compact, value_itemsize)
  dense = 2 * (senders - 1) * unit * value_itemsize // senders
  return min(pairs, dense), dense < pairs


def group_by_block(indices: jax.Array, values: jax.Array, blocks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The pairs ordered by index, as (uint16 offsets inside their block, values, int32 pairs per block)."""
  order = jnp.argsort(indices)
  indices, values = indices[order], values[order]
  counts = jnp.bincount(indices // COMPACT_BLOCK, length=blocks).astype(jnp.int32)
  return (indices % COMPACT_BLOCK).astype(jnp.uint16), values, counts


def indices_from_blocks(offsets: jax.Array, counts: jax.Array) -> jax.Array:
  """Inverse of ``group_by_block`` for one sender: int32 indices from its offsets and per-block counts."""
  block = jnp.searchsorted(jnp.cumsum(counts), jnp.arange(offsets.size), side="right")
  return block.astype(jnp.int32) * COMPACT_BLOCK + offsets.astype(jnp.int32)


def num_selected(size: int, density: float) -> int:
  """k for a vector of ``size`` entries at ``density`` (at least 1, at most size).

  The density is taken as the decimal the user wrote (``Fraction(repr(0.07))`` is exactly 7/100): in
  binary floating point 0.07 * 100 is 7.000000000000001, and its ceiling would keep 8.
  """
  return min(size, max(1, math.ceil(fractions.Fraction(repr(float(density))) * size)))


def exact_topk(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """(int32 indices, values) of the k entries of flat ``x`` largest in magnitude."""
  _, indices = lax.top_k(jnp.abs(x), k)
  return indices.astype(jnp.int32), x[indices]


def mstopk(x: jax.Array, k: int, rounds: int = MSTOPK_ROUNDS) -> tuple[jax.Array, jax.Array]:
  """(int32 indices, values) of exactly k large-magnitude entries of flat ``x``, without sorting.

  Indices come out in increasing order (a masked, static-size ``nonzero``).
  """
  a = jnp.abs(x)

  def count_at_least(t):
    return jnp.sum(a >= t)

  mean = jnp.mean(a)
  lo = jnp.where(count_at_least(mean) >= k, mean, jnp.min(a))  # count(a >= lo) >= k
  hi = jnp.max(a) * (1 + 1e-6) + 1e-30  # count(a >= hi) == 0 <= k

  def halve(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    fits = count_at_least(mid) <= k
    return jnp.where(fits, lo, mid), jnp.where(fits, mid, hi)

  t2, t1 = lax.fori_loop(0, rounds, halve, (lo, hi))
  above = a >= t1  # all in the exact top-k
  k1 = jnp.sum(above)
  band = (a >= t2) & ~above
  fill = band & (jnp.cumsum(band) <= k - k1)  # first k - k1 of the band
  (indices,) = jnp.nonzero(above | fill, size=k, fill_value=0)
  indices = indices.astype(jnp.int32)
  return indices, x[indices]


SELECTORS: dict[str, Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]] = {
  "exact": exact_topk,
  "mstopk": mstopk,
}


class Memory(NamedTuple):
  """A device's state for one bucket with momentum correction: accumulated v and velocity u."""

  residual: jax.Array
  velocity: jax.Array


@dataclasses.dataclass(frozen=True)
class MomentumCorrection:
  """DGC's momentum correction: the momentum, Nesterov's or heavy ball, and momentum factor masking
  (the velocity zeroed where entries were sent too; ``comm.momentum_masking``)."""

  momentum: float
  nesterov: bool = False
  masking: bool = True

  def step(self, x: jax.Array, velocity: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(new velocity u, the step momentum SGD takes) for gradient ``x``: heavy ball u <- m u + g, step u;
    Nesterov (DGC's form, u = m t for optax's trace t) u <- m (u + g), step u + g.

    It also serves the buckets too small to compress, which send the step whole: the optimizer runs
    without momentum, and the reduction is linear, so the devices' summed steps are momentum SGD's.
    """
    if self.nesterov:
      velocity = self.momentum * (velocity + x)
      return velocity, velocity + x
    velocity = self.momentum * velocity + x
    return velocity, velocity


def compensate(
  x: jax.Array, memory: jax.Array | Memory, error_feedback: bool, correction: MomentumCorrection | None = None
) -> tuple[jax.Array, Callable[[jax.Array], jax.Array | Memory]]:
  """(the vector top-k selects from, ``(indices, unsent) -> new memory`` once those entries are sent).

  ``memory`` is a residual (error feedback; untouched when it is off) or, with ``correction``, a
  ``Memory`` (momentum correction). ``unsent``: what stays at the sent indices (0, or the part of each
  value that rounding on the wire dropped).
  """
  if correction is not None:
    velocity, step = correction.step(x, memory.velocity)
    accumulated = memory.residual + step

    def forget_sent(sent, unsent=0.0):
      return Memory(accumulated.at[sent].set(unsent), velocity.at[sent].set(0.0) if correction.masking else velocity)

    return accumulated, forget_sent
  if not error_feedback:
    return x, lambda sent, unsent=0.0: memory
  corrected = x + memory
  return corrected, lambda sent, unsent=0.0: corrected.at[sent].set(unsent)


def apply_error_feedback(
  x: jax.Array,
  memory: jax.Array | Memory,
  k: int,
  selector: str,
  error_feedback: bool,
  correction: MomentumCorrection | None = None,
  value_dtype=None,
) -> tuple[jax.Array, jax.Array, jax.Array | Memory]:
  """Selects k entries of ``x + residual`` (see ``compensate``); returns (indices, values, new memory).

  With error feedback off there is no residual (None in the state): nothing is added or kept. ``value_dtype``: the
  values' dtype on the wire; when narrower, they come back rounded and the residual keeps what rounding dropped.
  """
  corrected, forget_sent = compensate(x, memory, error_feedback, correction)
  indices, values = SELECTORS[selector](corrected, k)
  if value_dtype is None or jnp.dtype(value_dtype) == values.dtype:
    return indices, values, forget_sent(indices)
  sent = values.astype(value_dtype)
  return indices, sent, forget_sent(indices, values - sent.astype(values.dtype))


class Estimate(NamedTuple):
  """A device's state for one bucket under EF21 (``comm.feedback="ef21"``, ``select_change``): the estimate of
  its momentum step that its peers hold (``own``), the sum of every sender's estimate (``total``, the same on
  each of them: what the reduction returns), and DGC's velocity."""

  own: jax.Array
  total: jax.Array
  velocity: jax.Array


def select_change(
  x: jax.Array,
  state: Estimate,
  k: int,
  selector: str,
  correction: MomentumCorrection,
  value_dtype=None,
) -> tuple[jax.Array, jax.Array, Estimate]:
  """EF21 with momentum (Richtarik et al. 2021; Fatkhullin et al. 2023): top-k of the change of this device's
  momentum step since its estimate was last moved; returns (indices, values, the state with ``own`` moved by
  them and the new velocity). The caller adds every sender's pairs to ``total``.

  Error feedback keeps what was not sent and sends it later; EF21 keeps, for every entry, the last step its
  peers know, and the reduction returns the sum of those estimates whole: every entry moves every step, by a
  possibly stale value, instead of only when it is sent. ``value_dtype``: narrower values move ``own`` by
  what the peers received, rounding included, so ``own`` stays what they hold.
  """
  velocity, step = correction.step(x, state.velocity)
  indices, values = SELECTORS[selector](step - state.own, k)
  if value_dtype is not None:
    values = values.astype(value_dtype)
  own = state.own.at[indices].add(values.astype(x.dtype))
  return indices, values, state._replace(own=own, velocity=velocity)


def clip_local(local_grads, clip_norm: float, num_devices: int):
  """DGC's local gradient clipping: each device's gradient scaled down to global norm
  ``clip_norm / sqrt(num_devices)`` if it is longer, so that the sum of ``num_devices`` independent gradients
  would be about ``clip_norm`` long."""
  clipped, _ = optax.clip_by_global_norm(clip_norm / math.sqrt(num_devices)).update(local_grads, optax.EmptyState())
  return clipped
