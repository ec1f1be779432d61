"""Run output: progress bar, ``metrics.jsonl``, TensorBoard scalars, ``summary.json`` and a PNG plot.

Only process 0 writes files; every process may call these (the others are no-ops).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import tqdm


class MetricsError(RuntimeError):
  """``metrics.jsonl`` is damaged before its last line; the message says which line and what to do."""


class MetricsWriter:
  """Appends one JSON object per evaluation to ``DIR/metrics.jsonl`` and mirrors numbers to TensorBoard."""

  def __init__(self, workdir: str, enabled: bool = True, resume_step: int | None = None, goes_on: bool = True):
    """``resume_step``: keep the records up to that step (a resumed run); None: start a new file. ``goes_on``: the
    run trains past ``resume_step`` (a finished run extended by a larger num_epochs or max_steps): its old last
    record is no longer the final one."""
    self.workdir = workdir
    self.enabled = enabled
    self.records: list[dict[str, Any]] = []
    self._tb = None
    # A finished run resumed, which trains nothing, keeps its summary and plot (and their timing) as they are.
    self._keeps_summary = resume_step is not None and not goes_on
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      if os.path.exists(path) and resume_step is None and read_records(path):
        # A run started over where another left records but no checkpoint: they are kept aside, not dropped.
        keep_aside(path)
      elif os.path.exists(path):
        not_final = lambda r: {**r, "final": False} if r.get("final") else r  # noqa: E731  (the run goes on past it)
        self.records, dropped = keep_records(path, resume_step, not_final if goes_on else None)
        if dropped:
          logging.warning("%s: dropping %d record(s) after step %s (resumed there)", path, dropped, resume_step)
      if not self._keeps_summary:
        # A run that trains makes the previous run's summary and plot stale (a killed extension left a finished
        # run's summary, which tools read as "done"): kept aside, not lost.
        for name in ("summary.json", "curves.png"):
          keep_aside(os.path.join(workdir, name))
      from tensorboardX import SummaryWriter  # imported here: only process 0 needs it

      # TensorBoard is written again from the records kept, every earlier event hidden (purge_step 0): a resumed
      # run's events after its checkpoint would be drawn beside the new ones, and a killed run's last events may
      # never have reached the file (tensorboardX writes from a queue, on its own thread).
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=0)
      for record in self.records:
        self._mirror(record)
      self._tb.flush()

  def write(self, record: dict[str, Any]) -> None:
    """Appends ``record``; one of the same step before it is replaced (a resumed run that evaluates its
    checkpoint's step again: EpochEvaluation.finish_unevaluated)."""
    if self.records and self.records[-1]["step"] == record["step"]:
      self.records.pop()
      if self.enabled:
        keep_records(os.path.join(self.workdir, "metrics.jsonl"), record["step"] - 1)
    self.records.append(record)
    if not self.enabled:
      return
    with open(os.path.join(self.workdir, "metrics.jsonl"), "a") as f:
      f.write(json.dumps(record) + "\n")
    self._mirror(record)
    self._tb.flush()

  def _mirror(self, record: dict[str, Any]) -> None:
    for key, value in record.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
        self._tb.add_scalar(key, value, record["step"])

  def write_summary(self, summary: dict[str, Any]) -> None:
    path = os.path.join(self.workdir, "summary.json")
    if not self.enabled or (self._keeps_summary and os.path.exists(path)):
      return
    with open(path + ".tmp", "w") as f:  # whole or not at all: tools read its presence as a finished run
      json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)
    plot_history(self.records, os.path.join(self.workdir, "curves.png"))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def keep_aside(path: str) -> None:
  """Renames ``path`` (if there) to ``NAME.before-STAMP`` (the UTC time; a name taken gets a count), saying so."""
  if not os.path.exists(path):
    return
  stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
  kept, count = f"{path}.before-{stamp}", 1
  while os.path.lexists(kept):  # two starts in one second: nothing kept before is replaced
    count += 1
    kept = f"{path}.before-{stamp}-{count}"
  try:
    os.replace(path, kept)
  except OSError as e:
    raise MetricsError(
      f"{path} is a previous run's, and cannot be moved aside to {os.path.basename(kept)} ({e.strerror}); move it "
      "away, or choose another --workdir"
    ) from None
  logging.warning("%s: a previous run's, kept as %s", path, os.path.basename(kept))


def plot_history(records: list[dict[str, Any]], path: str, title: str = "") -> None:
  """Training loss and test top-1/top-5 accuracy against epoch, side by side, as a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  epochs = [r["epoch"] for r in records]
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
  ax_loss.plot(epochs, [r["train_loss"] for r in records], marker="o")
  ax_loss.set(xlabel="epoch", ylabel="train loss", title="training loss")
  ax_acc.plot(epochs, [100 * r["eval_top1"] for r in records], marker="o", label="top-1")
  ax_acc.plot(epochs, [100 * r["eval_top5"] for r in records], marker="o", label="top-5")
  ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
  ax_acc.legend()
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def progress_bar(total: int, enabled: bool, initial: int = 0) -> tqdm.tqdm:
  """Steps bar with ETA; the trainer sets loss and images/s as its postfix."""
  return tqdm.tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, mininterval=1.0)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of ``DIR/metrics.jsonl`` (``read_records``)."""
  return read_records(os.path.join(workdir, "metrics.jsonl"))


def keep_records(
  path: str, last_step: int | None, edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], int]:
  """(the records of the JSON-lines file ``path`` up to ``last_step`` (None: none), each through ``edit`` if
  given; how many were dropped), the kept ones written again to a new file renamed over it (without a last line
  cut short): a kill mid-write cannot lose them. A resumed run's steps after its checkpoint run again, and their
  records with them."""
  records = read_records(path)
  kept = [edit(r) if edit else r for r in records if last_step is not None and r["step"] <= last_step]
  with open(path + ".tmp", "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in kept)
  os.replace(path + ".tmp", path)
  return kept, len(records) - len(kept)


def read_records(path: str) -> list[dict[str, Any]]:
  """The records of a JSON-lines file. A last line cut short (a crash or a full disk mid-append) is left out
  with a warning: it is the newest record, which a resumed run writes again. A bad line before it is an error."""
  with open(path, "rb") as f:
    lines = [line for line in f if line.strip()]
  records = []
  for number, line in enumerate(lines, 1):
    try:
      record = json.loads(line.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      if number < len(lines):
        reason = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise MetricsError(_damaged(path, number, f"not a JSON record ({reason})")) from None
      logging.warning("%s: leaving out its last line, cut short: %r", path, line[:80])
      continue
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
      raise MetricsError(_damaged(path, number, "not a record with a step"))
    records.append(record)
  return records


def _damaged(path: str, number: int, what: str) -> str:
  return (
    f"{path}, line {number}: {what}; the file is damaged. Move it away to go on (a resumed run then writes the "
    "records from its checkpoint on; the earlier ones stay in the moved file)."
  )


def _plain(text: str) -> str:
  """``text`` as matplotlib shows it literally: a "$" would start its math mode (a label "$\\foo$" failed)."""
  return text.replace("$", r"\$")


def plot_comparison(runs: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
  """Test top-1 and training loss against epoch for several runs (label -> records) in one PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
  for label, records in runs.items():
    epochs = [r["epoch"] for r in records]
    ax_loss.plot(epochs, [r["train_loss"] for r in records], marker="o", label=_plain(label))
    ax_acc.plot(epochs, [100 * r["eval_top1"] for r in records], marker="o", label=_plain(label))
  ax_loss.set(xlabel="epoch", ylabel="train loss", title="training loss")
  ax_acc.set(xlabel="epoch", ylabel="test top-1 (%)", title="test top-1 accuracy")
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
    ax.legend()
  if title:
    fig.suptitle(_plain(title))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
