"""The emulated cluster (network namespaces on tc-shaped links) and the mesh lab that runs on it.

Needs root and iproute2, as on these machines and in CI; elsewhere these tests are skipped.
"""

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from light_jax import emulated_cluster
from light_jax.emulated_cluster import EmulatedCluster, LoopbackCluster, free_port, parse_rate
from light_jax.exit_codes import ExitCode
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
PEER_TIMEOUT = 6

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


def test_a_second_signal_during_close_does_not_cut_the_cleanup_short(monkeypatch):
  """Ctrl-C, then Ctrl-C again while close() removes the namespaces: the cleanup finishes, then the interrupt
  is raised once."""
  # Ctrl-C as in a terminal: under nohup or a background shell (CI) SIGINT is ignored, and the cluster leaves an
  # ignored signal alone.
  outside = signal.signal(signal.SIGINT, signal.default_int_handler)
  cluster = EmulatedCluster(2)
  sh = emulated_cluster._sh

  def interrupted(*args, **kwargs):
    if args[:3] == ("ip", "netns", "del") and args[3] == cluster.namespaces[0]:
      signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, in the middle of the cleanup
    return sh(*args, **kwargs)

  monkeypatch.setattr(emulated_cluster, "_sh", interrupted)
  try:
    with pytest.raises(KeyboardInterrupt):
      signal.raise_signal(signal.SIGINT)
    left = cluster.exists() or any(os.path.exists(f"/etc/netns/{ns}") for ns in cluster.namespaces)
  finally:
    monkeypatch.undo()
    cluster._cleanup()  # a failing run leaves no namespaces behind either
    restored = signal.signal(signal.SIGINT, outside)
  assert not left
  assert restored is signal.default_int_handler  # the handler from before the cluster, back in place


def test_a_signal_while_the_cluster_is_made_waits_until_what_is_made_is_recorded(monkeypatch):
  """Ctrl-C right after `ip link add` made a node's veth pair, before the cluster recorded it: the cluster is
  made up to there, then removed, veth pair included, and the interrupt raised."""
  outside = signal.signal(signal.SIGINT, signal.default_int_handler)
  sh = emulated_cluster._sh
  made = []

  def interrupted(*args, **kwargs):
    result = sh(*args, **kwargs)
    if args[:3] == ("ip", "link", "add") and "veth" in args:
      made.append(args[3])
      signal.raise_signal(signal.SIGINT)  # its handler runs before the link is recorded
    return result

  monkeypatch.setattr(emulated_cluster, "_sh", interrupted)
  try:
    with pytest.raises(KeyboardInterrupt):
      EmulatedCluster(2)
  finally:
    monkeypatch.undo()
    signal.signal(signal.SIGINT, outside)
  assert made  # the interrupt came while making
  links = sh("ip", "-o", "link", "show", check=False).stdout
  namespaces = sh("ip", "netns", "list", check=False).stdout
  prefix = made[0][: -len("h0")]  # ljIDh0 -> ljID
  assert prefix not in links and prefix not in namespaces, (links, namespaces)


def test_a_nodes_process_ends_with_the_lab_even_one_killed_with_sigkill(tmp_path):
  """The lab killed with SIGKILL (out of memory): its nodes' processes do not train on alone. (The 127.0.0.1
  cluster, which starts them the same way and leaves no namespace behind a SIGKILL.)"""
  pid_file = tmp_path / "child.pid"
  lab = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {ROOT!r})
    from light_jax.emulated_cluster import LoopbackCluster
    child = LoopbackCluster(1).run(0, [sys.executable, "-c", "import time; time.sleep(120)"])
    open({str(pid_file)!r}, "w").write(str(child.pid))
    time.sleep(120)
  """)
  process = subprocess.Popen([sys.executable, "-c", lab])
  deadline = time.time() + 60
  while not (pid_file.exists() and pid_file.read_text()):
    assert process.poll() is None and time.time() < deadline
    time.sleep(0.1)
  child = int(pid_file.read_text())
  process.kill()
  process.wait()

  def running() -> bool:  # an ended process may stay a zombie until whoever adopted it reaps it
    try:
      with open(f"/proc/{child}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
      return False

  deadline = time.time() + 10
  while running() and time.time() < deadline:
    time.sleep(0.1)
  assert not running()


def test_a_hangup_removes_the_cluster():
  """An ssh session dropped during a lab run (SIGHUP): the namespaces go, then the handler from before runs."""

  class HungUp(Exception):
    pass

  def hung_up(signum, frame):
    raise HungUp

  outside = signal.signal(signal.SIGHUP, hung_up)
  cluster = EmulatedCluster(1)
  try:
    with pytest.raises(HungUp):
      signal.raise_signal(signal.SIGHUP)
    left = cluster.exists()
  finally:
    cluster.close()
    restored = signal.signal(signal.SIGHUP, outside)
  assert not left and restored is hung_up


def test_two_clusters_open_at_once_each_keep_their_cleanup_whichever_closes_first():
  """Each cluster put back the handlers it found when it closed: the older one closed first, a SIGHUP then left
  the newer one's namespaces behind."""

  class HungUp(Exception):
    pass

  def hung_up(signum, frame):
    raise HungUp

  outside = signal.signal(signal.SIGHUP, hung_up)
  first, second = EmulatedCluster(1), EmulatedCluster(1)
  try:
    first.close()
    with pytest.raises(HungUp):
      signal.raise_signal(signal.SIGHUP)
    left = second.exists()
  finally:
    first.close()
    second.close()
    restored = signal.signal(signal.SIGHUP, outside)
  assert not left and restored is hung_up


@pytest.mark.parametrize("command", ["sleep 120 & echo $!; wait", "sleep 120 & echo $!"], ids=["waits", "exits"])
def test_closing_a_cluster_ends_what_its_nodes_started_too(command):
  """A node's process killed alone left its own children running (a shell's command, a worker pool), and so did
  one that had ended before the cluster closed."""
  cluster = LoopbackCluster(1)
  shell = cluster.run(0, ["sh", "-c", command], stdout=subprocess.PIPE, text=True)
  child = int(shell.stdout.readline())
  cluster.close()
  deadline = time.time() + 10
  while os.path.exists(f"/proc/{child}") and time.time() < deadline:
    with open(f"/proc/{child}/stat") as f:
      if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended; its adopter has yet to reap it
        break
    time.sleep(0.1)
  else:
    assert not os.path.exists(f"/proc/{child}")


def test_a_cluster_never_takes_or_removes_another_ones_names(monkeypatch):
  """The same draw of the random id twice (as two processes whose pids agree mod 10,000 can get): the second
  cluster takes another id. And one that cannot be made, its id taken meanwhile (check, then create), removes
  only what it made, not the other cluster's namespaces, links and hosts files."""
  state = random.getstate()
  first = EmulatedCluster(1)
  try:
    random.setstate(state)
    with EmulatedCluster(1) as second:
      assert second.id != first.id and first.exists() and second.exists()
    assert first.exists() and not second.exists()
    monkeypatch.setattr(emulated_cluster, "_free_id", lambda: first.id)
    with pytest.raises(emulated_cluster.ClusterError, match="File exists"):
      EmulatedCluster(1)
    assert first.exists() and os.path.exists(f"/etc/netns/{first.namespaces[0]}/hosts")
    assert first.id in subprocess.run(["ip", "link", "show", first.bridge], capture_output=True, text=True).stdout
  finally:
    first.close()
  assert not first.exists()


def test_an_unwritable_etc_is_a_cluster_error_and_leaves_nothing(monkeypatch):
  def read_only(path, *args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system", path)

  monkeypatch.setattr(emulated_cluster.os, "makedirs", read_only)
  with pytest.raises(emulated_cluster.ClusterError, match=r"cannot write /etc/netns/lj\w+/hosts \(Read-only"):
    EmulatedCluster(1)
  ours = f"lj{os.getpid() % 10000:04d}"  # this process's clusters' names (EmulatedCluster.id)
  listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  listed += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
  assert ours not in listed


@pytest.mark.parametrize("peer", ["gives_up", "hangs"])
def test_a_failing_job_names_the_first_node_to_fail_and_stops_the_rest(peer):
  """Node 1 fails at once; node 0, its peer, then fails too (1 s later) or hangs. The error names node 1, with its
  output, then node 0's last lines; it comes once node 0 has ended or its grace is over, not at the deadline."""
  script = (
    "import sys, time\n"
    "if sys.argv[-1] == '--process_id=1':\n"
    "  print('node 1: the cause'); sys.exit(3)\n"
    "print('node 0: waiting on its peer', flush=True)\n"
    f"time.sleep({1 if peer == 'gives_up' else 60}); print('node 0: peer failed'); sys.exit(4)\n"
  )
  with LoopbackCluster(2) as cluster:
    cluster.failure_grace = 2
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
      cluster.run_everywhere([sys.executable, "-c", script], timeout=6)
    assert time.perf_counter() - start < 4
    assert all(p.poll() is not None for p in cluster._processes)
  node_0 = "exited 4; its last lines:\n  node 0: waiting on its peer\n  node 0: peer failed"
  assert str(info.value) == (
    f"`{sys.executable} -c` on node 1 exited 3, the first node to fail:\nnode 1: the cause\n\nthen node 0 "
    + (node_0 if peer == "gives_up" else "was stopped; its last lines:\n  node 0: waiting on its peer")
  )


def test_a_process_0_that_fails_and_lingers_is_named_not_the_peer_that_read_its_failure():
  """Process 0 keeps the coordination service up a few seconds after its own failure (liveness.PeerWatchdog.close),
  so its peer, told of it, exits PEER_FAILURE first: the cause is still process 0."""
  script = (
    "import sys, time\n"
    "if sys.argv[-1] == '--process_id=1':\n"
    "  time.sleep(0.3); print('node 1: peer 0 failed'); sys.exit(4)\n"
    "print('node 0: the cause', flush=True); time.sleep(1.5); sys.exit(2)\n"
  )
  with LoopbackCluster(2) as cluster:
    cluster.failure_grace = 3
    with pytest.raises(RuntimeError) as info:
      cluster.run_everywhere([sys.executable, "-c", script], timeout=10)
  assert str(info.value).startswith(
    f"`{sys.executable} -c` on node 0 exited 2, the first node to fail:\nnode 0: the cause"
  )
  assert str(info.value).endswith("then node 1 exited 4; its last lines:\n  node 1: peer 0 failed")


def _mesh_lab(*extra):
  return subprocess.run(
    [sys.executable, "benchmarks/mesh_lab.py", "--nodes", "2", "--local", "2", "--bandwidth", "unshaped",
     "--strategies", "hierarchical", "--steps", "4", "--warmup", "2", "--set", "data.train_subset=1024",
     "--set", "global_batch_size=64", "--set", "data.eval_subset=200", "--set", "data.eval_batch_size=100", *extra],
    cwd=ROOT, capture_output=True, text=True, timeout=600,
  )  # fmt: skip


# The loopback run (for machines without root) repeats the namespace run's path but for the wiring: slow.
@pytest.mark.parametrize(
  "loopback", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["namespaces", "loopback"]
)
def test_two_namespace_training_run_through_the_mesh_lab(loopback):
  """train.py on 2 processes in 2 namespaces: step times recorded, and the bytes node 0 sent per step at
  least the accounted inter-node bytes of its devices (the rest: TCP/IP and the collectives outside the
  gradient reduction). --loopback: the same run on 127.0.0.1 without namespaces; no wire count there."""
  result = _mesh_lab(*(["--loopback"] if loopback else []))
  assert result.returncode == 0, result.stderr[-4000:]
  cell = json.loads(result.stdout.strip().splitlines()[-1])["hierarchical@unshaped"]
  assert (
    cell["inter_node_bytes_per_step"] == 616_148
  )  # 4 bytes x 308,074 / 2 devices: a ring over 2 nodes sends it once
  assert 0 < cell["step_seconds"] < 10
  if loopback:
    assert cell["wire_bytes_per_step"] is None
  else:
    assert (
      2 * cell["inter_node_bytes_per_step"] <= cell["wire_bytes_per_step"] < 3 * 2 * cell["inter_node_bytes_per_step"]
    )


# The loopback mode's refusal of a shaped bandwidth: tests/test_lab_inputs.py (check_args, and mesh_lab.py itself).


@pytest.mark.slow  # its check: test_lab_inputs.py::test_mesh_lab_refuses_bad_arguments_before_any_run
def test_a_plot_without_a_shaped_and_an_unshaped_bandwidth_is_refused_before_any_run(tmp_path):
  """Predicted step times need both (the unshaped step, its collectives moved to the shaped link)."""
  result = _mesh_lab("--loopback", "--plot", str(tmp_path / "lab.png"))
  assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
  assert "--plot draws predicted against measured step seconds, which needs an unshaped and a shaped" in result.stderr


def _train_pair(cluster, workdir, logs):
  """train.py on both machines, as on a real 2-machine cluster; a long run with frequent checkpoints."""
  port = free_port()
  args = ["--config", "configs/fashion_mnist.py", "--workdir", str(workdir), "--config.mesh.nodes=-1",
          "--config.mesh.local=-1", "--config.data.train_subset=1024", "--config.data.eval_subset=200",
          "--config.global_batch_size=64", "--config.data.eval_batch_size=96", "--config.num_epochs=6",
          "--config.checkpoint.every_steps=4", "--config.log_every_steps=2", f"--peer_timeout={PEER_TIMEOUT}",
          f"--coordinator={cluster.coordinator}:{port}", "--num_processes=2"]  # fmt: skip
  return [
    cluster.run(i, [sys.executable, "train.py", *args, f"--process_id={i}"], cwd=ROOT,
                env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=open(logs[i], "w"), stderr=subprocess.STDOUT)
    for i in range(2)
  ]  # fmt: skip


@pytest.mark.slow  # two whole fault drills, ~2 min each: `make test-all`
@pytest.mark.parametrize("fault", ["link_down", "killed"])
def test_a_machine_cut_off_or_killed_stops_the_run_and_the_same_command_resumes(tmp_path, fault):
  """Machine 1's link goes down (its process keeps running) or its process is killed, mid-run: machine 0
  stops within peer_timeout (+ slack) with a message that names it, and once the link is back the same
  command resumes from the newest checkpoint and finishes."""
  workdir, logs = tmp_path / "run", [tmp_path / "machine0.log", tmp_path / "machine1.log"]
  with EmulatedCluster(2) as cluster:
    procs = _train_pair(cluster, workdir, logs)
    deadline = time.time() + 300
    while not _checkpoints(workdir) or max(_checkpoints(workdir)) < 8:
      assert time.time() < deadline and all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
      time.sleep(0.05)
    if fault == "link_down":
      cluster.set_link(1, up=False)
    else:
      procs[1].kill()
    start = time.time()
    procs[0].wait(timeout=PEER_TIMEOUT + 60)
    out = logs[0].read_text()
    assert procs[0].returncode == ExitCode.PEER_FAILURE, out[-3000:]
    assert time.time() - start < PEER_TIMEOUT + 15
    # A dead peer's sockets close (a collective fails at once); a cut-off one is silent (the watchdog).
    assert "process 1 has given no sign of life" in out or "another process probably died" in out, out[-3000:]
    try:  # the cut-off machine loses its coordinator too: its watchdog (or JAX's heartbeat) ends it
      procs[1].wait(timeout=120)
    except subprocess.TimeoutExpired:
      pytest.fail("machine 1 was still running 120 s after its link went down")
    assert procs[1].returncode != 0
    saved = max(_checkpoints(workdir))

    if fault == "link_down":
      cluster.set_link(1, up=True)
    procs = _train_pair(cluster, workdir, [tmp_path / "again0.log", tmp_path / "again1.log"])
    for p in procs:
      assert p.wait(timeout=300) == ExitCode.OK, (tmp_path / "again0.log").read_text()[-3000:]
  assert f"resumed from the checkpoint at step {saved}" in (tmp_path / "again0.log").read_text()
  assert max(_checkpoints(workdir)) == 96  # 6 epochs of 16 steps: the run finished


def _checkpoints(workdir):
  d = workdir / "checkpoints"
  return [int(n) for n in os.listdir(d) if n.isdigit()] if d.is_dir() else []


@pytest.mark.parametrize("variant", [None, "gtopk_4x2", "shapes", "auto", "strategies"])
def test_mesh_experiment_configs_name_runnable_cells(variant):
  import importlib.util

  from light_jax.parallel import strategies

  spec = importlib.util.spec_from_file_location("mesh_experiments", os.path.join(ROOT, "configs/mesh_experiments.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  experiment = module.get_config(variant)
  assert all(nodes >= 2 and nodes * local == 8 for nodes, local in experiment.meshes)
  assert all(parse_rate(b) is None or parse_rate(b) > 0 for b in experiment.bandwidths)
  assert "unshaped" in experiment.bandwidths  # the prediction needs each strategy's compute-only step
  for text in experiment.strategies:
    name = text.partition("/")[0].partition("@")[0]
    assert name in (*strategies.NAMES, "auto"), text
  assert os.path.exists(os.path.join(ROOT, experiment.config))


def test_link_calibration_on_the_emulated_cluster_finds_the_shaped_rate(tmp_path):
  """benchmarks/calibrate_links.py on 2 namespaces at 20 Mbit/s: psums over `node` from both processes. The
  largest one moves its link bytes at the shaped rate less TCP/IP overhead (never faster: the shaper is the
  limit); the fitted bandwidth is near it. The fit of a few sub-second sizes spreads: 15.7-21.8 Mbit/s over
  22 calibrations beside a training run, medians of 1, 3 or 5 repeats alike (a CI run failed on 22.0 under
  the old bound of 20.5), against 17.4-18.8 for the largest size alone (10 of them; a CI run measured 15.3
  on it, its median of 3 slowed by a stall, while its fit said 17.4), so the largest size gets 30% below the
  rate and the fit 25% either way (an error in the link-byte count is a factor of 2 or more). The intra
  level (memory copies, not shaped) goes up to 16 MiB: up to 1 MiB its times are dispatch noise (0.5-7 ms
  beside a training run) and a CI run fitted a per-byte cost of 0 to them; from 2 MiB they grow with the
  size."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  from calibrate_links import calibrate_on_cluster

  rate = parse_rate("20mbit")
  with EmulatedCluster(2, bandwidth_bits=rate) as cluster:
    fit, output = calibrate_on_cluster(cluster, 2, str(tmp_path / "links.json"), repeats=3, max_seconds=0.3, max_mib=16)
  assert "2 processes" in output
  # the report's inter rows: level, buffer bytes, link bytes, seconds, fitted seconds
  inter = [line.split() for line in output.splitlines() if line.startswith("inter ")]
  assert inter, output
  link_bytes, seconds = int(inter[-1][2].replace(",", "")), float(inter[-1][3])
  assert 0.7 * rate < 8 * link_bytes / seconds <= rate, output
  assert 0.75 * rate < 8 / fit["inter"]["beta"] < 1.25 * rate, output
  assert fit["intra"]["beta"] > 0 and 0 <= fit["inter"]["alpha"] < 0.05
  assert 0 < fit["topk_elements_per_sec"] < float("inf"), output  # node 0's device's top-k rate, unshaped
