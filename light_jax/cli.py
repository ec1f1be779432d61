"""Bad input on the command line: one ``error:`` line and exit code 2, never a traceback (train.py, scripts/)."""

from __future__ import annotations

import ast
import contextlib
import sys
from typing import NoReturn

from absl import flags

from light_jax.exit_codes import ExitCode

# What absl and ml_collections raise for a flag they cannot take: an unknown flag, a value of the wrong type,
# a --config.FIELD that names no field (AttributeError, KeyError), a config file that did not load (OSError).
FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError)


def fail(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(ExitCode.BAD_INPUT)


def flags_parser(*config_file_flags):
  """For ``app.run(main, flags_parser=...)``: absl's parsing, but any error is ``fail``'s one line.

  ``config_file_flags``: ml_collections' config-file flags, whose load error waits for the config's first use.
  """

  def parse(argv: list[str]) -> list[str]:
    try:
      argv = flags.FLAGS(argv)
      for flag in config_file_flags:
        if flag.value is not None:
          flag.value.keys()  # a config file that failed to load raises here
    except FLAG_ERRORS as e:
      fail(f"{describe_flag_error(e)} (--help lists the flags)")
    return argv

  return parse


def describe_flag_error(e: Exception) -> str:
  """One line from what absl and ml_collections raise, which may hold a whole traceback."""
  text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
  if text[:1] in "'\"":  # ml_collections quotes its KeyError's message, newlines escaped
    with contextlib.suppress(ValueError, SyntaxError):
      text = str(ast.literal_eval(text))
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if not lines:
    return type(e).__name__
  if "Traceback (most recent call last)" in text:  # raised inside the config file's get_config: its last line
    head = text.split("Error whilst parsing config file")[0].rstrip(": \n")
    return f"{head}: {lines[-1]}"
  if "Configuration is not available" in text:  # the config file did not load: why is on the last line
    return f"--config: cannot load the config file: {lines[-1]}"
  if isinstance(e, (AttributeError, KeyError)):  # a --config.FIELD=VALUE naming no field
    return f"no such config field {lines[0]}" + "".join(f"; {line}" for line in lines[1:])
  return " ".join(lines)
