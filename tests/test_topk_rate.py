"""The device's top-k selection rate in the cluster's costs: the calibration file's optional field, the presets'
assumptions, auto planned with it (in cost_model and in the trainer), and benchmarks/calibrate_links.py measuring
it."""

import json
import logging
import math
import os
import sys

import pytest

from light_jax import optim, schedules, simulation
from light_jax.compiled_steps import CompiledSteps
from light_jax.data import DatasetInfo
from light_jax.models import create_model
from light_jax.parallel import cost_model, fusion
from light_jax.parallel import mesh as mesh_lib
from light_jax.parallel import reducer as reducer_lib
from tests.helpers import ROOT, small_config

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import calibrate_links  # noqa: E402

LINKS = {"intra": {"alpha": 1e-5, "beta": 1e-10}, "inter": {"alpha": 5e-5, "beta": 1e-9}}
# Slow links (100 MB/s a device inside a node, 10 MB/s a node's link) where, on a 2 x 4 mesh, link time alone
# gives gtopk every bucket of resnet8_small (width 16, 64 KiB buckets, 1%): its 36,864-element bucket takes 1.5 ms
# by gtopk's pairs, 2.1 ms by topk's all-gather, 2.5 ms by hitopk's dense hop inside the node. gtopk selects from
# 4 x 36,864 elements (1 + log2(8)), hitopk from 9,216 (its shard): below about 1.4e8 elements/s gtopk is slower.
SLOW_LINKS = {"intra": {"alpha": 0.0, "beta": 1 / 1e8}, "inter": {"alpha": 0.0, "beta": 1 / 1e7}}
CPU_RATE = 3e7  # about the rate calibrate_links.py measured on a 2-core CPU (2.96e7 elements/s)


def _write(tmp_path, data) -> str:
  path = tmp_path / "links.json"
  path.write_text(json.dumps(data) if not isinstance(data, str) else data)
  return str(path)


def test_a_calibration_loads_with_its_rate_and_an_older_one_without_it(tmp_path):
  cost = cost_model.load(_write(tmp_path, {**LINKS, "topk_elements_per_sec": 2.5e8}))
  assert cost.topk_elements_per_sec == 2.5e8 and cost.has_topk_rate
  assert cost.inter == cost_model.LinkCost(5e-5, 1e-9)
  older = cost_model.load(_write(tmp_path, LINKS))  # a file calibrate_links.py wrote before it measured the rate
  assert older.topk_elements_per_sec == math.inf and not older.has_topk_rate and older.inter == cost.inter


@pytest.mark.parametrize("value", [0, -1e9, "fast", True, None, [1e9], "NaN", "Infinity", "1e400"])
def test_a_bad_rate_is_a_value_error_naming_the_file_and_field(tmp_path, value):
  # NaN, Infinity and 1e400 as JSON numbers (Python's json reads them as nan, inf, inf), the rest as values.
  text = json.dumps(LINKS)[:-1] + ', "topk_elements_per_sec": '
  text += value if value in ("NaN", "Infinity", "1e400") else json.dumps(value)
  path = _write(tmp_path, text + "}")
  with pytest.raises(ValueError, match=r"topk_elements_per_sec=.* must be a finite number > 0 .*leave the field out"):
    cost_model.load(path)
  with pytest.raises(ValueError, match=str(path)):
    cost_model.load(path)


def test_the_rate_round_trips_through_json_and_the_presets_carry_the_simulators():
  for cost in (*cost_model.PRESETS.values(), cost_model.ClusterCost.from_dict(LINKS)):
    assert cost_model.ClusterCost.from_dict(json.loads(cost.to_json())) == cost
  assert "topk_elements_per_sec" not in cost_model.ClusterCost.from_dict(LINKS).to_json()  # JSON has no inf
  # The presets name hardware: their rate is the assumption for that device, as the simulator's V100 takes it.
  assert cost_model.PRESETS["h100_nvlink_ib"].topk_elements_per_sec == cost_model.ASSUMED_TOPK_RATES["h100"]
  v100 = cost_model.PRESETS["v100_nvlink_25gbe"].topk_elements_per_sec
  assert v100 == simulation.DEVICES["v100"].topk_elements_per_sec == 1e9
  with pytest.raises(ValueError, match="must be a number > 0"):
    cost_model.ClusterCost.from_dict({**LINKS, "topk_elements_per_sec": 0})


def _profile():
  return fusion.profile_parameters(create_model("resnet8_small", 10, width=16), (28, 28, 1))


@pytest.mark.parametrize("overlap", [True, False])
def test_with_a_slow_rate_auto_does_not_take_gtopk_where_link_time_alone_does(overlap):
  """2 x 4 devices: planned on link time alone, auto gives gtopk every bucket; charged its 1 + log2(8) = 4
  selections of the whole bucket at a CPU's rate, it gives gtopk none, and the step the simulator models at that
  rate is shorter for it."""
  profile = _profile()
  base = reducer_lib.make_gradient_reducer(
    "hierarchical", 2, 4, "fixed", 2**16, density=0.01, order=profile.order, min_compress_elements=16
  )
  links = cost_model.ClusterCost.from_dict(SLOW_LINKS)
  slow = cost_model.ClusterCost.from_dict({**SLOW_LINKS, "topk_elements_per_sec": CPU_RATE})
  alone, _ = cost_model.plan_auto(base, profile, links, 1e12, 64, overlap)
  charged, reasons = cost_model.plan_auto(base, profile, slow, 1e12, 64, overlap)
  assert len(alone.choices) > 4 and set(alone.choices) == {"gtopk"}
  assert "gtopk" not in charged.choices and all("gtopk" not in r for r in reasons)
  # At a fast device's rate the selections cost little: gtopk again (a trade-off, not a ban).
  fast_device = cost_model.ClusterCost.from_dict({**SLOW_LINKS, "topk_elements_per_sec": 1e10})
  fast, _ = cost_model.plan_auto(base, profile, fast_device, 1e12, 64, overlap)
  assert "gtopk" in fast.choices

  def step_seconds(reducer):
    backward = [profile.backward_flops[i] * 64 / 1e12 for i in profile.order]
    buckets = simulation.bucket_comms(reducer, profile.params)
    return simulation.simulate_step(links, 2, 4, buckets, 0.0, backward, overlap=overlap,
                                    topk_elements_per_sec=CPU_RATE).total  # fmt: skip

  assert step_seconds(charged) < step_seconds(alone)


def _compiled_steps(cost_model_name: str) -> CompiledSteps:
  """The trainer's planning (CompiledSteps builds and plans its reducer; nothing is compiled before a step is
  asked for) on the 2 x 4 mesh of the tests above."""
  config = small_config(
    comm__strategy="auto",
    comm__cost_model=cost_model_name,
    comm__bucket_bytes=2**16,
    comm__density=0.01,
    comm__min_compress_elements=16,
    model__width=16,
  )
  plan = schedules.EpochPlan(2048, 1, (), config.global_batch_size)
  schedule = schedules.learning_rate_schedule(config.optimizer, plan)
  optimizer = optim.from_config(config, schedule, schedules.momentum_schedule(config.optimizer, plan))
  info = DatasetInfo(num_classes=10, image_shape=(28, 28, 1), mean=(127.5,), std=(64.0,))
  model = create_model(config.model.name, 10, config.model.dtype, config.model.width)
  return CompiledSteps(config, model, optimizer, mesh_lib.make_mesh(2, 4), info, plan)


def test_the_trainer_plans_auto_with_the_files_rate_and_says_so(tmp_path, caplog):
  """A calibration with a rate: auto is planned with it (no gtopk on these links) and its log says so. An older
  one without: link time alone (gtopk everywhere), one warning that says how to get a rate. A preset: its rate."""
  with_rate = _write(tmp_path, {**SLOW_LINKS, "topk_elements_per_sec": CPU_RATE})
  with caplog.at_level(logging.INFO):
    planned = _compiled_steps(with_rate).reducer
  assert f"comm.strategy=auto ({with_rate}, top-k at 3e+07 elements/s), per bucket:" in caplog.text
  assert "holds no top-k selection rate" not in caplog.text
  assert planned.choices and "gtopk" not in planned.choices

  caplog.clear()
  older = str(tmp_path / "older.json")
  with open(older, "w") as f:
    json.dump(SLOW_LINKS, f)
  with caplog.at_level(logging.INFO):
    planned = _compiled_steps(older).reducer
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1 and older in warnings[0] and "holds no top-k selection rate" in warnings[0]
  assert "rerun benchmarks/calibrate_links.py" in warnings[0]
  assert f"comm.strategy=auto ({older}, link time alone, no top-k rate), per bucket:" in caplog.text
  assert set(planned.choices) == {"gtopk"}

  caplog.clear()
  with caplog.at_level(logging.INFO):
    _compiled_steps("v100_nvlink_25gbe")
  assert "comm.strategy=auto (v100_nvlink_25gbe, top-k at 1e+09 elements/s), per bucket:" in caplog.text


def test_calibrate_links_measures_a_positive_finite_rate_and_writes_it(tmp_path, monkeypatch, capsys):
  """The whole script on the 8 test devices at small sizes (psums up to 1 MiB, one top-k size of 2^18
  elements): the file and the last line hold the rate, the slowest of the printed top-k rows, and it loads."""
  assert calibrate_links.topk_sizes(64 * 2**20) == [2**20, 2**22, 2**24]
  assert calibrate_links.topk_sizes(2**20) == [2**18]
  out = tmp_path / "links.json"
  monkeypatch.setattr(sys, "argv", ["calibrate_links.py", "--repeats=1", "--max_mib=1", f"--out={out}"])
  calibrate_links.main()
  printed = capsys.readouterr().out
  last = json.loads(printed.strip().splitlines()[-1])
  rate = json.loads(out.read_text())["topk_elements_per_sec"]
  assert 0 < rate < math.inf and last["topk_elements_per_sec"] == rate
  rows = [line.split() for line in printed.splitlines() if line.startswith("exact ")]
  assert len(rows) == 2 and min(float(r[-1]) for r in rows) == pytest.approx(rate, rel=1e-2)
  assert cost_model.load(str(out)).topk_elements_per_sec == rate
