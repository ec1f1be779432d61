"""Bad input on the command line: one ``error:`` line and exit code 2, never a traceback (train.py, scripts/)."""

from __future__ import annotations

import argparse
import ast
import atexit
import contextlib
import functools
import os
import re
import sys
import tempfile
import traceback
from typing import NoReturn

import ml_collections
from absl import flags
from ml_collections import config_flags

from light_jax.exit_codes import ExitCode, signals_exit_at_once

# What absl and ml_collections raise for a flag they cannot take: an unknown flag, a value of the wrong type,
# a --config.FIELD that names no field (AttributeError, KeyError), a config file that did not load (OSError).
FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError)
_NOT_LOADED = "Configuration is not available because of an earlier failure to load: "


_HELP_FLAGS = ("help", "?", "helpshort", "helpfull", "helpxml")  # absl's
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # configs/ is there (an editable install)

# Where to look next, after an error's one line.
FIELDS_HINT = "base_config() in light_jax/config.py lists the fields"
FLAGS_HINT = "--help lists the flags"


class CommandLineError(ValueError):
  """A flag the program cannot take; the message is one line that says which and why, then, in parentheses,
  ``hint`` (where to look next) if there is one."""

  def __init__(self, message: str, hint: str | None = None):
    super().__init__(f"{message} ({hint})" if hint else message)


def fail(message: str) -> NoReturn:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(ExitCode.BAD_INPUT)


def define_config_file(name: str, help_text: str, **kwargs):
  """ml_collections' ``DEFINE_config_file(name, None, help_text, **kwargs)``, which reads the command line as it is
  defined (a --flagfile that cannot be opened raises then): a mistake there is ``fail``'s one line."""
  try:
    return config_flags.DEFINE_config_file(name, None, help_text, **kwargs)
  except FLAG_ERRORS as e:
    error = describe_flag_error(e, sys.argv)
    if error is None:  # not the command line's: a bug, with its traceback
      raise
    fail(str(error))


def flags_parser(*config_file_flags):
  """For ``app.run(main, flags_parser=...)``: absl's parsing, but a mistake on the command line is ``fail``'s
  one line (a config file that is not Python, or has a syntax error, too). An error raised while a config file runs,
  or in a module it imports, keeps its traceback.

  ``config_file_flags``: ml_collections' config-file flags, whose load error waits for the config's first use.
  """

  def parse(argv: list[str]) -> list[str]:
    try:
      rest = _parse(flags.FLAGS, argv, [flag.name for flag in config_file_flags])
    except CommandLineError as e:
      fail(str(e))
    except SystemExit as e:  # absl exits 1 after the help it was asked for, the code of an unexpected error here
      asked_for_help = any(arg.split("=")[0].lstrip("-") in _HELP_FLAGS for arg in argv[1:])
      sys.exit(ExitCode.OK if e.code == 1 and asked_for_help else e.code)
    if rest[1:]:  # an override without its dashes would be dropped without a word, and the run go on without it
      fail(f"unexpected argument(s) {' '.join(rest[1:])}: give flags only (a config override looks like "
           "--config.num_epochs=3)")  # fmt: skip
    return rest

  return parse


def resolve_config(config_file: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """The config that ``train.py --config=CONFIG_FILE OVERRIDES`` runs, its overrides parsed as train.py parses
  them (an override of a bool field may read ``true``, of a string field any text).

  Raises:
    CommandLineError: for a file or override train.py would refuse.
  """
  argv = ["train.py", f"--config={config_file}", *overrides]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, lock_config=True, sys_argv=argv)
  _parse(values, argv, ["config"])
  return values.config


def int_at_least(minimum: int):
  """An argparse ``type``: an int >= ``minimum``, else argparse's one-line error naming the flag."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
    return value

  return parse


# train.py's --peer_timeout: below it, a process busy compiling or loading can miss its heartbeats, and its peers
# stop it for dead.
MIN_PEER_TIMEOUT = 5.0
# The longest timeout: 11 days. JAX takes its timeouts in milliseconds as 32-bit ints (its heartbeat's is four times
# --peer_timeout, at most twice this: liveness.heartbeat_timeout).
MAX_SECONDS = 1e6


def check_seconds(args: argparse.Namespace, *names: str) -> None:
  """Raises ValueError naming the first flag of ``names`` (attributes of ``args``) that is not a number of seconds
  > 0 and at most MAX_SECONDS (``peer_timeout``: at least MIN_PEER_TIMEOUT): a timeout of 0 fails every job, and
  nan never stops a hung one."""
  for name in names:
    value = getattr(args, name)
    if not 0 < value <= MAX_SECONDS:  # nan too
      raise ValueError(f"--{name} {value} must be a number of seconds > 0 and at most {MAX_SECONDS:.0f}")
    if name == "peer_timeout" and value < MIN_PEER_TIMEOUT:
      raise ValueError(f"--peer_timeout {value} must be at least {MIN_PEER_TIMEOUT:g} seconds (train.py's floor)")


# The most devices a benchmark's mesh may have: one machine's GPUs, or CPU devices simulated in one process (thousands
# crashed it, or failed after a minute with "Multiprocess computations aren't implemented on the CPU backend"; in
# train.py 1,024 stalled in the first steps' collectives).
MAX_DEVICES = 512


def check_device_count(count: int, flags_given: str) -> None:
  """``fail``s where a benchmark's ``count`` devices (from ``flags_given``, as typed) exceed MAX_DEVICES."""
  if count > MAX_DEVICES:
    fail(
      f"{flags_given}: {count:,} devices; this benchmark runs on one machine's devices (on the CPU, simulated), at "
      f"most {MAX_DEVICES}: predict a larger cluster with scripts/simulate.py"
    )


def out_of_memory(e: BaseException) -> str | None:
  """What ran out of memory, where ``e`` says a device or this machine did, else None: XLA's "RESOURCE_EXHAUSTED:
  Out of memory ..." or "RESOURCE_EXHAUSTED: Failed to allocate ..." (a GPU's, and the CPU's past its limit; not
  any RESOURCE_EXHAUSTED: gRPC's message size, say), numpy's MemoryError."""
  if isinstance(e, MemoryError):
    return f"this machine's memory ({str(e) or type(e).__name__})"
  first = str(e).strip().split("\n", 1)[0]
  if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and (
    "out of memory" in first.lower() or "failed to allocate" in first.lower()
  ):
    return f"the device's memory ({first})"
  return None


@contextlib.contextmanager
def out_of_memory_fails(smaller: str):
  """Inside, an ``out_of_memory`` error is ``fail``'s one line, which names the flags that ask for less
  (``smaller``), instead of the allocator's traceback."""
  try:
    yield
  except Exception as e:
    ran_out = out_of_memory(e)
    if ran_out is None:
      raise
    fail(f"out of {ran_out}: ask for less, {smaller}")


@contextlib.contextmanager
def measuring(smaller: str):
  """A device benchmark's measurement: a Ctrl-C or SIGTERM exits at once in one line, running its exit handlers
  (``exit_codes.signals_exit_at_once``), and running out of memory is one line naming the flags ``smaller``."""
  with signals_exit_at_once("measuring: no result written", exit_handlers=True), out_of_memory_fails(smaller):
    yield


def check_model(name: str, flag: str = "--model") -> None:
  """A model name the benchmarks take, checked before any work (create_model's own error is a traceback)."""
  from light_jax.models import ARCHITECTURES  # flax: imported only where a model is named

  if name not in ARCHITECTURES:
    fail(f"{flag}={name}: no such model; use one of {', '.join(ARCHITECTURES)}")


def output_path(path: str, flag: str) -> str:
  """``path``, a file the program will write at its end, with its folder made now: a folder it cannot make or
  write in, or a ``path`` that is a folder, is ``fail``'s one line before any work, not a traceback after it.
  The folders made here are removed at exit if still empty (a later refusal, or a run that wrote nothing)."""
  _not_a_folder(path, flag)
  folder = os.path.dirname(os.path.abspath(path))
  missing = _missing_folders(folder)  # what os.makedirs will make
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    above = nearest_existing(folder)
    if not os.path.isdir(above):  # it said "cannot make its folder (File exists)"
      fail(f"{flag}={path}: {above} is a file, not a folder; give a path in a folder")
    fail(f"{flag}={path}: cannot make its folder ({e.strerror}); give a path in a writable folder")
  if missing:
    atexit.register(_remove_if_empty, missing)
  try:  # by writing: os.access says yes to root, who may still meet a read-only file system or /proc
    with tempfile.NamedTemporaryFile(dir=folder):
      pass
    if os.path.exists(path):
      with open(path, "a"):
        pass
  except OSError as e:
    fail(f"{flag}={path}: cannot write there ({e.strerror}); give a writable path")
  return path


def unwritable_folder(folder: str) -> str | None:
  """Why this process cannot write files in ``folder`` (made when missing), or None: it, or the nearest existing
  folder above it, is a file or cannot be written in. Tested by writing: os.access says yes to root, who may
  still meet a read-only file system."""
  if os.path.exists(folder) and not os.path.isdir(folder):
    return f"{folder} is a file; give a folder"
  existing = nearest_existing(os.path.abspath(folder))
  if not os.path.isdir(existing):
    return f"{existing} is a file; give a folder"
  try:
    with tempfile.NamedTemporaryFile(dir=existing):
      pass
  except OSError as e:
    return f"cannot write in {existing} ({e.strerror}); give a writable folder"
  return None


def _missing_folders(folder: str) -> list[str]:
  """``folder`` (absolute) and the folders above it that do not exist yet, innermost first."""
  missing = []
  while not os.path.exists(folder):
    missing.append(folder)
    folder = os.path.dirname(folder)
  return missing


def nearest_existing(path: str) -> str:
  """``path`` (absolute) if it exists, else the nearest folder above it that does."""
  missing = _missing_folders(path)
  return os.path.dirname(missing[-1]) if missing else path


def _remove_if_empty(folders: list[str]) -> None:
  for folder in folders:  # innermost first; one that holds something stays, and so do its parents
    try:
      os.rmdir(folder)
    except OSError:
      return


def _not_a_folder(path: str, flag: str) -> None:
  if not path.strip():  # "" wrote ./.png.png
    fail(f"{flag}= is empty; give a file's path")
  if path.endswith(os.sep) or os.path.isdir(path):
    fail(f"{flag}={path}: is a folder; give a file's path (in that folder, or elsewhere)")


def plot_path(path: str, flag: str) -> str:
  """``output_path`` for a figure matplotlib saves (``savefig``): a format it cannot write is refused now too.
  Returns the path matplotlib will write: ``path``, or with no extension ``path`` + ".png", as savefig saves it."""
  from matplotlib.backend_bases import FigureCanvasBase

  _not_a_folder(path, flag)  # before ".png" is added to it: --plot /tmp wrote /tmp.png
  extension = os.path.splitext(path)[1][1:].lower()
  formats = FigureCanvasBase.get_supported_filetypes()
  if not extension:
    path = path.rstrip(".") + ".png"  # as savefig names it: its default format (savefig.format); "out." is out.png
  elif extension not in formats:
    fail(f"{flag}={path}: matplotlib cannot write .{extension} files; end it in one of .{', .'.join(sorted(formats))}")
  return output_path(path, flag)


_OVERRIDE = re.compile(r"-{1,2}(?:no)?config\.([^=]+)")  # ml_collections' forms: -config.X, --noconfig.X (a bool)


def overridden_fields(argv: list[str]) -> list[str]:
  """The FIELD of each ``--config.FIELD=VALUE`` in ``argv`` (dotted; also ``-config.FIELD``, ``--noconfig.FIELD``)."""
  return [m[1] for m in map(_OVERRIDE.match, argv) if m]


def config_overrides(argv: list[str]) -> list[str]:
  """The ``--config.FIELD=VALUE`` arguments of ``argv`` (``overridden_fields``' forms), the two-argument form
  (``--config.FIELD VALUE``) joined."""
  joined = []
  for i, arg in enumerate(argv):
    if _OVERRIDE.match(arg):
      joined.append(arg if "=" in arg or i + 1 == len(argv) else f"{arg}={argv[i + 1]}")
  return joined


def _parse(flag_values: flags.FlagValues, argv: list[str], config_file_flags: list[str]) -> list[str]:
  """absl's parsing of ``argv`` into ``flag_values``, each config file loaded; a mistake on the command line
  raises CommandLineError, a bug inside a config file its own error."""
  try:
    expanded = flag_values.read_flags_from_files(argv[1:], force_gnu=False)  # a --flagfile's flags in its place
    for name in config_file_flags:  # absl would keep the last, or fail on an override as "defined twice"
      given = _values_of(name, expanded)
      if len(given) > 1:
        raise CommandLineError(f"--{name} is given {len(given)} times ({', '.join(given)}); give one config file")
    parsed = flag_values(argv)
    for name in config_file_flags:
      if flag_values[name].value is not None:
        flag_values[name].value.keys()  # a config file that failed to load raises here
  except CommandLineError:
    raise
  except SyntaxError as e:  # a config file that is not Python (a YAML file, say), or Python with a syntax error
    if _ran_code_of_its_own(e):  # a module the config file imports: a bug, with its traceback
      raise
    where = f"{e.filename}, line {e.lineno}" if e.filename else "the config file"
    raise CommandLineError(
      f"--config: {where}: {e.msg} ({(e.text or '').strip()[:60]!r}); a config file is Python defining "
      "get_config(variant=None) that returns base_config() with its changes (configs/fashion_mnist.py)"
    ) from None
  except FLAG_ERRORS as e:
    error = describe_flag_error(e, argv)
    if error is None:
      raise
    raise error from None
  return parsed


def _values_of(name: str, argv: list[str]) -> list[str]:
  """The values ``argv`` (flags) gives the flag ``name`` (``--name=V``, ``--name V``, one dash too), up to ``--``."""
  values, i = [], 0
  while i < len(argv) and argv[i] != "--":  # "--": absl's end of the flags
    arg, following = argv[i], argv[i + 1] if i + 1 < len(argv) else None
    if re.match(rf"-{{1,2}}{name}(=|$)", arg):
      values.append(arg.split("=", 1)[1] if "=" in arg else following or "(no value)")
      i += "=" not in arg
    elif _OVERRIDE.match(arg) and "=" not in arg and following and not following.startswith("-"):
      i += 1  # --config.FIELD VALUE: the value is not a flag (a bool's --config.FIELD takes none)
    i += 1
  return values


def _ran_code_of_its_own(error: SyntaxError) -> bool:
  """Whether a config file's own code ran before ``error`` (a module it imports failed to compile), rather than the
  file itself failing to compile: then every frame after ml_collections' loading is the import machinery's."""
  frames = traceback.extract_tb(error.__traceback__)
  loader = max((i for i, f in enumerate(frames) if "ml_collections" in f.filename), default=-1)
  return any(not f.filename.startswith("<frozen") for f in frames[loader + 1 :])


@functools.cache
def _base_fields() -> dict[str, object]:
  """base_config()'s fields: dotted path -> default (built once: an error's suggestions look them up often)."""
  from light_jax.config import base_config

  return _field_paths(base_config())


def _field_paths(node: ml_collections.ConfigDict, prefix: str = "") -> dict[str, object]:
  """Every field of ``node`` (base_config()'s): dotted path -> default."""
  paths = {}
  for key, value in node.items():
    if isinstance(value, ml_collections.ConfigDict):
      paths.update(_field_paths(value, f"{prefix}{key}."))
    else:
      paths[f"{prefix}{key}"] = value
  return paths


def _similar_fields(path: str) -> list[str]:
  """base_config()'s fields that ``path`` may have meant: close in spelling, or whose last part holds its last part
  or is held by it (``lr``: optimizer.base_lr; ``batch_size``: global_batch_size)."""
  import difflib

  fields = list(_base_fields())
  group, _, last = path.rpartition(".")

  def name(field: str) -> str:
    return field.rsplit(".", 1)[-1]

  def ratio(field: str) -> float:
    return difflib.SequenceMatcher(None, last, name(field)).ratio()

  # By the fields' own names (a shared group's prefix made optimizer.wd look like optimizer.decay): the same group's
  # first, then the same name (momentum: optimizer.momentum), then names holding it, closest first.
  holding = [f for f in fields if len(last) > 1 and (last in name(f) or name(f) in last)]
  close = [f for f in fields if ratio(f) >= 0.75]
  return sorted(
    dict.fromkeys([*holding, *close]),
    key=lambda f: (f.rpartition(".")[0] != group, name(f) != last, f not in holding, -ratio(f), len(name(f))),
  )[:3]


def _field_default(path: str) -> tuple[bool, object]:
  """(whether ``path`` is one of base_config()'s fields, its default)."""
  return path in _base_fields(), _base_fields().get(path)


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _override_of_the_wrong_shape(e: Exception, text: str, argv: list[str]) -> CommandLineError | None:
  """ml_collections' errors, which name no field, for an override that sets a group of fields to what is not a dict
  (``--config.comm=dense``: "Failed to parse 'dense' as a ConfigDict") or goes through a text field as if it were a
  group (``--config.comm.strategy.x=1``: "string indices must be integers"); None for any other error."""
  group = re.match(r"flag --config\.([\w.]+)=.*as a ConfigDict", text, re.DOTALL)
  if group:
    return CommandLineError(
      f"--config.{group[1]}: a group of fields, not one; set its fields one by one (--config.{group[1]}.FIELD=VALUE)",
      FIELDS_HINT,
    )
  if not (isinstance(e, TypeError) and "string indices must be" in text):
    return None
  from light_jax.config import base_config

  for path in overridden_fields(argv):
    node, parts = base_config(), path.split(".")
    for depth, part in enumerate(parts[:-1]):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        break
      node = node[part]
      if not isinstance(node, ml_collections.ConfigDict):
        field = ".".join(parts[: depth + 1])
        return CommandLineError(f"--config.{path}: {field} is a field, not a group of fields", FIELDS_HINT)
  return None


_EXAMPLES = {"config": "configs/fashion_mnist.py", "workdir": "runs/fmnist"}  # what a missing flag's example shows


def describe_flag_error(e: Exception, argv: list[str]) -> CommandLineError | None:
  """One line from what absl and ml_collections raise (which may hold a whole traceback), with where to look
  next, or None where the error is not the command line's: a bug inside the config file, whose traceback says
  where."""
  text = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
  if text[:1] in "'\"":  # ml_collections quotes its KeyError's message, newlines escaped
    with contextlib.suppress(ValueError, SyntaxError):
      text = str(ast.literal_eval(text))
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if not lines:
    return CommandLineError(type(e).__name__, FLAGS_HINT)
  # The config file's own messages say what to give instead: no hint.
  if "Traceback (most recent call last)" in text:  # raised inside the config file's get_config, or calling it
    head = text.split("Error whilst parsing config file")[0].rstrip(": \n")
    if lines[-1].startswith("ValueError:"):  # config files raise ValueError for a bad variant
      return CommandLineError(f"{head}: {lines[-1]}")
    called_with_variant = any("config_module.get_config(" in line for line in lines[-4:])  # the call itself failed
    if called_with_variant and re.match(r"TypeError: get_config\(\) takes 0 positional arguments", lines[-1]):
      # A get_config that takes no variant (a bug inside the file keeps its traceback).
      return CommandLineError(
        f"{head}: {lines[-1]}; a training config file defines get_config(variant=None) returning base_config() "
        "with its changes (configs/fashion_mnist.py)"
      )
    return None
  if _NOT_LOADED in text:  # the config file did not load: why is on the last line
    why = lines[-1].replace(_NOT_LOADED, "")
    missing = re.search(r"No such file or directory: '([^']+)'", why)
    if missing and not os.path.isabs(missing[1]) and os.path.isfile(os.path.join(_REPOSITORY, missing[1])):
      why += f" (a path from the current folder, {os.getcwd()}; the repository's: {_REPOSITORY}/{missing[1]})"
    return CommandLineError(f"--config: cannot load the config file: {why}")
  if isinstance(e, AttributeError) and "has no attribute 'get_config'" in text:  # another kind of Python file
    return CommandLineError(
      "--config: the file has no get_config(); a training config file defines get_config(variant=None) returning "
      "base_config() with its changes (configs/fashion_mnist.py)"
    )
  shape_error = _override_of_the_wrong_shape(e, text, argv)
  if shape_error:
    return shape_error
  if isinstance(e, (AttributeError, KeyError)):  # a --config.FIELD=VALUE naming no field, or a config file's bug
    name = lines[0].strip("'\"")  # the missing key, or a message that names the path looked up
    candidates = [p for p in overridden_fields(argv) if p in text or name in p.split(".")]
    # The override that failed: its last part is the missing key, and it is no field of base_config (one that is
    # may only be named in the suggestion, or added by a tool, as the mesh lab's mesh fields).
    path = next((p for p in candidates if p.split(".")[-1] == name and not _field_default(p)[0]), None)
    path = path or next((p for p in candidates if not _field_default(p)[0]), None) or next(iter(candidates), None)
    if path is None:
      return None
    if _field_default(path)[0]:  # a field of every training config: this file is not one
      return CommandLineError(
        f"--config.{path}: the config file has no such field: it is not a training config, which returns "
        "base_config() with its changes (a mesh experiment goes to benchmarks/mesh_lab.py --experiment)"
      )
    similar = _similar_fields(path) if len(lines) == 1 else []
    if similar:  # where ml_collections suggests none (lr: optimizer.base_lr; batch_size: global_batch_size)
      lines = [lines[0], "did you mean " + " or ".join(f"--config.{f}" for f in similar) + "?"]
    return CommandLineError(
      f"--config.{path}: no such config field" + "".join(f"; {line}" for line in lines[1:]), FIELDS_HINT
    )
  message = " ".join(lines)
  missing = re.findall(r"Flag --(\w+) must have a value other than None", message)  # absl's required flags
  if missing:
    example = "e.g. " + " ".join(f"--{name} {_EXAMPLES.get(name, name.upper())}" for name in missing)
    are = "are" if len(missing) > 1 else "is"
    return CommandLineError(f"{' and '.join(f'--{name}' for name in missing)} {are} required: {example}", FLAGS_HINT)
  flagfile = re.match(r"ERROR:: Unable to open flagfile: (.*)", message)
  if flagfile:
    return CommandLineError(f"--flagfile: cannot open it: {flagfile[1]}; give a file of flags, one per line")
  unknown = re.match(r"Unknown command line flag '([\w.]+)'", message)
  if unknown and unknown[1].startswith("config."):  # an override without the config file it overrides
    return CommandLineError(f"--{unknown[1]} overrides a field of --config FILE, which is not given", FLAGS_HINT)
  if unknown:  # a config field given as a flag (--num_epochs=3): say how fields are set
    is_field, _ = _field_default(unknown[1])
    similar = [unknown[1]] if is_field else _similar_fields(unknown[1])
    if similar and (is_field or "." in unknown[1] or unknown[1] in [f.rsplit(".", 1)[-1] for f in similar]):
      # absl's own suggestion (a flag of this program) kept, where the name is not exactly a config field's
      said = (
        f"--{unknown[1]} is not a flag"
        if is_field or unknown[1] in [f.rsplit(".", 1)[-1] for f in similar]
        else message
      )
      return CommandLineError(
        f"{said}; a config field is set with --config.FIELD=VALUE, e.g. "
        + " or ".join(f"--config.{f}=..." for f in similar),
        FIELDS_HINT,
      )
  typed = re.match(r"flag --config\.([\w.]+)=(.*?): (invalid literal|could not convert)", message)
  if typed and _field_default(typed[1])[0]:  # Python's words: say what the field takes
    default = _field_default(typed[1])[1]
    word = _TYPE_WORDS.get(type(default), type(default).__name__)
    return CommandLineError(
      f"--config.{typed[1]}={typed[2]}: {typed[1]} takes {word} (its default: {default!r})", FIELDS_HINT
    )
  # absl's bool parser raises ValueError('Non-boolean argument to boolean flag', value), shown as a tuple
  message = re.sub(
    r"\('Non-boolean argument to boolean flag', (.*)\)$", r"\1 is not a boolean; use true or false", message
  )
  # absl names the flag whose value it could not take: a config field's (--help does not list those) or a flag's.
  field_value = any(message.startswith(f"flag --config.{path}=") for path in overridden_fields(argv))
  return CommandLineError(message, FIELDS_HINT if field_value else FLAGS_HINT)
