"""A run's start-up checks, on their own: the coordinator address (light_jax/coordinator.py), the processes' settings
(light_jax/same_settings.py) and the compilation cache's folder (light_jax/compilation_cache.py).
tests/test_multiprocess.py and tests/test_train_e2e.py run them through train.py."""

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from light_jax import compilation_cache, coordinator, same_settings
from light_jax.config import base_config


@pytest.mark.parametrize(
  "address,expected",
  [
    ("127.0.0.1:1234", ("127.0.0.1", 1234)),
    ("[::1]:80", ("::1", 80)),
    ("host-0.example:65535", ("host-0.example", 65535)),
  ],
)
def test_a_coordinator_address_parses(address, expected):
  assert coordinator.parse(address) == expected


# No port (an IndexError inside JAX), a port JAX wrapped, one int() took from other digits, no host.
@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:abc", "127.0.0.1:99999", "h:0", "h:\uff11\uff12", ":1234"])
def test_a_coordinator_address_that_cannot_work_is_refused(address):
  with pytest.raises(coordinator.CoordinatorError, match="expected host:port, the port from 1 to 65535"):
    coordinator.parse(address)


def test_a_host_that_does_not_resolve_is_named():
  with pytest.raises(coordinator.CoordinatorError, match="cannot resolve 'no-such-host.invalid'"):
    coordinator.resolve("no-such-host.invalid", 1234)
  with pytest.raises(coordinator.CoordinatorError, match="cannot resolve"):  # a label over 63 characters
    coordinator.resolve("a" * 70 + ".example", 1234)


@pytest.mark.parametrize(
  "family,address", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::1")]
)
def test_a_port_with_a_listener_on_any_address_is_in_use(family, address):
  try:
    listener = socket.socket(family, socket.SOCK_STREAM)
  except OSError:
    pytest.skip("no IPv6 here")
  with listener:
    listener.bind((address, 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(coordinator.CoordinatorError, match=f"port {port} is in use on this machine"):
      coordinator.check_port_free(port)
  coordinator.check_port_free(port)  # closed: free again


def test_waiting_for_the_coordinator_returns_the_time_left_or_says_what_failed():
  lines = []
  with socket.socket() as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert 9 < coordinator.wait_for("127.0.0.1", port, 10, lines.append) <= 10
  assert lines == []  # answered at once: nothing to say
  start = time.monotonic()
  with pytest.raises(coordinator.CoordinatorError, match=f"nothing answered at --coordinator=127.0.0.1:{port} in 1 s"):
    coordinator.wait_for("127.0.0.1", port, 1, lines.append)
  assert 1 <= time.monotonic() - start < 5
  assert lines == [f"waiting for process 0 at 127.0.0.1:{port} (Connection refused), up to --init_timeout=1 s"]


def test_settings_differ_in_what_a_run_shares_not_in_a_machines_own_input():
  config = base_config()
  mine = same_settings.settings(config, 2)
  assert mine["--num_processes"] == 2 and mine["global_batch_size"] == config.global_batch_size
  assert "data.data_dir" not in mine and "data.num_workers" not in mine
  other = base_config()
  other.data.num_workers, other.data.data_dir = 3, "/elsewhere"
  assert same_settings.differences(mine, same_settings.settings(other, 2), 1) == []
  other.global_batch_size, other.data.cache_budget_gb = 4096, float("nan")
  config.data.cache_budget_gb = float("nan")  # the same on both: NaN != NaN refused a run one process accepts
  assert same_settings.differences(same_settings.settings(config, 2), same_settings.settings(other, 3), 1) == [
    "--num_processes=2 here, 3 on process 1",
    f"global_batch_size={config.global_batch_size} here, 4096 on process 1",
  ]
  assert same_settings.differences({"a": 1}, {}, 0) == ["a=1 here, unset on process 0"]


def test_a_real_error_after_a_swallowed_stop_stays_that_error():
  """A stop a library swallowed, then a real error before set-up's next check: the error was reported as the
  stop, exit 0 and "run the same command again", its message lost."""
  code = """
import os, signal
from light_jax.preemption import PreemptionGuard

class SignalledWhenFreed:
  def __del__(self):
    os.kill(os.getpid(), signal.SIGTERM)
    (lambda: None)()

with PreemptionGuard():
  SignalledWhenFreed()
  raise ValueError("the real error")
"""
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == "ValueError: the real error"


def test_after_a_stop_in_set_up_only_what_it_cut_short_goes_unreported():
  code = """
import asyncio
from light_jax import preemption

class Unrelated:
  def __del__(self):
    raise OSError(28, "No space left on device")

preemption.drop_what_set_up_left()
Unrelated()
asyncio.sleep(1)  # a coroutine never awaited: dropped
"""
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert "Exception ignored in: <function Unrelated.__del__" in result.stderr, result.stderr
  assert "never awaited" not in result.stderr


def test_the_compilation_cache_folder_is_the_flag_s_then_jax_s_variable_then_one_per_host(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "from_env"))
  assert compilation_cache.directory_for(str(tmp_path / "flag")) == str(tmp_path / "flag")
  assert compilation_cache.directory_for(None) == str(tmp_path / "from_env")
  assert compilation_cache.directory_for("") is None  # --compilation_cache_dir= turns it off
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  monkeypatch.setenv("HOME", str(tmp_path))
  # An XLA:CPU entry is machine code for the CPU that compiled it: machines sharing a home keep their own.
  assert compilation_cache.directory_for(None) == str(
    tmp_path / ".cache" / "light_jax" / "compilation_cache" / socket.gethostname()
  )


def test_a_compilation_cache_folder_that_cannot_be_used_is_named(tmp_path):
  """An entry is code the run executes: a folder another user owns or can write to is refused too."""
  (tmp_path / "file").write_text("")
  (tmp_path / "shared").mkdir(mode=0o777)
  os.chmod(tmp_path / "shared", 0o1777)  # as /tmp: the sticky bit keeps others' files, not their new ones, out
  assert compilation_cache.problem(str(tmp_path / "shared")).endswith(
    "is writable by other users (mode 1777), who could put code there that this run executes"
  )
  (tmp_path / "theirs").mkdir(mode=0o755)
  os.chown(tmp_path / "theirs", 65534, 65534)
  assert "belongs to another user (uid 65534)" in compilation_cache.problem(str(tmp_path / "theirs"))
  assert (
    compilation_cache.problem(str(tmp_path / "file" / "cache"))
    == f"{tmp_path}/file/cache cannot be made (Not a directory)"
  )
  assert compilation_cache.problem(str(tmp_path / "new" / "cache")) is None
  assert stat.S_IMODE(os.stat(tmp_path / "new" / "cache").st_mode) == 0o700  # made for this user alone
