"""Config validation: one clear error per mistake, raised before anything heavy starts."""

import os
import subprocess
import sys

import pytest

from configs import fashion_mnist, imagenet_resnet50
from light_jax import cli
from light_jax import config as config_lib
from tests.helpers import ROOT, override, tmpfs, train_py


def _config(**overrides):
  return override(fashion_mnist.get_config(), **overrides)


def test_default_configs_validate():
  assert config_lib.validate(fashion_mnist.get_config(), 8) == (2, 4)
  assert config_lib.validate(fashion_mnist.get_config("lars"), 8) == (2, 4)
  assert config_lib.validate(fashion_mnist.get_config("hitopk"), 8) == (2, 4)
  assert config_lib.validate(imagenet_resnet50.get_config(), 128, num_processes=16) == (16, 8)


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"comm__strategy": "ring"},
      r"comm.strategy='ring' is unknown; use one of \['dense', 'hierarchical', 'hitopk', 'topk', 'gtopk', "
      r"'powersgd', 'diloco', 'auto'\]",
    ),
    ({"comm__topk_selector": "sort"}, r"comm.topk_selector='sort' is unknown; use one of \['exact', 'mstopk'\]"),
    ({"train__profile_steps": "5"}, r"train.profile_steps='5' is not 'A:B' with 1 <= A < B"),
    ({"train__profile_steps": "9:3"}, r"train.profile_steps='9:3' is not 'A:B'"),
    ({"train__profile_steps": "0:3"}, r"train.profile_steps='0:3' is not 'A:B' with 1 <= A < B"),  # was a no-op
    ({"train__inject_hang_at_step": 0}, r"train.inject_hang_at_step=0 must be -1 \(off\) or an integer >= 1"),
    ({"train__inject_nan_at_step": -3}, r"train.inject_nan_at_step=-3 must be -1 \(off\) or an integer >= 0"),
    ({"train__inject_hang_at_step": 3}, r"train.inject_hang_at_step is a drill for multi-process runs"),
    ({"train__inject_hang_at_step": True}, r"train.inject_hang_at_step=True must be -1 \(off\) or an integer >= 1"),
    ({"comm__fusion": "bucketed"}, r"comm.fusion='bucketed' is unknown; use one of \['none', 'fixed', 'adaptive'\]"),
    (
      {"comm__fusion": "adaptive", "comm__cost_model": "/nope.json"},
      r"comm.cost_model='/nope.json' is neither a preset",
    ),
    ({"comm__density": 0.0}, r"comm.density=0.0 must be in \(0, 1\]"),
    ({"comm__final_density_epochs": 2.0}, r"comm.strategy='hierarchical' selects no entries"),
    ({"comm__density_warmup_epochs": 1.0}, r"density_warmup_epochs .* comm.strategy='hierarchical' selects no entries"),
    (
      {"comm__strategy": "powersgd", "comm__density_warmup_epochs": 1.0},
      r"density_warmup_epochs .* comm.strategy='powersgd' selects no entries",
    ),
    (
      {"comm__strategy": "hitopk", "comm__final_density_epochs": 2.0, "comm__final_density": 0.0},
      r"comm.final_density=0.0 must be in \(0, 1\]",
    ),
    (
      {"comm__strategy": "hitopk", "comm__final_density_epochs": 6.0, "comm__density_warmup_epochs": 3.0},
      r"overlap in a run of num_epochs=8: the final phase would cut the warm-up short",
    ),
    ({"optimizer__lars_trust": "mlperf"}, r"optimizer.lars_trust='mlperf' chooses LARS's trust ratio; optimizer.name="),
    (
      {"optimizer__name": "lamb", "optimizer__lars_trust": "mlperf"},
      r"optimizer.name='lamb' has none \(LAMB's is its own\)",
    ),
    ({"num_epochs": 10**9}, r"num_epochs=1000000000 is over 1,000,000; give the epochs the run should train"),
    ({"comm__dtype": "float16"}, r"comm.dtype='float16' is unknown; use one of \['float32', 'bfloat16'\]"),
    ({"optimizer__name": "adam"}, r"optimizer.name='adam' is unknown; use one of \['sgd', 'lars', 'lamb'\]"),
    ({"optimizer__decay": "step"}, r"optimizer.decay='step' is unknown"),
    ({"model__name": "vgg16"}, r"model.name='vgg16' is unknown"),
    ({"model__dtype": "float8"}, r"model.dtype='float8' is unknown"),
    (
      {"model__dtype": "float16", "train__on_nonfinite": "stop"},
      r"dynamic loss scaling skips the steps whose gradient overflows, by design",
    ),
    ({"optimizer__lars_trust": "you"}, r"optimizer.lars_trust='you' is unknown; use one of \['optax', 'mlperf'\]"),
    (
      {"optimizer__momentum_schedule": "cycle", "optimizer__min_momentum": 0.95},
      r"optimizer.min_momentum=0.95 must be in \[0, optimizer.momentum=0.9\]",
    ),
    ({"comm__momentum_correction": True}, r"comm.strategy='hierarchical' is not a top-k strategy"),
    ({"comm__local_clip_norm": 1.0}, r"comm.strategy='hierarchical' does not compress"),
    ({"comm__residual_units": "update"}, r"comm.strategy='hierarchical' with comm.error_feedback=True keeps none"),
    ({"comm__strategy": "hitopk", "comm__momentum_masking": False}, r"comm.momentum_correction is off"),
    (
      {
        "comm__strategy": "hitopk",
        "comm__momentum_correction": True,
        "optimizer__name": "lars",
        "comm__decay_in_velocity": False,
      },
      r"optimizer.name=sgd and optimizer.sharded_update=False \(got True, 'lars', False\)",
    ),
    (
      {"comm__strategy": "hitopk", "comm__momentum_correction": True, "optimizer__name": "lars"},
      r"comm.momentum_correction with optimizer.name=lars needs comm.local_trust_ratio=True: without it LARS's",
    ),
    ({"comm__residual_units": "lr"}, r"comm.residual_units='lr' is unknown; use one of \['gradient', 'update'\]"),
    ({"comm__feedback": "ef22"}, r"comm.feedback='ef22' is unknown; use one of \['residual', 'ef21'\]"),
    (
      {"comm__feedback": "ef21", "comm__strategy": "gtopk"},
      r"change comm.strategy='gtopk' \(needs hitopk or topk\); comm.momentum_correction=False \(needs True",
    ),
    (
      {
        "comm__feedback": "ef21",
        "comm__strategy": "topk",
        "comm__momentum_correction": True,
        "optimizer__momentum": 0.0,
      },
      r"optimizer.momentum=0.0 \(needs > 0: the step's momentum\); comm.momentum_masking=True",
    ),
    (
      {"comm__feedback": "ef21", "comm__strategy": "hitopk", "comm__momentum_correction": True},
      r"change comm.momentum_masking=True \(needs False: nothing is owed\), or set comm.feedback=residual",
    ),
    ({"comm__k_allocation": "sqrt"}, r"comm.strategy='hierarchical' compresses nothing"),
    (
      {"comm__strategy": "auto", "comm__local_clip_norm": 1.0},
      r"comm.strategy='auto' chooses per bucket whether to compress, untried with it\. Use a top-k strategy",
    ),
    ({"comm__compact_pairs": True}, r"comm.strategy='hierarchical' sends none it can narrow"),
    ({"comm__strategy": "auto", "comm__k_allocation": "sqrt"}, r"costs computed with the proportional k"),
    ({"comm__k_allocation": "log"}, r"comm.k_allocation='log' is unknown"),
    ({"comm__local_trust_ratio": True}, r"optimizer.name='sgd' has none. Set optimizer.name=lars"),
    ({"optimizer__weight_decay": 1.5}, r"optimizer.weight_decay=1.5 must be below 1"),
    ({"data__cache_budget_gb": float("nan")}, r"data.cache_budget_gb=nan must be >= 0 and finite"),
    ({"data__cache": "memroy"}, r"data.cache='memroy' is unknown"),  # on Fashion-MNIST too: it was no cache
    ({"model__loss_scale_period": 2**31}, r"model.loss_scale_period=2147483648 must be below 2\*\*31"),
    ({"global_batch_size": 4}, r"global_batch_size=4 does not divide over 8 devices; use a multiple of 8 \(e.g. 8\)\."),
    (
      {
        "comm__local_trust_ratio": True,
        "optimizer__name": "lars",
        "comm__strategy": "hitopk",
        "comm__local_clip_norm": 2.0,
      },
      r"comm.local_trust_ratio makes LARS's scaled update: a gradient's threshold there would cut every layer's",
    ),
    (
      {"comm__local_trust_ratio": True, "optimizer__name": "lars", "comm__strategy": "diloco"},
      r"comm.strategy=diloco applies the optimizer its own way",
    ),
    (
      {"comm__strategy": "hitopk", "comm__momentum_correction": True, "comm__error_feedback": False},
      r"set comm.error_feedback=True",
    ),
    (
      {"comm__strategy": "dense", "optimizer__sharded_update": True},
      r"it needs comm.strategy in \('hierarchical', 'hitopk'\), not 'dense'\.$",  # not a word on the fusion
    ),
    (
      {"comm__fusion": "adaptive", "optimizer__sharded_update": True},
      r"it needs comm.fusion 'fixed' or 'none' with comm.strategy='hierarchical', not 'adaptive'",
    ),
    (
      {"optimizer__name": "lars", "optimizer__fused_norms": True, "optimizer__sharded_update": True},
      r"optimizer.sharded_update computes them from each device's shards its own way",
    ),
    ({"micro_batches": 3}, r"global_batch_size=256 gives 32 examples per device, which do not split into"),
    ({"micro_batches": 0}, r"micro_batches=0 must be an integer >= 1"),
    ({"data__dataset": "cifar10"}, r"data.dataset='cifar10' is unknown"),
    ({"mesh__nodes": 4}, r"mesh 4 x 4 = 16 devices, but 8 are available.* mesh.cpu_devices=8 sets how many"),
    ({"mesh__local": 3, "mesh__nodes": -1}, r"mesh.local=3 does not divide the 8 devices"),
    (
      {"global_batch_size": 100},
      r"global_batch_size=100 does not divide over 8 devices; use a multiple of 8 \(e.g. 96 or 104\)",
    ),
    ({"data__eval_batch_size": 4}, r"data.eval_batch_size=4 does not divide over 8 devices"),
    ({"global_batch_size": 0}, r"global_batch_size=0 must be > 0"),
    ({"max_steps": -1}, r"max_steps=-1 must be >= 0"),
    ({"optimizer__base_lr": float("nan")}, r"optimizer.base_lr=nan must be > 0 and finite\."),
    ({"optimizer__weight_decay": float("inf")}, r"optimizer.weight_decay=inf must be >= 0 and finite\."),
    ({"optimizer__label_smoothing": 1.0}, r"label_smoothing=1.0 must be in \[0, 1\)"),
    ({"optimizer__momentum": 1.5}, r"optimizer.momentum=1.5 must be in \[0, 1\)"),
    ({"optimizer__lars_eta": -0.001}, r"optimizer.lars_eta=-0.001 must be > 0"),
    ({"optimizer__end_lr_factor": -1.0}, r"optimizer.end_lr_factor=-1.0 must be in \[0, 1\] \(the final lr"),
    ({"model__width": -4}, r"model.width=-4 must be >= 0"),
    ({"model__width": 100_000}, r"model.width=100000: at most 1024 channels"),  # 3e12 parameters: a hang
    # Another strategy's, dataset's or schedule's field out of range: accepted and ignored without a word, before.
    ({"comm__rank": 0}, r"comm.rank=0 must be > 0"),
    ({"comm__sync_every": 0}, r"comm.sync_every=0 must be > 0"),
    ({"comm__outer_lr": float("nan")}, r"comm.outer_lr=nan must be > 0 and finite"),
    ({"comm__outer_momentum": 5.0}, r"comm.outer_momentum=5.0 must be in \[0, 1\)"),
    ({"comm__device_tflops": float("nan")}, r"comm.device_tflops=nan must be > 0 and finite"),
    ({"comm__final_density": 5.0}, r"comm.final_density=5.0 must be in \(0, 1\]"),
    ({"optimizer__min_momentum": 5.0}, r"optimizer.min_momentum=5.0 must be in \[0, 1\)"),
    ({"data__random_scale_min": 5.0}, r"data.random_scale_min=5.0 must be in \(0, 1\]"),
    ({"data__image_size": -3}, r"data.image_size=-3 must be >= 0"),
    ({"data__cache_size": -1}, r"data.cache_size=-1 must be > 0"),
    ({"data__crop_padding": -1}, r"data.crop_padding=-1 must be >= 0"),
    ({"data__train_subset": -100}, r"data.train_subset=-100 must be >= 0"),
    ({"seed": -1}, r"seed=-1 must be an integer in \[0, 2\*\*32\)"),
  ],
)
def test_bad_config_gets_one_clear_error(overrides, message):
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(_config(**overrides), 8)


def test_auto_takes_compact_pairs_for_its_hitopk_and_topk_buckets():
  assert config_lib.validate(_config(comm__strategy="auto", comm__compact_pairs=True), 8) == (2, 4)


def test_strategy_labels_name_their_comm_fields():
  assert config_lib.strategy_fields("hitopk@0.001") == {"strategy": "hitopk", "density": 0.001}
  assert config_lib.strategy_fields("powersgd@4") == {"strategy": "powersgd", "rank": 4}
  assert config_lib.strategy_fields("hitopk@0.01/bfloat16/compact") == {
    "strategy": "hitopk",
    "density": 0.01,
    "dtype": "bfloat16",
    "compact_pairs": True,
  }
  with pytest.raises(config_lib.ConfigError, match=r"/fp8 is neither a wire dtype \(float32, bfloat16\) nor /compact"):
    config_lib.strategy_fields("hitopk@0.01/fp8")
  with pytest.raises(config_lib.ConfigError, match=r"strategy 'hitopk@2': comm.density=2.0 must be in \(0, 1\]"):
    config_lib.strategy_fields("hitopk@2")
  # "hitopk@" ran at the config's density, "dense@0.5" as dense: the label a table showed said otherwise.
  with pytest.raises(config_lib.ConfigError, match=r"'hitopk@': nothing after @; give a value \(hitopk@0.01\)"):
    config_lib.strategy_fields("hitopk@")
  with pytest.raises(config_lib.ConfigError, match=r"'dense@0.5': dense takes no @VALUE"):
    config_lib.strategy_fields("dense@0.5")
  with pytest.raises(config_lib.ConfigError, match=r"strategy 'diloco@0': comm.sync_every=0 must be > 0"):
    config_lib.strategy_fields("diloco@0")


def test_gtopk_needs_a_power_of_two_device_count():
  config = _config(comm__strategy="gtopk", mesh__nodes=2, mesh__local=3)
  with pytest.raises(config_lib.ConfigError, match=r"needs a power-of-two device count, not 2 x 3 = 6; .* 4 devices"):
    config_lib.validate(config, 6)
  assert config_lib.validate(_config(comm__strategy="gtopk"), 8) == (2, 4)


def test_cli_reports_a_bad_config_without_traceback(tmp_path):
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path), "--config.mesh.nodes=3")
  assert result.returncode == 2
  assert result.stderr.count("mesh 3 x 4 = 12 devices, but 8 are available") == 1  # one line, not a log line too
  assert "error: invalid config: mesh 3 x 4 = 12 devices, but 8 are available" in result.stderr
  assert "Traceback" not in result.stderr
  assert not os.listdir(tmp_path)  # nothing written before validation


def test_train_py_refuses_what_only_the_data_or_the_process_count_says_is_too_large(tmp_path):
  """A crop padding of a billion was a traceback once training had begun (100 on 28 px trained on crops mostly of
  padding); 1,024 simulated devices in one process stalled in the first steps' collectives."""
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "a"),
                    "--config.data.crop_padding=28", "--config.data.train_subset=512")  # fmt: skip
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "error: invalid config: data.crop_padding=28 must be below the images' 28 px" in result.stderr
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "b"),
                    "--config.mesh.cpu_devices=1024", "--config.mesh.nodes=-1")  # fmt: skip
  assert result.returncode == 2 and "mesh.cpu_devices=1024 simulates 1024 CPU devices in each of 1" in result.stderr


FIELDS = "base_config() in light_jax/config.py lists the fields"
FLAGS = "--help lists the flags"


@pytest.mark.parametrize(
  "args,message,hint",
  [
    (
      ["--config.global_batch_siz=64"],
      '--config.global_batch_siz: no such config field; Did you mean "global_batch_size"',
      FIELDS,
    ),
    (  # ml_collections suggests nothing: the fields holding its name
      ["--config.optimizer.lr=0.1"],
      "--config.optimizer.lr: no such config field; did you mean --config.optimizer.base_lr or",
      FIELDS,
    ),
    (["--config.batch_size=64"], "no such config field; did you mean --config.global_batch_size or", FIELDS),
    (["--config.momentum=0.9"], "no such config field; did you mean --config.optimizer.momentum or", FIELDS),
    # Python's own words were "invalid literal for int() with base 10: 'abc'"
    (["--config.global_batch_size=abc"], "--config.global_batch_size=abc: global_batch_size takes an integer", FIELDS),
    (["--config.comm.density=0.5,0.1"], "--config.comm.density=0.5,0.1: comm.density takes a number (its def", FIELDS),
    # a field given as a flag: absl suggested --num_processes
    (
      ["--num_epochs=3"],
      "--num_epochs is not a flag; a config field is set with --config.FIELD=VALUE, e.g. --config.num_epochs=...",
      FIELDS,
    ),
    (["--flagfile=/nonexistent/flags"], "--flagfile: cannot open it: [Errno 2] No such file or directory", None),
    # ml_collections: "Failed to parse 'dense' as a ConfigDict: ValueError('malformed node ...')"
    (["--config.comm=dense"], "--config.comm: a group of fields, not one; set its fields one by one", FIELDS),
    # ml_collections: "string indices must be integers, not 'str'"
    (["--config.comm.strategy.x=1"], "--config.comm.strategy.x: comm.strategy is a field, not a group", FIELDS),
    # a group given as a dict is valid: the error is the other override's
    (
      ["--config.comm={'strategy': 'dense'}", "--config.optimizer.bse_lr=1"],
      "--config.optimizer.bse_lr: no such",
      FIELDS,
    ),
    # "./": not a path that tests/test_docs.py expects to exist
    (["--config=./configs/fashion_mnst.py"], "--config: cannot load the config file: [Errno 2] No such file", None),
    (
      ["--config=configs/fashion_mnist.py:nope"],
      "ValueError: unknown variant 'nope' of fashion_mnist.py; known: lars,",
      None,
    ),
    (["--nope=1"], "Unknown command line flag 'nope'", FLAGS),
    (["--peer_timeout=abc"], "flag --peer_timeout=abc: could not convert string to float", FLAGS),
    (["--config.comm.compact_pairs=maybe"], "compact_pairs=maybe: 'maybe' is not a boolean; use true or false", FIELDS),
    (["--config.mesh.cpu_devices=-2"], "invalid config: mesh.cpu_devices=-2 must be >= 0", None),
    (["--peer_timeout=0"], "--peer_timeout must be from 5 to 1000000 seconds", FLAGS),
    (["--peer_timeout=inf"], "--peer_timeout must be from 5 to 1000000 seconds", FLAGS),  # was a traceback
    (["--init_timeout=99999999999"], "--init_timeout must be from 1 to 1000000 seconds", FLAGS),
    (["--coordinator=127.0.0.1", "--num_processes=2", "--process_id=0"], "--coordinator must be host:port", FLAGS),
    # without its dashes it was dropped, and the run went on at the default
    (["config.num_epochs=1"], "unexpected argument(s) config.num_epochs=1: give flags only", None),
    (["--config=README.md"], "; a config file is Python defining get_config(variant=None)", None),  # a traceback
    (  # "no such config field": a field of every training config
      ["--config=configs/mesh_experiments.py", "--config.seed=1"],
      "--config.seed: the config file has no such field: it is not a training config",
      None,
    ),
    (  # the good override was named as the one missing, and the file as no training config
      ["--config.seed=1", "--config.seeds=2"],
      '--config.seeds: no such config field; Did you mean "seed"',
      FIELDS,
    ),
  ],
  ids=[
    "misspelled-field",
    "no-such-field",
    "a-near-name",
    "the-same-name-first",
    "wrong-type",
    "wrong-type-float",
    "field-as-flag",
    "flagfile",
    "a-group",
    "through-a-field",
    "a-group-as-a-dict",
    "missing-config-file",
    "unknown-variant",
    "unknown-flag",
    "flag-wrong-type",
    "not-a-boolean",
    "cpu-devices",
    "peer-timeout",
    "peer-timeout-inf",
    "init-timeout-huge",
    "coordinator-no-port",
    "positional",
    "not-python",
    "not-a-training-config",
    "the-override-that-fails",
  ],  # fmt: skip
)
def test_cli_bad_flags_get_one_error_line_and_exit_code_2(tmp_path, args, message, hint):
  """One line that says what is wrong, then where to look: the config's fields are not among --help's flags."""
  config = [] if any(arg.startswith("--config=") for arg in args) else ["--config", "configs/fashion_mnist.py"]
  result = train_py(*config, "--workdir", str(tmp_path / "run"), *args)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
  assert errors[0].endswith(f" ({hint})") if hint else not errors[0].endswith(("fields)", "flags)")), errors[0]
  assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")


def test_cli_a_config_path_from_another_folder_names_the_repository_s(tmp_path):
  """train.py reads --config from the current folder (scripts/tune.py falls back to the repository's)."""
  result = subprocess.run(
    [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/fashion_mnist.py:lars", f"--workdir={tmp_path}"],
    cwd=tmp_path, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
    "error: --config: cannot load the config file: [Errno 2] No such file or directory: 'configs/fashion_mnist.py' "
    f"(a path from the current folder, {tmp_path}; the repository's: {ROOT}/configs/fashion_mnist.py)"
  ), result.stderr[-2000:]


def test_cli_help_exits_0():
  """absl exits 1 after --help, which the exit codes (light_jax/exit_codes.py) read as an unexpected error."""
  result = train_py("--help")
  assert result.returncode == 0 and "--workdir" in result.stdout, result.stderr[-2000:]


TYPO_CONFIG = """
from light_jax.config import base_config


def get_config():
  c = base_config()
  c.global_batch_sizee = 64  # misspelled: the run would take the default batch
  return c
"""


@pytest.mark.parametrize(
  "config,message",
  [
    ("typo.py", 'global_batch_sizee is not a config field; did you mean "global_batch_size"?'),
    ("typo.py:large", "TypeError: get_config() takes 0 positional arguments but 1 was given; a training config file"),
    ("configs/mesh_experiments.py:strategies", "the config has no field checkpoint, checkpoint.every_steps,"),
    ("configs/search_spaces.py", "--config: the file has no get_config(); a training config file defines get_config("),
  ],
  ids=["misspelled-in-the-file", "variant-of-a-file-without-variants", "mesh-experiment", "search-space"],
)
def test_a_config_file_that_is_not_a_training_config_gets_one_error_line(tmp_path, config, message):
  (tmp_path / "typo.py").write_text(TYPO_CONFIG)
  path = str(tmp_path / config) if config.startswith("typo") else config
  result = train_py("--config", path, "--workdir", str(tmp_path / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
  assert not (tmp_path / "run").exists()


def test_a_bug_inside_a_config_file_keeps_its_traceback(tmp_path):
  (tmp_path / "bug.py").write_text(
    "from configs import fashion_mnist\n\n\ndef get_config(variant=None):\n"
    "  return fashion_mnist.get_config(variant, 'extra')\n"
  )
  result = train_py("--config", f"{tmp_path / 'bug.py'}:large_batch", "--workdir", str(tmp_path / "run"))
  assert result.returncode == 1 and "Traceback" in result.stderr and "bug.py" in result.stderr, result.stderr[-2000:]
  assert "a training config file defines" not in result.stderr  # not taken for a file without variants


def test_validate_refuses_a_field_base_config_does_not_have():
  config = config_lib.base_config()
  config.optimizer.nesterovv = False
  with pytest.raises(config_lib.ConfigError, match='optimizer.nesterovv is not a config field; did you mean "optim'):
    config_lib.validate(config, num_devices=8)


def test_throughput_benchmark_names_a_misspelled_config_field():
  """benchmarks/throughput.py's config flag applies its overrides as the script loads, before flag parsing."""
  result = subprocess.run(
    [sys.executable, "benchmarks/throughput.py", "--config.global_batch_siz=64"],
    cwd=ROOT, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.startswith('error: --config.global_batch_siz: no such config field; Did you mean "global')


def test_cli_workdir_that_is_a_file(tmp_path):
  (tmp_path / "run").write_text("not a directory")
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert f"error: --workdir={tmp_path / 'run'}: {tmp_path / 'run'} is a file, not a directory" in result.stderr
  assert (tmp_path / "run").read_text() == "not a directory"


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user, _workdir_problem refuses /proc first")
def test_cli_workdir_that_passes_the_access_test_but_cannot_be_made():
  # /proc is writable by root as far as os.access can tell, but nothing can be made in it.
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", "/proc/light_jax_nope/run")
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert (
    result.stderr.strip().splitlines()[-1].startswith("error: --workdir=/proc/light_jax_nope/run: cannot create it")
  )


def test_cli_workdir_on_a_read_only_file_system(tmp_path):
  with tmpfs(tmp_path / "read_only", "ro,size=1m") as mount:
    result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(mount / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert f"error: --workdir={mount / 'run'}: {mount} is not writable (permissions, or a read-only" in result.stderr


def test_cli_a_workdir_whose_checkpoints_cannot_be_written_is_refused_before_training(tmp_path):
  """Found only at the resumed run's first save, it failed (and hung) after training."""
  with tmpfs(tmp_path / "run" / "checkpoints", "ro,size=1m"):
    result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert f"{tmp_path / 'run' / 'checkpoints'} is not writable" in result.stderr.strip().splitlines()[-1]


def test_a_plot_or_a_cache_in_a_folder_that_cannot_be_written_is_one_line(tmp_path):
  from light_jax import data as data_lib
  from light_jax.data import records

  with tmpfs(tmp_path / "ro", "ro,size=1m") as folder:
    result = subprocess.run([sys.executable, "scripts/simulate.py", "--config", "configs/imagenet_resnet50.py:light",
                             "--sweep", "bandwidth", "--plot", str(folder / "s.png")], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    config = imagenet_resnet50.get_config("tiny").data
    config.update(cache="disk", cache_dir=str(folder / "cache"))
    with pytest.raises(data_lib.DataError, match=r"data.cache_dir=.*cannot make it .*or data.cache=none"):
      data_lib._decoded_cache(records.ListRecords([(b"x", 0, "a.jpg")]), config)
    config.update(cache_dir=str(folder))
    with pytest.raises(data_lib.DataError, match=r"data.cache_dir=.*cannot write there"):
      data_lib._decoded_cache(records.ListRecords([(b"x", 0, "a.jpg")]), config)
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert f"error: --plot={folder / 's.png'}: cannot write there" in result.stderr


@pytest.mark.parametrize("flags", [["--coordinator=localhost:1234"], ["--num_processes=2", "--process_id=2"]])
def test_cli_multi_process_flags_go_together(tmp_path, flags):
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path), *flags)
  assert result.returncode == 2 and "Traceback" not in result.stderr
  assert "--coordinator, --num_processes and --process_id go together" in result.stderr
  assert not os.listdir(tmp_path)


def test_cli_a_cluster_variable_without_a_cluster_task_says_what_to_do(tmp_path, monkeypatch):
  """SLURM_JOB_ID alone (salloc, or sbatch without srun) is not enough for jax.distributed to start."""
  monkeypatch.setenv("SLURM_JOB_ID", "1")
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "error: jax.distributed could not start" in result.stderr and "variables set: SLURM_JOB_ID" in result.stderr


def test_cli_imagenet_without_prepared_data_says_how_to_prepare_it(tmp_path):
  # 8 simulated CPU devices as 1 x 8 stand in for the 16 x 8 GPU mesh.
  result = train_py(
    "--config",
    "configs/imagenet_resnet50.py",
    "--workdir",
    str(tmp_path / "run"),
    "--config.mesh.nodes=1",
    "--config.mesh.cpu_devices=8",
    "--config.global_batch_size=64",
    "--config.data.eval_batch_size=64",
    f"--config.data.data_dir={tmp_path / 'nothing'}",
  )
  assert result.returncode == 2, result.stderr[-2000:]
  # TFDS's own error, where nothing is prepared, names the TFRecord format: misleading
  assert f"error: TFDS dataset 'imagenet2012' not found: {tmp_path / 'nothing'}/imagenet2012 does not exist" in (
    result.stderr
  )
  assert "TFRECORD" not in result.stderr
  assert "python scripts/prepare_imagenet.py --manual_dir" in result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"data__cache": "ssd"}, r"data.cache='ssd' is unknown; use one of \['none', 'disk', 'memory'\]"),
    (
      {"data__resolution_schedule": "0-128"},
      r"data.resolution_schedule='0-128' is not 'first_epoch:size\[:global_batch\],...'",
    ),
    ({"data__resolution_schedule": "3:128"}, r"the first phase must start at epoch 0"),
    (
      {"data__resolution_schedule": "0:24:64,1:32:36"},
      r"the batch 36 in data.resolution_schedule does not divide over 8 devices; use a multiple of 8 \(e.g. 32 or 40\)",
    ),
    ({"data__resolution_schedule": "0:24,0:32"}, r"two phases start at the same epoch"),
    ({"data__host_prefetch": 0}, r"data.host_prefetch=0 must be -1 \(measure at start-up\) or >= 1"),
    ({"data__num_workers": -2}, r"data.num_workers=-2 must be -1 \(measure at start-up\) or >= 0"),
    ({"data__random_scale_min": 0.0}, r"data.random_scale_min=0.0 must be in \(0, 1\]"),
    ({"data__image_size": 0}, r"data.image_size=0 must be > 0"),
    ({"data__crop_padding": 4}, r"data.crop_padding=4 pads the images of array datasets .* Set data.crop_padding=0"),
    (
      {"data__cache": "memory", "data__cache_size": 24, "data__resolution_schedule": "0:24,1:32"},
      r"data.cache_size=24 is smaller than the largest training size \(32 px\).* Set data.cache_size >= 32",
    ),
  ],
)
def test_bad_image_data_config_gets_one_clear_error(overrides, message):
  config = override(imagenet_resnet50.get_config("tiny"), **overrides)
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config, 8)
  assert config_lib.validate(imagenet_resnet50.get_config("tiny"), 8) == (2, 4)


@pytest.mark.parametrize(
  "schedule,message",
  [
    ("0:20,1", r"data.resolution_schedule='0:20,1' is not 'first_epoch:size\[:global_batch\],...'"),
    ("0:20:4096,14:28:36", r"the batch 36 in data.resolution_schedule does not divide over 8 devices"),
  ],
)
def test_a_bad_resolution_schedule_on_fashion_mnist_is_refused(schedule, message):
  """Fashion-MNIST (arrays) takes a resolution schedule too, so a wrong one is an error, not ignored."""
  config = fashion_mnist.get_config("large_batch")
  config.data.resolution_schedule = schedule
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(config, 8)
  config.data.resolution_schedule = "0:20:8192,14:28:4096"
  assert config_lib.validate(config, 8) == (2, 4)


def test_resolve_config_reads_overrides_as_train_py_does(tmp_path):
  config = cli.resolve_config("configs/fashion_mnist.py:large_batch", ["--config.train.time_steps=true"])
  assert config.train.time_steps is True and config.global_batch_size == 4096
  with pytest.raises(ValueError, match=r'^--config.optimizer.bse_lr: no such config field; Did you mean "base_lr"'):
    cli.resolve_config("configs/fashion_mnist.py", ["--config.optimizer.bse_lr=0.1"])
  buggy = tmp_path / "buggy.py"  # a bug inside a config file is not the command line's: its own error, traceback
  buggy.write_text("from configs import fashion_mnist\n\ndef get_config():\n  return fashion_mnist.get_config().nope\n")
  with pytest.raises(AttributeError, match="nope"):
    cli.resolve_config(str(buggy), [])


def test_train_py_without_its_required_flags_says_which_with_an_example():
  """absl said "flag --config=None: Flag --config must have a value other than None." for each."""
  result = train_py()
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
    "error: --config and --workdir are required: e.g. --config configs/fashion_mnist.py --workdir runs/fmnist "
    "(--help lists the flags)"
  )


def test_a_config_file_given_twice_is_refused_naming_both(tmp_path):
  """absl kept the last --config without a word, and with an override said 'the flag config.X is defined twice'."""
  other = "configs/imagenet_resnet50.py"
  for overrides in ([f"--config={other}"], ["-config", other, "--config.seed=1"]):
    with pytest.raises(
      cli.CommandLineError, match=rf"^--config is given 2 times \(configs/fashion_mnist.py, {other}\)"
    ):
      cli.resolve_config("configs/fashion_mnist.py", overrides)
  flagfile = tmp_path / "flags"
  flagfile.write_text(f"--config={other}\n")
  for overrides in ([], ["--config.seed=1"]):
    with pytest.raises(
      cli.CommandLineError, match=rf"^--config is given 2 times \(configs/fashion_mnist.py, {other}\)"
    ):
      cli.resolve_config("configs/fashion_mnist.py", [f"--flagfile={flagfile}", *overrides])
  # Not a second config file: what follows "--" (not flags), a string override's value.
  assert cli.resolve_config("configs/fashion_mnist.py", ["--config.model.name", "resnet8_fast", "--", "--config=x"])


def test_a_damaged_metrics_jsonl_is_refused_before_the_devices_start(tmp_path):
  """It was found by the metrics writer, after compiling every phase's step (minutes on a GPU)."""
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 4, "ep\n{"step": 8, "epoch": 2.0}\n')
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {tmp_path / 'run' / 'metrics.jsonl'}, line 1: not a JSON record"), last
  assert "JAX" not in result.stderr  # train.py logs the JAX version once the devices are up


def test_a_metrics_jsonl_that_cannot_be_read_is_refused_in_one_line(tmp_path):
  """Another user's (mode 600, for a run not as root) or on a failing disk: a traceback from the start-up check."""
  (tmp_path / "run").mkdir()
  os.symlink("/proc/self/mem", tmp_path / "run" / "metrics.jsonl")  # a file whose reads fail (EIO) even for root
  result = train_py("--config", "configs/fashion_mnist.py", "--workdir", str(tmp_path / "run"))
  assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert result.stderr.strip().splitlines()[-1] == (
    f"error: --workdir={tmp_path / 'run'}: cannot read {tmp_path / 'run' / 'metrics.jsonl'} (Input/output error); "
    "make it readable, or choose another directory."
  )


def test_out_of_memory_is_told_from_other_errors():
  class JaxRuntimeError(RuntimeError):  # jax.errors' name; XLA's text on a GPU
    pass

  gpu = JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25.00GiB.\nmore")
  assert cli.out_of_memory(gpu) == (
    "the device's memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 25.00GiB.)"
  )
  assert (
    cli.out_of_memory(MemoryError("Unable to allocate 22.9 GiB"))
    == "this machine's memory (Unable to allocate 22.9 GiB)"
  )
  assert cli.out_of_memory(JaxRuntimeError("RESOURCE_EXHAUSTED: Failed to allocate request for 12.00GiB")) == (
    "the device's memory (RESOURCE_EXHAUSTED: Failed to allocate request for 12.00GiB)"
  )
  assert cli.out_of_memory(JaxRuntimeError("INTERNAL: a collective failed")) is None
  assert cli.out_of_memory(JaxRuntimeError("RESOURCE_EXHAUSTED: Received message larger than max")) is None
  assert cli.out_of_memory(RuntimeError("Out of memory")) is None  # not XLA's
  with pytest.raises(SystemExit) as stopped, cli.out_of_memory_fails("a smaller --batch"):
    raise gpu
  assert stopped.value.code == 2
  with pytest.raises(ValueError), cli.out_of_memory_fails("a smaller --batch"):
    raise ValueError("not memory")
