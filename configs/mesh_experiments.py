"""Mesh experiments for the mesh lab:

  python benchmarks/mesh_lab.py --experiment configs/mesh_experiments.py[:VARIANT]


Each variant is a grid: mesh shapes (machines x devices per machine) x strategies (NAME, NAME@DENSITY,
"/bfloat16" for the bfloat16 wire dtype) x inter-machine bandwidths, on a training config with
overrides. Write a new variant to ask a new question; no code needed.

  (none)      Light's claim in miniature: 2 x 4 at 10 Mbit/s, hierarchical against hitopk at 0.1%.
  gtopk_4x2   4 machines x 2 devices at 100 Mbit/s: gtopk at 1% and 0.1% against hierarchical and hitopk.
  shapes      the same 8 devices as 2 x 4, 4 x 2 and 8 x 1 at 50 Mbit/s, hierarchical and hitopk at 1%.
  auto        comm.strategy=auto against hierarchical and hitopk at 10 and 100 Mbit/s, 2 x 4, with 256 KiB
              buckets (6 of them) so that auto can mix strategies.
  strategies  dense, hierarchical (and its bfloat16 wire), topk, hitopk and gtopk at 10 Mbit/s on 2 x 4: the
              cost model's validation (powersgd, diloco and auto: name them with --strategies).
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  experiment = ml_collections.ConfigDict()
  experiment.meshes = [(2, 4)]
  experiment.bandwidths = ["10mbit", "unshaped"]  # "unshaped" gives each strategy's compute-only step
  experiment.strategies = ["hierarchical", "hitopk@0.001"]
  experiment.steps = 30  # measured steps per cell
  experiment.warmup = 5  # steps dropped first
  experiment.config = "configs/fashion_mnist.py"
  experiment.overrides = []  # "FIELD=VALUE" for every run, e.g. "model.name=resnet20_small"
  if variant == "gtopk_4x2":
    experiment.meshes = [(4, 2)]
    experiment.bandwidths = ["100mbit", "unshaped"]
    experiment.strategies = ["hierarchical", "hitopk@0.01", "gtopk@0.01", "gtopk@0.001"]
  elif variant == "shapes":
    experiment.meshes = [(2, 4), (4, 2), (8, 1)]
    experiment.bandwidths = ["50mbit", "unshaped"]
    experiment.strategies = ["hierarchical", "hitopk@0.01"]
  elif variant == "auto":
    experiment.bandwidths = ["10mbit", "100mbit", "unshaped"]
    experiment.strategies = ["hierarchical", "hitopk@0.01", "auto@0.01"]
    experiment.overrides = ["comm.bucket_bytes=262144"]
  elif variant == "strategies":
    experiment.strategies = ["dense", "hierarchical", "hierarchical/bfloat16", "topk@0.01", "hitopk@0.01",
                             "hitopk@0.001", "gtopk@0.01"]  # fmt: skip
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of mesh_experiments.py; known: gtopk_4x2, shapes, auto, strategies")
  return experiment
