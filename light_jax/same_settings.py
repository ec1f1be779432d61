"""Every process of a multi-process run must train the same config on the same number of devices.

Each process applies its own config to its own copy of the replicated state. Started by hand with different
overrides, the processes trained on silently (a batch size or a seed of their own: copies that drift apart, a
summary with process 0's values) or hung at the first step one of them did not take (``max_steps``); a different
``--num_processes`` split the simulated devices differently and failed later with a wrong hint. At start-up each
process publishes its settings in the distributed runtime's key-value store and compares them with process 0's
(process 0 with every other's): a difference stops every process, naming the fields.

Left out: the fields of one machine's own input pipeline (where its data and cache are, how many threads and
worker processes read it, how far ahead), which may differ between machines.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import ml_collections

from light_jax import liveness

MACHINE_FIELDS = frozenset(
  {"data.data_dir", "data.cache_dir", "data.read_threads", "data.num_workers", "data.host_prefetch", "data.prefetch"}
)
_PREFIX = "light_jax/settings/"
_SHOWN = 6  # differences named in the message; the rest are counted


class SettingsDiffer(ValueError):
  """This process's settings differ from another's; the message names the fields."""


def settings(config: ml_collections.ConfigDict, num_processes: int) -> dict[str, Any]:
  """The config's fields by dotted name (less ``MACHINE_FIELDS``), the process count this process was started
  with and its device count."""
  flat = {"--num_processes": num_processes, "local devices": jax.local_device_count()}

  def add(prefix: str, value: Any) -> None:
    if isinstance(value, dict):
      for key, inner in value.items():
        add(f"{prefix}.{key}" if prefix else key, inner)
    elif prefix not in MACHINE_FIELDS:
      flat[prefix] = value

  add("", json.loads(config.to_json_best_effort()))
  return flat


def differences(mine: dict[str, Any], theirs: dict[str, Any], other: int) -> list[str]:
  unset = "(unset)"
  return [
    f"{key}={json.dumps(mine.get(key, unset))} here, {json.dumps(theirs.get(key, unset))} on process {other}"
    for key in sorted(set(mine) | set(theirs))
    if mine.get(key, unset) != theirs.get(key, unset)
  ]


def check(config: ml_collections.ConfigDict, num_processes: int, timeout_seconds: float) -> None:
  """Raises SettingsDiffer if this process's settings differ from process 0's (on process 0: from any other's).
  Every process must call it, after jax.distributed has started; a single process returns at once."""
  if jax.process_count() == 1:
    return
  client = liveness.client()
  index = jax.process_index()
  mine = settings(config, num_processes)
  client.key_value_set(f"{_PREFIX}{index}", json.dumps(mine))
  for other in range(1, jax.process_count()) if index == 0 else [0]:
    theirs = json.loads(client.blocking_key_value_get(f"{_PREFIX}{other}", int(timeout_seconds * 1000)))
    found = differences(mine, theirs, other)
    if found:
      more = f"; and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
      raise SettingsDiffer(
        f"process {index} was started with other settings than process {other}: {'; '.join(found[:_SHOWN])}{more}. "
        "Start every process with the same config file, variant, --config overrides and --num_processes (only "
        f"the fields of a machine's own input may differ: {', '.join(sorted(MACHINE_FIELDS))})"
      )
