"""An emulated cluster on one machine: N "machines" = N Linux network namespaces on shaped links.

Each node is a network namespace with its own address, joined to the others through a veth pair to a
bridge in the root namespace. Each node's egress is shaped with ``tc`` (a token bucket, ``tbf``) to the
inter-node bandwidth, so everything a node sends to another one crosses a link of that rate. The kernel
here has no ``sch_netem``, so no latency is added: it is whatever the veth and bridge give (tens of
microseconds). A process started with ``run`` lives in its node's namespace and reaches the others only
through the shaped links, so ``train.py`` runs there as it would on separate machines (one process per
node, ``jax.distributed`` over gloo).

Two traps of gloo in namespaces are handled here:
- the coordinator address must be node 0's namespace address (``coordinator``), not 127.0.0.1;
- gloo advertises the address the hostname resolves to (127.0.0.1 on these machines), so peers would
  connect to themselves: ``ip netns exec`` bind-mounts ``/etc/netns/NS/hosts`` over ``/etc/hosts``,
  and each node gets one that maps the hostname to its own address.

Needs root and iproute2. Names carry a per-run id that no namespace, link or hosts file uses yet, and
``close`` (also called on exit and on SIGTERM/SIGINT/SIGHUP) removes every namespace, link, qdisc and hosts
file this cluster made, and only those: a cluster that could not be made leaves another one's alone.
Traffic only goes to the addresses of the namespaces made here.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from light_jax import child_process, coordinator
from light_jax.exit_codes import ExitCode


class ClusterError(RuntimeError):
  """The emulated cluster cannot be made here; the message says why and what to do instead."""


def check_privileges() -> None:
  """Raises ClusterError unless this process can make namespaces (root and iproute2)."""
  if os.geteuid() != 0:
    raise ClusterError(
      "an emulated cluster needs root (network namespaces, veth links, tc); run as root, or use the unshaped "
      "127.0.0.1 mode (benchmarks/mesh_lab.py --loopback --bandwidth unshaped)"
    )
  if shutil.which("ip") is None or shutil.which("tc") is None:
    raise ClusterError(
      "an emulated cluster needs iproute2 (`ip`, `tc`): apt-get install -y iproute2, or use the unshaped "
      "127.0.0.1 mode (benchmarks/mesh_lab.py --loopback --bandwidth unshaped)"
    )


# What tc's token bucket holds as shape() sets it (checked with tc on a veth pair): below 1 kbit/s its 16 KiB bucket
# is longer than the ~275 s a bucket may last, and tc cut it short (to 166 bytes at 8 bit/s: less than a packet);
# above 300 Gbit/s its queue (100 ms at the rate) passes 4 GiB, and tc cut the queue's latency (14 ms at 400 Gbit/s).
MIN_RATE_BITS, MAX_RATE_BITS = 10**3, 3 * 10**11


def parse_rate(text: str) -> int | None:
  """ "50mbit" -> 50_000_000 bits/s; "unshaped" -> None. Units: bit, kbit, mbit, gbit (powers of 1000)."""
  text = text.strip().lower()
  if text == "unshaped":
    return None
  for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
    if text.endswith(unit):
      try:
        bits = float(text[: -len(unit)]) * scale
      except ValueError:
        break
      if not math.isfinite(bits) or not MIN_RATE_BITS <= bits <= MAX_RATE_BITS:
        raise ValueError(f"bandwidth {text!r} must be a rate from 1kbit to 300gbit (bits/s), e.g. '10mbit'; "
                         "'unshaped' for no limit")  # fmt: skip
      return int(bits)
  raise ValueError(f"bandwidth {text!r} is not 'unshaped' or a rate like '10mbit', '500kbit', '1gbit'")


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
  # In a session of its own: a terminal's Ctrl-C goes to the whole foreground group, and an `ip ... add` cut
  # short could leave what it made unrecorded; these commands are short, and the cluster acts on the signal after.
  result = subprocess.run(args, capture_output=True, text=True, start_new_session=True)
  if check and result.returncode:
    raise ClusterError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
  return result


class _Machines:
  """What both clusters share: one process per node started together as one multi-process job, and the
  cleanup of what they started (and made) on ``close``, at exit and on SIGTERM/SIGINT/SIGHUP."""

  nodes: int
  failure_grace = 10.0  # seconds the other nodes get to end once one has failed (process 0 lingers ~6 s to tell)

  def __init__(self):
    self._processes: list[subprocess.Popen] = []
    # While making the cluster or starting a process a signal waits (_deferred_signal): acted on at once, the
    # cleanup would miss a namespace, link or process made but not yet recorded.
    self._making = False
    self._closing = self._closed = False  # close() has started; it has finished
    self._deferred_signal = None
    self._lock = threading.RLock()  # reentrant: the signal handler may call close() inside close()'s lock
    atexit.register(self.close)
    _opened(self)

  def run(self, node: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    raise NotImplementedError

  def run_everywhere(self, argv: Sequence[str], timeout: float, **popen_kwargs) -> list[str]:
    """Runs ``argv`` + ``--process_id=NODE`` on every node at once, as one multi-process job, for at most
    ``timeout`` seconds in all; returns each node's output (stdout and stderr), or raises RuntimeError naming
    the first node that failed, with its output and the last lines of the others that failed or were stopped
    (``failure_grace`` seconds after it), or the nodes still running at the deadline, which are then killed."""
    procs = [
      self.run(
        node,
        [*argv, f"--process_id={node}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",  # a node's stray bytes must not kill its reader
        **popen_kwargs,
      )  # fmt: skip
      for node in range(self.nodes)
    ]
    # Every node's output is drained as it comes, each by a thread of its own: read one node after another, a
    # later node whose pipe filled (64 KiB) would block in its write, and its peers with it in a collective.
    # In chunks, so a node whose child still holds the pipe at the end keeps what it wrote.
    chunks: list[list[str]] = [[] for _ in procs]

    def drain(proc: subprocess.Popen, out: list[str]) -> None:
      for chunk in iter(lambda: proc.stdout.read(65536), ""):
        out.append(chunk)

    readers = [threading.Thread(target=drain, args=(p, out), daemon=True) for p, out in zip(procs, chunks)]
    for reader in readers:
      reader.start()
    deadline = time.monotonic() + timeout  # one for the job: waiting node by node would allow nodes x timeout
    # All nodes are watched at once. Once one fails its peers fail too ("peer failed", exit PEER_FAILURE), some
    # only after a timeout of their own, and process 0 lingers a few seconds after its own failure so that they
    # can read why: they get failure_grace seconds to end, then are stopped.
    exited, stopped = [], []  # the nodes in the order they ended; those killed at the deadline
    graced = False  # whether the deadline has been brought to failure_grace after the first failure
    try:
      while True:
        exited += [node for node, p in enumerate(procs) if p.poll() is not None and node not in exited]
        if not graced and any(procs[node].returncode for node in exited):
          deadline, graced = min(deadline, time.monotonic() + self.failure_grace), True
        running = [node for node, p in enumerate(procs) if p.returncode is None]
        if not running:
          break
        if time.monotonic() >= deadline:
          for node in running:
            _kill_group(procs[node])
          stopped = running
          break
        time.sleep(0.02)
    finally:
      # What an ended node's process left in its group goes now, not at close: by then the group may be gone and
      # its id another process group's, which close (as root) would kill.
      for proc in procs:
        if proc.returncode is not None:
          _kill_group(proc)
          with contextlib.suppress(ValueError):
            self._processes.remove(proc)
      # The pipes close when the processes end; a child left holding one is given up on after 5 s in all.
      readers_deadline = time.monotonic() + 5
      for reader in readers:
        reader.join(timeout=max(readers_deadline - time.monotonic(), 0))
      for proc, reader in zip(procs, readers):
        if not reader.is_alive():  # closing a pipe under a blocked read is not safe; a stuck one is left open
          proc.stdout.close()
    outputs = ["".join(out) for out in chunks]
    command = " ".join(argv[:2])
    failed = [node for node in exited if procs[node].returncode]
    if stopped and not failed:
      last = "".join(f"\nnode {node}'s last lines:" + _last_lines(outputs[node]) for node in stopped)
      raise RuntimeError(
        f"`{command}` on node(s) {', '.join(map(str, stopped))} still ran after {timeout:g} s (the limit for the "
        f"whole job); raise the timeout (e.g. --timeout) or run fewer steps{last}"
      )
    if failed:
      # The cause: the first to end with its own error; one that only reports a peer's failure is an effect.
      first = next((node for node in failed if procs[node].returncode != ExitCode.PEER_FAILURE), failed[0])
      message = f"`{command}` on node {first} exited {procs[first].returncode}, the first node to fail:\n"
      message += outputs[first][-3000:]
      for node in [*failed, *stopped]:
        if node != first:
          how = "was stopped" if node in stopped else f"exited {procs[node].returncode}"
          message += f"\nthen node {node} {how}; its last lines:" + _last_lines(outputs[node])
      raise RuntimeError(message)
    return outputs

  def _cleanup(self) -> None:
    """Kills the processes still running; a cluster that made more removes it too. Each step may run twice."""
    for proc in self._processes:
      _kill_group(proc)

  def close(self) -> None:
    """Kills the processes still running and removes everything this cluster made (idempotent). A SIGINT,
    SIGTERM or SIGHUP during it is acted on once it is done: cut short, it would leave namespaces and links behind."""
    with self._lock:
      if self._closing:
        return
      self._closing = True
    try:
      self._cleanup()
    finally:
      handlers = _closed(self)
      atexit.unregister(self.close)
      self._closed = True
    if self._deferred_signal:
      _pass_on(handlers, *self._deferred_signal)

  def _busy(self) -> bool:
    """Making something (see __init__), or inside close() (a second Ctrl-C while it removes links)."""
    return self._making or (self._closing and not self._closed)

  @contextlib.contextmanager
  def _making_something(self):
    """Signals wait until what is made inside is recorded; then a waiting one closes the cluster and is passed on."""
    self._making = True
    try:
      yield
    finally:
      self._making = False
    if self._deferred_signal and not self._closing:
      self.close()  # passes the signal on

  def _start(self, argv: Sequence[str], popen_kwargs: dict) -> subprocess.Popen:
    """Starts a node's process, recorded for ``close``; it ends with this process, even one killed with SIGKILL.
    In a process group of its own (a new session), which ``close`` kills whole: what the node's process started
    goes with it."""
    with self._making_something():
      proc = subprocess.Popen(
        list(argv),
        preexec_fn=child_process.bound_to_this_process(),
        start_new_session=True,
        **popen_kwargs,
      )
      self._processes.append(proc)
    return proc

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class LoopbackCluster(_Machines):
  """The unshaped 127.0.0.1 mode, for machines without root or iproute2: ``nodes`` processes on this
  machine's loopback, joined through jax.distributed on 127.0.0.1 like several machines. No namespaces,
  so nothing to clean up but the processes, and nothing to shape, cut or count per node: links run at
  memory speed, and their bytes are not measured (``measures_wire`` False)."""

  measures_wire = False
  coordinator = "127.0.0.1"
  bandwidth_bits = None

  def __init__(self, nodes: int):
    if nodes < 1:
      raise ClusterError(f"nodes={nodes}: use at least 1")
    self.nodes = nodes
    super().__init__()

  def shape(self, bandwidth_bits: int | None) -> None:
    if bandwidth_bits:
      raise ClusterError(
        "the 127.0.0.1 mode cannot shape links (that needs root and tc: network namespaces); use --bandwidth unshaped"
      )

  def run(self, node: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    return self._start(argv, popen_kwargs)


class EmulatedCluster(_Machines):
  """``nodes`` namespaces on a bridge, each node's egress shaped to ``bandwidth_bits`` (None: unshaped).

  Use as a context manager; ``run(node, argv)`` starts a process in a node, ``sent_bytes(node)`` reads
  what the node has sent over its link so far.
  """

  measures_wire = True  # each node's traffic crosses its own link, counted in sysfs

  def __init__(self, nodes: int, bandwidth_bits: int | None = None):
    check_privileges()
    if nodes < 1 or nodes > 200:
      raise ClusterError(f"nodes={nodes}: use 1 to 200")
    self.nodes = nodes
    self.id = _free_id()
    self.subnet = ipaddress.ip_network(f"10.{random.randrange(64, 128)}.{random.randrange(256)}.0/24")
    self.bridge = f"lj{self.id}b"
    self.namespaces = [f"lj{self.id}n{i}" for i in range(nodes)]
    self.host_links = [f"lj{self.id}h{i}" for i in range(nodes)]  # the bridge's end of each node's link
    self.node_links = [f"lj{self.id}c{i}" for i in range(nodes)]  # the node's end
    self.addresses = [str(self.subnet[i + 1]) for i in range(nodes)]
    self.bandwidth_bits = bandwidth_bits
    self._made: set[str] = set()  # the namespaces, links and hosts directories made here: close removes these
    super().__init__()  # the cleanup handlers, before anything is made
    try:
      with self._making_something():
        self._create()
    except BaseException:
      self.close()
      raise

  def _create(self) -> None:
    _sh("ip", "link", "add", self.bridge, "type", "bridge")
    self._made.add(self.bridge)
    _sh("ip", "link", "set", self.bridge, "up")
    hostname = socket.gethostname()
    for ns, host_link, node_link, address in zip(self.namespaces, self.host_links, self.node_links, self.addresses):
      _sh("ip", "netns", "add", ns)
      self._made.add(ns)
      _sh("ip", "link", "add", host_link, "type", "veth", "peer", "name", node_link)
      self._made.add(host_link)
      _sh("ip", "link", "set", node_link, "netns", ns)
      _sh("ip", "link", "set", host_link, "master", self.bridge)
      _sh("ip", "link", "set", host_link, "up")
      _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", node_link)
      _sh("ip", "netns", "exec", ns, "ip", "link", "set", node_link, "up")
      _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
      try:
        os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
        self._made.add(f"/etc/netns/{ns}")
        with open(f"/etc/netns/{ns}/hosts", "w") as f:  # gloo advertises what the hostname resolves to
          f.write(f"127.0.0.1 localhost\n{address} {hostname}\n")
      except OSError as e:
        raise ClusterError(
          f"cannot write /etc/netns/{ns}/hosts ({e.strerror}): each node needs a hosts file there (`ip netns exec` "
          "mounts it over /etc/hosts); make /etc writable, or use the unshaped 127.0.0.1 mode "
          "(benchmarks/mesh_lab.py --loopback --bandwidth unshaped)"
        ) from e
    self.shape(self.bandwidth_bits)

  def shape(self, bandwidth_bits: int | None) -> None:
    """Sets every node's egress rate (None: removes the shaping)."""
    for ns, link in zip(self.namespaces, self.node_links):
      _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", link, "root", check=False)
      if bandwidth_bits:
        # The bucket (burst, in bytes) is 1 ms at the rate but at least 16 KiB (tbf needs one MTU-sized packet):
        # below 131 Mbit/s it is 16 KiB, 13 ms of link time at 10 Mbit/s and 131 ms at 1 Mbit/s, which a link idle
        # that long sends unshaped (README, Mesh lab). Up to 100 ms of traffic queues behind it.
        burst = max(bandwidth_bits // 8 // 1000, 16 * 1024)
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", f"{bandwidth_bits}bit",
            "burst", str(burst), "latency", "100ms")  # fmt: skip
    self.bandwidth_bits = bandwidth_bits

  @property
  def coordinator(self) -> str:
    """Node 0's address, for ``jax.distributed`` (``--coordinator=ADDRESS:PORT``)."""
    return self.addresses[0]

  def run(self, node: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
    """Starts ``argv`` in ``node``'s namespace; ``close`` kills it if it is still running."""
    return self._start(["ip", "netns", "exec", self.namespaces[node], *argv], popen_kwargs)

  def set_link(self, node: int, up: bool) -> None:
    """Takes ``node``'s link down (as if its cable were pulled: its processes keep running) or up again."""
    _sh("ip", "link", "set", self.host_links[node], "up" if up else "down")

  def sent_bytes(self, node: int) -> int:
    """Bytes ``node`` has sent over its link (counted at the bridge's end, which receives them)."""
    with open(f"/sys/class/net/{self.host_links[node]}/statistics/rx_bytes") as f:
      return int(f.read())

  def exists(self) -> bool:
    """Whether any of this cluster's namespaces or links is still there."""
    namespaces = _sh("ip", "netns", "list", check=False).stdout
    links = _sh("ip", "-o", "link", "show", check=False).stdout
    return f"lj{self.id}" in namespaces or f"lj{self.id}" in links

  def _cleanup(self) -> None:
    super()._cleanup()
    for ns in self.namespaces:  # deleting a namespace deletes its end of the veth pair, hence the pair
      if ns in self._made:
        _sh("ip", "netns", "del", ns, check=False)
      if f"/etc/netns/{ns}" in self._made:
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    for link in [*self.host_links, self.bridge]:
      if link in self._made:
        _sh("ip", "link", "del", link, check=False)


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the ssh session or terminal closed
_open_clusters: list[_Machines] = []  # this process's, oldest first: one signal handler serves them all
_handlers_before: dict[int, Any] = {}  # the handlers it replaced, put back once the last cluster closes
_installed = False  # whether it is installed (signal handlers are set on the main thread only)


def _on_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def _opened(cluster: _Machines) -> None:
  global _installed
  if not _installed and _on_main_thread():
    for sig in _SIGNALS:
      if signal.getsignal(sig) is not signal.SIG_IGN:  # a signal ignored (nohup, a background job) stays so
        _handlers_before[sig] = signal.signal(sig, _on_signal)
    _installed = True
  _open_clusters.append(cluster)


def _closed(cluster: _Machines) -> dict[int, Any]:
  """Forgets ``cluster``; returns the handlers a signal it deferred is passed on to. Each cluster put back the
  handlers it found, before: two open at once, closed oldest first, left the other without its cleanup. Off the
  main thread the handler stays (it passes a signal on when no cluster is open) until a close on it."""
  global _installed
  with contextlib.suppress(ValueError):
    _open_clusters.remove(cluster)
  handlers = dict(_handlers_before)
  if not _open_clusters and _installed and _on_main_thread():
    for sig, handler in _handlers_before.items():
      signal.signal(sig, handler)
    _handlers_before.clear()
    _installed = False
  return handlers


def _on_signal(signum, frame) -> None:
  """Closes every open cluster, newest first, then passes the signal on. A cluster busy making something or
  closing finishes first, then closes and passes it on itself (atexit closes the others)."""
  busy = next((c for c in reversed(_open_clusters) if c._busy()), None)
  if busy is not None:
    busy._deferred_signal = busy._deferred_signal or (signum, frame)
    return
  handlers = dict(_handlers_before)
  for cluster in reversed(list(_open_clusters)):
    cluster.close()
  _pass_on(handlers, signum, frame)


def _pass_on(handlers: dict[int, Any], signum, frame) -> None:
  handler = handlers.get(signum)
  if callable(handler):
    handler(signum, frame)
  else:
    raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
  """Kills a node's process group (the node's process and what it started), also where the process itself has
  ended and left children (Linux reuses no pid while its process group exists)."""
  with contextlib.suppress(ProcessLookupError, PermissionError):  # ESRCH: the group is gone
    os.killpg(proc.pid, signal.SIGKILL)
  if proc.poll() is None:
    proc.kill()  # not in a group of its own (a Popen made elsewhere): the process alone
    # Bounded: a signal handler's close can interrupt the main thread inside a poll of this process, holding the
    # lock an unbounded wait takes (a deadlock); a timed wait does not take it.
    with contextlib.suppress(subprocess.TimeoutExpired):
      proc.wait(timeout=5)


def _free_id() -> str:
  """An id for a cluster's names (this process's pid mod 10,000, then 2 random digits; names stay within 15
  characters) that no namespace, link or /etc/netns directory uses yet. Checked, not reserved: a cluster made
  with the same id meanwhile makes ``_create`` fail, and the failed one removes only what it made."""
  taken = _sh("ip", "netns", "list", check=False).stdout + _sh("ip", "-o", "link", "show", check=False).stdout
  taken += " ".join(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else ""
  for suffix in random.sample(range(100), 100):
    cluster_id = f"{os.getpid() % 10000:04d}{suffix:02d}"
    if f"lj{cluster_id}" not in taken:
      return cluster_id
  raise ClusterError(f"all 100 cluster ids of process {os.getpid()} are in use: close some clusters (`ip netns list`)")


def report_failure(what: str, error: RuntimeError) -> None:
  """A failed job (``run_everywhere``'s RuntimeError): its nodes' output, then one line naming it."""
  first, _, output = str(error).partition("\n")
  if output.strip():
    print(output.rstrip(), file=sys.stderr)
  print(f"error: {what} failed: {first.rstrip(':')}", file=sys.stderr, flush=True)


def _last_lines(output: str, count: int = 3) -> str:
  return "".join(f"\n  {line}" for line in output.splitlines()[-count:])


def free_port() -> int:
  """A TCP port free on this machine now (coordinator.check_port_free: process 0 takes it only then), for a
  jax.distributed coordinator, which binds it seconds later. Drawn below the kernel's range for outgoing
  connections' ports (ip_local_port_range): a port from that range, free now, can be taken by any connection in
  between (gloo's and grain's among them). In an emulated machine's namespace every port is free."""
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      ephemeral_low = int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    ephemeral_low = 32768  # Linux's default
  if ephemeral_low > 10000 + 100:  # else no range below it to draw from
    for _ in range(100):
      port = random.randrange(10000, ephemeral_low)
      try:
        coordinator.check_port_free(port)
      except coordinator.CoordinatorError:
        continue
      return port
  with socket.socket() as s:  # one the kernel picks
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
