"""What a run says about itself: the start-up lines and run.json's "start" and "data"
records (`describe`), and at the end the `Summary` it returns, said in one line and recorded
(`summarize`). `r` is train_lm's `run_setup.Run`."""
from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

import fnscale as fs
from recipes.lm import cli, data, evaluation, finetune, goodput, hardware, memory, progress
from recipes.lm import models, run_log, rundir


def param_count(state) -> int:
  """The number of parameters of a train state, trained and frozen."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves((state.params, state.frozen)))


def describe(r, state) -> None:
  """The start-up lines and the "start" and "data" records of run.json of run `r`, about to
  train `state`."""
  s, o, c, seq, say = r.setup, r.setup.o, r.setup.cfg, r.setup.cfg.seq, r.rec.say
  compiled, baseline = r.compiled, r.evals.baseline
  n_params = param_count(state)
  dp = int(np.prod([s.mesh.shape[a] for a in fs.data_axes(s.mesh)]))
  say(f"fnscale train_lm: model {o.model.model_config} ({c.layers} layers, d_model "
      f"{c.d_model}, {c.heads} heads, seq {seq}, vocab {c.vocab}), {n_params / 1e6:.2f}M params")
  say(hardware.describe(s.topo))
  say(fs.describe_mesh(s.mesh))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  say("train state: " + fs.sharding_report(state, shardings).splitlines()[-1].strip()
      + ("; the optimizer state in the host's memory (--optimizer_offload): the step brings "
         "it to the device a param or a layer at a time" if o.step.optimizer_offload else ""))
  axes = fs.data_axes(s.mesh)
  split = fs.parallel.context.shards(s.mesh)
  batch, sched = o.step.global_batch, o.schedule
  say(f"batch: {batch} rows x {seq} tokens = {batch * seq} tokens/step "
      f"({batch // dp} per data-parallel device x {dp} over {axes})"
      + (f", each row split {split} ways over the context axis ({seq // split} tokens per "
         "device)"
         if split > 1 else "")
      + (f", {o.step.accum_steps} accumulation steps" if o.step.accum_steps > 1 else ""))
  say(f"data: {s.corpus.describe}; held-out bigram baseline {baseline.bigram:.4f} "
      "nats/token (recipes/baseline.py)")
  say(f"schedule: {sched.schedule_steps} steps"
      + (f" (the run trains {sched.steps}; --schedule_steps)"
         if sched.schedule_steps != sched.steps else "")
      + f", peak lr {sched.lr:g}, warmup {sched.warmup_steps}, cosine to "
      f"{sched.lr * sched.min_lr_ratio:g}; precision {o.model.precision}"
      + (f" ({compiled.policy})" if compiled.policy is not None else " (float32)"))
  say("compile: " + str(compiled.report).replace("\n", "\n  "))
  say(f"MFU denominator: {compiled.peak.about}")
  say(where(o.ckpt.run_dir, o.ckpt.checkpoint_dir, o.log.tracker))
  lora = finetune.describe(state, s.lora, say) if s.lora is not None else None
  run_log.write_run_record(o.ckpt.run_dir, "start", dict(
      step=int(state.step), options=cli.flat(o), params=n_params, seq=seq,
      global_batch=o.step.global_batch, mesh=dict(s.mesh.shape), devices=jax.device_count(),
      processes=jax.process_count(), compile_s=compiled.report.compile_seconds,
      resumed_from=r.resumed, peak_flops=compiled.peak.flops,
      flops_per_step=progress.flops_per_step(r.setup), lora=lora,
      tokenizer_sha256=models.tokenizer_sha(s),
      xla_warnings=list(compiled.report.xla_warnings)), active=jax.process_index() == 0)
  run_log.write_run_record(o.ckpt.run_dir, "data", dict(
      dataset=o.data.dataset, tokenizer=o.model.tokenizer, unigram_loss=baseline.unigram,
      bigram_loss=baseline.bigram), active=jax.process_index() == 0)


def summarize(r, state, out: dict) -> "Summary":
  """The Summary of run `r` that ended with `state`; `out`: the loop's figures (train_lm's
  `_loop`, `_finish`). Said in two lines (`closing_lines`: the summary's and the goodput's)
  and recorded as the "summary" of run.json, with the compiled step's memory in another
  (`say_memory`)."""
  s, ev, compiled = r.setup, out["eval_loss"], r.compiled
  summary = Summary(
      final_step=int(state.step), start_step=r.start, resumed_from=r.resumed,
      stopped=out["stopped"], loss=out.get("loss"), eval_loss=ev, eval_step=out["eval_step"],
      bits_per_byte=None if ev is None else evaluation.bits_per_byte(s.corpus, ev),
      bigram_loss=r.evals.baseline.bigram, tokens_per_s=out["tokens_per_s"], mfu=out["mfu"],
      compile_s=compiled.report.compile_seconds,
      step_bytes=int(fs.analysis.step_bytes(compiled.step)),
      train_s=out["train_s"], wall_s=time.time() - r.t0,
      params=param_count(state), global_batch=s.o.step.global_batch, seq=s.cfg.seq,
      mesh=dict(s.mesh.shape), devices=jax.device_count(), processes=jax.process_count(),
      sample=out["sample"], run_dir=s.o.ckpt.run_dir, state=state,
      checkpoint_dir=s.o.ckpt.checkpoint_dir or None,
      metrics=os.path.join(s.o.ckpt.run_dir, run_log.METRICS_FILE), goodput=out["goodput"])
  run_log.write_run_record(s.o.ckpt.run_dir, "summary", summary.record(),
                           active=jax.process_index() == 0)
  for line in closing_lines(summary, s.o.tune.objective):
    r.rec.say(line)
  say_memory(s, summary.step_bytes, r.rec.say)
  return summary


def finished(s, state, start: int, t0: float, say) -> "Summary":
  """The Summary of a rerun of setup `s` that found its last step (`start`) already trained
  and ended with that `state`: nothing compiled, evaluated or sampled; the losses quoted are
  the run's last logged ones, each at its step. run.json keeps the run's own summary."""
  o, base = s.o, data.baseline(s.corpus).bigram
  loss, ev = (last_logged(o.ckpt.run_dir, tags, start) for tags in (
      ("train/loss",), ("eval/loss", "eval/dpo_loss")))
  summary = Summary(
      final_step=start, start_step=start, resumed_from=start, stopped=None,
      loss=loss and loss[1], eval_loss=ev and ev[1], eval_step=ev and ev[0],
      bits_per_byte=ev and evaluation.bits_per_byte(s.corpus, ev[1]), bigram_loss=base,
      tokens_per_s=None, mfu=None, compile_s=0.0, step_bytes=None, train_s=0.0,
      wall_s=time.time() - t0, params=param_count(state), global_batch=o.step.global_batch,
      seq=s.cfg.seq, mesh=dict(s.mesh.shape), devices=jax.device_count(),
      processes=jax.process_count(), sample=None, run_dir=o.ckpt.run_dir, state=state,
      checkpoint_dir=o.ckpt.checkpoint_dir or None,
      metrics=os.path.join(o.ckpt.run_dir, run_log.METRICS_FILE))
  say(_line(summary, o.tune.objective, "nothing trained this time, "))
  return summary


def closing_lines(summary: "Summary", objective: str) -> list[str]:
  """The two lines a run that trained ends with: the summary's (`_line`) and the goodput's.
  A run with several starts labels which is which: the wall time is this start's, the
  goodput the whole run's."""
  starts = int(summary.goodput[goodput.TAG + "starts"])
  return [_line(summary, objective, f"{summary.train_s:.0f} s training, ",
                " this start" if starts > 1 else ""),
          ("the whole run: " if starts > 1 else "") + goodput.line(summary.goodput)]


def _line(summary: "Summary", objective: str, timing: str, whose: str = "") -> str:
  """The summary's line: the step, why it stopped, the eval loss and the step it is of, and
  `timing` before the wall time (`whose`: " this start", where a run had several)."""
  head = (f"stopped: step {summary.final_step} ({summary.stopped})" if summary.stopped
          else f"done: step {summary.final_step}")
  base = (f" (bigram baseline {summary.bigram_loss:.4f})"
          if summary.bigram_loss is not None else "")
  unit, base = (" (DPO)", "") if objective == "dpo" else (" nats/token", base)
  ev = ("no eval" if summary.eval_loss is None else  # the step next to the loss it is of
        f"eval loss {summary.eval_loss:.4f}{unit} at step {summary.eval_step}{base}")
  return (f"{head}, {ev}, {timing}{summary.wall_s:.0f} s total{whose}; metrics in "
          f"{summary.metrics}")


def last_logged(run_dir: str, tags: tuple, step: int) -> tuple[int, float] | None:
  """(step, value) of the last record of `run_dir`'s metrics.jsonl at or before `step` that
  holds one of `tags` (e.g. "eval/loss"); None where there is none (or no file: a process
  other than 0)."""
  path, found = os.path.join(run_dir, run_log.METRICS_FILE), None
  if not os.path.isfile(path):
    return None
  for record in run_log.records(path):
    tag = next((t for t in tags if t in record), None)
    if tag is not None and record.get("step", step + 1) <= step:
      found = (int(record["step"]), float(record[tag]))
  return found


def say_memory(s, step_bytes: int, say) -> None:
  """Says the compiled step's peak bytes per device (XLA's memory analysis,
  `fnscale.analysis.step_bytes`), against the device's memory where it is known, and the
  runtime's own peak count where it keeps one (TPU, GPU), labelled as such: that count is
  of the arrays the runtime allocated, without the step's temporaries. Recorded in run.json
  as "device_memory"."""
  limit, runtime = memory.limit(s.mesh), runtime_peak()
  unit = (2**30, "GiB") if max(step_bytes, limit or 0) >= 2**30 else (2**20, "MiB")
  size = lambda nbytes: f"{nbytes / unit[0]:.2f} {unit[1]}"  # one unit a line
  what = ("XLA's memory analysis of the compiled step"
          + (": arguments + outputs + temporaries - aliased" if s.topo.platform == "cpu"
             else ""))
  say(f"device memory: the step's peak {size(step_bytes)} per device ({what})"
      + (f" of {size(limit)}" if limit else "")
      + (f"; the runtime's peak_bytes_in_use counter, which leaves the step's temporaries "
         f"out, read {size(runtime)}" if runtime is not None else ""))
  run_log.write_run_record(s.o.ckpt.run_dir, "device_memory", dict(
      step_peak_bytes=step_bytes, bytes_limit=limit, runtime_peak_bytes_in_use=runtime),
      active=jax.process_index() == 0)


def where(run_dir: str, checkpoint_dir: str, tracker: str = "tensorboard") -> str:
  """The line that says what a run writes where."""
  events = (f"TensorBoard events (tensorboard --logdir {run_dir})" if tracker == "tensorboard"
            else "a W&B run (wandb/)" if tracker == "wandb" else "")
  return (f"run directory {run_dir}: {run_log.METRICS_FILE}"
          + (f" and {events}" if events else "") + f", {run_log.RUN_FILE}, {rundir.LOG_FILE} "
          "(only when the libraries or XLA warn), "
          + (f"checkpoints in {checkpoint_dir}" if checkpoint_dir else "no checkpoints"))


def runtime_peak() -> int | None:
  """The runtime's own peak count of bytes in use (`Device.memory_stats`:
  "peak_bytes_in_use", TPU and GPU) on the busiest local device; None where it keeps none
  (CPU)."""
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  peaks = [int(s["peak_bytes_in_use"]) for s in stats if "peak_bytes_in_use" in s]
  return max(peaks) if peaks else None


class Summary(NamedTuple):
  """What `train_lm` returns; its printed form leaves out the final `state`.

  `loss` is the last progress line's train loss; `eval_loss` the last eval's held-out loss,
  of the state at `eval_step` (the final step, or a stop's: a stop by --stop_after or by
  Ctrl-C evaluates; one by a preemption notice has no time to); `bigram_loss` the corpus's
  add-one smoothed bigram model's on the whole held-out split (the level to beat,
  `data.baseline`); all in nats per token. `tokens_per_s` and `mfu` are
  whole-run figures: every timed step this call ran (each step after its first; evals,
  checkpoints and the sample left out), not the last progress window; None when fewer than
  two steps ran. `step_bytes`: the compiled step's peak bytes per device, from XLA's memory
  analysis (`fnscale.analysis.step_bytes`; None when no step was compiled). `goodput`: the
  run's goodput record (goodput.py: seconds of wall time per phase, over every start of the
  run directory; None when nothing was trained).
  """
  final_step: int
  start_step: int
  resumed_from: int | None
  stopped: str | None
  loss: float | None
  eval_loss: float | None
  eval_step: int | None
  bits_per_byte: float | None
  bigram_loss: float | None
  tokens_per_s: float | None
  mfu: float | None
  compile_s: float
  step_bytes: int | None
  train_s: float
  wall_s: float
  params: int
  global_batch: int
  seq: int
  mesh: dict
  devices: int
  processes: int
  sample: str | None
  run_dir: str
  metrics: str
  checkpoint_dir: str | None
  state: Any = None
  goodput: dict | None = None  # the run's cumulative goodput record (goodput.py)

  def __repr__(self):
    return "Summary(" + ", ".join(f"{k}={v!r}" for k, v in self.record().items()) + ")"

  def record(self) -> dict:
    return {k: v for k, v in self._asdict().items() if k != "state"}
