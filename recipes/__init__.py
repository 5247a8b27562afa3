"""Recipes: complete jobs built on fnscale's public API, meant to be run and copied.

`train_lm.py` is the main job; `lm/` holds its models (GPT, Llama), data and run log;
`launch/` starts it on several processes or a Ray cluster; `bench/` measures fnscale (and
compares it with MaxText); `examples/` embed fnscale in Flax and Equinox. The small commands
at this level (`plan.py`, `show_topology.py`, `baseline.py`, `plot_run.py`,
`train_tokenizer.py`) are tools around a run.
"""

import fnscale as _fnscale

if getattr(_fnscale, "__file__", None) is None:  # a folder of that name, not the package
  _where = ", ".join(getattr(_fnscale, "__path__", ())) or "?"
  raise ImportError(
      f"'import fnscale' found the folder {_where}, not the fnscale package: Python searches "
      "the directory it runs from first, and a folder named fnscale there (the clone itself, "
      "when run from the folder above it) hides the package. Fix: run from inside the clone "
      "(cd fnscale; python recipes/train_lm.py) or from a directory without a folder named "
      "fnscale.")
del _fnscale
