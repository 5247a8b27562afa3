"""fnscale: a single-device JAX train step as one SPMD program on every chip.

Pure functions compose in one direction: topology -> mesh -> shardings -> compiled step; this
namespace holds that pipeline and its errors. The tools around it are namespaces, each name
with one spelling: `fnscale.analysis` (cost, planning, HLO), `fnscale.checkpoint`,
`fnscale.kernels`, `fnscale.multihost`, `fnscale.parallel`, `fnscale.lora`,
`fnscale.cloud`, `fnscale.adapters`. Modules whose names start with `_` are the implementation.

Reading order: five files hold the pipeline, each doing its job once. `_topology.py` (what
hardware is there), `_mesh.py` (named axes over it), `_sharding.py` (logical rules ->
PartitionSpecs, FSDP), `_step.py` (the pure train step; it names its three parts), and
`_compile.py` (`shard_step`: the step compiled once for the mesh); then
`kernels/_attention.py` (`with_kernel`).

Layout of the package: the core pipeline sits at the root, each layer above it is a folder,
and a layer imports only the layers below it, with no cycle (tests/test_imports.py checks
every import and that this table names every module):

  core (the root modules)  <-  kernels/, parallel/  <-  multihost/, checkpoint/  <-  analysis/

| module | job |
|---|---|
| `_errors.py`, `_compat.py`, `_tree.py`, `_deprecation.py` | error types by kind; every JAX interface JAX doesn't promise to keep; pytree helpers; old spellings that warn |
| `_topology.py`, `_chips.py`, `_override.py`, `_sources.py`, `_machine.py`, `_metadata.py`, `_mesh.py`, `_axes.py`, `_context.py` | the hardware (environment, libtpu, GCE metadata): the topology, the chips' published facts, the strings that name a topology, the sources it is read from, this machine's device files; named device axes; the axis conventions; the ambient values, declared in one place |
| `_sharding.py`, `_rules.py`, `_specs.py`, `_batch_sharding.py`, `_step.py`, `_loss.py`, `_accumulate.py`, `_update.py`, `_model_state.py`, `_offload.py`, `_ratio.py`, `_lookups.py`, `_state.py`, `lora.py` | a tree's shardings and automatic FSDP, logical rules -> PartitionSpecs, spec checks, batch shardings; the pure train step, the loss as it calls it, its microbatch loop and reductions, its optimizer update and norms, the model state its loss updates (a BatchNorm's statistics), that update with the optimizer state in the host's memory; a masked-mean loss read as (sum, count); the tables a loss looks up in, gathered for it; the state born sharded; low-rank adapters over a frozen base |
| `_compile.py`, `_compiler.py`, `_closure.py`, `_autodiff.py` | `shard_step`; compiling with XLA's warnings captured; closed-over arrays; forward-mode autodiff through kernels |
| `cloud.py`, `adapters.py`, `_flax.py` | deleting the Cloud TPU VM when the job ends; params from flax/equinox models; Flax's sharding metadata and logical rules, read by duck typing |
| `kernels/`, `parallel/` | attention, cross-entropy and grouped-matmul kernels, `with_kernel`; context, expert and pipeline parallelism |
| `multihost/`, `checkpoint/` | joining the job, agreement, lost peers, preemption, global batches; orbax and Hugging Face checkpoints |
| `analysis/` | the HLO reader, FLOPs and MFU, compile reports, the planner and its cost model, mesh invariance |
"""
from fnscale import _deprecation
from fnscale._errors import (
    CheckpointError,
    CloudError,
    DistributedArgumentError,
    DistributedError,
    ExpertError,
    FnscaleError,
    InputError,
    FitError,
    KernelError,
    LoraError,
    MeshError,
    PlanError,
    RuntimeFailure,
    ShardingError,
    StepError,
    StorageError,
    TopologyError,
)
# The pipeline, in order: topology -> mesh -> shardings -> compiled step.
from fnscale._topology import (CHIP_FACTS, ChipFacts, Topology, detect_topology, quiet_libtpu,
                               simulate_cpu_devices, target_devices)
from fnscale._mesh import (MeshAxes, check_axis_names, describe_mesh, make_mesh, parallelism,
                           parse_axes, with_mesh)
from fnscale._axes import AxisConventions, axis_conventions, data_axes
from fnscale._axes import FNSCALE as FNSCALE_AXES, LEVANTER as LEVANTER_AXES, MAXTEXT as MAXTEXT_AXES
from fnscale._sharding import (batch_sharding, constrain_batch, logical_to_spec, sharding_layout,
                               shardings)
from fnscale._step import ACCUM_GATHER, LossScale, TrainState, train_step
from fnscale._state import init_state, state_shardings
from fnscale._compile import shard_step
from fnscale._compiler import compilation_cache, compilation_cache_restored, fast_compile_options
from fnscale.analysis._report import CompileReport, compile_report, sharding_report
from fnscale.kernels._attention import attention, with_kernel
from fnscale.kernels._cross_entropy import cross_entropy
from fnscale.multihost._agreement import barrier
from fnscale.multihost._cluster import initialize
from fnscale.multihost._global_batch import global_batch, process_rows
# The layers above the pipeline, reached as namespaces (`fs.checkpoint.save`, ...).
from fnscale import adapters, analysis, checkpoint, cloud, kernels, lora, multihost, parallel

__all__ = [
    "FnscaleError", "InputError", "RuntimeFailure",
    "CheckpointError", "CloudError", "DistributedArgumentError", "DistributedError",
    "ExpertError", "FitError", "KernelError", "LoraError", "MeshError", "PlanError",
    "ShardingError", "StepError", "StorageError", "TopologyError",
    "Topology", "detect_topology", "simulate_cpu_devices", "target_devices", "quiet_libtpu",
    "ChipFacts", "CHIP_FACTS",
    "MeshAxes", "make_mesh", "parallelism", "with_mesh", "parse_axes", "check_axis_names",
    "describe_mesh", "AxisConventions", "axis_conventions", "data_axes",
    "FNSCALE_AXES", "LEVANTER_AXES", "MAXTEXT_AXES",
    "batch_sharding", "constrain_batch", "logical_to_spec", "sharding_layout", "sharding_report",
    "shardings",
    "TrainState", "LossScale", "train_step", "ACCUM_GATHER",
    "init_state", "state_shardings",
    "shard_step", "compilation_cache", "compilation_cache_restored", "fast_compile_options",
    "CompileReport", "compile_report",
    "attention", "cross_entropy", "with_kernel",
    "barrier", "global_batch", "initialize", "process_rows",
    "adapters", "analysis", "checkpoint", "cloud", "kernels", "lora", "multihost", "parallel",
]

_PIPELINE = "fnscale.{} (the pipeline's names are fnscale's own)"
__getattr__ = _deprecation.moved(__name__, {
    "plan": ("fnscale.analysis._plan", "fnscale.analysis.plan (the planner's names are in "
             "fnscale.analysis)"),
    "hlo": ("fnscale.analysis.hlo", "fnscale.analysis.hlo"),
    "flops": ("fnscale.analysis._flops", "fnscale.analysis.mfu, .peak_flops, "
              ".model_flops_per_token, ... (fnscale.analysis)"),
    "report": ("fnscale.analysis._report", "fnscale.compile_report, fnscale.sharding_report, "
               "fnscale.analysis.format_report"),
    "invariance": ("fnscale.analysis._invariance", "fnscale.analysis.check_mesh_invariance"),
    "topology": ("fnscale._topology", _PIPELINE.format(
        "detect_topology, fnscale.target_devices, fnscale.quiet_libtpu, fnscale.CHIP_FACTS")),
    "mesh": ("fnscale._mesh", _PIPELINE.format(
        "make_mesh, fnscale.with_mesh, fnscale.parse_axes, fnscale.describe_mesh")),
    "sharding": ("fnscale._sharding", _PIPELINE.format(
        "shardings, fnscale.logical_to_spec, fnscale.data_axes, fnscale.batch_sharding")),
    "step": ("fnscale._step", _PIPELINE.format("train_step, fnscale.TrainState, "
                                               "fnscale.LossScale, fnscale.ACCUM_GATHER")),
    "state": ("fnscale._state", _PIPELINE.format("init_state, fnscale.state_shardings")),
    "compile": ("fnscale._compile", _PIPELINE.format("shard_step, fnscale.compile_report")),
    "errors": ("fnscale._errors", "fnscale.MeshError, fnscale.InputError, ... (fnscale's own "
               "names)"),
})
