"""One process of a multi-process training run over gloo; run by tests/test_multiprocess.py.

  python tests/multiprocess_worker.py --num_processes P --process_id I --port N --steps S --out params.npz

Each process holds 8 / P simulated CPU devices; the (node, local) mesh spans all of them. The data
pipeline gives each process its own rows of every global batch. Top-k strategies run at --density
with fixed buckets of --bucket_bytes (4 KiB: several buckets are compressed and carry residuals) on a
resnet8_small of --width. Process 0 writes the final parameters.
"""

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--num_processes", type=int, required=True)
  parser.add_argument("--process_id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--strategy", default="hierarchical")
  parser.add_argument("--density", type=float, default=0.05)
  parser.add_argument("--width", type=int, default=4)
  parser.add_argument("--bucket_bytes", type=int, default=4096)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()

  import jax

  jax.config.update("jax_num_cpu_devices", 8 // args.num_processes)
  if args.num_processes > 1:
    jax.distributed.initialize(
      f"127.0.0.1:{args.port}", num_processes=args.num_processes, process_id=args.process_id, initialization_timeout=120
    )
  import numpy as np
  import optax

  from light_jax import data as data_lib
  from light_jax import train_step as step_lib
  from light_jax.models import create_model
  from light_jax.parallel import diloco
  from light_jax.parallel import mesh as mesh_lib
  from light_jax.parallel import reducer as reducer_lib
  from tests.helpers import info_for, random_source

  assert jax.device_count() == 8, jax.devices()
  mesh = mesh_lib.make_mesh(-1, -1) if args.num_processes > 1 else mesh_lib.make_mesh(2, 4)
  assert mesh.devices.shape == (2, 4)
  source = random_source(32 * args.steps, shape=(16, 16, 1))
  info = info_for(source)
  batches = data_lib.TrainBatches(
    source,
    32,
    num_epochs=1,
    seed=0,
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    crop_padding=2,
    random_flip=True,
  )
  model = create_model("resnet8_small", num_classes=10, width=args.width)
  name, _, option = args.strategy.partition("+")  # "hitopk+compact": bfloat16 values, uint16 indices
  # "hitopk+ef21": EF21's estimates; the momentum moves into the reducer (momentum correction)
  ef21 = dict(feedback="ef21", momentum_correction=0.9, momentum_masking=False) if option == "ef21" else {}
  tx = optax.sgd(0.1) if ef21 else optax.sgd(0.1, momentum=0.9)
  if args.strategy == "diloco":  # an outer step after step 2; step 3 leaves the machines apart
    reducer = diloco.DiLoCo(2, 4, sync_every=2, inner_tx=tx)
  else:
    top_k = {} if args.strategy == "powersgd" else {"density": args.density, **ef21}  # powersgd: its rank (4)
    if option == "compact":
      top_k["compact_pairs"] = True
    reducer = reducer_lib.make_gradient_reducer(
      name, 2, 4, fusion="fixed", bucket_bytes=args.bucket_bytes, min_compress_elements=64, **top_k
    )
  state = step_lib.create_train_state(model, tx, reducer, info.image_shape, mesh, seed=0)
  step = step_lib.make_train_step(model, tx, reducer, mesh, info, label_smoothing=0.1)
  with contextlib.closing(
    data_lib.DevicePrefetcher(batches.iterator(), mesh_lib.batch_sharding(mesh))
  ) as batches_on_mesh:
    for batch in batches_on_mesh:  # closed on an error too: its thread left inside a transfer aborts the exit
      state, loss = step(state, batch["images"], batch["labels"])
  # Replicated arrays: every process holds a full copy on its own devices.
  params = jax.tree_util.tree_leaves_with_path(state.params)
  arrays = {f"params/{jax.tree_util.keystr(k)}": np.asarray(v.addressable_data(0)) for k, v in params}
  # Residuals and BatchNorm statistics are per device: gather them all (node-major) to compare with the
  # one-process run.
  gather = jax.jit(lambda r: r, out_shardings=mesh_lib.replicated(mesh))
  for prefix, tree in (("residual", state.comm_state), ("batch_stats", state.batch_stats)):
    for path, per_device in jax.tree_util.tree_leaves_with_path(tree):
      arrays[f"{prefix}/{jax.tree_util.keystr(path)}"] = np.asarray(gather(per_device).addressable_data(0))
  arrays["__loss"] = np.asarray(jax.device_get(loss.addressable_data(0)))
  if jax.process_index() == 0:
    np.savez(args.out, **arrays)
  print(f"process {jax.process_index()}: {int(jax.device_get(state.step.addressable_data(0)))} steps done")


if __name__ == "__main__":
  main()
