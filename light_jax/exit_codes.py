"""Exit codes of ``train.py``, for scripts and cluster managers that restart runs."""

import enum


class ExitCode(enum.IntEnum):
  OK = 0  # finished, or preempted after saving a checkpoint (rerun to resume)
  ERROR = 1  # an unexpected error in this process (its traceback is printed)
  BAD_INPUT = 2  # invalid config, missing or corrupt data, unusable checkpoint: the message says what to fix
  NONFINITE_STOP = 3  # non-finite loss with train.on_nonfinite=stop: checkpoint saved, every process stopped
  PEER_FAILURE = 4  # another process of a multi-process run died, hung, failed, or never joined
