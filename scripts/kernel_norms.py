"""The norm of every kernel (conv and dense weights) of finished runs, at their newest checkpoint, beside
the same model's norms at initialisation.

python scripts/kernel_norms.py runs/large_batch/sgd_4096_w3_lr015 \
    runs/large_batch/sgd_4096_w3_hitopk_dgc_per_tensor_nesterov

With BatchNorm after a convolution its output does not depend on the kernel's scale, but the step's
effect does (it scales as 1 / ||w||): the norms show where weight decay shrank the kernels and where
they stayed near their initial scale. The runs must share a model and a device count (the checkpoints
restore onto the mesh shape they were saved from). Last line: JSON, run -> {tensor: norm}, and "init".
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from light_jax import cli  # noqa: E402


def newest_checkpoint(workdir: str) -> str:
  directory = os.path.join(workdir, "checkpoints")
  steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []
  if not steps:
    cli.fail(f"{workdir}: no checkpoint under {directory}; is it a train.py workdir with a saved step?")
  return os.path.join(directory, str(steps[-1]), "state")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", help="train.py workdirs (their summary.json and checkpoints)")
  args = parser.parse_args()
  summaries = []
  for workdir in args.workdirs:
    path = os.path.join(workdir, "summary.json")
    if not os.path.exists(path):
      cli.fail(f"{workdir}: no summary.json; kernel norms need a finished train.py run")
    try:
      with open(path) as f:
        summaries.append(json.load(f))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      cli.fail(f"{path} is not JSON ({e}): the run did not end cleanly; run it again (the same command resumes)")
    except OSError as e:  # a folder in its place, no permission
      cli.fail(f"cannot read {path} ({e.strerror})")
  try:
    config = summaries[0]["config"]
    # The mesh the run resolved (the config's may say -1, all devices), which the checkpoints were saved on.
    devices = {s["mesh"]["nodes"] * s["mesh"]["local"] for s in summaries}
    models = {json.dumps(s["config"]["model"], sort_keys=True) for s in summaries}
    model_name, width, seed = config["model"]["name"], config["model"]["width"], config["seed"]
    channels = 1 if config["data"]["dataset"] == "fashion_mnist" else 3
  except (KeyError, TypeError) as e:
    cli.fail(f"a summary.json of {', '.join(args.workdirs)} is not train.py's ({type(e).__name__}: {e})")
  if len(devices) > 1 or len(models) > 1:
    cli.fail(f"the runs differ in device count ({sorted(devices)}) or model; compare runs of one kind")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import orbax.checkpoint as ocp

  from light_jax.models import create_model

  jax.config.update("jax_num_cpu_devices", devices.pop())

  def kernel_norms(params) -> dict[str, float]:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {
      jax.tree_util.keystr(p, simple=True, separator="/"): float(np.linalg.norm(x)) for p, x in leaves if x.ndim > 1
    }

  # A column per run, named by its folder; by the path as given where two folders share a name (or one is "init").
  run_names = [os.path.basename(os.path.normpath(workdir)) for workdir in args.workdirs]
  if len(set(run_names)) < len(run_names) or "init" in run_names:
    run_names = [os.path.normpath(workdir) for workdir in args.workdirs]
  if len(set(run_names)) < len(run_names):
    cli.fail(f"a workdir is given twice ({' '.join(args.workdirs)}); give each run once")
  finals = {}
  for name, workdir in zip(run_names, args.workdirs):
    checkpoint = os.path.abspath(newest_checkpoint(workdir))
    try:
      params = ocp.StandardCheckpointer().restore(checkpoint)["params"]
    except Exception as e:  # not an orbax checkpoint, or damaged: any error orbax raises
      cli.fail(
        f"{checkpoint} cannot be restored ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
      )
    finals[name] = kernel_norms(params)
  # The same model at initialisation: the classes from the classifier (the one 2-D kernel), the input
  # channels from the dataset; no kernel's shape depends on the image size.
  num_classes = next(x.shape[-1] for x in jax.tree.leaves(params) if x.ndim == 2)
  model = create_model(model_name, num_classes, width=width)
  init = model.init(jax.random.key(seed), jnp.zeros((1, 32, 32, channels)), train=False)["params"]
  columns = {"init": kernel_norms(init), **finals}
  names = list(columns)
  print(f"{'kernel':<28}" + "".join(f"{n[-24:]:>26}" for n in names))
  for tensor in columns["init"]:
    print(f"{tensor:<28}" + "".join(f"{columns[n][tensor]:>26.3f}" for n in names))
  print(json.dumps(columns))


if __name__ == "__main__":
  main()
