"""ResNet-50 on ImageNet, 128 GPUs as 16 nodes x 8 GPUs, LARS: the Light-scale target.

Recipe: MLPerf ResNet-50 v1.5 LARS (docs/techniques.md section 6): batch 32,768, peak lr from the
linear scaling rule, 5 warm-up epochs, polynomial (power 2) decay, label smoothing 0.1, bfloat16
compute, no weight decay or trust ratio on biases and BatchNorm parameters. One departure: the trust ratio
is optax's form, eta ||w|| / ||g + wd w|| (``optimizer.lars_trust``; MLPerf's: eta ||w|| / (||g|| + wd ||w||)).

Data: TFDS imagenet2012 as ArrayRecord (``scripts/prepare_imagenet.py``), a decoded disk cache on local
SSD, progressive resizing 128 -> 224 -> 288 px.

Variants:
  tiny   the same pipeline at toy scale on 8 simulated CPU devices (tests, laptops): point data_dir at a
         small prepared dataset (e.g. --config.data.dataset=image_folder --config.data.data_dir=DIR).
  light  the seed's setting: the 28-epoch recipe of the DAWNBench record Light beat, on 16 x 8 V100
         (`python scripts/simulate.py --config configs/imagenet_resnet50.py:light --cluster v100x128_25gbe`).
"""

import ml_collections

from light_jax.config import apply_variant, base_config


def tiny(config: ml_collections.ConfigDict) -> None:
  config.mesh.update(nodes=2, local=4, cpu_devices=8)
  config.model.update(name="resnet8_small", width=16, dtype="float32")
  config.data.update(
    image_size=32,
    resolution_schedule="0:24,1:32",
    cache_size=40,
    cache_budget_gb=1.0,
    eval_batch_size=64,
    read_threads=2,
    num_workers=0,
    host_prefetch=4,
    random_scale_min=0.35,
  )
  config.global_batch_size = 32
  config.num_epochs = 2
  config.optimizer.update(name="sgd", base_lr=0.4, nesterov=True, warmup_epochs=0.5, decay="cosine", weight_decay=5e-4)
  config.log_every_steps = 5
  config.checkpoint.update(every_steps=0, keep=1)


def light(config: ml_collections.ConfigDict) -> None:
  """The DAWNBench 28-epoch recipe (docs/techniques.md section 6): 96 px for 13 epochs, 128 for 11, 224 for
  3, 288 for 1; batch 32,768, then 16,384 for the last epoch; LARS, eta 0.0008, wd 1e-4, 14 warm-up
  epochs to a peak of 25, decay to 0.2 (end factor 0.008). The peak follows each phase's batch (linear
  scaling), so the last epoch's 16,384 halves the rate: it ends at 0.1. Nesterov momentum, as the recipe (the
  ImageNet config's MLPerf LARS has none). Departures: power-2 decay instead of linear, no momentum cycling, no
  rectified lr or trust-ratio clipping; bfloat16 compute (V100s need float16).
  """
  config.num_epochs = 28
  # Light's V100s: adaptive fusion and auto plan with the backward FLOP/s the simulator's V100 profile runs at
  # (simulation.device_tflops: 32), not the 100 of the ImageNet config's newer GPUs.
  config.comm.device_tflops = 32.0
  config.data.resolution_schedule = "0:96,13:128,24:224,27:288:16384"
  config.optimizer.update(
    base_lr=25.0 * 256 / 32_768,
    warmup_epochs=14.0,
    weight_decay=1e-4,
    lars_eta=0.0008,
    end_lr_factor=0.008,
    nesterov=True,
  )


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  config = base_config()
  config.mesh.update(nodes=16, local=8, cpu_devices=0)  # one process per node (jax.distributed)
  config.model.update(name="resnet50", dtype="bfloat16")
  config.data.update(
    dataset="imagenet2012",  # or "image_folder": a folder converted by scripts/prepare_image_folder.py
    data_dir="~/tensorflow_datasets",  # TFDS data dir prepared by scripts/prepare_imagenet.py
    image_size=288,
    # A third field sets a phase's global batch, e.g. the DAWNBench record's "0:96,13:128,24:224,27:288:16384"
    # with 28 epochs; the learning rate scales with it.
    resolution_schedule="0:128,14:224,32:288",
    cache="disk",  # on local SSD
    # >= the largest training size: ~425 GB. At 288 px nearly every random crop of the 288 px phase is enlarged
    # (63% from the JPEGs); the budget, not the recipe, sets this size.
    cache_size=288,
    cache_budget_gb=500.0,
    eval_batch_size=7_168,  # 1,024 x 7: the 50,000 validation images in 7 batches, 176 padding rows
    read_threads=16,
    host_prefetch=-1,
    num_workers=-1,
  )
  config.global_batch_size = 32_768
  config.num_epochs = 37
  config.optimizer.update(
    name="lars",
    # Peak lr 25 with 5 warm-up epochs: Google's MLPerf LARS values for batches below 32k. 32,768 is in
    # its next bracket (29, 18 warm-up epochs, momentum 0.929; docs/techniques.md section 6): not tuned yet.
    base_lr=25.0 * 256 / 32_768,
    nesterov=False,
    weight_decay=5e-5,
    warmup_epochs=5.0,
    decay="poly",
    end_lr_factor=1e-4,
  )
  # device_tflops: newer GPUs' bfloat16 at a guess; set your device's (scripts/simulate.py: an H200 runs at 196).
  config.comm.update(device_tflops=100.0, density=0.001)
  config.log_every_steps = 10
  config.checkpoint.every_steps = 500
  return apply_variant(config, variant, {"tiny": tiny, "light": light}, "imagenet_resnet50.py")
