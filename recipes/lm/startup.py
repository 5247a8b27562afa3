"""train_lm's start-up: simulated CPU devices, the compile cache, the processes of a job and
the shutdown at exit (`start`), then (after the hardware, `recipes.lm.hardware.detect`) the
mesh (`mesh_axes`, `make_mesh`; `plan_mesh` for --mesh=auto) and the precision (`policy`)."""
from __future__ import annotations

import functools
import os

import jax
import numpy as np

import fnscale as fs
from recipes.lm import cli
from recipes.lm.options import MIXED
from recipes.lm.remat import remat_off

# Options that may differ between the processes of one job.
PER_PROCESS = ("coordinator_address", "num_processes", "process_id")


def start(o):
  """Simulated CPU devices, compile cache, multi-process start-up and the shutdown at exit of
  a run with options `o`, before anything touches a device. Returns `say`, a print on process 0.
  """
  count = o.hardware.devices
  if count is None:  # keep a device count the environment already asks for
    flag = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_force_host_platform_device_count=")]
    count = flag[-1].split("=", 1)[1] if flag else os.environ.get("JAX_NUM_CPU_DEVICES", "8")
    if not str(count).isdigit():
      raise fs.InputError(f"simulated device count {count!r} (XLA_FLAGS / "
                            "JAX_NUM_CPU_DEVICES) is not an int")
  fs.quiet_libtpu()  # libtpu's host-lookup warnings on a machine without a TPU
  fs.simulate_cpu_devices(int(count))
  if o.ckpt.compile_cache_dir:
    fs.compilation_cache(o.ckpt.compile_cache_dir)
  # Values not given come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
  # (launch_local.py) or the pod/SLURM environment; one process is a no-op.
  # Every process checks the others ran with the same options (fields that differ per
  # process left out), so a mismatch is named at start-up, not found as a hang later.
  hw = o.hardware
  fs.initialize(hw.coordinator_address or None, hw.num_processes or None,
                hw.process_id if hw.process_id >= 0 else None, config={
                    k: v for k, v in cli.flat(o).items() if k not in PER_PROCESS})
  say = (lambda *a: print(*a, flush=True)) if jax.process_index() == 0 else (lambda *a: None)
  if hw.shutdown_at_exit:
    request = fs.cloud.shutdown_at_exit(hw.shutdown_delay_s, hw.shutdown_dry_run)
    say(f"shutdown at exit ({hw.shutdown_delay_s:g} s after the end"
        + (", dry run" if hw.shutdown_dry_run else "") + f"): {fs.cloud.describe(request)}")
  return say


def check_init_from(init_from: str) -> None:
  """Raises InputError for an --init_from that is no Hugging Face model directory: checked
  before anything reads its tokenizer.json or weights, so the message says what is wrong
  with the directory (a missing tokenizer.json's fix would be --tokenizer, a minute before
  the missing config.json). gs:// paths are left to the readers."""
  if not init_from or "://" in init_from:
    return
  for path, what in ((init_from, "no such directory"),
                     (os.path.join(init_from, "config.json"), "no config.json")):
    if not os.path.exists(path):
      raise fs.InputError(f"--init_from={init_from}: {what}; expected a Hugging Face model "
                          "directory (config.json, *.safetensors, tokenizer.json)")


def mesh_axes(text: str, flag: str) -> dict[str, int]:
  """The axes of a --mesh or --dcn value ("data=-1,fsdp=2": {"data": -1, "fsdp": 2}; ""
  none), parsed once, their names checked: ones fnscale's conventions know, refused before
  anything is written (a typo of "fsdp" would train with its devices holding copies).

  Raises:
    MeshError: naming `flag`, the bad axis and the closest known name.
  """
  axes = fs.parse_axes(text or {}, what=flag)
  fs.check_axis_names(axes, flag)
  return axes


def make_mesh(axes, dcn: dict, topo, say, devices=None):
  """`fs.make_mesh(axes, dcn=dcn)` over `devices` (default `jax.devices()`), `axes` a dict
  (`mesh_axes`) or the planner's `MeshAxes`; over several TPU slices without `dcn` (and
  without a `MeshAxes` of its own), data parallel across the slices: `replica` = the slice
  count, the `axes` within each slice, said by `say`; unless `axes` has a "stage" axis of the
  slice count: make_mesh lays the pipeline stages across the slices."""
  devices = jax.devices() if devices is None else devices
  slices = len({getattr(d, "slice_index", 0) or 0 for d in devices})
  planned = isinstance(axes, fs.MeshAxes)
  if not dcn and slices > 1 and not planned and axes.get("stage") != slices:
    dcn = {"replica": slices}
    say(f"mesh: the devices span {slices} TPU slices and --dcn is not set: data parallel "
        f"across the slices (--dcn=replica={slices}), the --mesh axes within each slice")
  return fs.make_mesh(axes, dcn=dcn or None, topology=topo, devices=devices)


def policy(precision: str, platform: str):
  """A jmp policy (None: float32). auto: float32 on CPU, bfloat16 compute elsewhere."""
  import jmp  # pylint: disable=import-outside-toplevel
  precision = {"auto": "float32" if platform == "cpu" else MIXED, "bfloat16": MIXED,
               "bf16": MIXED, "f32": "float32"}.get(precision, precision)
  if precision == "float32":
    return None
  try:
    return jmp.get_policy(precision)
  except ValueError as e:
    raise fs.InputError(f"precision={precision!r} is not a jmp policy ({e}); write e.g. "
                          f"'{MIXED}', 'float32' or 'bfloat16'") from None


def plan_mesh(model, cfg, topo, global_batch: int, precision: str, optimizer, lora=None,
              keep: str = "none"):
  """`--mesh=auto`: fnscale.analysis.plan's choice for this machine (`topo`), this model's
  abstract params, the run's optimizer (an optax transformation: its state is what the plan
  holds), the global batch and what the blocks keep without remat (`keep`: --remat_policy
  resolved; `PlanOptions.remat_off`), and the top of its table with why the winner won. With
  `lora` (a LoraConfig), the plan of a LoRA state: the base frozen in the compute dtype, no
  gradient or optimizer state for it (a DPO run is planned as its LoRA language-model step:
  its reference pass adds a forward pass, no residuals).

  Returns:
    ((MeshAxes, remat: bool, accum_steps: int, accum_gather: str, the attention form over
    its context axis or None without one) of the chosen row, the table's text).

  Raises:
    PlanError (an FnscaleError): the model fits no mesh of these devices.
  """
  rows = jax.ShapeDtypeStruct((global_batch, cfg.seq), np.int32)
  pol = policy(precision, topo.platform)
  init, loss = functools.partial(model.init_params, cfg), model.loss_fn
  if lora is not None:
    init = lora_state(model, cfg, pol, lora, optimizer)
    loss = fs.lora.with_lora(functools.partial(model.loss_fn, cfg=cfg), lora)
  options = fs.analysis.PlanOptions(policy=pol, rules=model.RULES,
                                    remat_off=remat_off(model, keep),
                                    logical_axes=model.logical_axes(cfg), key=jax.random.key(0))
  p = fs.analysis.plan(init, loss, optimizer, {"inputs": rows, "targets": rows}, topo, options)
  context = p.rows[0].context if p.rows[0].context_why else None  # a context axis's form
  return ((p.axes, p.remat, p.accum_steps, p.accum_gather, context),
          fs.analysis.format_plan(p, top=6).replace("\n", "\n  "))


def lora_state(model, cfg, pol, lora, optimizer):
  """The abstract LoRA state the planner profiles (`plan_mesh`, `memory.profile`): the base
  abstract in the compute dtype (as `finetune.init` stores it) on one device (the planner
  places it on each candidate mesh), the adapters and their `optimizer`'s state."""
  dtype = pol.compute_dtype if pol is not None else np.float32
  mesh = fs.make_mesh({"data": 1}, devices=jax.devices()[:1])
  base = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=jax.sharding.NamedSharding(
          mesh, jax.sharding.PartitionSpec())),
      jax.eval_shape(functools.partial(model.init_params, cfg), jax.random.key(0)))
  return fs.lora.init_state(base, lora, optimizer, key=jax.random.key(1), policy=pol,
                            abstract=True)
