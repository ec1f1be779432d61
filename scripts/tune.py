"""AutoML: an Optuna study of a training config's hyper-parameters, each trial a real train.py run.

  python scripts/tune.py --config configs/fashion_mnist.py:large_batch_lars --study_dir runs/tune --trials 16
  python scripts/tune.py --config configs/fashion_mnist.py:large_batch_lars --study_dir runs/tune --trials 24
  python scripts/tune.py --config configs/fashion_mnist.py:large_batch --space configs/search_spaces.py:sgd \
      --study_dir runs/tune_sgd --trials 16 --config.num_epochs=3

The search space is a config file (--space, default configs/search_spaces.py). The sampler is TPE; a
median pruner stops a trial whose test top-1 after an epoch is below the median of earlier trials at that
epoch (train.py writes one evaluation per epoch to its metrics.jsonl, which this script follows). The
study lives in STUDY_DIR/study.db (SQLite): --trials is the number of finished (completed + pruned)
trials the study should hold, so the same command continues a killed study, and a larger --trials
extends a finished one. Several machines can share a study through the same storage (--storage, e.g. a
PostgreSQL URL). The study stores its --config and overrides: a later run with others, or with a search-space
field of another kind, is refused before its first trial; a study directory holds one study (its name in
study_name.txt). Each trial's sampler is seeded with --seed plus its trial number, so a continued study samples new
values, and machines sharing a study draw differently (not alike); a machine starts a trial only while the finished
and running trials are fewer than --trials (two that check at once may both start one: up to machines - 1 more).
A trial whose sampled values train.py refuses fails, and the study goes on. A trial killed with its study is
marked failed once its heartbeat stops (--heartbeat_grace seconds: the study's, as it was created; or, killed
before its first heartbeat, once it has run that long without one) and is retried once with the same parameters,
resuming from its checkpoint; a continued study that finds trials running, and does not hold --trials yet, first
waits that long, so that it retries a killed one before sampling new ones. A trial stopped by Ctrl-C is retried the
same way when the same command runs again.

Output: a table of the trials, STUDY_DIR/best_config.py (a config file train.py accepts: the base config,
the --config overrides and the best trial's parameters), Optuna's plots as PNG in STUDY_DIR, and as the
last line one JSON object: {"trials", "completed", "pruned", "failed", "best": {"number", "value",
"params"}, "best_config", "seconds"}.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import math
import numbers
import operator
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from typing import NoReturn

import ml_collections
import optuna
import sqlalchemy
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages._rdb import models as rdb_models  # beaten_trial_ids
from optuna.trial import TrialState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from light_jax import child_process, cli  # noqa: E402  (the repository's, whichever directory this runs from)
from light_jax.exit_codes import ExitCode  # noqa: E402

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
DEFAULT_STUDY_NAME = "light_jax"
DEFAULT_HEARTBEAT_GRACE = 60  # seconds without a heartbeat before a running trial counts as killed


class TrialFailed(RuntimeError):
  """train.py exited with an error; the message says where its log is."""


class TrialInterrupted(RuntimeError):
  """train.py was stopped (SIGINT or SIGTERM: it saved a checkpoint and exited 0) before its end."""


class TrialTakenOver(RuntimeError):
  """Another process sharing the study failed this running trial as killed (its heartbeat looked stale)."""


def check_not_taken_over(trial: optuna.Trial) -> None:
  """Raises TrialTakenOver where another process sharing the study has failed this running trial."""
  if trial.study._storage.get_trial(trial._trial_id).state != TrialState.RUNNING:
    raise TrialTakenOver(f"trial {trial.number} was failed by another process sharing the study")


class TrialRejected(RuntimeError):
  """train.py rejected a new trial as bad input (exit code 2: its config, or the data): every trial would."""


# Each kind of search-space field as the Optuna distribution it samples from: built when the space loads, so
# a bad field stops the study before its database or a trial exists.
KINDS = {
  "log": lambda low, high: optuna.distributions.FloatDistribution(low, high, log=True),
  "float": lambda low, high: optuna.distributions.FloatDistribution(low, high),
  "int": lambda low, high: optuna.distributions.IntDistribution(low, high),
  "choice": lambda choices: optuna.distributions.CategoricalDistribution(choices),
}


def from_cwd(spec: str) -> str:
  """A file[:variant] flag's file from the current directory where it is there (as train.py reads it), made
  absolute for the trials' train.py, which runs in ROOT; else as given, relative to the repository."""
  path, colon, variant = spec.partition(":")
  return os.path.abspath(path) + colon + variant if os.path.isfile(path) else spec


def load_space(spec: str) -> dict[str, tuple]:
  path, _, variant = from_cwd(spec).partition(":")
  if not os.path.isfile(os.path.join(ROOT, path)):
    raise ValueError(f"no such file: {path} (in the current directory or the repository)")
  module_spec = importlib.util.spec_from_file_location("search_space", os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  get_space = getattr(module, "get_space", None)
  if not callable(get_space):
    raise ValueError(f"{path} has no function get_space(variant=None)")
  try:  # checked before the call, so that a TypeError inside get_space keeps its traceback
    inspect.signature(get_space).bind(variant or None)
  except TypeError:
    raise ValueError(
      f"get_space{inspect.signature(get_space)} cannot take the variant; define get_space(variant=None) "
      "(it is called with the text after ':' in --space, or None)"
    ) from None
  space = get_space(variant or None)
  check_space(space)
  return space


def check_space(space: dict[str, tuple]) -> None:
  """Raises ValueError naming the first field that is not one of the kinds with its arguments."""
  if not isinstance(space, dict):
    raise ValueError(f"get_space returned a {type(space).__name__}, not a dict of field -> (kind, ...)")
  if not space:  # every trial would train the same config
    raise ValueError("get_space returned no field: the study would sample nothing; give it a field to search")
  for name, field in space.items():
    kind, *args = field if isinstance(field, (tuple, list)) and field else (None,)
    if kind not in KINDS:
      raise ValueError(f"search space field {name}: unknown kind {kind!r}; use log, float, int or choice")
    usage = "(kind, low, high)" if kind != "choice" else '("choice", [a, b, ...])'
    try:
      _check_args(kind, args)
      KINDS[kind](*args)  # Optuna's own checks: the number of arguments, low <= high, log bounds > 0
    except (TypeError, ValueError) as e:
      raise ValueError(f"search space field {name}: {field!r} is not {usage}: {e}") from e


def _check_args(kind: str, args: list) -> None:
  """What Optuna's distributions let through: a string of choices (sampled letter by letter), an int field's
  float bounds (suggest_int would round them), bounds that are no numbers."""
  if kind == "choice":
    if len(args) != 1 or not isinstance(args[0], (list, tuple)) or not args[0]:
      raise ValueError("the choices are not a non-empty list")
    return
  if not all(isinstance(a, numbers.Real) and not isinstance(a, bool) and math.isfinite(a) for a in args):
    raise ValueError("the bounds are not finite numbers")
  if kind == "int" and not all(isinstance(a, numbers.Integral) for a in args):
    raise ValueError("the bounds of an int field are not integers")


def _spec(distribution: optuna.distributions.BaseDistribution) -> tuple:
  """A stored trial's distribution as the search-space field it was sampled from."""
  if isinstance(distribution, optuna.distributions.CategoricalDistribution):
    return ("choice", list(distribution.choices))
  kind = "int" if isinstance(distribution, optuna.distributions.IntDistribution) else "float"
  return ("log" if distribution.log else kind, distribution.low, distribution.high)


def _format(value) -> str:
  """A sampled value for the log and the table: numbers short, choices (strings, None) as they are."""
  return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def check_study_config(config_spec: str, overrides: list[str], space: dict[str, tuple]) -> ml_collections.ConfigDict:
  """The config the trials start from, checked before any trial: it loads, train.py takes its overrides, the
  search space names fields it has, and none of them is overridden too (a trial's sampled value would silently
  replace the override).

  Raises:
    ValueError: with a message that says what to change.
  """
  config = cli.resolve_config(os.path.join(ROOT, config_spec), overrides)  # as the trials' train.py, run in ROOT
  unknown = [name for name in space if _missing(config, name)]
  if unknown:
    raise ValueError(f"the search space names fields that {config_spec} does not have: {unknown}")
  clash = sorted(set(cli.overridden_fields(overrides)) & set(space))
  if clash:
    raise ValueError(
      f"--config overrides of fields the search space samples would be replaced in every trial: {clash}; "
      "drop the override, or search another space (--space)"
    )
  for name, (kind, *args) in space.items():
    if isinstance(group := _field(config, name), ml_collections.ConfigDict):
      raise ValueError(
        f"search space field {name} is a group of fields ({', '.join(sorted(group))}), not a field; "
        f"sample one of them, e.g. {name}.{next(iter(sorted(group)), 'x')}"
      )
    # Each trial's value as train.py reads it: its bounds and choices, so that a value of the wrong type stops the
    # study here, not each trial (a value out of the field's valid range stays that trial's fault).
    for value in args[0] if kind == "choice" else args:
      try:
        read = _field(cli.resolve_config(os.path.join(ROOT, config_spec), [*overrides, _override(name, value)]), name)
      except cli.CommandLineError as e:
        raise ValueError(f"search space field {name}: train.py refuses its value {value!r}: {e}") from None
      if read != value or isinstance(read, str) != isinstance(value, str):  # a text field reads any value
        raise ValueError(
          f"search space field {name}: train.py reads its value {value!r} as {read!r} "
          f"({type(read).__name__}); sample values of the field's type"
        )
  return config


def _override(name: str, value) -> str:
  """A trial's sampled value as its train.py flag (a string choice as it is, a number or None as Python writes it)."""
  return f"--config.{name}={value if isinstance(value, str) else repr(value)}"


def _config_key(spec: str) -> str:
  """A --config spec as its file relative to the repository (the trials' directory) and its variant."""
  path, colon, variant = spec.partition(":")
  return os.path.relpath(os.path.normpath(os.path.join(ROOT, path)), ROOT) + colon + variant


def _override_values(overrides: list[str]) -> dict[str, str]:
  """Each overridden field's text, as train.py takes them (the last of a field's overrides wins)."""
  return dict(arg[len("--config.") :].split("=", 1) for arg in overrides)


def check_resume(study: optuna.Study, args, space: dict[str, tuple]) -> None:
  """Before any trial of a study run before: its trials' parameters fit the search space, and it runs the same
  config and overrides (which best_config.py joins to the best trial, and a retried trial resumes under). A
  study without them stored (new, or from before they were) stores them, and so does one where no trial ran
  under them to an end or can be retried (every trial failed, e.g. train.py refused the overrides).

  Raises:
    ValueError: with a message that says what differs and what to do.
  """
  new_study = "start a new study in a new --study_dir"
  checked = set()
  for trial in study.get_trials(deepcopy=False):
    for name, stored in trial.distributions.items():
      if name not in space or name in checked:
        continue
      checked.add(name)
      try:  # Optuna's check, which otherwise fails the first new trial with a traceback
        optuna.distributions.check_distribution_compatibility(stored, KINDS[space[name][0]](*space[name][1:]))
      except ValueError:
        raise ValueError(
          f"--space={args.space}: field {name} is {tuple(space[name])!r}, but the study's trials sampled it as "
          f"{_spec(stored)!r}, which Optuna cannot mix; restore the field, or {new_study}"
        ) from None
  current = {"config": _config_key(args.config), "overrides": _override_values(args.overrides)}
  stored = study.user_attrs
  states = {t.state for t in study.get_trials(deepcopy=False)}
  # A running (killed) or waiting (interrupted) trial is retried from its workdir, under the stored overrides.
  nothing_ran = not states & {TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING}
  for key, value in current.items():
    if key not in stored or nothing_ran:  # new, from before these were stored, or only failed trials so far
      study.set_user_attr(key, value)
      stored[key] = value
  if stored["config"] != current["config"]:
    raise ValueError(
      f"the study in {args.study_dir} was run with --config={stored['config']}, not {args.config}; "
      f"rerun with that --config, or {new_study}"
    )
  if stored["overrides"] != current["overrides"]:
    was, now = stored["overrides"], current["overrides"]
    differ = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
    was = " ".join(f"--config.{k}={v}" for k, v in was.items()) or "none"
    raise ValueError(
      f"the study in {args.study_dir} was run with other --config overrides ({was}); this run's overrides differ "
      f"in {differ}; rerun with the study's, or {new_study}"
    )


def _field(config: ml_collections.ConfigDict, dotted: str):
  """The value of a dotted field name, e.g. "optimizer.base_lr" (KeyError or TypeError where there is none)."""
  return functools.reduce(operator.getitem, dotted.split("."), config)


def _missing(config: ml_collections.ConfigDict, dotted: str) -> bool:
  try:
    _field(config, dotted)
  except (KeyError, TypeError):
    return True
  return False


def suggest(trial: optuna.Trial, space: dict[str, tuple]) -> dict:
  """The trial's values of the (checked) search space's fields, each sampled from its field's distribution."""
  params = {}
  for name, (kind, *args) in space.items():
    distribution = KINDS[kind](*args)
    if isinstance(distribution, optuna.distributions.CategoricalDistribution):
      params[name] = trial.suggest_categorical(name, distribution.choices)
    elif isinstance(distribution, optuna.distributions.IntDistribution):
      params[name] = trial.suggest_int(name, distribution.low, distribution.high)
    else:
      params[name] = trial.suggest_float(name, distribution.low, distribution.high, log=distribution.log)
  return params


def sample(trial: optuna.Trial, space: dict[str, tuple]) -> tuple[dict, int | None]:
  """The trial's values of ``space``, and the number of the killed trial whose run it resumes (its workdir) or None.
  A retry takes the killed trial's values, those of fields the search space has lost since too (the trial records
  them, and the best config would hold them). A field the space gained since is sampled, which makes the run
  another config than the killed run's checkpoint, which train.py refuses to resume from: it starts afresh. The
  trial records the trial whose workdir its run uses (``WORKDIR_TRIAL``), which its own retry resumes."""
  frozen = trial.study.get_trials(deepcopy=False)[trial.number]
  inherited = dict(frozen.params)  # a retry's, from the killed trial
  retried = RetryHeartbeatStaleTrialCallback.retried_trial_number(frozen)
  params = suggest(trial, space)
  if retried is not None:
    params |= {name: value for name, value in inherited.items() if name not in params}
    if set(params) != set(inherited):
      print(
        f"trial {trial.number} retries trial {retried}, but the search space has gained a field since: it starts "
        "afresh",
        flush=True,
      )
      retried = None
  trial.set_user_attr(WORKDIR_TRIAL, trial.number if retried is None else retried)
  return params, retried


# The user attribute of the trial whose workdir (trials/NNNN) a trial's run uses: its own, or the killed trial's
# that it resumes. A retry queued after a Ctrl-C resumes that one (a retry that started afresh ran in its own).
WORKDIR_TRIAL = "workdir_trial"


# How long a retry waits for the killed trial's train.py to let go of its workdir: its save at SIGTERM (the step, an
# epoch's evaluation, the checkpoint) is minutes at most.
KILLED_RUN_SECONDS = 600


def wait_for_the_killed_run(workdir: str, number: int, retried: int) -> None:
  """Waits while a train.py still holds ``workdir`` (its lock): the killed trial's, which outlives its study (its own
  session) and saves at the SIGTERM it gets when the study dies, for seconds past the heartbeat grace. Started now,
  the retry's train.py was refused the workdir "in use" (exit 2), and a retry is not retried: the trial was lost."""
  from light_jax import checkpoint  # orbax: imported only for a retry

  holder, deadline = checkpoint.workdir_holder(workdir), time.time() + KILLED_RUN_SECONDS
  if holder:
    print(f"trial {number}: trial {retried}'s run still holds {workdir} ({holder}): waiting for it to end", flush=True)
  while holder and time.time() < deadline:
    time.sleep(1.0)
    holder = checkpoint.workdir_holder(workdir)


def read_records(workdir: str) -> list[dict]:
  """The epoch records train.py has written so far (a line being written is left for the next read)."""
  try:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = f.read().split("\n")
  except FileNotFoundError:
    return []
  records = []
  for line in lines[:-1]:  # the text after the last newline may be incomplete
    if line.strip():
      records.append(json.loads(line))
  return records


def claim_study_dir(args) -> None:
  """A study directory holds one study's trials (``trials/NNNN``, by trial number), best config and plots: another
  --study_name there would replace them. The first study to run in it names it in ``study_name.txt``."""
  path = os.path.join(args.study_dir, "study_name.txt")
  if os.path.exists(path):
    with open(path) as f:
      owner = f.read().strip()
    if owner != args.study_name:
      cli.fail(
        f"--study_dir={args.study_dir} holds study {owner!r}'s trials; --study_name={args.study_name} would replace "
        "them: give it another --study_dir (or --study_name=" + owner + " to continue that study)"
      )
  elif not os.listdir(os.path.join(args.study_dir, "trials")) or args.study_name == DEFAULT_STUDY_NAME:
    write_whole(path, args.study_name + "\n")  # a new directory, or one of a study from before the name was kept
  else:
    cli.fail(
      f"--study_dir={args.study_dir} holds trials of a study from before the study name was kept, the default "
      f"{DEFAULT_STUDY_NAME!r}; give --study_name={args.study_name} another --study_dir"
    )


def run_trial(trial: optuna.Trial, args, space: dict[str, tuple]) -> float:
  """Trains one sample of ``space``; reports each epoch's test top-1 to the pruner; returns the final one."""
  params, retried = sample(trial, space)
  number = trial.number if retried is None else retried  # a retried trial resumes in its first workdir
  workdir = os.path.join(args.study_dir, "trials", f"{number:04d}")
  if retried is None and os.path.exists(workdir):  # left by an earlier study of this name: start afresh
    shutil.rmtree(workdir)
  if retried is not None:
    wait_for_the_killed_run(workdir, trial.number, retried)
  os.makedirs(workdir, exist_ok=True)
  command = [
    sys.executable,
    os.path.join(ROOT, "train.py"),
    f"--config={args.config}",
    f"--workdir={workdir}",
    *args.overrides,
    *(_override(name, value) for name, value in params.items()),
  ]
  log_path = os.path.join(args.study_dir, "trials", f"{number:04d}.log")
  print(f"trial {trial.number}: " + ", ".join(f"{k}={_format(v)}" for k, v in params.items()), flush=True)
  start = time.time()
  with open(log_path, "a") as log:
    # In a session of its own, so a terminal's Ctrl-C reaches only this process, whose SIGTERM below is then
    # the run's one signal (it saves a checkpoint; a second signal would make it exit without one).
    process = subprocess.Popen(
      command,
      stdout=log,
      stderr=subprocess.STDOUT,
      cwd=ROOT,
      start_new_session=True,
      preexec_fn=child_process.bound_to_this_process(signal.SIGTERM),
    )
    try:
      reported = set()
      while True:
        exited = process.poll() is not None
        for record in read_records(workdir):
          epoch = round(record["epoch"])
          if epoch in reported:
            continue
          reported.add(epoch)
          try:
            trial.report(record["eval_top1"], epoch)
          except optuna.exceptions.UpdateFinishedTrialError:  # failed from outside between two checks below
            check_not_taken_over(trial)  # raises TrialTakenOver
            raise
          print(f"  epoch {epoch}: test top-1 {100 * record['eval_top1']:.2f}%", flush=True)
          if trial.should_prune():
            raise optuna.TrialPruned(f"test top-1 {record['eval_top1']:.4f} after epoch {epoch} is below the median")
        if exited:
          break
        # Failed from outside: its retry resumes in this workdir, where this run must not write on (stopped below).
        check_not_taken_over(trial)
        time.sleep(1.0)
    except TrialTakenOver:
      process.kill()  # no checkpoint: the retry may already be reading or writing this workdir's
      raise
    finally:
      if process.poll() is None:  # pruned, interrupted or failed here: stop the run (it saves a checkpoint)
        process.terminate()
        try:
          process.wait(timeout=60)
        except subprocess.TimeoutExpired:
          process.kill()
      trial.set_user_attr("seconds", time.time() - start)  # last: it raises on a trial failed from outside
  if process.returncode == ExitCode.BAD_INPUT and retried is None:  # a retry may fail on its own checkpoint
    with open(log_path) as f:
      errors = [line[len("error:") :].strip() for line in f if line.startswith("error:")]
    reason = errors[-1] if errors else log_path
    if any(name in reason for name in params):  # this sample's value (momentum below min_momentum): not every trial's
      failure = TrialFailed(f"trial {trial.number}: train.py rejected its sampled values: {reason}")
      print(f"  failed: {failure}", file=sys.stderr, flush=True)
      raise failure
    raise TrialRejected(f"trial {trial.number}: train.py rejected it: {reason}")
  if process.returncode != 0:
    failure = TrialFailed(f"trial {trial.number}: train.py exited with {process.returncode}; see {log_path}")
    print(f"  failed: {failure}", file=sys.stderr, flush=True)  # optuna logs errors only (main)
    raise failure
  if not os.path.exists(os.path.join(workdir, "summary.json")):  # a signal to train.py alone, e.g. SIGINT here ignored
    raise TrialInterrupted(f"trial {trial.number}: train.py was stopped before its end; see {log_path}")
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  trial.set_user_attr("wall_seconds", summary["wall_seconds"])
  return summary["final_eval_top1"]


def write_best_config(path: str, args, study: optuna.Study, resolved: ml_collections.ConfigDict) -> None:
  """A config file for train.py: the study's base config and overrides (their values as train.py read them, in
  ``resolved``), then the best trial's values."""
  best = study.best_trial
  values = {name: _field(resolved, name) for name in cli.overridden_fields(args.overrides)}
  fields = {**values, **best.params}
  base, _, variant = args.config.partition(":")
  lines = [
    f'"""The best trial of the Optuna study in {args.study_dir}: trial {best.number}, test top-1 {best.value:.4f}.',
    "",
    "Written by scripts/tune.py:",
    f"  python train.py --config {path} --workdir runs/best",
    '"""',
    "",
    "import importlib.util",
    "import os",
    "",
    f"BASE = {os.path.join(ROOT, base)!r}",
    f"VARIANT = {variant or None!r}",
    "FIELDS = {",
    *(f"  {k!r}: {v!r}," for k, v in fields.items()),
    "}",
    "",
    "",
    "def get_config():",
    '  spec = importlib.util.spec_from_file_location("base_config", BASE)',
    "  module = importlib.util.module_from_spec(spec)",
    "  spec.loader.exec_module(module)",
    "  config = module.get_config(VARIANT) if VARIANT else module.get_config()",
    "  config.update_from_flattened_dict(FIELDS)",
    "  return config",
    "",
  ]
  write_whole(path, "\n".join(lines))


def write_whole(path: str, text: str) -> None:
  """``text`` in ``path``, whole or not at all (a kill mid-write left a cut file: an empty study_name.txt refused
  its study directory for good)."""
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def save_plots(study: optuna.Study, study_dir: str) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from optuna.visualization import matplotlib as optuna_plots

  written = []
  plots = {
    "optimization_history": optuna_plots.plot_optimization_history,
    "intermediate_values": optuna_plots.plot_intermediate_values,
    "param_importances": optuna_plots.plot_param_importances,
    "slice": optuna_plots.plot_slice,
  }
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    for name, plot in plots.items():
      try:
        axes = plot(study)
      except (ValueError, RuntimeError) as e:  # e.g. importances need two completed trials
        print(f"no {name} plot: {e}", file=sys.stderr)
        continue
      figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
      figure.set_size_inches(max(figure.get_size_inches()[0], 8), 5)
      figure.set_layout_engine("constrained")  # tight_layout cannot place the slice plot's colour bar: it warned
      path = os.path.join(study_dir, f"{name}.png")
      figure.savefig(path + ".tmp.png", dpi=110)  # whole or not at all, as write_whole
      os.replace(path + ".tmp.png", path)
      plt.close(figure)
      written.append(path)
  return written


def print_table(study: optuna.Study) -> None:
  names = list(dict.fromkeys(k for t in study.trials for k in t.params))
  short = [n.split(".")[-1] for n in names]
  print(f"{'trial':>5}  {'state':8} {'top-1':>7} {'epochs':>6} {'seconds':>7}  " + "  ".join(f"{s:>13}" for s in short))
  ranked = sorted(study.trials, key=lambda t: (t.value is None, -(t.value or 0.0), t.number))
  for t in ranked:
    last = max(t.intermediate_values, default=0)
    value = t.value if t.value is not None else t.intermediate_values.get(last)
    print(
      f"{t.number:>5}  {t.state.name.lower():8} {'' if value is None else f'{100 * value:6.2f}%':>7} {last:>6} "
      f"{t.user_attrs.get('seconds', 0):7.0f}  "
      + "  ".join(f"{_format(t.params.get(n, float('nan'))):>13}" for n in names)
    )


def requested_grace(args) -> int:
  """The heartbeat grace this command asks for: --heartbeat_grace, or the default."""
  return args.heartbeat_grace or DEFAULT_HEARTBEAT_GRACE


def study_grace(study: optuna.Study, args) -> int:
  """The study's heartbeat grace: the one it was created with (stored then), else --heartbeat_grace or the default,
  which it stores. A machine with a shorter one would fail the live trials of the others as killed.

  Raises:
    ValueError: --heartbeat_grace differs from the study's.
  """
  stored = study.user_attrs.get("heartbeat_grace")
  if stored is None:  # a new study, or one from before the grace was stored
    stored = requested_grace(args)
    study.set_user_attr("heartbeat_grace", stored)
  elif args.heartbeat_grace not in (None, stored):
    raise ValueError(
      f"the study in {args.study_dir} was created with --heartbeat_grace={stored}, not {args.heartbeat_grace} "
      "(every machine of a study must use the same); leave the flag out, or start a new study in a new --study_dir"
    )
  return stored


def retry_killed(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
  """Queues the retry of ``trial``, failed as killed: once (a retry failed so too is not retried)."""
  RetryHeartbeatStaleTrialCallback(max_retry=1)(study, trial)


def beaten_trial_ids(storage: RDBStorage) -> set[int]:
  """The ids of the trials that have a heartbeat (Optuna has no public query for it: its storage's table)."""
  session = storage.scoped_session()
  try:
    ids = {trial_id for (trial_id,) in session.query(rdb_models.TrialHeartbeatModel.trial_id)}
    session.commit()  # ends the read: an SQLite file stays locked for the other processes' writes until then
  except BaseException:
    session.rollback()
    raise
  return ids


def fail_killed_trials(study: optuna.Study, storage: RDBStorage) -> None:
  """Fails the study's trials killed with their study process, and queues their retries (``retry_killed``): those
  whose heartbeat is the grace old (``storage.grace_period``, Optuna's ``fail_stale_trials``), and those killed
  between Optuna's ``ask`` and their heartbeat thread's first beat, which have none: Optuna never fails those, which
  stayed RUNNING for good, and a study one trial short of --trials waited for them forever. A trial that has run the
  grace without a heartbeat is one (a live trial beats within milliseconds of its start, with any version of this
  script)."""
  optuna.storages.fail_stale_trials(study)
  beaten = beaten_trial_ids(storage)
  for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
    if trial._trial_id in beaten or time.time() - trial.datetime_start.timestamp() < storage.grace_period:
      continue
    try:
      study.tell(trial.number, state=TrialState.FAIL)
    except (ValueError, optuna.exceptions.UpdateFinishedTrialError):  # another process ended it meanwhile
      continue
    retry_killed(study, study.get_trials(deepcopy=False)[trial.number])


def open_storage(url: str, grace: int) -> RDBStorage:
  """The study's storage: a running trial beats every grace / 3 seconds and counts as killed after ``grace``
  seconds without a beat. Two processes creating the same new database at once (machines sharing a study, or a
  monitor reading it) race on its schema table; the loser retries against the schema the winner wrote."""
  for attempt in range(3):
    try:
      return RDBStorage(
        url,
        heartbeat_interval=max(1, grace // 3),
        grace_period=grace,
        heartbeat_stale_trial_callback=retry_killed,
      )
    except sqlalchemy.exc.DBAPIError:  # IntegrityError or "database is locked" while the other one creates it
      if attempt == 2:
        raise
      time.sleep(1 + attempt)


def wait_for_killed_trials(study: optuna.Study, storage: RDBStorage) -> None:
  """A trial killed with its study process stays RUNNING until its heartbeat is the grace old (``storage``'s). A study
  continued before then would sample new trials around it, and could reach --trials with it never retried. So
  when the study holds running trials, wait out the grace: a killed one is then failed and its retry queued
  (the storage's stale-trial callback), while one running on another machine sharing the study beats on."""
  waiting_for = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
  if not waiting_for:
    return
  grace = storage.grace_period
  print(
    f"trials {sorted(waiting_for)} are running: waiting up to {grace} s to tell one killed with its study (its "
    "heartbeat stopped; retried from its checkpoint) from one running on another machine",
    flush=True,
  )
  deadline = time.time() + grace + 2  # its last beat is at most grace / 3 old when it was killed, before now
  try:
    while time.time() < deadline:
      fail_killed_trials(study, storage)
      running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
      if not waiting_for & running:
        break
      time.sleep(1)
  except KeyboardInterrupt:  # no trial of this process's is running
    resume_later(study, [])
  failed = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
  killed = sorted(waiting_for & failed)  # not those another machine finished meanwhile
  trials = study.get_trials(deepcopy=False)
  retried = [n for n in killed if not trials[n].system_attrs.get("retry_history")]  # a retry is not retried again
  if retried:
    print(f"trials {retried} were killed with their study: each is retried once", flush=True)
  if len(retried) < len(killed):
    print(f"trials {sorted(set(killed) - set(retried))} were killed with their study, as retries: not retried again",
          flush=True)  # fmt: skip


def needs_a_trial(study: optuna.Study, storage: RDBStorage, trials: int) -> bool:
  """Whether this process should start a trial: the finished trials and those running (on other machines sharing
  the study) are fewer than ``trials``. While they are not, but fewer than ``trials`` finished, it waits: a trial
  running elsewhere may be pruned into the count or fail (a killed one's retry is then queued, for this process
  to run). Two machines that check at the same moment may still both start one: the study then overshoots."""
  waiting = False
  try:
    while True:
      states = [t.state for t in study.get_trials(deepcopy=False)]
      finished = sum(s in FINISHED for s in states)
      if finished >= trials:
        return False
      running = states.count(TrialState.RUNNING)
      if finished + running < trials:
        return True
      if not waiting:
        print(f"{finished} of {trials} trials finished, {running} running elsewhere: waiting for them", flush=True)
        waiting = True
      time.sleep(2)
      fail_killed_trials(study, storage)  # a killed one's retry is queued, then counts as not running
  except KeyboardInterrupt:  # no trial of this process's is running
    resume_later(study, [])


def resume_later(study: optuna.Study, started: list[int]) -> NoReturn:
  """After Ctrl-C (or its trial's train.py stopped alone): Optuna has marked the running trial failed, where the
  heartbeat's retry never applies; queue its retry as that callback does (same parameters, its first workdir and
  checkpoint), then exit 130. Its retry history is left as it was: an interruption is no failure, so the
  retry still has its one retry left should its study be killed later."""
  trial = study.get_trials()[started[-1]] if started else None
  if trial is not None and trial.state == TrialState.FAIL:
    # As RetryHeartbeatStaleTrialCallback queues a retry ("failed_trial": the first run, whose workdir and
    # checkpoint it resumes), but without adding this trial to "retry_history", which its max_retry counts.
    workdir_trial = trial.user_attrs.get(WORKDIR_TRIAL, trial.system_attrs.get("failed_trial", trial.number))
    system_attrs = {"retry_history": [], **trial.system_attrs, "failed_trial": workdir_trial}
    study.add_trial(
      optuna.create_trial(
        state=TrialState.WAITING,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs=trial.user_attrs,
        system_attrs=system_attrs,
      )
    )
    print(
      f"interrupted: trial {trial.number} resumes from its checkpoint when the same command runs again",
      file=sys.stderr,
    )
  else:
    print("interrupted: the same command continues the study", file=sys.stderr)
  sys.exit(130)  # 128 + SIGINT, as a shell reports it


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  where = "a file in the current directory, else in the repository"
  parser.add_argument("--config", required=True, help=f"config file[:variant], as for train.py: {where}")
  parser.add_argument("--study_dir", required=True)
  parser.add_argument("--trials", type=int, required=True, help="finished trials (completed + pruned) to reach")
  parser.add_argument("--space", default="configs/search_spaces.py", help=f"search space file[:variant]: {where}")
  parser.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite in --study_dir)")
  parser.add_argument("--study_name", default=DEFAULT_STUDY_NAME)
  parser.add_argument("--startup_trials", type=int, default=5, help="random trials before TPE models the space")
  parser.add_argument("--pruner_warmup_epochs", type=int, default=1, help="epochs before a trial may be pruned")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--heartbeat_grace",
    type=int,
    default=None,
    help=f"seconds without a heartbeat before a running trial counts as killed (default: the study's, which keeps "
    f"the one it was created with, {DEFAULT_HEARTBEAT_GRACE} unless given; another is refused: a machine with a "
    "shorter one would fail the trials of others)",
  )
  args, unknown = parser.parse_known_args()
  bad = [u for u in unknown if not u.startswith("--config.") or "=" not in u]
  if bad:
    parser.error(f"unrecognised arguments {bad}; config overrides look like --config.optimizer.base_lr=2.0")
  args.overrides = unknown
  args.config = from_cwd(args.config)
  if args.trials < 1:
    parser.error("--trials must be >= 1")
  for flag in ("startup_trials", "pruner_warmup_epochs", "seed"):  # Optuna's and numpy's own checks are tracebacks
    if getattr(args, flag) < 0:
      parser.error(f"--{flag} must be >= 0")
  if args.heartbeat_grace is not None and args.heartbeat_grace < 3:
    parser.error("--heartbeat_grace must be >= 3 (a trial beats every third of it)")
  # The trials' train.py runs in ROOT: a relative directory would be read here and written there.
  args.study_dir = os.path.abspath(args.study_dir)
  if args.storage:
    try:
      sqlalchemy.engine.make_url(args.storage)
    except sqlalchemy.exc.ArgumentError:
      cli.fail(
        f"--storage={args.storage} is not a database URL; for a SQLite file write "
        f"sqlite:///{args.storage} (or leave --storage out: sqlite in --study_dir)"
      )
  start = time.time()
  try:
    space = load_space(args.space)
  except (OSError, ValueError, AttributeError, SyntaxError) as e:
    cli.fail(f"--space={args.space}: {e}")
  try:
    resolved = check_study_config(args.config, args.overrides, space)
  except ValueError as e:
    cli.fail(str(e))
  made = [d for d in (args.study_dir, os.path.join(args.study_dir, "trials")) if not os.path.exists(d)]
  try:
    os.makedirs(os.path.join(args.study_dir, "trials"), exist_ok=True)
  except OSError as e:
    what = "cannot write in it" if os.path.isdir(args.study_dir) else "cannot create it"
    cli.fail(f"--study_dir={args.study_dir}: {what} ({e.strerror}); choose another directory")
  # Errors only: run_trial reports a failed trial in one line (its log holds the rest), not with a traceback.
  optuna.logging.set_verbosity(optuna.logging.ERROR)
  logging.getLogger("optuna").setLevel(logging.ERROR)
  warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the heartbeat's, in Optuna 5
  url = args.storage or f"sqlite:///{os.path.abspath(os.path.join(args.study_dir, 'study.db'))}"
  try:
    storage = open_storage(url, requested_grace(args))
  except (sqlalchemy.exc.SQLAlchemyError, ImportError) as e:  # no driver for the URL, a database it cannot open
    for folder in reversed(made):  # a refused start leaves nothing behind
      with contextlib.suppress(OSError):
        os.rmdir(folder)
    reason = str(e).splitlines()[0][:300]
    cli.fail(f"--storage={url}: cannot open the study's database ({type(e).__name__}: {reason})")
  claim_study_dir(args)  # once its storage opens: a start that fails before leaves the directory to any study
  pruner = optuna.pruners.MedianPruner(n_startup_trials=args.startup_trials, n_warmup_steps=args.pruner_warmup_epochs)
  study = optuna.create_study(
    study_name=args.study_name, storage=storage, direction="maximize", load_if_exists=True, pruner=pruner
  )
  try:
    grace = study_grace(study, args)
  except ValueError as e:
    cli.fail(str(e))
  if grace != requested_grace(args):  # the study's: its trials beat every third of it
    storage = open_storage(url, grace)
    study = optuna.load_study(study_name=args.study_name, storage=storage, pruner=pruner)
  args.heartbeat_grace = grace
  try:
    check_resume(study, args, space)
  except ValueError as e:
    cli.fail(str(e))
  finished = sum(t.state in FINISHED for t in study.get_trials(deepcopy=False))
  if finished < args.trials:  # else no trial runs here, e.g. to print the results of a study running elsewhere
    wait_for_killed_trials(study, storage)
    finished = sum(t.state in FINISHED for t in study.get_trials(deepcopy=False))
  print(f"study {args.study_name} in {args.study_dir}: {finished} of {args.trials} trials finished", flush=True)
  started = []  # this process's trials: the last is the one a Ctrl-C stops
  taken_over = set()  # of those, the ones another process failed as killed (and retries)

  def objective(trial: optuna.Trial) -> float:
    started.append(trial.number)
    # Seeded per trial: trial numbers are unique across the processes sharing the study, so no two draw the same
    # values, and a continued study samples new ones. TPE keeps nothing between trials (it reads them from the
    # storage), so a new sampler per trial samples as one would; set before the first suggest.
    trial.study.sampler = optuna.samplers.TPESampler(
      n_startup_trials=args.startup_trials, seed=args.seed + trial.number
    )
    value = run_trial(trial, args, space)
    check_not_taken_over(trial)  # Optuna asserts on it
    return value

  while needs_a_trial(study, storage, args.trials):
    try:  # optuna records a failed trial and goes on (TrialFailed), or records it and raises (TrialRejected)
      study.optimize(objective, n_trials=1, catch=(TrialFailed,))
    except TrialRejected as e:  # every trial would be: stop the study
      cli.fail(str(e))
    except (KeyboardInterrupt, TrialInterrupted):
      resume_later(study, started)
    except ValueError as e:  # Optuna's "Cannot tell a FAIL trial.": another process failed it (TrialTakenOver)
      if not str(e).startswith("Cannot tell a"):
        raise
      taken_over.add(started[-1])
      print(
        f"  trial {started[-1]} was failed by another process sharing the study (its heartbeat was over {grace} s "
        "old, or missing): that process retries it; this one goes on",
        file=sys.stderr,
        flush=True,
      )
    # This run's own: not other machines' killed trials that optimize failed, nor its trials taken over.
    mine = set(started) - taken_over
    failures = sum(t.number in mine for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
    if failures > max(3, args.trials // 4):
      sys.exit(f"error: {failures} trials failed in this run; see the logs in {args.study_dir}/trials")

  print_table(study)
  states = [t.state for t in study.trials]
  best = study.best_trial
  best_config = os.path.join(args.study_dir, "best_config.py")
  write_best_config(best_config, args, study, resolved)
  plots = save_plots(study, args.study_dir)
  print(f"best: trial {best.number}, test top-1 {100 * best.value:.2f}%; wrote {best_config} and {len(plots)} plots")
  result = {
    "trials": sum(s in FINISHED for s in states),
    "completed": states.count(TrialState.COMPLETE),
    "pruned": states.count(TrialState.PRUNED),
    "failed": states.count(TrialState.FAIL),
    "best": {"number": best.number, "value": best.value, "params": best.params},
    "best_config": best_config,
    "seconds": round(time.time() - start, 1),
  }
  print(json.dumps(result))


if __name__ == "__main__":
  try:
    main()
  except KeyboardInterrupt:  # outside a trial (a trial's own Ctrl-C: resume_later): set-up, the table, the plots
    print("stopped by Ctrl-C; the study's finished trials are stored: the same command goes on", file=sys.stderr)
    sys.exit(130)  # 128 + SIGINT, as a shell reports it
