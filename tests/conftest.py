"""Every test runs on 8 simulated CPU devices (set before any JAX backend starts).

The tests compile the same train steps many times, in-process and in the train.py processes they start:
JAX's persistent compilation cache, in a fresh directory per session (inherited by the subprocesses
and by pytest-xdist's workers through the environment), compiles each program once. They also compile
with XLA's backend optimisations off (--xla_backend_optimization_level=0) and with XLA's older CPU code
emitters (--xla_cpu_use_fusion_emitters=false), both merged into XLA_FLAGS so that the subprocesses get them
too: the tests' programs are tiny, so compile time dominates their run time (optimisations off:
tests/test_train_step.py and tests/test_models.py 32 s instead of 79 s; the older emitters then compile a
small train step in 1.4 s instead of 2.6 s, and took `make test` from 927 to 745 s of the workers' time).
The optimised pipeline runs in the benchmarks and in `make train`. The tests compare runs with tolerances,
not bit for bit across these flags; where they compare bit for bit (an exact resume), both runs must be the
same program: under the older emitters, two programs that differ only in a constant the compared values do
not use (a run's end as a record boundary) can round differently.
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "LIGHT_JAX_TESTS_JIT_CACHE" not in os.environ:  # pytest-xdist's workers inherit the controller's
  os.environ["LIGHT_JAX_TESTS_JIT_CACHE"] = tempfile.mkdtemp(prefix="light_jax_tests_jit_cache_")
  atexit.register(shutil.rmtree, os.environ["LIGHT_JAX_TESTS_JIT_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["LIGHT_JAX_TESTS_JIT_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
for flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
  if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The files whose tests take longest (20 s to 2 minutes each on 2 cores, `--durations=0`), slowest first, collected
# first: `make test` hands files to its two workers in collection order (--no-loadscope-reorder), and one of these
# collected last would run alone at the end of the suite. The others (under 20 s each) follow in name order.
SLOWEST_FILES = (
  "test_checkpoint.py",
  "test_multiprocess.py",
  "test_train_loop.py",
  "test_tune.py",
  "test_train_step.py",
  "test_script_inputs.py",
  "test_emulated_cluster.py",
  "test_collectives.py",
  "test_imagenet_prepare.py",
  "test_image_data.py",
  "test_sharded_update.py",
  "test_train_e2e.py",
  "test_simulation.py",
)


def pytest_collection_modifyitems(items):
  first = {name: rank for rank, name in enumerate(SLOWEST_FILES)}
  items.sort(key=lambda item: first.get(os.path.basename(str(item.path)), len(first)))  # stable: in-file order kept
