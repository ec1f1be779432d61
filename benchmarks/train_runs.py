"""Whole `train.py` runs for the studies under benchmarks/ (large_batch.py, compression_accuracy.py).

``run`` starts one run and waits for it, resumes it from its checkpoint when it stopped before its end,
or reuses its workdir when that already holds the summary of the same command; ``read`` returns what a
run left: its figures when it finished, its per-epoch records when it was stopped before the end.
``study`` is both studies' command line: parse it, run the chosen runs, read them all; a run that fails is
named in one line and the others go on. ``prepare_workdir`` is the reuse-resume-or-start-over rule of ``run``,
also used by benchmarks/time_to_accuracy.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from light_jax import child_process, cli, metrics  # noqa: E402
from light_jax.exit_codes import ExitCode  # noqa: E402


def say_stale(label: str, changed: str) -> None:
  """That ``label``'s finished run is run again: its command's config differs from the run's now (``changed``)."""
  print(f"{label}: the command's config differs from its finished run's now ({changed}); running it again",
        file=sys.stderr, flush=True)  # fmt: skip


def run(label: str, config: str, overrides: list[str], workdir: str, rerun: bool = False, retries: int = 1) -> None:
  """``python train.py --config=CONFIG --workdir=WORKDIR OVERRIDES``, its output in WORKDIR/train.log.

  A run that stopped before its end (killed, or aborted: XLA's CPU collectives abort a process whose device
  threads wait too long) resumes from its last checkpoint, exactly, rather than starting over: when its
  workdir holds a checkpoint of the same command, and up to ``retries`` times when train.py dies (a
  signal, an unexpected error, a failed peer) after writing one; not after a deliberate stop (a bad input,
  a non-finite loss), which would stop again. ``rerun`` starts over."""
  workdir = os.path.abspath(workdir)  # train.py runs in ROOT: a relative one would be read here and written there
  command = [sys.executable, "train.py", f"--config={config}", f"--workdir={workdir}", *overrides]
  summary = os.path.join(workdir, "summary.json")
  if not rerun and os.path.exists(summary) and not _readable_summary(summary):
    # A damaged summary (a half-written file): the run's checkpoints are kept, and the same command resumes the
    # finished run, which evaluates what it restored and writes the summary again.
    print(f"{label}: {summary} is damaged; resuming the run to write it again", file=sys.stderr, flush=True)
    os.remove(summary)
  if not rerun and os.path.exists(summary):
    try:
      changed = config_changed(workdir, config, overrides)
    except cli.CommandLineError as e:  # a field renamed since, a mistake in the config file: train.py would refuse
      raise cli.CommandLineError(f"{label}: the row's command no longer gives a config: {e}") from None
    if changed:  # the same command gives another run now (a variant's values changed): its result is stale
      say_stale(label, changed)
      rerun = True
  stamp, older_stamp = _stamps(workdir, config, overrides)
  if not prepare_workdir(label, workdir, stamp, rerun, also=(older_stamp,)):
    return
  log_path = os.path.join(workdir, "train.log")
  for attempt in range(retries + 1):
    with open(log_path, "a") as log:  # a resumed run's output follows the stopped one's
      # In a session of its own (a terminal's Ctrl-C reaches the study, which passes it on: once, a save; twice,
      # at once), and sent SIGTERM (a save) if the study dies.
      process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=child_process.bound_to_this_process(signal.SIGTERM),
      )
      returncode = _wait_for(label, process)
    if returncode == 0:
      if os.path.exists(os.path.join(workdir, "summary.json")):
        return
      raise subprocess.CalledProcessError(0, command)  # stopped by a signal after a save, or in set-up
    died = returncode < 0 or returncode in (ExitCode.ERROR, ExitCode.PEER_FAILURE)
    if attempt == retries or not died or not has_checkpoint(workdir):
      raise subprocess.CalledProcessError(returncode, command)
    print(
      f"{label}: train.py exited with {returncode} (see {log_path}); resuming from its last checkpoint "
      f"(retry {attempt + 1} of {retries})",
      file=sys.stderr,
      flush=True,
    )


def _wait_for(label: str, process: subprocess.Popen) -> int:
  """``process``'s exit code. A Ctrl-C (SIGINT) is passed on to train.py, which saves after its step and exits, and
  is waited for (subprocess.run killed it 0.25 s later, mid-save); a second makes it exit at once. The
  KeyboardInterrupt is raised again after."""
  try:
    return process.wait()
  except KeyboardInterrupt:
    print(f"{label}: stopping; train.py saves a checkpoint first (a second Ctrl-C stops it without)",
          file=sys.stderr, flush=True)  # fmt: skip
    process.send_signal(signal.SIGINT)
    try:
      process.wait()
    except KeyboardInterrupt:
      process.send_signal(signal.SIGINT)
      process.wait()
    raise


def _stamps(workdir: str, config: str, overrides: list[str]) -> tuple[str, str]:
  """The stamp of the row's run in ``workdir`` (absolute), and the one it had before workdirs were absolute, relative
  to ROOT (the studies ran from there)."""
  command = ["train.py", f"--config={config}", f"--workdir={workdir}", *overrides]
  relative = [*command[:2], f"--workdir={os.path.relpath(workdir, ROOT)}", *command[3:]]
  return shlex.join(command), shlex.join(relative)


def _readable_summary(path: str) -> bool:
  try:
    with open(path) as f:
      return isinstance(json.load(f), dict)
  except (OSError, ValueError):
    return False


class UnusableWorkdir(RuntimeError):
  """A run's workdir that ``prepare_workdir`` cannot ready: a train.py still running there, a file, a path that
  cannot be made."""


def prepare_workdir(label: str, workdir: str, command: str, rerun: bool = False, also: tuple[str, ...] = ()) -> bool:
  """Readies ``workdir`` for the run of ``command`` (its text, stamped in WORKDIR/command.txt; ``also``: older
  stamps of the same run). False when the workdir already holds that run's summary.json: nothing to run. Else
  True, and a checkpoint of the same command is kept, for the run to resume from; any other workdir (or any,
  with ``rerun``) is emptied (``empty_workdir``) and stamped. Raises UnusableWorkdir where a run still going there
  holds it, where it holds files no run of a study made, where it is a file, or where it cannot be made."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise UnusableWorkdir(f"{label}: {workdir} is a file, not a run's directory; move it away, then run this again")
  same_command = stamped_command(workdir) in (command, *also)
  if not rerun and same_command and os.path.exists(os.path.join(workdir, "summary.json")):
    print(f"{label}: reusing {workdir}", file=sys.stderr)
    return False
  if not rerun and same_command and has_checkpoint(workdir):
    print(f"{label}: resuming {workdir} from its last checkpoint", file=sys.stderr, flush=True)
    return True
  empty_workdir(label, workdir)
  try:
    os.makedirs(workdir)
  except OSError as e:  # a file on the way there, say
    raise UnusableWorkdir(f"{label}: cannot make {workdir} ({e.strerror}); choose another --workdir") from None
  stamp(workdir, command)
  print(f"{label}: {command}", file=sys.stderr, flush=True)
  return True


def empty_workdir(label: str, workdir: str) -> None:
  """Removes ``workdir``, a run's folder that a study made (stamped with its command, ``prepare_workdir``) or an
  empty one. Raises UnusableWorkdir where a run still going there holds it (--rerun, or another command, while it
  trains: emptied, it broke that run), or where it holds files and no stamp: the user's own, which a mistyped
  --workdir would have deleted."""
  if not os.path.isdir(workdir):
    return
  from light_jax import checkpoint  # orbax: imported only where a workdir is to be emptied

  holder = checkpoint.workdir_holder(workdir)
  if holder:
    raise UnusableWorkdir(
      f"{label}: {workdir} is in use by a run still going ({holder}); wait for it to end or stop it, then run this "
      "again"
    )
  inside = sorted(os.listdir(workdir))
  if inside and stamped_command(workdir) is None:
    listed = ", ".join(inside[:4]) + (" ..." if inside[4:] else "")
    raise UnusableWorkdir(
      f"{label}: {workdir} holds files no run of this program made ({listed}; no command.txt), which starting the "
      "run there would delete; move them away, or give another --workdir"
    )
  for name in inside:  # the stamp last: a removal cut short (a signal) leaves a folder this program may empty again
    path = os.path.join(workdir, name)
    if name != os.path.basename(_stamp_path(workdir)):
      shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
  shutil.rmtree(workdir)


def stamp(workdir: str, command: str) -> None:
  """Writes ``command`` in ``workdir`` (made), which a later ``empty_workdir`` may then remove."""
  os.makedirs(workdir, exist_ok=True)
  with open(_stamp_path(workdir), "w") as f:
    f.write(command)


# Fields that cannot change a finished run's result: how it was watched, saved, fed and where its data was.
NO_EFFECT_ON_RESULT = (
  "checkpoint",
  "log_every_steps",
  "train.time_steps",
  "train.profile_steps",
  "mesh.cpu_devices",
  "data.read_threads",
  "data.host_prefetch",
  "data.prefetch",
  "data.num_workers",
  "data.cache",
  "data.cache_dir",
  "data.cache_budget_gb",
  "data.data_dir",
)


def config_changed(workdir: str, config: str, overrides: list[str]) -> str:
  """How the config that ``config`` and ``overrides`` give now differs from the one WORKDIR's finished run
  recorded, in a field that can change its result (checkpoint.config_changes with NO_EFFECT_ON_RESULT as the
  safe fields: a field added since, at its default, is the same run); "" when it does not."""
  import contextlib

  from light_jax import checkpoint

  with open(os.path.join(workdir, "summary.json")) as f:
    recorded = json.load(f).get("config")
  if recorded is None:
    return ""
  with contextlib.chdir(ROOT):  # the config's relative paths, as train.py reads them
    now = json.loads(json.dumps(cli.resolve_config(config, overrides).to_dict()))  # as the summary holds it
  changed, _ = checkpoint.config_changes(recorded, now, NO_EFFECT_ON_RESULT)
  return "; ".join(changed)


def failure_line(label: str, returncode: int, workdir: str) -> str:
  """The one line that names a failed run, why, and what the next try should be."""
  how = f"exited {returncode}" if returncode > 0 else f"was killed by signal {-returncode}"
  if returncode == 0:
    how = "was stopped (a signal) before its end"
  if returncode == ExitCode.BAD_INPUT:  # the same command would be refused again
    hint = "train.py refused its input: fix the config or flag its log names (an unusable checkpoint: --rerun)"
  elif returncode == ExitCode.NONFINITE_STOP:
    hint = "a non-finite loss stopped it (train.on_nonfinite=stop)"
  elif has_checkpoint(workdir):
    hint = "the same command resumes it from its last checkpoint"
  else:
    hint = "the same command starts it again"
  return f"error: {label} failed: train.py {how}; {hint}; see {os.path.join(workdir, 'train.log')}"


def has_checkpoint(workdir: str) -> bool:
  directory = os.path.join(workdir, "checkpoints")
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def elapsed(records: list[dict]) -> list[float]:
  """Training seconds at each record, from the run's start. A resumed run's clock goes on from its
  checkpoint's; in a run resumed from a checkpoint older than that (no ``train_seconds`` in its meta) the
  clock restarted at 0, so a drop marks a new process and the seconds before it are added (those between
  the last record kept and the checkpoint are lost)."""
  offset = previous = 0.0
  seconds = []
  for record in records:
    if record["train_seconds"] < previous:  # a new process: the one before ended at ``previous``
      offset += previous
    previous = record["train_seconds"]
    seconds.append(offset + previous)
  return seconds


def read_records(workdir: str) -> list[dict]:
  """A run's per-evaluation records so far; [] when it has none (no workdir, or stopped before its first)."""
  return metrics.read_metrics(workdir) if os.path.exists(os.path.join(workdir, "metrics.jsonl")) else []


def read(workdir: str) -> tuple[dict | None, list[dict]]:
  """(the run's figures, or None if it did not finish; its per-evaluation records, [] if none)."""
  records = read_records(workdir)
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    return None, records
  try:
    with open(path) as f:
      summary = json.load(f)
    figures = {
      "batch": summary["config"]["global_batch_size"],
      "epochs": summary["config"]["num_epochs"],
      "top1": summary["final_eval_top1"],
      "top5": summary["final_eval_top5"],
      "train_seconds": elapsed(records)[-1],
      "images_per_sec": summary["images_per_sec_mean"],
      "inter_node_bytes_per_step": summary["inter_node_bytes_per_step"],
      # The run's exact mean (summaries since commit 9e1ba31); for older ones, from the records: see mean_per_step.
      "inter_node_bytes_mean": summary.get("inter_node_bytes_per_step_mean")
      or mean_per_step(records, "inter_node_bytes_per_step"),
      "intra_node_bytes_per_step": summary["intra_node_bytes_per_step"],
      "nonfinite_steps": summary["nonfinite_steps"],
    }
  except (OSError, ValueError, KeyError, TypeError, IndexError) as e:  # damaged: the other runs are still reported
    raise metrics.MetricsError(
      f"{path} is not a finished run's summary ({type(e).__name__}: {e}); run it again (--rerun --only LABEL)"
    ) from None
  return figures, records


def check_workdir(parser: argparse.ArgumentParser, workdir: str) -> None:
  """The study's --workdir, which holds a folder per run, must be a folder (or not exist yet) in a place this
  process can write: else each run failed with a traceback, and the study with them."""
  problem = cli.unwritable_folder(workdir)
  if problem:
    parser.error(f"--workdir={workdir}: {problem} (each run gets a folder in it)")


def study(description: str, runs: dict[str, tuple], workdir: str, plot_help: str):
  """The command line of a study of ``runs`` (label -> (config, overrides, what it shows)): --workdir,
  --only, --rerun, --report_only, --plot. Runs the chosen ones (unless --report_only); one that fails is named
  in one line and the next still runs. Returns (args, finished runs' figures with their "records", the records
  of runs stopped before the end); ``args.failed`` lists the runs that failed, for the caller's exit status."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--workdir", default=workdir)
  parser.add_argument("--only", default="", help="comma-separated labels (default: all): " + ",".join(runs))
  parser.add_argument("--rerun", action="store_true", help="rerun runs whose workdir already has a result")
  parser.add_argument("--report_only", action="store_true")
  parser.add_argument("--plot", help=plot_help)
  args = parser.parse_args()
  labels = args.only.split(",") if args.only else list(runs)
  unknown = [label for label in labels if label not in runs]
  if unknown:
    parser.error(f"unknown runs {unknown}; known: {', '.join(runs)}")
  if args.report_only and args.rerun:  # --rerun was dropped without a word
    parser.error("--report_only runs nothing, so it cannot --rerun: give one of them")
  if args.report_only and not os.path.exists(args.workdir):  # it printed an empty table
    parser.error(f"--report_only: --workdir={args.workdir} does not exist; give the folder the study's runs are in")
  if args.plot is not None:  # its folder now, not a traceback after the runs; "" drew nothing, without a word
    args.plot = cli.plot_path(args.plot, "--plot")
  check_workdir(parser, args.workdir)
  args.failed, refused = [], set()
  # A Ctrl-C is a KeyboardInterrupt even where the study started with SIGINT ignored (a script's background job):
  # it must reach train.py through the study, in its own session.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  if not args.report_only:
    for label in labels:
      config, overrides, _ = runs[label]
      workdir = os.path.abspath(os.path.join(args.workdir, label))
      try:
        run(label, config, overrides, workdir, args.rerun)
      except KeyboardInterrupt:
        print(f"stopped by Ctrl-C during {label}: the same command resumes it", file=sys.stderr, flush=True)
        sys.exit(130)  # 128 + SIGINT, as a shell reports it
      except subprocess.CalledProcessError as e:  # its log says why; the other runs do not depend on it
        print(failure_line(label, e.returncode, workdir), file=sys.stderr, flush=True)
        args.failed.append(label)
      except (UnusableWorkdir, cli.CommandLineError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        args.failed.append(label)
        refused.add(label)
  results, stopped, absent = {}, {}, []
  for label in labels:
    if label in refused:  # its folder holds files no run of a study made, say: not this row's result
      continue
    config, overrides, _ = runs[label]
    stale = other_run(os.path.abspath(os.path.join(args.workdir, label)), config, overrides)
    if stale:  # --report_only, or a run refused above: its workdir holds another command's run
      print(f"error: {label}: left out: {stale}; run it (--only {label})", file=sys.stderr, flush=True)
      if label not in args.failed:
        args.failed.append(label)
      continue
    try:
      result, records = read(os.path.join(args.workdir, label))
    except metrics.MetricsError as e:  # a damaged metrics.jsonl: the other runs are still reported
      print(f"error: {label}: {e}", file=sys.stderr, flush=True)
      args.failed.append(label)
      continue
    if result:
      results[label] = result | {"records": records}
    elif records:  # stopped early: curves only
      stopped[label] = records
    elif args.report_only:  # a row left out of the table without a word, an empty table if all were (exit 0)
      print(f"{label}: no run in {os.path.join(args.workdir, label)} yet; run it (--only {label})", file=sys.stderr)
      absent.append(label)
  if args.report_only and absent == labels:
    parser.error(f"--report_only: --workdir={args.workdir} holds no run of {', '.join(labels)}")
  return args, results, stopped


def row_figures(label: str, runs: dict[str, tuple], workdir: str, results: dict[str, dict]) -> dict | None:
  """The figures of the row ``label`` (a reference row, say): this report's (``results``), else its finished run's
  in the study's ``workdir`` when that is the run its row names now (--only may have left it out of this report);
  None where it has not run so."""
  if label in results:
    return results[label]
  config, overrides, _ = runs[label]
  run_dir = os.path.abspath(os.path.join(workdir, label))
  if other_run(run_dir, config, overrides):
    return None
  try:
    figures, _ = read(run_dir)
  except metrics.MetricsError:
    return None
  return figures


def other_run(workdir: str, config: str, overrides: list[str]) -> str:
  """Why ``workdir``'s run is not the run of ``config`` and ``overrides`` now ("" where it is, or where there is none
  to read): another command stamped it, or its finished run recorded a config that differs where it matters."""
  stamp = stamped_command(workdir)
  if stamp is None:  # no run, or one from before the stamps: read as it is
    return ""
  if stamp not in _stamps(workdir, config, overrides):
    return f"{workdir} holds the run of another command ({stamp})"
  changed = finished_run_changed(workdir, config, overrides)
  return f"its finished run's config differs from the row's now ({changed})" if changed else ""


def finished_run_changed(workdir: str, config: str, overrides: list[str]) -> str:
  """``config_changed`` for ``workdir``'s finished run; "" where no summary is readable (none yet, or damaged:
  read() names it), or where the summary has another shape; where the row's command no longer gives a config (a
  field renamed since), that."""
  if not _readable_summary(os.path.join(workdir, "summary.json")):
    return ""
  try:
    return config_changed(workdir, config, overrides)
  except cli.CommandLineError as e:
    return f"the row's command no longer gives a config: {e}"
  except (ValueError, TypeError, AttributeError):
    return ""


def mean_per_step(records: list[dict], key: str) -> int:
  """The mean of ``key`` over the steps, each evaluation's value standing for the steps since the last one
  (the inter-node bytes of a run whose density warm-up sends more in its first epochs). A record holds its
  last step's value: where a density phase ends between two evaluations this is not the exact mean (a
  5-epoch warm-up's phases end mid-epoch: 10,799 against 12,679 bytes), which summaries now hold."""
  steps, total = 0, 0.0
  for record in records:
    total += (record["step"] - steps) * record[key]
    steps = record["step"]
  return round(total / steps) if steps else 0


def figures(results: dict[str, dict]) -> str:
  """The study's last line: one JSON object keyed by label, the figures without the records."""
  return json.dumps({label: {k: v for k, v in r.items() if k != "records"} for label, r in results.items()})


def stamped_command(workdir: str) -> str | None:
  """The command ``prepare_workdir`` stamped in ``workdir``; None where there is none (no run, or one from before
  the stamps)."""
  try:
    with open(_stamp_path(workdir)) as f:
      return f.read()
  except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: a file on the way, refused after
    return None


def _stamp_path(workdir: str) -> str:
  return os.path.join(workdir, "command.txt")
