"""scripts/tune.py: an Optuna study of real train.py runs that survives a kill and writes a usable config."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types

import optuna
import pytest
from optuna.storages import RetryHeartbeatStaleTrialCallback

from light_jax import config as config_lib
from tests.helpers import ROOT, main_refuses, workdir_held

TINY = [  # two epochs of 8 steps each: the study's mechanics, not its accuracy
  "--config.data.train_subset=1024",
  "--config.data.eval_subset=200",
  "--config.data.eval_batch_size=40",
  "--config.global_batch_size=128",
  "--config.num_epochs=2",
  "--config.micro_batches=1",  # the variant's 8 slices make each trial's program 8x larger to compile
  "--config.model.width=8",  # resnet8_fast's own is 32
]


def _tune(study_dir, trials, *flags, **popen):
  command = [
    sys.executable,
    "scripts/tune.py",
    "--config=configs/fashion_mnist.py:large_batch_lars",  # a variant unlike the default, which best_config keeps
    f"--study_dir={study_dir}",
    f"--trials={trials}",
    "--startup_trials=1",
    *flags,
    *TINY,
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
    command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
  )


def _finished(study_dir):
  if not os.path.exists(os.path.join(study_dir, "trials", "0000.log")):
    return 0  # tune.py is still creating the study: reading the database now would race with it
  try:
    study = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{study_dir}/study.db")
  except KeyError:  # not created yet
    return 0
  return sum(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in study.trials)


def test_a_killed_study_resumes_to_its_trial_count_and_writes_the_best_config(tmp_path):
  study_dir = str(tmp_path / "study")
  grace = "--heartbeat_grace=3"  # 60 s by default: the rerun waits that long to know trial 1 was killed
  first = _tune(study_dir, 2, grace, start_new_session=True)
  deadline = time.time() + 300
  running = os.path.join(study_dir, "trials", "0001.log")  # written once trial 1 runs (and beats)
  while not (_finished(study_dir) == 1 and os.path.exists(running)) and first.poll() is None:
    assert time.time() < deadline
    time.sleep(1)
  assert first.poll() is None, first.communicate()[0]
  os.killpg(first.pid, signal.SIGKILL)  # the study and its running trial, mid-way
  first.wait()
  assert _finished(study_dir) == 1

  second = _tune(study_dir, 2, grace)  # at once: trial 1's heartbeat is still fresh
  output = second.communicate(timeout=600)[0]
  assert second.returncode == 0, output
  assert "1 of 2 trials finished" in output and "trials [1] were killed with their study" in output, output
  result = json.loads(output.strip().splitlines()[-1])
  assert result["trials"] == 2 and result["completed"] + result["pruned"] == 2
  study = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{study_dir}/study.db")
  # Trial 1 was retried (trial 2, its parameters), not left running beside a newly sampled trial.
  states = [t.state.name for t in study.trials]
  assert states[:2] == [states[0], "FAIL"] and len(states) == 3, states
  assert study.trials[2].system_attrs["failed_trial"] == 1 and study.trials[2].params == study.trials[1].params
  assert result["best"]["value"] == study.best_value and 0.1 < study.best_value <= 1.0
  assert len(study.trials[0].intermediate_values) >= 1  # the pruner was fed per-epoch evaluations
  for plot in ("optimization_history", "intermediate_values", "slice"):
    assert os.path.getsize(os.path.join(study_dir, f"{plot}.png")) > 10_000

  # The best config: the base config with the overrides and the best trial's values, valid for train.py.
  spec = importlib.util.spec_from_file_location("best", result["best_config"])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  assert config.global_batch_size == 128 and config.optimizer.name == "lars"
  assert config.optimizer.base_lr == result["best"]["params"]["optimizer.base_lr"]
  assert config_lib.validate(config, 8) == (2, 4)


def _tune_fails(study_dir, *overrides):
  command = [sys.executable, "scripts/tune.py", "--config=configs/fashion_mnist.py:large_batch_lars",
             f"--study_dir={study_dir}", "--trials=2", "--startup_trials=1", *TINY, *overrides]  # fmt: skip
  result = subprocess.run(
    command, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  return errors[0]


def test_a_study_that_cannot_run_stops_before_its_first_trial(tmp_path):
  study_dir = tmp_path / "study"
  error = _tune_fails(study_dir, "--config.optimizer.bse_lr=0.5")
  assert error.startswith('error: --config.optimizer.bse_lr: no such config field; Did you mean "base_lr"')
  # The search space samples the learning rate: an override of it would be replaced in every trial.
  error = _tune_fails(study_dir, "--config.optimizer.base_lr=0.5")
  assert "overrides of fields the search space samples would be replaced in every trial: ['optimizer.base_lr']" in error
  assert not study_dir.exists()  # no study, no trial


def test_bad_study_flags_and_storage_get_one_line_before_any_trial(tmp_path, monkeypatch, capsys):
  tune = _tune_module()  # in this process: the killed study and the refused trial run tune.py itself
  flags = {  # Optuna's or numpy's tracebacks; a heartbeat every third of 2 s rounds to none
    "--seed=-1": "must be >= 0",
    "--startup_trials=-1": "must be >= 0",
    "--pruner_warmup_epochs=-5": "must be >= 0",
    "--heartbeat_grace=2": "must be >= 3",
  }
  for flag, reason in flags.items():  # argparse's own lines: "tune.py: error: ..."
    args = ["--config=configs/fashion_mnist.py", f"--study_dir={tmp_path}/s", "--trials=1", flag]
    assert f"error: --{flag[2:].split('=')[0]} {reason}" in main_refuses(monkeypatch, capsys, "scripts/tune.py", *args)
  error = _main_fails(tune, monkeypatch, capsys, f"--study_dir={tmp_path}/study", "--trials=2", "--storage=foo://bar")
  assert error.startswith("error: --storage=foo://bar: cannot open the study's database (NoSuchModuleError")
  assert not (tmp_path / "study").exists()  # a refused start leaves nothing behind (it left study/trials/)
  # A database that cannot be made: test_a_failed_start_does_not_claim_the_study_dir.


def test_a_trial_that_train_py_refuses_stops_the_study_with_its_error(tmp_path):
  error = _tune_fails(tmp_path / "study", "--config.optimizer.decay=cosin")
  assert error.startswith("error: trial 0: train.py rejected it: invalid config: optimizer.decay='cosin'")
  study = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{tmp_path}/study/study.db")
  assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL]  # one trial, not one per --trials


def test_a_bad_storage_or_search_space_stops_the_study_before_it_exists(tmp_path):
  study_dir = tmp_path / "study"
  error = _tune_fails(study_dir, "--storage=runs/x.db")
  assert error.startswith("error: --storage=runs/x.db is not a database URL") and "sqlite:///runs/x.db" in error
  space = tmp_path / "space.py"
  for field, expected in [
    ('("uniform", 0.1, 1.0)', "unknown kind 'uniform'; use log, float, int or choice"),
    ('("log", 0.0, 1.0)', "('log', 0.0, 1.0) is not (kind, low, high)"),
    ('("choice", "cosine", "poly")', 'is not ("choice", [a, b, ...])'),
  ]:
    space.write_text(f"def get_space(variant=None):\n  return {{'optimizer.decay': {field}}}\n")
    error = _tune_fails(study_dir, f"--space={space}")
    assert error.startswith(f"error: --space={space}: search space field optimizer.decay: ") and expected in error
  assert not study_dir.exists()


def _tune_module():
  """scripts/tune.py, loaded afresh, for a study in this process. Its studies draw no plots (Optuna's three take
  1-2 s a study): the killed study above, of real train.py runs, draws them and checks them."""
  spec = importlib.util.spec_from_file_location("tune", os.path.join(ROOT, "scripts", "tune.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.save_plots = lambda study, study_dir: []
  return module


def _clock(tune, monkeypatch, sleep):
  """tune.py's clock, its own only: ``sleep(seconds)`` instead of waiting, time moved on by what it slept."""
  now = [time.time()]

  def slept(seconds):
    sleep(seconds)
    now[0] += seconds

  monkeypatch.setattr(tune, "time", types.SimpleNamespace(time=lambda: now[0], sleep=slept))


def test_the_trials_log_and_table_show_string_choices(capsys):
  tune = _tune_module()
  space = {"optimizer.decay": ("choice", ["cosine", "poly"]), "optimizer.base_lr": ("log", 0.02, 2.0)}
  tune.check_space(space)
  study = optuna.create_study(direction="maximize")
  study.optimize(lambda trial: len(str(tune.suggest(trial, space))) / 100, n_trials=2)
  tune.print_table(study)
  table = capsys.readouterr().out
  assert "decay" in table and any(decay in table for decay in ("cosine", "poly"))
  assert [tune._format(v) for v in (0.123456, 3, "poly", None, True)] == ["0.1235", "3", "poly", "None", "True"]


def test_a_study_stopped_by_ctrl_c_retries_its_trial_from_its_workdir(tmp_path, monkeypatch, capsys):
  """Optuna marks a trial that KeyboardInterrupt stops failed (no heartbeat retry then): the study queues its
  retry itself, so the next run resumes the trial's checkpoint with the same parameters. No training here."""
  tune = _tune_module()
  seen, histories = [], []

  def fake_trial(trial, args, space, interrupt=True):
    params = tune.suggest(trial, space)
    retried = RetryHeartbeatStaleTrialCallback.retried_trial_number(trial.study.get_trials()[trial.number])
    seen.append((params, retried, args.study_dir))
    histories.append(trial.study.get_trials()[trial.number].system_attrs.get("retry_history", []))
    if interrupt:
      raise KeyboardInterrupt
    return 0.5

  monkeypatch.chdir(tmp_path)  # a relative --study_dir, from outside the repository
  argv = ["tune.py", "--config=configs/fashion_mnist.py:large_batch_lars", "--study_dir=study", "--trials=1"]
  monkeypatch.setattr(sys, "argv", argv)
  monkeypatch.setattr(tune, "run_trial", fake_trial)
  for _ in range(2):  # interrupted, then its retry interrupted too
    with pytest.raises(SystemExit) as stopped:
      tune.main()
    assert stopped.value.code == 130
    assert "interrupted: trial" in capsys.readouterr().err
  monkeypatch.setattr(tune, "run_trial", lambda *a: fake_trial(*a, interrupt=False))
  tune.main()
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 1
  assert [retried for _, retried, _ in seen] == [None, 0, 0]  # trial 0's workdir, each time
  assert all(params == seen[0][0] for params, _, _ in seen)
  assert all(study_dir == str(tmp_path / "study") for _, _, study_dir in seen)
  assert histories == [[], [], []]  # an interruption spends no retry: a kill later is still retried once


def test_a_search_space_field_with_bad_bounds_or_choices_names_the_field():
  tune = _tune_module()
  for field, expected in [
    (("choice", "sgd"), "the choices are not a non-empty list"),  # a string would be sampled letter by letter
    (("choice", []), "the choices are not a non-empty list"),
    (("int", 0.5, 3.7), "the bounds of an int field are not integers"),
    (("int", 3, 1), "`low <= high` must hold"),
    (("float", 2.0, 1.0), "`low <= high` must hold"),
    (("log", 0.0, 1.0), "is not (kind, low, high)"),
    (("float", "0.1", 1.0), "the bounds are not finite numbers"),
  ]:
    with pytest.raises(ValueError, match="search space field optimizer.decay: ") as e:
      tune.check_space({"optimizer.decay": field})
    assert expected in str(e.value), (field, str(e.value))
  tune.check_space({"a": ("choice", ("sgd",)), "b": ("int", 1, 1), "c": ("float", 0, 1)})


def _main_fails(tune, monkeypatch, capsys, *argv):
  """tune.main() in this process: exit code 2 and one error line, before any trial runs."""
  monkeypatch.setattr(sys, "argv", ["tune.py", "--config=configs/fashion_mnist.py:large_batch_lars", *argv])
  with pytest.raises(SystemExit) as stopped:
    tune.main()
  err = capsys.readouterr().err
  assert stopped.value.code == 2, err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in err, err
  return errors[0]


def test_a_get_space_without_the_variant_argument_is_one_error_line(tmp_path, monkeypatch, capsys):
  tune = _tune_module()
  space = tmp_path / "space.py"
  space.write_text("def get_space():\n  return {'optimizer.momentum': ('float', 0.8, 0.95)}\n")
  error = _main_fails(tune, monkeypatch, capsys, f"--study_dir={tmp_path}/study", "--trials=1", f"--space={space}")
  assert error.startswith(f"error: --space={space}: get_space() cannot take the variant") and "variant=None" in error
  space.write_text("def get_space(variant=None):\n  return [('optimizer.momentum', ('float', 0.8, 0.95))]\n")
  error = _main_fails(tune, monkeypatch, capsys, f"--study_dir={tmp_path}/study", "--trials=1", f"--space={space}")
  assert "get_space returned a list, not a dict" in error
  space.write_text("def get_space(variant=None):\n  return {}\n")  # every trial would train the same config
  error = _main_fails(tune, monkeypatch, capsys, f"--study_dir={tmp_path}/study", "--trials=1", f"--space={space}")
  assert error.endswith("get_space returned no field: the study would sample nothing; give it a field to search")
  assert not (tmp_path / "study").exists()


def _run_fake_study(tune, monkeypatch, capsys, *argv):
  """A study of trials that train nothing (each scores 0.5), to set up one a later run resumes."""
  monkeypatch.setattr(tune, "run_trial", lambda trial, args, space: tune.suggest(trial, space) and 0.5)
  monkeypatch.setattr(sys, "argv", ["tune.py", "--config=configs/fashion_mnist.py:large_batch_lars", *argv])
  tune.main()
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_resuming_with_a_changed_field_kind_is_refused_before_a_trial(tmp_path, monkeypatch, capsys):
  tune = _tune_module()
  study = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study, "--trials=1")
  space = tmp_path / "space.py"
  space.write_text("def get_space(variant=None):\n  return {'optimizer.momentum': ('choice', [0.9, 0.95])}\n")
  error = _main_fails(tune, monkeypatch, capsys, study, "--trials=2", f"--space={space}")
  assert "field optimizer.momentum is ('choice', [0.9, 0.95])" in error and "('float', 0.8, 0.95)" in error
  assert "a new --study_dir" in error
  # A changed range of the same kind is one Optuna takes.
  space.write_text("def get_space(variant=None):\n  return {'optimizer.momentum': ('float', 0.85, 0.99)}\n")
  assert _run_fake_study(tune, monkeypatch, capsys, study, "--trials=2", f"--space={space}")["completed"] == 2


def test_resuming_with_another_config_or_overrides_is_refused(tmp_path, monkeypatch, capsys):
  tune = _tune_module()
  study = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study, "--trials=1", "--config.num_epochs=3")
  error = _main_fails(tune, monkeypatch, capsys, study, "--trials=2", "--config.num_epochs=4")
  assert "overrides differ in ['num_epochs']" in error and "--config.num_epochs=3" in error
  error = _main_fails(tune, monkeypatch, capsys, study, "--trials=2")
  assert "overrides differ in ['num_epochs']" in error
  error = _main_fails(tune, monkeypatch, capsys, study, "--trials=2", "--config=configs/fashion_mnist.py:large_batch")
  assert "--config=configs/fashion_mnist.py:large_batch_lars" in error and "a new --study_dir" in error
  # The same settings, the config spelt another way, continue it.
  config = f"--config={ROOT}/configs/../configs/fashion_mnist.py:large_batch_lars"
  assert (
    _run_fake_study(tune, monkeypatch, capsys, study, "--trials=2", "--config.num_epochs=3", config)["completed"] == 2
  )


def test_a_study_from_before_the_stored_config_resumes_and_stores_it(tmp_path, monkeypatch, capsys):
  tune = _tune_module()
  study_dir = tmp_path / "study"
  os.makedirs(study_dir / "trials")
  storage = f"sqlite:///{study_dir}/study.db"
  old = optuna.create_study(study_name="light_jax", storage=storage, direction="maximize")  # no stored config
  momentum = optuna.distributions.FloatDistribution(0.8, 0.95)
  old.add_trial(
    optuna.create_trial(params={"optimizer.momentum": 0.9}, distributions={"optimizer.momentum": momentum}, value=0.5)
  )
  assert (
    _run_fake_study(tune, monkeypatch, capsys, f"--study_dir={study_dir}", "--trials=2", "--config.num_epochs=3")[
      "completed"
    ]
    == 2
  )
  attrs = optuna.load_study(study_name="light_jax", storage=storage).user_attrs
  assert attrs == {
    "config": "configs/fashion_mnist.py:large_batch_lars",
    "overrides": {"num_epochs": "3"},
    "heartbeat_grace": 60,
  }


def test_a_study_whose_trials_all_failed_takes_the_new_overrides(tmp_path, monkeypatch, capsys):
  """train.py refused the only trial's overrides: run again with them fixed, the study goes on instead of holding
  to the overrides that failed."""
  tune = _tune_module()
  study_dir = tmp_path / "study"
  os.makedirs(study_dir / "trials")
  storage = f"sqlite:///{study_dir}/study.db"
  failed = optuna.create_study(study_name="light_jax", storage=storage, direction="maximize")
  failed.set_user_attr("config", "configs/fashion_mnist.py:large_batch_lars")
  failed.set_user_attr("overrides", {"mesh.nodes": "3"})
  failed.tell(failed.ask(), state=optuna.trial.TrialState.FAIL)
  result = _run_fake_study(tune, monkeypatch, capsys, f"--study_dir={study_dir}", "--trials=1", "--config.num_epochs=3")
  assert result["completed"] == 1
  attrs = optuna.load_study(study_name="light_jax", storage=storage).user_attrs
  assert attrs["overrides"] == {"num_epochs": "3"}


def test_a_continued_study_samples_new_values_and_a_study_dir_keeps_one_study(tmp_path, monkeypatch, capsys):
  """Seeded as it began, a continued study sampled its first trials' values again; and another --study_name in the
  same --study_dir replaced the first study's trial folders, best config and plots."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=2")
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=4")
  trials = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{tmp_path}/study/study.db").trials
  first, continued = [t.params for t in trials[:2]], [t.params for t in trials[2:]]
  assert len(continued) == 2 and not any(params in first for params in continued), (first, continued)
  error = _main_fails(tune, monkeypatch, capsys, study_dir, "--trials=1", "--study_name=other")
  assert "holds study 'light_jax''s trials; --study_name=other would replace them: give it another --study_dir" in error


REJECTS_ITS_MOMENTUM = """import sys
print("error: invalid config: optimizer.min_momentum=0.85 must be in [0, optimizer.momentum=0.82].", file=sys.stderr)
sys.exit(2)
"""


def test_a_sample_train_py_refuses_fails_that_trial_not_the_study(tmp_path, monkeypatch, capsys):
  """A cycled momentum refuses a sampled momentum below its minimum: that sample's fault, not every trial's. Each
  such trial fails and the study goes on, until too many fail (as for any failure)."""
  tune = _tune_module()
  (tmp_path / "root").mkdir()
  (tmp_path / "root" / "train.py").write_text(REJECTS_ITS_MOMENTUM)
  monkeypatch.setattr(tune, "ROOT", str(tmp_path / "root"))  # train.py: the stand-in; the config: absolute
  config = f"--config={os.path.join(ROOT, 'configs', 'fashion_mnist.py')}:large_batch_lars"
  space = f"--space={os.path.join(ROOT, 'configs', 'search_spaces.py')}"
  monkeypatch.setattr(sys, "argv", ["tune.py", config, space, f"--study_dir={tmp_path}/study", "--trials=8"])
  _clock(tune, monkeypatch, lambda seconds: time.sleep(min(seconds, 0.05)))  # polls its stand-in trials sooner
  with pytest.raises(SystemExit) as stopped:
    tune.main()
  err = capsys.readouterr().err
  assert "rejected its sampled values: invalid config: optimizer.min_momentum=0.85" in err
  assert "error: 4 trials failed in this run" in str(stopped.value.code), (stopped.value.code, err[-2000:])


def test_processes_sharing_a_study_sample_distinct_trials(tmp_path, monkeypatch, capsys):
  """Two processes that open a study at the same trial count (machines started together, or restarted after a
  kill) were seeded alike and sampled the same values: here the second opens it while the first checks it."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1")
  check_resume, calls = tune.check_resume, []

  def other_process_meanwhile(study, args, space):
    check_resume(study, args, space)
    calls.append(args.trials)
    if len(calls) == 1:  # the first process has opened the study (1 trial): the other runs trial 1 to its end
      assert _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=2")["completed"] == 2
      monkeypatch.setattr(sys, "argv", ["tune.py", "--config=configs/fashion_mnist.py:large_batch_lars", study_dir,
                                        "--trials=3"])  # fmt: skip

  monkeypatch.setattr(tune, "check_resume", other_process_meanwhile)
  assert _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=3")["completed"] == 3
  trials = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{tmp_path}/study/study.db").trials
  assert len({json.dumps(t.params, sort_keys=True) for t in trials}) == 3, [t.params for t in trials]


def test_a_study_waits_for_trials_running_elsewhere_instead_of_overshooting(tmp_path, monkeypatch, capsys):
  """One trial finished and one running on another machine make --trials=2: the study waits for that one rather
  than start a third, and starts one only if it fails."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1", "--heartbeat_grace=3")
  study = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{tmp_path}/study/study.db")
  elsewhere = (
    study.ask()
  )  # running on another machine: its heartbeat is fresh here (tune.py's clock is not the storage's)
  study._storage.record_heartbeat(elsewhere._trial_id)
  # The study's wait for it (2 s) ends with it finished; the grace's waits (1 s) only move the clock on.
  _clock(tune, monkeypatch, lambda seconds: seconds == 2 and study.tell(elsewhere, 0.25))
  result = _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=2", "--heartbeat_grace=3")
  assert result["trials"] == 2 and result["completed"] == 2, result
  assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]


def test_a_trial_killed_before_its_heartbeat_began_is_retried_not_waited_for_forever(tmp_path, monkeypatch, capsys):
  """Killed between Optuna's ask and its heartbeat's first beat, a trial has no heartbeat, which Optuna never fails:
  it stayed RUNNING, and a study one trial short of --trials waited for it forever. Now, without a heartbeat after
  the grace, it is failed as killed and retried."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1", "--heartbeat_grace=3")
  study = optuna.load_study(study_name="light_jax", storage=f"sqlite:///{tmp_path}/study/study.db")
  study.ask()  # killed at once: no heartbeat, no objective
  waited = []

  def sleep(seconds):
    waited.append(seconds)
    assert sum(waited) < 60, "it waited for the killed trial forever"

  _clock(tune, monkeypatch, sleep)
  result = _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=2", "--heartbeat_grace=3")
  assert result["trials"] == 2 and result["completed"] == 2, result
  assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE"]
  assert study.trials[2].system_attrs["failed_trial"] == 1  # the retry of the killed trial
  assert sum(waited) <= 3 + 2  # the grace, and the wait's margin


def test_a_study_keeps_its_heartbeat_grace_and_a_trial_failed_from_outside_is_one_line(tmp_path, monkeypatch, capsys):
  """A machine with a shorter grace failed the live trials of the others as killed, and the process whose trial
  it was stopped with Optuna's "Cannot tell a FAIL trial" traceback."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  opened, open_storage = [], tune.open_storage
  monkeypatch.setattr(tune, "open_storage", lambda url, grace: opened.append(grace) or open_storage(url, grace))
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1", "--heartbeat_grace=6")
  error = _main_fails(tune, monkeypatch, capsys, study_dir, "--trials=2", "--heartbeat_grace=3")
  assert "was created with --heartbeat_grace=6, not 3" in error and "leave the flag out" in error
  opened.clear()
  assert _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=2")["completed"] == 2
  assert opened[-1] == 6  # the study's grace, without the flag

  def failed_from_outside(trial, args, space):
    tune.suggest(trial, space)
    if trial.number == 2:  # another process takes it for killed
      trial.study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
    return 0.5

  monkeypatch.setattr(tune, "run_trial", failed_from_outside)
  monkeypatch.setattr(
    sys, "argv", ["tune.py", "--config=configs/fashion_mnist.py:large_batch_lars", study_dir, "--trials=3"]
  )
  tune.main()
  out, err = capsys.readouterr()
  assert json.loads(out.strip().splitlines()[-1])["completed"] == 3 and "Traceback" not in err, err
  assert "trial 2 was failed by another process sharing the study" in err


def test_trials_taken_over_by_another_process_are_not_this_runs_failures(tmp_path, monkeypatch, capsys):
  """Each trial another process fails as killed goes on there: this run counted them as its own failures, and
  stopped itself ("4 trials failed in this run") while well. Its study files are written whole (a .tmp renamed)."""
  tune = _tune_module()

  def taken_over_one_to_four(trial, args, space):
    tune.suggest(trial, space)
    if 1 <= trial.number <= 4:
      trial.study._storage.set_trial_state_values(trial._trial_id, optuna.trial.TrialState.FAIL)
    return 0.5

  monkeypatch.setattr(tune, "run_trial", taken_over_one_to_four)
  argv = ["tune.py", "--config=configs/fashion_mnist.py:large_batch_lars", f"--study_dir={tmp_path}/study"]
  monkeypatch.setattr(sys, "argv", [*argv, "--trials=3"])
  tune.main()
  out, err = capsys.readouterr()
  result = json.loads(out.strip().splitlines()[-1])
  assert result["completed"] == 3 and result["failed"] == 4 and "failed in this run" not in err, err[-2000:]
  assert not [name for name in os.listdir(tmp_path / "study") if ".tmp" in name]


def test_a_search_space_field_of_the_wrong_type_or_a_group_stops_the_study_before_its_first_trial(
  tmp_path, monkeypatch, capsys
):
  """Each such trial failed at train.py's flags: four failed trials and exit 1 instead of one line."""
  tune = _tune_module()
  monkeypatch.setattr(tune, "run_trial", lambda *a: pytest.fail("a trial ran"))
  space = tmp_path / "space.py"
  for field, expected in [
    (
      "'micro_batches': ('float', 1.0, 2.0)",
      "field micro_batches: train.py refuses its value 1.0: --config.micro_batches=1.0: micro_batches takes an integer",
    ),
    ("'optimizer': ('log', 0.1, 1.0)", "field optimizer is a group of fields (base_lr, "),
    ("'optimizer.nesterov': ('choice', [True, 0.5])", "field optimizer.nesterov: train.py refuses its value 0.5"),
    ("'optimizer.decay': ('float', 0.1, 1.0)", "field optimizer.decay: train.py reads its value 0.1 as '0.1' (str)"),
  ]:
    space.write_text(f"def get_space(variant=None):\n  return {{{field}}}\n")
    error = _main_fails(tune, monkeypatch, capsys, f"--study_dir={tmp_path}/study", "--trials=1", f"--space={space}")
    assert expected in error, (field, error)
  assert not (tmp_path / "study").exists()


def test_a_failed_start_does_not_claim_the_study_dir(tmp_path, monkeypatch, capsys):
  """A start whose storage did not open named the directory after its study, which then refused any other."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  with monkeypatch.context() as patched:
    _clock(tune, patched, lambda seconds: None)  # its retries of the storage, without their waits
    error = _main_fails(tune, patched, capsys, study_dir, "--trials=1", "--storage=sqlite:////proc/light_jax_nope/x.db")
  assert "cannot open the study's database (OperationalError" in error
  assert _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1", "--study_name=other")["completed"] == 1


def test_config_and_space_files_are_read_from_the_current_directory_first(tmp_path, monkeypatch, capsys):
  """As train.py reads them: they were read from the repository only ("no such file" for one here)."""
  tune = _tune_module()
  monkeypatch.chdir(tmp_path)
  (tmp_path / "my_config.py").write_text(
    "from configs import fashion_mnist\n\n\ndef get_config(variant):\n"
    "  config = fashion_mnist.get_config(variant)\n  config.num_epochs = 5\n  return config\n"
  )
  (tmp_path / "my_space.py").write_text(
    "def get_space(variant=None):\n  return {'optimizer.momentum': ('float', 0.8, 0.9)}\n"
  )
  seen = []
  monkeypatch.setattr(tune, "run_trial", lambda trial, args, space: seen.append((args.config, space)) or 0.5)
  monkeypatch.setattr(sys, "argv", ["tune.py", "--config=my_config.py:large_batch_lars", "--space=my_space.py",
                                    "--study_dir=study", "--trials=1"])  # fmt: skip
  tune.main()
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completed"] == 1
  assert seen == [(f"{tmp_path}/my_config.py:large_batch_lars", {"optimizer.momentum": ("float", 0.8, 0.9)})]
  assert f"BASE = '{tmp_path}/my_config.py'" in (tmp_path / "study" / "best_config.py").read_text()


def test_a_study_that_holds_its_trials_prints_its_results_without_waiting(tmp_path, monkeypatch, capsys):
  """--trials 1 to see the results of a study running elsewhere waited out the heartbeat grace (60 s)."""
  tune = _tune_module()
  study_dir = f"--study_dir={tmp_path}/study"
  _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1")
  optuna.load_study(study_name="light_jax", storage=f"sqlite:///{tmp_path}/study/study.db").ask()  # elsewhere
  monkeypatch.setattr(tune.time, "sleep", lambda seconds: pytest.fail("it waited"))
  result = _run_fake_study(tune, monkeypatch, capsys, study_dir, "--trials=1")
  assert result["trials"] == 1


def test_a_retry_keeps_the_killed_trials_values_and_starts_afresh_where_the_space_gained_a_field(tmp_path):
  """A retry resumes the killed trial's run with the killed trial's values; a field added to the search space
  since was sampled anew (a removed one dropped), so the resumed run had another config, which train.py refused:
  the killed trial was lost. A field the space lost keeps its value (the trial records it, and the best config
  would hold it); one it gained makes the retry start afresh."""
  tune = _tune_module()
  study = optuna.create_study(storage=f"sqlite:///{tmp_path}/study.db")
  momentum = optuna.distributions.FloatDistribution(0.8, 0.95)
  killed = study.ask({"optimizer.momentum": momentum})
  study.tell(killed, state=optuna.trial.TrialState.FAIL)
  same = {"optimizer.momentum": ("float", 0.8, 0.95)}
  gained = {**same, "optimizer.nesterov": ("choice", [True, False])}
  smoothing = {"optimizer.label_smoothing": ("float", 0.0, 0.2)}  # momentum lost, label smoothing gained
  for space, resumes in [(same, 0), (gained, None), ({}, 0), (smoothing, None)]:
    study.add_trial(optuna.create_trial(state=optuna.trial.TrialState.WAITING, params=killed.params,
                                        distributions=killed.distributions,
                                        system_attrs={"failed_trial": 0, "retry_history": [0]}))  # fmt: skip
    retry = study.ask()
    params, retried = tune.sample(retry, space)
    assert retried == resumes and params["optimizer.momentum"] == killed.params["optimizer.momentum"]
    study.tell(retry, 0.5)


def test_a_retry_that_started_afresh_and_was_interrupted_resumes_its_own_run(tmp_path, capsys):
  """A retry that started afresh (the space gained a field) runs in its own workdir; interrupted by Ctrl-C, its own
  retry resumed the first killed trial's workdir instead: another config's checkpoint, refused, the trial lost."""
  tune = _tune_module()
  study = optuna.create_study(storage=f"sqlite:///{tmp_path}/study.db")
  momentum = optuna.distributions.FloatDistribution(0.8, 0.95)
  killed = study.ask({"optimizer.momentum": momentum})
  study.tell(killed, state=optuna.trial.TrialState.FAIL)
  study.add_trial(optuna.create_trial(state=optuna.trial.TrialState.WAITING, params=killed.params,
                                      distributions=killed.distributions,
                                      system_attrs={"failed_trial": 0, "retry_history": [0]}))  # fmt: skip
  gained = {"optimizer.momentum": ("float", 0.8, 0.95), "optimizer.nesterov": ("choice", [True, False])}
  retry = study.ask()
  assert tune.sample(retry, gained)[1] is None  # started afresh, in trials/0001
  study.tell(retry, state=optuna.trial.TrialState.FAIL)  # as Optuna records a Ctrl-C
  with pytest.raises(SystemExit):
    tune.resume_later(study, [retry.number])
  assert "interrupted: trial 1 resumes from its checkpoint" in capsys.readouterr().err
  again = study.ask()
  params, retried = tune.sample(again, gained)
  assert retried == retry.number and params == retry.params


def test_a_retry_waits_for_the_killed_run_to_let_go_of_its_workdir(tmp_path, monkeypatch, capsys):
  """The killed trial's train.py, SIGTERMed as its study died, still saved a few seconds past the heartbeat grace:
  the retry's train.py was refused the workdir "in use" (exit 2), and a retry is not retried."""
  tune = _tune_module()
  workdir = tmp_path / "trials" / "0000"
  workdir.mkdir(parents=True)
  with workdir_held(workdir) as holder:
    slept = []

    def sleep(seconds):  # the killed run ends during the third second waited
      slept.append(seconds)
      if len(slept) == 3:
        os.kill(holder, signal.SIGKILL)
        time.sleep(0.5)  # the kernel drops its lock as it exits

    _clock(tune, monkeypatch, sleep)
    tune.wait_for_the_killed_run(str(workdir), 3, 0)
  assert len(slept) == 3
  assert f"trial 3: trial 0's run still holds {workdir} (process {holder} on " in capsys.readouterr().out
