"""The emulated cluster (network namespaces on tc-shaped links) and the mesh lab that runs on it.

Needs root and iproute2, as on these machines and in CI; elsewhere these tests are skipped.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from light_jax.emulated_cluster import EmulatedCluster, parse_rate
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

SERVER = textwrap.dedent("""
  import socket, sys, time
  s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  s.bind((sys.argv[1], 5001)); s.listen(1); print("listening", flush=True)
  conn, _ = s.accept(); total = 0; start = None
  while chunk := conn.recv(1 << 16):
    start = start or time.perf_counter()
    total += len(chunk)
  print(total, time.perf_counter() - start, flush=True)
""")
CLIENT = textwrap.dedent("""
  import socket, sys
  s = socket.create_connection((sys.argv[1], 5001)); s.sendall(b"x" * int(sys.argv[2])); s.close()
""")


def _send(cluster, size):
  """Node 1 sends ``size`` bytes to node 0 over TCP; returns (seconds from first to last byte received,
  bytes received)."""
  server = cluster.run(0, [sys.executable, "-c", SERVER, cluster.addresses[0]], stdout=subprocess.PIPE, text=True)
  assert server.stdout.readline().strip() == "listening"
  cluster.run(1, [sys.executable, "-c", CLIENT, cluster.addresses[0], str(size)]).wait(timeout=60)
  received, seconds = server.communicate(timeout=60)[0].split()
  return float(seconds), int(received)


def test_parse_rate():
  assert parse_rate("50mbit") == 50_000_000 and parse_rate("1.5gbit") == 1_500_000_000
  assert parse_rate("unshaped") is None
  with pytest.raises(ValueError, match="not 'unshaped' or a rate"):
    parse_rate("50mb")


def test_shaped_link_carries_traffic_at_its_rate_and_everything_is_removed():
  with EmulatedCluster(2, bandwidth_bits=parse_rate("20mbit")) as cluster:
    assert cluster.exists() and all(os.path.exists(f"/etc/netns/{ns}/hosts") for ns in cluster.namespaces)
    before = cluster.sent_bytes(1)
    seconds, received = _send(cluster, 2_000_000)
    assert received == 2_000_000
    # 16 Mbit at 20 Mbit/s: 0.8 s, and the bucket lets at most a burst through early.
    assert 0.6 < seconds < 1.6, seconds
    assert 2_000_000 <= cluster.sent_bytes(1) - before < 2_200_000  # payload + TCP/IP headers
    cluster.shape(None)
    unshaped, _ = _send(cluster, 2_000_000)
    assert unshaped < seconds / 4
  assert not cluster.exists()
  assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in cluster.namespaces)


def test_failing_and_running_processes_do_not_keep_the_cluster_alive():
  cluster = EmulatedCluster(2)
  failed = cluster.run(0, [sys.executable, "-c", "raise SystemExit(3)"])
  hanging = cluster.run(1, [sys.executable, "-c", "import time; time.sleep(600)"])
  assert failed.wait(timeout=30) == 3
  start = time.perf_counter()
  cluster.close()
  assert hanging.poll() is not None and time.perf_counter() - start < 30
  assert not cluster.exists()
  cluster.close()  # idempotent


def test_two_namespace_training_run_through_the_mesh_lab():
  """train.py on 2 processes in 2 namespaces: step times recorded, and the bytes node 0 sent per step at
  least the accounted inter-node bytes of its devices (the rest: TCP/IP and the collectives outside the
  gradient reduction)."""
  result = subprocess.run(
    [sys.executable, "benchmarks/mesh_lab.py", "--nodes", "2", "--local", "2", "--bandwidth", "unshaped",
     "--strategies", "hierarchical", "--steps", "4", "--warmup", "2", "--set", "data.train_subset=1024",
     "--set", "global_batch_size=64", "--set", "data.eval_subset=200", "--set", "data.eval_batch_size=100"],
    cwd=ROOT, capture_output=True, text=True, timeout=600,
  )  # fmt: skip
  assert result.returncode == 0, result.stderr[-4000:]
  cell = json.loads(result.stdout.strip().splitlines()[-1])["hierarchical@unshaped"]
  assert (
    cell["inter_node_bytes_per_step"] == 616_148
  )  # 4 bytes x 308,074 / 2 devices: a ring over 2 nodes sends it once
  assert 0 < cell["step_seconds"] < 10
  assert (
    2 * cell["inter_node_bytes_per_step"] <= cell["wire_bytes_per_step"] < 3 * 2 * cell["inter_node_bytes_per_step"]
  )
