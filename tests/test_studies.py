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


def test_the_large_batch_variant_is_the_row_that_measured_it(monkeypatch):
  """README reports `lars_tuned_lr1`'s run as :large_batch's: the two must stay the same config."""
  monkeypatch.chdir(ROOT)
  config, overrides, _ = importlib.import_module("large_batch").RUNS["lars_tuned_lr1"]
  assert _resolve(config, overrides).to_dict() == _resolve("configs/fashion_mnist.py:large_batch", []).to_dict()
