"""Analysis: what a compiled step costs, and which mesh a model should use on a target.

One flat namespace, as optax's are, plus the HLO reader's vocabulary:

- the planner: `plan` ranks meshes, remat and accumulation for a model on a described target
  and verifies the best by compiling for it (`PlanOptions`, `Plan`, `Candidate`,
  `CompileCheck`, `format_plan`, `plan_summary`); its parts `profile_model`, `predict`, `hardware`,
  `calibrate_cpu`, `cannot_verify`, `mesh_str`, `ForecastTerms`, `FORECAST_TERMS`,
  `forecast_terms` (the terms for a target);
- FLOPs: `model_flops_per_token`, `peak_flops`, `mfu`, `measure_matmul_peak`,
  `host_matmul_peak` (`HostPeak`), `usable_cores`;
- `format_report` prints a `fnscale.CompileReport` (`fnscale.compile_report` makes one);
- `check_mesh_invariance` checks that a step computes the same thing on several meshes
  (`InvarianceReport`);
- memory before a step runs: `compile_fitting` compiles a step and holds XLA's peak bytes
  (`step_bytes`) against its devices' memory (`device_memory`), `check_fit` any figure;
  `fit_options` (`FitOption`s) are what would fit on a mesh, `data_parallel` the devices that
  split its batch;
- `hlo` reads an optimized HLO module: matmul FLOPs with loop trip counts, each collective's
  runs and bytes, what crosses slices (`hlo.summarize`, `hlo.collectives`, ...); its
  docstring maps the files (`_hlo_*.py`) that read the text, loops, FLOPs, kernels and
  collectives.

Layer: the top of the library; imports the core pipeline, `fnscale.kernels` and
`fnscale.parallel`; never `fnscale.multihost`, `fnscale.checkpoint` or the package root.

Examples:
  What a v5p-128 offers, and the MFU of a step that does 6 x 8e9 FLOPs per token for 1M
  tokens in 10 s on it:

  >>> import fnscale as fs
  >>> hw = fs.analysis.hardware("v5p-128")
  >>> hw.num_devices, hw.peak_flops / 1e12
  (64, 459.0)
  >>> round(fs.analysis.mfu(6 * 8e9 * 1e6, 10.0, hw.num_devices, hw.peak_flops), 3)
  0.163
"""
from fnscale import _deprecation
from fnscale.analysis import hlo
from fnscale.analysis._fit import FitOption, check_fit, compile_fitting, device_memory, step_bytes
from fnscale.analysis._flops import (HostPeak, host_matmul_peak, measure_matmul_peak, mfu,
                                     model_flops_per_token, peak_flops, usable_cores)
from fnscale.analysis._invariance import InvarianceReport, check_mesh_invariance
from fnscale.analysis._plan import (FORECAST_TERMS, Candidate, CompileCheck, ForecastTerms, Plan,
                                    PlanOptions, calibrate_cpu, cannot_verify, data_parallel,
                                    fit_options, forecast_terms, format_plan, hardware, mesh_str,
                                    plan, plan_summary, predict, profile_model)
from fnscale.analysis._report import format_report

__all__ = [
    "plan", "PlanOptions", "Plan", "Candidate", "CompileCheck", "format_plan", "plan_summary",
    "profile_model", "predict", "hardware", "calibrate_cpu", "cannot_verify", "mesh_str",
    "ForecastTerms", "FORECAST_TERMS", "forecast_terms",
    "model_flops_per_token", "peak_flops", "mfu", "measure_matmul_peak", "host_matmul_peak",
    "HostPeak", "usable_cores",
    "format_report",
    "check_mesh_invariance", "InvarianceReport",
    "compile_fitting", "check_fit", "device_memory", "step_bytes", "fit_options", "FitOption",
    "data_parallel",
    "hlo",
]

__getattr__ = _deprecation.moved(__name__, {
    "flops": ("fnscale.analysis._flops", "fnscale.analysis.mfu, .peak_flops, "
              ".model_flops_per_token, ... (fnscale.analysis)"),
    "report": ("fnscale.analysis._report", "fnscale.compile_report, fnscale.sharding_report, "
               "fnscale.analysis.format_report"),
    "invariance": ("fnscale.analysis._invariance", "fnscale.analysis.check_mesh_invariance"),
    "summary": ("fnscale.analysis._plan:plan_summary", "fnscale.analysis.plan_summary"),
    "fit": ("fnscale.analysis._fit", "fnscale.analysis.compile_fitting, .check_fit, "
            ".device_memory, .step_bytes, .FitOption (fnscale.analysis)"),
})
