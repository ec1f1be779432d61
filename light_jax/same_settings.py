"""Every process of a multi-process run must train the same config on the same number of devices.

Each process applies its own config to its own copy of the replicated state. Started by hand with different
overrides, the processes trained on silently (a batch size or a seed of their own: copies that drift apart, a
summary with process 0's values) or hung at the first step one of them did not take (``max_steps``); a different
``--num_processes`` split the simulated devices differently and failed later with a wrong hint. At start-up each
process publishes its settings in the distributed runtime's key-value store and compares them with process 0's
(process 0 with every other's): a difference stops every process, naming the fields.

Left out: the fields of one machine's own input pipeline (``config.MACHINE_FIELDS``), which may differ between
machines.
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
  client = liveness.client()
  index = jax.process_index()
  mine = settings(config, num_processes)
  client.key_value_set(f"{_PREFIX}{index}", json.dumps(mine))
  for other in range(1, jax.process_count()) if index == 0 else [0]:
    theirs = json.loads(_get(client, f"{_PREFIX}{other}", other, timeout_seconds))
    found = differences(mine, theirs, other)
    if found:
      more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
      devices = (
        " and let each machine see as many devices (CUDA_VISIBLE_DEVICES, mesh.cpu_devices)"
        if mine["local devices"] != theirs.get("local devices")
        else ""
      )
      raise SettingsDiffer(
        f"process {index} was started with other settings than process {other}: {'; '.join(found[:_SHOWN])}{more}. "
        f"Start every process with the same config file, variant, --config overrides and --num_processes{devices} "
        f"(only the fields of a machine's own input may differ: {', '.join(sorted(MACHINE_FIELDS))})"
      )


def _get(client, key: str, other: int, timeout_seconds: float) -> str:
  """The settings process ``other`` publishes at ``key``, waited for up to ``timeout_seconds``. Polled, with Python
  between the polls: a blocking get held a signal's handler in C++ until it returned, and each get that times out
  stays pending in the coordination service until the key is set."""
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
        f"process {other} joined, but did not come to compare its settings within --init_timeout="
        f"{timeout_seconds:g} s (a start-up slower than that: see its log, or raise --init_timeout)"
      )
    if not said and waited >= _SAY_AFTER_SECONDS:
      logging.info("waiting for process %d to compare its settings (up to --init_timeout=%g s)", other, timeout_seconds)
      said = True
    time.sleep(_POLL_SECONDS)
