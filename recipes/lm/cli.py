"""Every recipe's command line ends the same way on bad input: one `error: ...` line on
stderr and exit status 2, never a traceback or a usage block.

`run(main)` runs a recipe's `main(argv)` that way (fnscale's errors, an `ArgumentParser`'s
refusals, absl flag errors); `ArgumentParser` is argparse's, refusing by raising;
`number(...)` is an argparse `type=` that also checks the range; `absl_run(main)` replaces
`absl.app.run` for recipes whose flags are absl's.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
import math
import sys

from absl import flags

from fnscale.errors import FnscaleError, InputError

EXIT_BAD_INPUT = 2


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
