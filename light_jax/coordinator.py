"""Joining a multi-process run: the checks before a run started by hand (``--coordinator host:port``) joins JAX's
distributed runtime, and the join itself (``join``: a Ctrl-C or SIGTERM is taken while it waits).

Without them, most start-up mistakes were minutes of silence (``--init_timeout``, 300 s by default) and then a
C++ abort that blamed a dead peer ("another task died", exit 134):

* a host name that does not resolve, or nothing listening at the address (process 0 not started, not yet
  started, or on another machine);
* a port in use on process 0's machine: gRPC binds it with SO_REUSEPORT, so process 0 of a second run binds it
  too, and then both runs' processes meet the wrong coordinator and both runs abort (a run already training
  included).

Every process resolves the host; process 0 checks that the port is free on its machine; the others wait for
something to answer at the address, saying so, in a Python loop (Ctrl-C works there, not inside JAX's wait),
and give up with one line at ``--init_timeout``. The join itself gives up with one line too, where JAX aborted
5 s after ``--init_timeout`` when a process never came (not started, or stopped by its own start-up).
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import threading
import time
from collections.abc import Callable

from light_jax.exit_codes import ExitCode, exit_now, signals_exit_at_once


class CoordinatorError(ValueError):
  """The coordinator address cannot work; the message says what to change."""


def parse(address: str) -> tuple[str, int]:
  """``host:port`` (an IPv6 host in brackets, ``[::1]:1234``) -> (host, port)."""
  host, colon, port = address.rpartition(":")
  if host.startswith("[") and host.endswith("]"):
    host = host[1:-1]
  if not colon or not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
    raise CoordinatorError(
      f"--coordinator={address}: expected host:port, the port from 1 to 65535 (an IPv6 host in brackets: "
      "[::1]:1234), the same on every process"
    )
  return host, int(port)


def resolve(host: str, port: int) -> None:
  """Raises CoordinatorError if ``host`` has no address."""
  try:
    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
  except (socket.gaierror, UnicodeError) as e:  # UnicodeError: a label of over 63 characters
    reason = e.strerror if isinstance(e, socket.gaierror) else str(e)
    raise CoordinatorError(
      f"--coordinator={host}:{port}: cannot resolve {host!r} ({reason}); give the name or IP address by which "
      "every machine reaches process 0's machine"
    ) from None


def check_port_free(port: int) -> None:
  """For process 0: raises CoordinatorError if ``port`` is in use on this machine, on any address of either IP
  version, or not to be had. The probes take SO_REUSEADDR (a previous run's connections in TIME_WAIT do not count)
  but not SO_REUSEPORT (so a listener does)."""
  for family, any_address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):  # gRPC listens on [::]
    try:
      probe = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 on this machine
      continue
    with probe:
      probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      if family == socket.AF_INET6:  # also IPv4's addresses, as gRPC's socket (whatever net.ipv6.bindv6only says)
        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      try:
        probe.bind((any_address, port))
      except OSError as e:
        if e.errno == errno.EADDRINUSE:
          raise CoordinatorError(
            f"--coordinator: port {port} is in use on this machine (another run's coordinator, or another "
            "program); choose another port, the same in --coordinator on every process"
          ) from None
        if e.errno == errno.EACCES:
          raise CoordinatorError(
            f"--coordinator: port {port} cannot be taken here ({e.strerror}: ports below 1024 need root); choose "
            "a port from 1024 to 65535, the same in --coordinator on every process"
          ) from None
        # else an address family this machine does not serve


def wait_for(host: str, port: int, timeout_seconds: float, say: Callable[[str], None]) -> float:
  """For the processes other than 0: waits until something accepts a connection at host:port, saying once that it
  waits; returns the seconds left of ``timeout_seconds``. Raises CoordinatorError when none did in time."""
  deadline = time.monotonic() + timeout_seconds
  said = False
  while True:
    left = deadline - time.monotonic()
    try:
      with socket.create_connection((host, port), timeout=max(min(5.0, left), 0.1)):
        return max(deadline - time.monotonic(), 0.0)
    except OSError as e:
      reason = e.strerror or type(e).__name__
    if time.monotonic() >= deadline:
      raise CoordinatorError(
        f"nothing answered at --coordinator={host}:{port} in {timeout_seconds:g} s (--init_timeout; last: "
        f"{reason}): start process 0 there with the same --coordinator, or check the address, and that the port "
        "is open between the machines"
      )
    if not said:
      say(f"waiting for process 0 at {host}:{port} ({reason}), up to --init_timeout={timeout_seconds:g} s")
      said = True
    time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))


def wait_until_reachable(address: str, process_id: int, num_processes: int, init_timeout: int) -> int:
  """Before joining at ``address`` (--coordinator): the host resolves; process 0's port is free; the others wait
  for process 0 to answer. Returns the seconds left of ``init_timeout`` for JAX's own wait. Raises
  CoordinatorError."""
  host, port = parse(address)
  resolve(host, port)
  if process_id == 0:
    check_port_free(port)
    logging.info(
      "process 0: waiting for the other %d process(es) to join at port %d (up to --init_timeout=%d s)",
      num_processes - 1,
      port,
      init_timeout,
    )
    return init_timeout
  left = wait_for(host, port, init_timeout, lambda line: logging.info("%s", line))
  return max(int(left), 10)  # the others may still be joining


def join(jax, *args, not_joined: str, **kwargs) -> None:
  """jax.distributed.initialize(*args, **kwargs), which waits in C++ for every process, where a Ctrl-C is not seen,
  and aborts the process 5 s after ``initialization_timeout`` when one never comes (a C++ check failure blaming
  "another task died", exit 134; a process that came later than process 0 goes on retrying the vanished
  coordinator until its own timeout). It runs in a thread, and this one waits for it in 0.5 s slices (a signal
  handler runs only between them): it takes a Ctrl-C or SIGTERM, with handlers of its own (a script's background
  job starts with SIGINT ignored), and gives up at ``initialization_timeout`` with ``not_joined``'s line and exit
  code 4."""
  failed = []

  def initialize():
    try:
      jax.distributed.initialize(*args, **kwargs)
    except BaseException as e:  # raised again in the main thread
      failed.append(e)

  timeout = kwargs.get("initialization_timeout")
  deadline = None if timeout is None else time.monotonic() + timeout
  with signals_exit_at_once("waiting for the other processes to join; nothing to save."):
    joining = threading.Thread(target=initialize, name="jax.distributed.initialize", daemon=True)
    joining.start()
    while joining.is_alive():
      joining.join(0.5)
      if deadline is not None and joining.is_alive() and time.monotonic() >= deadline:
        exit_now(f"error: {not_joined}", ExitCode.PEER_FAILURE)
  if failed:
    raise failed[0]
