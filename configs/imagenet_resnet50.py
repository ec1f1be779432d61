"""ResNet-50 on ImageNet, 128 GPUs as 16 nodes x 8 GPUs, LARS: the Light-scale target.

Recipe: MLPerf ResNet-50 v1.5 LARS (light-techniques.md section 5): batch 32,768, peak lr from the
linear scaling rule, 5 warm-up epochs, polynomial (power 2) decay, label smoothing 0.1, bfloat16
compute, no weight decay or trust ratio on biases and BatchNorm parameters.

Data: TFDS imagenet2012 as ArrayRecord (``scripts/prepare_imagenet.py``), a decoded disk cache on local
SSD, progressive resizing 128 -> 224 -> 288 px.

Variant ``tiny``: the same pipeline at toy scale on 8 simulated CPU devices (tests, laptops).
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.mesh = dict(nodes=16, local=8, cpu_devices=0)   # one process per node (jax.distributed)
  config.model = dict(name="resnet50", width=0, dtype="bfloat16")
  config.data = dict(
      dataset="imagenet2012",  # or "image_folder": a folder converted by scripts/prepare_image_folder.py
      data_dir="~/tensorflow_datasets",  # TFDS data dir prepared by scripts/prepare_imagenet.py
      image_size=288,          # eval size (= the last training phase's), and the training size without a schedule
      # Progressive resizing, "first_epoch:size[:global_batch],...": small images early, full size at
      # the end (one compilation per batch shape). A third field sets that phase's global batch (else
      # global_batch_size), e.g. the DAWNBench record's "0:96,13:128,24:224,27:288:16384" with 28
      # epochs; the learning rate scales with it. "" = image_size throughout.
      resolution_schedule="0:128,14:224,32:288",
      random_scale_min=0.08,   # random-resized-crop area from this fraction of the image to all of it
      reduced_decode=True,     # decode JPEGs at 1/2, 1/4, 1/8 scale when the crop allows it
      cache="disk",            # none | disk (decoded, shorter side cache_size, local disk) | memory
      cache_dir="/tmp/light_jax_cache",   # local SSD
      cache_size=288,          # shorter side of the cached images (>= the largest training size): ~425 GB
      cache_budget_gb=500.0,   # the cache is skipped (JPEGs read instead) when it would be larger
      crop_padding=0,
      random_flip=True,
      train_subset=0,
      eval_subset=0,
      eval_batch_size=16_384,
      prefetch=2,
      read_threads=16,
      host_prefetch=-1,        # batches grain assembles ahead per worker (-1: measure 1, 2, 4, ... at start-up)
      num_workers=-1,          # -1: measure a few grain worker counts at start-up and keep the best
  )
  config.global_batch_size = 32_768
  config.num_epochs = 37
  config.max_steps = 0
  config.optimizer = dict(
      name="lars",
      base_lr=25.0 * 256 / 32_768,   # Google's MLPerf JAX recipe: peak lr 25 at batch < 32k
      momentum=0.9,
      nesterov=False,
      weight_decay=5e-5,
      warmup_epochs=5.0,
      decay="poly",
      end_lr_factor=1e-4,
      lars_eta=0.001,
      label_smoothing=0.1,
  )
  config.comm = dict(strategy="hierarchical", fusion="fixed", bucket_bytes=25 * 2**20, dtype="float32",
                     cost_model="v100_nvlink_25gbe", device_tflops=100.0, density=0.001,
                     error_feedback=True, topk_selector="exact", min_compress_elements=512,
                     density_warmup_epochs=0.0)
  config.log_every_steps = 10
  config.checkpoint = dict(every_steps=500, keep=3)
  config.train = dict(on_nonfinite="skip", inject_nan_at_step=-1)

  if variant == "tiny":
    # The same pipeline at toy scale on 8 simulated CPU devices (tests, laptops): point data_dir at a
    # small prepared dataset (e.g. --config.data.dataset=image_folder --config.data.data_dir=DIR).
    config.mesh = dict(nodes=2, local=4, cpu_devices=8)
    config.model = dict(name="resnet8_small", width=16, dtype="float32")
    config.data.update(image_size=32, resolution_schedule="0:24,1:32", cache_size=40, cache_budget_gb=1.0,
                       eval_batch_size=64, read_threads=2, num_workers=0, host_prefetch=4, random_scale_min=0.35)
    config.global_batch_size = 32
    config.num_epochs = 2
    config.optimizer.update(name="sgd", base_lr=0.4, nesterov=True, warmup_epochs=0.5, decay="cosine",
                            weight_decay=5e-4)
    config.log_every_steps = 5
    config.checkpoint = dict(every_steps=0, keep=1)
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of imagenet_resnet50.py; known: tiny")
  return config
