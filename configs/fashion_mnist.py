"""Fashion-MNIST on 8 simulated CPU devices as a 2 x 4 (node x local) mesh: the default `make train`.

Variants (``--config configs/fashion_mnist.py:VARIANT``):
  (none)   small ResNet, SGD with Nesterov momentum, hierarchical gradient all-reduce.
  lars     the same with LARS (the large-batch optimizer), at batch 1024.
  dense    the default with one flat psum instead of the hierarchical reduction.
  hitopk   the default with hierarchical top-k compression at 1% density and error feedback.
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # 8 CPU devices simulated in one process when running on the CPU; ignored on GPU hosts.
  config.mesh = dict(nodes=2, local=4, cpu_devices=8)

  config.model = dict(name="resnet8_fast", width=0, dtype="float32")

  config.data = dict(
      dataset="fashion_mnist",
      data_dir="/usr/share/datasets/fashion-mnist",
      crop_padding=0,        # >0: random crop of the zero-padded image; costs accuracy in runs this short
      random_flip=True,
      train_subset=0,        # 0 = all 60,000 training images; >0 = first N (smoke tests)
      eval_subset=0,         # 0 = all 10,000 test images
      eval_batch_size=1000,
      prefetch=2,            # batches placed on the devices ahead of the step
      read_threads=1,        # grain threads that assemble host batches
      host_prefetch=4,       # batches grain assembles ahead (bounds its parallelism too; -1: measure)
      num_workers=0,         # grain worker processes (-1: measure a few counts at start-up, keep the best)
      # Fields of the JPEG datasets (imagenet2012, image_folder); unused for Fashion-MNIST:
      image_size=0, resolution_schedule="", random_scale_min=0.08, reduced_decode=True,
      cache="none", cache_dir="/tmp/light_jax_cache", cache_size=160, cache_budget_gb=64.0,
  )

  config.global_batch_size = 256
  config.num_epochs = 8
  config.max_steps = 0       # 0 = no limit; otherwise stop after this many steps

  config.optimizer = dict(
      name="sgd",
      base_lr=0.2,           # peak lr = base_lr * global_batch_size / 256
      momentum=0.9,
      nesterov=True,
      weight_decay=5e-4,
      warmup_epochs=1.0,
      decay="cosine",
      end_lr_factor=0.0,     # final lr = peak lr * end_lr_factor
      lars_eta=0.001,
      label_smoothing=0.1,
  )

  config.comm = dict(
      strategy="hierarchical",   # dense | hierarchical | hitopk | topk | gtopk
      fusion="fixed",            # none | fixed (buckets of bucket_bytes) | adaptive (MG-WFBP)
      bucket_bytes=25 * 2**20,
      dtype="float32",           # wire dtype of the dense hops: bfloat16 halves them (float32 accumulation)
      cost_model="v100_nvlink_25gbe",  # adaptive: a cost_model.PRESETS name or a calibrated JSON file
      device_tflops=15.0,        # adaptive: sustained FLOP/s (x 1e12) for backward-time estimates
      # The top-k strategies (hitopk, topk, gtopk):
      density=0.01,              # fraction of entries kept (per local shard for hitopk)
      error_feedback=True,       # what is not sent is kept and added to the next step's gradient
      topk_selector="exact",     # exact (lax.top_k) | mstopk (sort-free threshold search)
      min_compress_elements=512,  # smaller buckets / shards go dense
      density_warmup_epochs=0.0,  # >0: DGC-style warm-up from density 0.25 down to `density`
  )

  config.log_every_steps = 20
  # Asynchronous orbax checkpoints in WORKDIR/checkpoints; a workdir with one resumes from it.
  config.checkpoint = dict(every_steps=200, keep=3)
  config.train = dict(
      on_nonfinite="skip",   # skip: drop the update and go on; stop: save a checkpoint and stop
      inject_nan_at_step=-1,  # fault drill: poison this step's loss (-1: off)
  )

  if variant == "lars":
    config.global_batch_size = 1024
    config.optimizer.name = "lars"
    config.optimizer.base_lr = 2.0
    config.optimizer.weight_decay = 5e-5
    config.optimizer.nesterov = False
    config.optimizer.decay = "poly"
  elif variant == "dense":
    config.comm.strategy = "dense"
  elif variant == "hitopk":
    config.comm.strategy = "hitopk"   # hierarchical top-k at 1% density with error feedback
    config.comm.density = 0.01
  elif variant:
    raise ValueError(f"unknown variant {variant!r} of fashion_mnist.py; use lars, dense or hitopk")
  return config
