"""Every process of a multi-process run must train the same config on the same number of devices.

Each process applies its own config to its own copy of the replicated state. Started by hand with different
overrides, the processes trained on silently (a batch size or a seed of their own: copies that drift apart, a
summary with process 0's values) or hung at the first step one of them did not take (``max_steps``); a different
``--num_processes`` split the simulated devices differently and failed later with a wrong hint. At start-up each
process publishes its settings in the distributed runtime's key-value store and compares them with process 0's
(process 0 with every other's): a difference stops every process, naming the fields.

Left out: the fields of one machine's own input pipeline (``config.MACHINE_FIELDS``), which may differ between
machines. Its own ``data.data_dir`` is a copy of the dataset that must be the same: once loaded, each process
compares what it found (``check_data``: the splits' sizes, the classes, the image shape). A copy with another eval
split took another number of evaluation collectives, and the run hung at its first evaluation until
``--step_timeout``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jax
import ml_collections
from absl import logging

from light_jax import liveness
from light_jax.config import MACHINE_FIELDS, flat_fields

_PREFIX = "light_jax/settings/"
_DATA_PREFIX = "light_jax/data/"
_SHOWN = 6  # differences named in the message; the rest are counted
_POLL_SECONDS = 0.2  # see _get
_SAY_AFTER_SECONDS = 2.0  # a process later than this is logged as waited for


class SettingsDiffer(ValueError):
  """This process's settings differ from another's; the message names the fields."""


class LateProcess(RuntimeError):
  """Another process joined but did not publish its settings within the timeout."""


def settings(config: ml_collections.ConfigDict, num_processes: int) -> dict[str, Any]:
  """The config's fields by dotted name (less ``MACHINE_FIELDS``), the process count this process was started
  with and its device count."""
  fields = flat_fields(json.loads(config.to_json_best_effort()))
  return {
    "--num_processes": num_processes,
    "local devices": jax.local_device_count(),
    **{name: value for name, value in fields.items() if name not in MACHINE_FIELDS},
  }


def differences(mine: dict[str, Any], theirs: dict[str, Any], other: int) -> list[str]:
  """``name=value here, value on process N`` for each field whose JSON differs (NaN equals NaN there)."""

  def shown(values: dict[str, Any], name: str) -> str:
    return json.dumps(values[name]) if name in values else "unset"

  return [
    f"{name}={shown(mine, name)} here, {shown(theirs, name)} on process {other}"
    for name in sorted(set(mine) | set(theirs))
    if shown(mine, name) != shown(theirs, name)
  ]


def check(config: ml_collections.ConfigDict, num_processes: int, timeout_seconds: float) -> None:
  """Raises SettingsDiffer if this process's settings differ from process 0's (on process 0: from any other's),
  LateProcess if the other's settings do not come within ``timeout_seconds``.
  Every process must call it, after jax.distributed has started; a single process returns at once."""
  if jax.process_count() == 1:
    return
  mine = settings(config, num_processes)
  for other, found, theirs in _compare(_PREFIX, mine, "settings", timeout_seconds):
    more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
    devices = (
      " and let each machine see as many devices (CUDA_VISIBLE_DEVICES, mesh.cpu_devices)"
      if mine["local devices"] != theirs.get("local devices")
      else ""
    )
    raise SettingsDiffer(
      f"process {jax.process_index()} was started with other settings than process {other}: "
      f"{'; '.join(found[:_SHOWN])}{more}. Start every process with the same config file, variant, --config "
      f"overrides and --num_processes{devices} (only the fields of a machine's own input may differ: "
      f"{', '.join(sorted(MACHINE_FIELDS))})"
    )


def check_data(facts: dict[str, Any], data_dir: str) -> None:
  """Raises SettingsDiffer if the dataset this process loaded (``facts``: the splits' sizes, the classes, the image
  shape) differs from process 0's (on process 0: from any other's). Waits for the others as long as they take
  (one may be building its decoded cache); the watchdog ends the wait if one dies. Every process must call it."""
  if jax.process_count() == 1:
    return
  for other, found, _ in _compare(_DATA_PREFIX, facts, "data", float("inf")):
    raise SettingsDiffer(
      f"process {jax.process_index()} loaded another dataset than process {other}: {'; '.join(found)}. Every "
      f"machine's data.data_dir ({data_dir} here) must hold the same dataset: copy it from one machine, or share it"
    )


def _compare(prefix: str, mine: dict[str, Any], what: str, timeout_seconds: float):
  """Publishes ``mine`` under ``prefix`` and yields (process, differences, theirs) for each other process whose
  published values differ: process 0 compares with every other, the others with process 0."""
  client = liveness.client()
  index = jax.process_index()
  client.key_value_set(f"{prefix}{index}", json.dumps(mine))
  for other in range(1, jax.process_count()) if index == 0 else [0]:
    theirs = json.loads(_get(client, f"{prefix}{other}", other, timeout_seconds, what))
    found = differences(mine, theirs, other)
    if found:
      yield other, found, theirs


def _get(client, key: str, other: int, timeout_seconds: float, what: str) -> str:
  """The ``what`` (settings, data) process ``other`` publishes at ``key``, waited for up to ``timeout_seconds``.
  Polled, with Python between the polls: a blocking get held a signal's handler in C++ until it returned, and each
  get that times out stays pending in the coordination service until the key is set."""
  start = time.monotonic()
  said = False
  while True:
    try:
      return client.key_value_try_get(key)
    except jax.errors.JaxRuntimeError as e:
      if not str(e).startswith("NOT_FOUND"):
        raise
    waited = time.monotonic() - start
    if waited >= timeout_seconds:
      raise LateProcess(
        f"process {other} joined, but did not come to compare its {what} within --init_timeout="
        f"{timeout_seconds:g} s (a start-up slower than that: see its log, or raise --init_timeout)"
      )
    if not said and waited >= _SAY_AFTER_SECONDS:
      limit = f" (up to --init_timeout={timeout_seconds:g} s)" if timeout_seconds < float("inf") else ""
      logging.info("waiting for process %d to compare its %s%s", other, what, limit)
      said = True
    time.sleep(_POLL_SECONDS)
