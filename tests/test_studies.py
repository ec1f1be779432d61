"""The studies' rows (benchmarks/large_batch.py, benchmarks/compression_accuracy.py) are valid train.py
command lines: each resolves, through train.py's own flag parser, to a config that passes validation on
the 8 devices the studies use. No training: a typo in a row would otherwise surface an hour into a study."""

import importlib
import os
import sys

import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from light_jax import config as config_lib
from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
STUDIES = ("large_batch", "compression_accuracy")


def _resolve(config: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """The config ``train.py --config=CONFIG OVERRIDES`` runs."""
  argv = ["train.py", f"--config={config}", *overrides]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=flag_values, lock_config=True, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


@pytest.mark.parametrize(
  "study,label", [(study, label) for study in STUDIES for label in importlib.import_module(study).RUNS]
)
def test_every_study_row_is_a_valid_config(study, label, monkeypatch):
  monkeypatch.chdir(ROOT)  # the rows name their config files relative to the repository, as train.py runs them
  config, overrides, _ = importlib.import_module(study).RUNS[label]
  assert config_lib.validate(_resolve(config, overrides), num_devices=8) == (2, 4)


@pytest.mark.parametrize(
  "variant,label",
  [
    ("large_batch", "sgd_4096_w3"),
    ("large_batch_hitopk", "sgd_4096_w3_hitopk_dgc_per_tensor_clip"),
    ("large_batch_lars", "lars_tuned_lr1"),
  ],
)
def test_the_large_batch_variants_are_the_rows_that_measured_them(variant, label, monkeypatch):
  """README reports these rows' runs as the variants' own: each pair must stay the same config."""
  monkeypatch.chdir(ROOT)
  config, overrides, _ = importlib.import_module("large_batch").RUNS[label]
  assert _resolve(config, overrides).to_dict() == _resolve(f"configs/fashion_mnist.py:{variant}", []).to_dict()


def test_mean_bytes_per_step_weights_each_evaluation_by_its_steps():
  """A density warm-up sends more in its first epochs: the report's mean covers them, step-weighted."""
  train_runs = importlib.import_module("train_runs")
  records = [{"step": 10, "b": 1000}, {"step": 20, "b": 100}, {"step": 40, "b": 10}]
  assert train_runs.mean_per_step(records, "b") == (10 * 1000 + 10 * 100 + 20 * 10) / 40
  assert train_runs.mean_per_step([], "b") == 0
