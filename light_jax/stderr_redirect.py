"""The process's stderr sent to a file for a while, and a way past that for words that must be seen.

A failed checkpoint restore sends stderr (the file descriptor: C++ threads print there too) to a file for half
a second, to drop the noise of its abandoned reads (``checkpoint``). The peer watchdog (``liveness``) may have
to say why it stops the process in that half second, and then ends it at once with ``os._exit``: the file would
never be read. ``write`` reaches the real stderr in either case. A lock keeps the two apart, so that ``write``
never uses a descriptor that the end of a redirection is closing.

``drop_unraisables`` keeps reports of exceptions Python cannot raise ("Exception ignored in: ...") off stderr,
by a filter each caller names.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_real_stderr: int | None = None  # a duplicate of fd 2 from before the redirection, while one lasts


@contextlib.contextmanager
def redirected_to(file):
  """File descriptor 2 goes to ``file`` (an open file) for the block."""
  global _real_stderr
  with _lock:
    sys.stderr.flush()
    _real_stderr = os.dup(2)
    os.dup2(file.fileno(), 2)
  try:
    yield
  finally:
    with _lock:
      sys.stderr.flush()
      os.dup2(_real_stderr, 2)
      os.close(_real_stderr)
      _real_stderr = None


def is_redirected() -> bool:
  return _real_stderr is not None


def write(text: str) -> None:
  """``text`` on the real stderr, redirected or not."""
  sys.stderr.flush()
  with _lock:
    os.write(2 if _real_stderr is None else _real_stderr, text.encode())


def drop_unraisables(drops: Callable[[Any], bool], marker: str | None = None) -> None:
  """Chains a filter on ``sys.unraisablehook``: the reports ``drops`` returns True for are not printed, the others
  pass to the hook installed before. With ``marker``: nothing is done while the hook installed last carries it
  (a filter put on once, again where something put back an older hook)."""
  previous = sys.unraisablehook
  if marker is not None and getattr(previous, marker, False):
    return

  def hook(unraisable):
    if not drops(unraisable):
      previous(unraisable)

  if marker is not None:
    setattr(hook, marker, True)
  sys.unraisablehook = hook
