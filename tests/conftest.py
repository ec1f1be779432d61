"""Every test runs on 8 simulated CPU devices (set before any JAX backend starts).

The tests compile the same train steps many times, in-process and in the train.py processes they start:
JAX's persistent compilation cache, in a fresh directory per session (inherited by the subprocesses
through the environment), compiles each program once.
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = tempfile.mkdtemp(prefix="light_jax_tests_jit_cache_")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
