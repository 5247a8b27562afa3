"""Every recipe's command line ends the same way on bad input: one `error: ...` line on
stderr and exit status 2, never a traceback or a usage block.

`run(main)` runs a recipe's `main(argv)` that way (fnscale's errors, an `ArgumentParser`'s
refusals, absl flag errors); `ArgumentParser` is argparse's, refusing by raising;
`number(...)` is an argparse `type=` that also checks the range; `absl_run(main)` replaces
`absl.app.run` for recipes whose flags are absl's.

A recipe whose options are a frozen dataclass (train_lm's `Options`, pretokenize's) declares
each field with `option(default, help)` and gets, from the class alone, its flags
(`parse_flags`), its keywords (`check_options`) and its command line (`options_main`). The
class may hold its options in groups (fields declared `group(GroupClass)`, each group a
frozen dataclass of options): the flags and keywords stay flat, one per option (`leaves`).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
import contextlib
import dataclasses
import difflib
import logging
import math
import os
import sys

from absl import flags

import fnscale as fs
from fnscale import FnscaleError, InputError

EXIT_BAD_INPUT = 2
# A run stopped early, by what stopped it (its Summary's `stopped`): 128 + the signal, what a
# shell reports for a command the signal ended; schedulers read 143 as "preempted".
CTRL_C = "Ctrl-C"
EXIT_STOPPED = {"SIGTERM": 143, CTRL_C: 130}


def did_you_mean(name, candidates) -> str:
  """"; did you mean 'gpt'?" for the candidate closest to `name` (difflib's ratio >= 0.6),
  or "" when none is close: the end of a message refusing an unknown word."""
  close = difflib.get_close_matches(str(name), [str(c) for c in candidates], n=1)
  return f"; did you mean {close[0]!r}?" if close else ""


def report(e: BaseException) -> int:
  """Prints `e` as one `error:` line on stderr; returns the bad-input exit status."""
  text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
  print(f"error: {text}", file=sys.stderr, flush=True)
  return EXIT_BAD_INPUT


def run(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
  """`main(argv)`'s exit status (None: 0); bad input (an fnscale error) is `report`ed."""
  try:
    return main(argv) or 0
  except FnscaleError as e:
    return report(e)


def absl_run(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> int:
  """`absl.app.run(main)` for a recipe with absl flags, bad flags `report`ed (absl prints
  two lines and exits 1). `--help` prints the flags."""
  argv = list(sys.argv if argv is None else argv)
  if any(a in ("-h", "--help", "--helpfull", "--helpshort") for a in argv[1:]):
    doc = sys.modules["__main__"].__doc__ or ""
    print(doc + "\nflags:\n" + flags.FLAGS.main_module_help())
    return 0
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    return report(InputError(f"{e}; see --help"))
  return run(main, rest)


class ArgumentParser(argparse.ArgumentParser):
  """argparse's parser whose refusals raise InputError (for `run`) instead of printing a
  usage block and exiting."""

  def error(self, message: str):
    raise InputError(f"{self.prog}: {message}; see --help")


def number(kind: type = int, *, minimum: float | None = None, above: float | None = None,
           maximum: float | None = None) -> Callable[[str], float]:
  """An argparse `type=` that parses `kind` (int or float; floats finite) and checks
  `value >= minimum`, `value > above` and `value <= maximum` where given."""
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an {kind.__name__}") from None
    problem = check_range(value, minimum=minimum, above=above, maximum=maximum)
    if problem:
      raise argparse.ArgumentTypeError(f"{text} {problem}")
    return value
  return parse


def numbers(kind: type = int, **bounds) -> Callable[[str], tuple]:
  """An argparse `type=` for comma-separated numbers, each parsed and checked as `number`."""
  one = number(kind, **bounds)
  def parse(text: str):
    return tuple(one(part.strip()) for part in text.split(","))
  return parse


def check_range(value, *, minimum=None, above=None, maximum=None) -> str | None:
  """Why a number is out of range ("must be >= 1", "is not finite"), or None."""
  if isinstance(value, float) and not math.isfinite(value):
    return "is not finite"
  for bound, ok, word in ((minimum, lambda b: value >= b, ">="), (above, lambda b: value > b, ">"),
                          (maximum, lambda b: value <= b, "<=")):
    if bound is not None and not ok(bound):
      return f"must be {word} {bound:g}"
  return None


# ------------------------------------------------------------------------------------------------
# Options as a frozen dataclass: its flags, its keywords, its command line
# ------------------------------------------------------------------------------------------------


def option(default, help_: str):
  """A field of an options dataclass: its default and its `--help` line (numbers' ranges:
  the class's `RANGES`, {name: check_range's bounds}; words' values: its `CHOICES`)."""
  return dataclasses.field(default=default, metadata={"help": help_})


def group(cls):
  """A field of an options dataclass that holds a group of options: a frozen dataclass
  `cls` of `option` fields, its defaults by default."""
  return dataclasses.field(default_factory=cls, metadata={"group": cls})


def leaves(cls) -> dict[str, tuple[str | None, dataclasses.Field]]:
  """Each option of options dataclass `cls`, by name: (the group field holding it, None for
  one of `cls`'s own; its field). Option names are unique across the groups: each is a
  flag `--name` and a keyword.

  >>> @dataclasses.dataclass(frozen=True)
  ... class Data:
  ...   seq: int = option(64, "tokens per row")
  >>> @dataclasses.dataclass(frozen=True)
  ... class Opts:
  ...   data: Data = group(Data)
  ...   seed: int = option(0, "the seed")
  >>> {name: where for name, (where, _) in leaves(Opts).items()}
  {'seq': 'data', 'seed': None}
  """
  out = {}
  for f in dataclasses.fields(cls):
    inner = f.metadata.get("group")
    for g in dataclasses.fields(inner) if inner else (f,):
      out[g.name] = (f.name if inner else None, g)
  return out


def build(cls, flat: dict):
  """`cls` with the options of `flat` ({name: value}, names as `leaves`), each in its group,
  the others their defaults."""
  where, groups, own = leaves(cls), {}, {}
  for name, value in flat.items():
    (own if where[name][0] is None else groups.setdefault(where[name][0], {}))[name] = value
  kinds = {f.name: f.metadata.get("group") for f in dataclasses.fields(cls)}
  return cls(**own, **{g: kinds[g](**kw) for g, kw in groups.items()})


def flat(o) -> dict:
  """{name: value} of every option of `o` (an options dataclass, grouped or not)."""
  return {name: getattr(getattr(o, g) if g else o, name)
          for name, (g, _) in leaves(type(o)).items()}


def check_options(cls, options: dict):
  """`cls(**options)` after checking each name, type (an int is a float; a bool is no int)
  and range.

  Raises:
    FnscaleError: an unknown name (the message lists the known ones), a wrong type or a
      number out of its range (the message names the option and the range).
  """
  known = {name: f for name, (_, f) in leaves(cls).items()}
  for name, value in options.items():
    if name not in known:
      raise fs.InputError(f"unknown option {name}={value!r}{did_you_mean(name, known)}; known "
                          f"options: {sorted(known)}")
    kind = known[name].type.split(" | ")
    types = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}[kind[0]]
    if not ((value is None and "None" in kind) or (
        isinstance(value, types) and (kind[0] == "bool" or not isinstance(value, bool)))):
      raise fs.InputError(f"option {name}={value!r}: expected {' or '.join(kind)}, got "
                            f"{type(value).__name__}")
  return _check_ranges(build(cls, options))


def _check_ranges(o):
  """`o` (an options dataclass) after checking each number against its range (the class's
  `RANGES`; floats must be finite), each word against its `CHOICES` and that of each pair
  of its `EXCLUSIVE` options at most one is given (neither its default, None nor "")."""
  ranges, choices = getattr(type(o), "RANGES", {}), getattr(type(o), "CHOICES", {})
  fields, values = {n: f for n, (_, f) in leaves(type(o)).items()}, flat(o)
  for f in fields.values():
    value = values[f.name]
    if f.name in choices and value is not None and value not in choices[f.name]:
      raise fs.InputError(f"--{f.name}={value!r}: expected one of {list(choices[f.name])}"
                          + did_you_mean(value, choices[f.name]))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      problem = check_range(value, **ranges.get(f.name, {}))
      if problem:
        raise fs.InputError(f"--{f.name}={value!r} {problem}: {f.metadata['help']}")
  given = lambda name: values[name] not in (fields[name].default, None, "")
  for a, b in getattr(type(o), "EXCLUSIVE", ()):
    if given(a) and given(b):
      raise fs.InputError(f"--{a}={values[a]!r} and --{b}={values[b]!r}: give one "
                          f"of them (--{a}: {fields[a].metadata['help']})")
  return o


def _flag_values(cls) -> flags.FlagValues:
  fv = flags.FlagValues()
  define = {"bool": flags.DEFINE_boolean, "int": flags.DEFINE_integer,
            "float": flags.DEFINE_float, "str": flags.DEFINE_string}
  for _, f in leaves(cls).values():
    define[f.type.split(" | ")[0]](f.name, f.default, f.metadata["help"], flag_values=fv)
  return fv


def parse_values(fv: flags.FlagValues, argv: list[str]) -> list[str]:
  """`fv` parsed from `argv` (argv[0] is the program name); returns what isn't a flag.
  Raises InputError on a bad flag (absl's message, and where the flags are listed)."""
  try:
    return fv(list(argv))
  except flags.Error as e:
    raise fs.InputError(f"{e}; see --help") from None


def parse_flags(cls, argv: list[str]):
  """absl flags (argv[0] is the program name) -> `cls`. Raises FnscaleError on a bad flag."""
  fv = _flag_values(cls)
  rest = parse_values(fv, argv)
  if len(rest) > 1:
    raise fs.InputError(f"unexpected arguments {rest[1:]}; flags are written --name=value")
  return _check_ranges(build(cls, {name: fv[name].value for name in leaves(cls)}))


def options_main(argv: list[str], cls, run, doc: str, *, own_process: bool = False) -> int:
  """Command-line entry: `--help`, flags -> `cls`, `run`, bad input as one `error:` line.
  Exit status 0 done, 2 bad input or a refused checkpoint, 75 a lost process, 143 stopped
  by SIGTERM, 130 by Ctrl-C (`run`'s result has `stopped`; a Ctrl-C `run` did not turn
  into a stop, a KeyboardInterrupt, is one line too, not a traceback: its text, when it has
  one, says what was saved).

  `own_process`: the process is this command's (`python recipes/train_lm.py`): after such a
  KeyboardInterrupt the process ends here (`end_at_once`), not through the interpreter's
  teardown."""
  if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
    print(doc + "\nflags:\n" + _flag_values(cls).get_help())
    return 0
  try:
    summary = run(parse_flags(cls, argv))
  except KeyboardInterrupt as e:
    said = str(e) or "what was saved is kept; rerun the same command to resume"
    print(f"\nstopped by {CTRL_C}: {said}", file=sys.stderr, flush=True)
    if own_process:
      end_at_once(EXIT_STOPPED[CTRL_C])
    return EXIT_STOPPED[CTRL_C]
  except fs.FnscaleError as e:
    status = report(e)
    if isinstance(e, fs.DistributedError) and str(e).startswith("lost "):
      # Python's own exit would wait for the lost process at JAX's shutdown barrier.
      sys.stdout.flush()
      os._exit(fs.multihost.EXIT_JOB_FAILED)  # pylint: disable=protected-access
    return status
  return EXIT_STOPPED.get(summary.stopped, 0)


def end_at_once(status: int) -> None:
  """Ends the process with `status` once Python's output and logs are flushed, skipping the
  interpreter's teardown: a compile that Ctrl-C interrupted goes on in a thread of XLA's,
  and tearing the runtime down under it crashes the process (a SIGSEGV in
  `PjRtLoadedExecutable::Create` on a TPU); a run's files are flushed or closed by then."""
  logging.shutdown()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  os._exit(status)  # pylint: disable=protected-access
