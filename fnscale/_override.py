"""Topology strings: an override, an accelerator type or a target, and a target's devices.

`_override_facts` reads what a caller types for `detect_topology(override)` ("4x4",
"v5p:2x4x8", "2x4x4x8" slices first, "v5p-128", "2x v5p-128"); `target_devices` turns the
same strings into libtpu's described devices of that TPU, for ahead-of-time compiles and plans
on a machine without it.
"""
import importlib.util
import math
import re
from typing import Any

from fnscale._chips import (_GRID_PREFIXES, _check_type, _slice_grid, libtpu_topology_name,
                            parse_accelerator_type, standard_grid)
from fnscale._errors import TopologyError

Facts = dict[str, tuple[Any, str]]  # field -> (value, where it came from)


def parse_shape(shape: str) -> tuple[int, ...]:
  """Parses a chip-grid string such as "4x4" or "2x4x8" into a tuple of positive ints.

  Raises:
    TopologyError: if the string is not 1-4 positive integers joined by "x".
  """
  if not isinstance(shape, str) or not re.fullmatch(r"\s*\d+(\s*x\s*\d+){0,3}\s*", shape):
    raise TopologyError(
        f"shape {shape!r} is not a chip grid: expected positive integers joined by 'x', such "
        "as '4x4', '2x4x8', or '2x4x4x8' (slices first); fix the string.")
  dims = tuple(int(d) for d in shape.replace(" ", "").split("x"))
  if any(d <= 0 for d in dims):
    raise TopologyError(
        f"shape {shape!r} has a zero or negative dimension {dims}: every dimension must be >= 1.")
  return dims


def _as_ints(value: str, source: str, sep: str, minimum: int) -> tuple[int, ...]:
  try:
    out = tuple(int(x) for x in value.split(sep))
  except ValueError:
    out = ()
  if not out or min(out) < minimum:
    raise TopologyError(f"{source}={value!r} is not {sep!r}-separated integers >= {minimum}; "
                        "fix or unset it.")
  return out


def _override_facts(override: str) -> Facts:
  text = override.strip()
  if not text:
    raise TopologyError(
        f"topology override {override!r} is empty: expected a chip grid such as '2x4x8', "
        "'v5p:2x4x8', slices first as '2x4x4x8', an accelerator type such as 'v5p-128', or "
        "slices of one as '2x v5p-128'.")
  facts: Facts = {}
  m = re.fullmatch(r"(\d+)\s*x\s*([a-z]\S*)", text)  # "2x v5p-128": two slices over DCN
  if m:
    facts["num_slices"] = (_as_ints(m.group(1), "override slices", ",", 1)[0], "override")
    text = m.group(2)
  if re.fullmatch(r"[a-z0-9]+-\d+", text):
    parse_accelerator_type(text)  # validates
    return {**facts, "accelerator_type": (text, "override")}
  if ":" in text:
    gen, _, text = text.partition(":")
    if gen.strip() not in _GRID_PREFIXES:
      raise TopologyError(
          f"topology override {override!r} names an unknown TPU generation {gen!r}: expected "
          f"one of {sorted(_GRID_PREFIXES)} before ':', e.g. 'v5p:2x4x8'.")
    facts["generation"] = (_GRID_PREFIXES[gen.strip()], "override")
  dims = parse_shape(text)
  if len(dims) == 4:
    facts["num_slices"] = (dims[0], "override")
    dims = dims[1:]
  return {**facts, "chip_grid": (dims, "override")}


def target_devices(target: str) -> list:
  """libtpu's described devices of a TPU target, for ahead-of-time compiles and plans from a
  machine without that TPU: "v5p-128", "v5p:4x4x4" (libtpu's spelling), "2x v5p-128" (two
  slices over DCN). Devices are laid out as Google provisions them: v4 as megacore (one
  device per chip, as JAX runs it), v5e/v6e slices of 8 chips on one host, 4 chips per host
  otherwise (libtpu's default).

  Returns:
    A list of `jax.Device` (platform "tpu"), to pass as `devices=` to `detect_topology` and
    `make_mesh`.

  Raises:
    TopologyError: a target that names no TPU generation, or libtpu is not installed
      (`pip install "fnscale[tpu]"`).

  Examples:
    Two v5p-8 slices, described here (no TPU needed; the tpu extra):

    >>> import fnscale as fs
    >>> devices = fs.target_devices("2x v5p-8")
    >>> len(devices), devices[0].platform, sorted({d.slice_index for d in devices})
    (8, 'tpu', [0, 1])
  """
  _check_type("target", target, str, "a str such as 'v5p-128', 'v5p:4x4x4' or '2x v5p-128'")
  facts = _override_facts(target)
  slices = facts.get("num_slices", (1,))[0]
  if "accelerator_type" in facts:
    generation, chips = parse_accelerator_type(facts["accelerator_type"][0])
    grid = standard_grid(generation, chips)
  elif "generation" in facts:
    generation, grid = facts["generation"][0], _slice_grid(facts["chip_grid"][0], None)
  else:
    raise TopologyError(f"target {target!r} names no TPU generation: write e.g. 'v5p-128', "
                        "'v5p:4x4x4' or '2x v5p-128'.")
  if importlib.util.find_spec("libtpu") is None:
    raise TopologyError(
        f"describing the TPU target {target!r} without the hardware needs libtpu, which is not "
        "installed: pip install \"fnscale[tpu]\" (or \"jax[tpu]\"), then run again.")
  import jax  # deferred: loads libtpu
  from jax.experimental import topologies
  kw = {"num_slices": slices} if slices > 1 else {}
  if generation == "v4":
    kw["chip_config_name"] = "megacore"
  if generation in ("v5e", "v6e") and math.prod(grid) <= 8:
    kw["chips_per_host_bounds"] = tuple(grid) + (1,) * (3 - len(grid))
  name = libtpu_topology_name(generation, grid)
  try:
    return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **kw).devices)
  except jax.errors.JaxRuntimeError as e:
    raise TopologyError(
        f"libtpu could not describe {name!r} {kw} for target {target!r}: {e}. If another "
        "process on this machine holds libtpu (its lockfile), set ALLOW_MULTIPLE_LIBTPU_LOAD=1."
    ) from None
