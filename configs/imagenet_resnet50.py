"""ResNet-50 on ImageNet, 128 GPUs as 16 nodes x 8 GPUs, LARS: the Light-scale target.

Recipe: MLPerf ResNet-50 v1.5 LARS (light-techniques.md section 5): batch 32,768, peak lr from the
linear scaling rule, 5 warm-up epochs, polynomial (power 2) decay, label smoothing 0.1, bfloat16
compute, no weight decay or trust ratio on biases and BatchNorm parameters.

The ImageNet input pipeline is issue #4: until it lands this config stops with a clear message.
"""

import ml_collections


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  del variant
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.mesh = dict(nodes=16, local=8, cpu_devices=0)   # one process per node (jax.distributed)
  config.model = dict(name="resnet50", width=0, dtype="bfloat16")
  config.data = dict(
      dataset="imagenet2012",
      data_dir="",           # TFDS data dir (issue #4)
      crop_padding=0,
      random_flip=True,
      train_subset=0,
      eval_subset=0,
      eval_batch_size=16_384,
      prefetch=2,
      read_threads=16,
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
  return config
