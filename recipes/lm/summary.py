"""What a run says about itself: the start-up lines and run.json's "start" and "data"
records (`describe`), and at the end the `Summary` it returns, said in one line and recorded
(`summarize`). `r` is train_lm's `run_setup.Run`."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, NamedTuple

import jax
import numpy as np

import fnscale as fs
from recipes.lm import evaluation, finetune, hardware, progress, run_log, rundir


def param_count(state) -> int:
  """The number of parameters of a train state, trained and frozen."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves((state.params, state.frozen)))


def describe(r, state) -> None:
  """The start-up lines and the "start" and "data" records of run.json of run `r`, about to
  train `state`."""
  s, o, c, seq, say = r.setup, r.setup.o, r.setup.cfg, r.setup.cfg.seq, r.say
  n_params = param_count(state)
  dp = int(np.prod([s.mesh.shape[a] for a in fs.data_axes(s.mesh)]))
  say(f"fnscale train_lm: model {o.model_config} ({c.layers} layers, d_model {c.d_model}, "
      f"{c.heads} heads, seq {seq}, vocab {c.vocab}), {n_params / 1e6:.2f}M params")
  say(hardware.describe(s.topo))
  say(fs.describe_mesh(s.mesh))
  shardings = jax.tree.map(lambda x: x.sharding, state)
  say("train state: " + fs.sharding_report(state, shardings).splitlines()[-1].strip())
  axes = fs.data_axes(s.mesh)
  split = fs.parallel.context.shards(s.mesh)
  say(f"batch: {o.global_batch} rows x {seq} tokens = {o.global_batch * seq} tokens/step "
      f"({o.global_batch // dp} per data-parallel device x {dp} over {axes})"
      + (f", each row split {split} ways over the context axis ({seq // split} tokens per "
         "device)"
         if split > 1 else "")
      + (f", {o.accum_steps} accumulation steps" if o.accum_steps > 1 else ""))
  say(f"data: {s.corpus.describe}; held-out bigram baseline {r.baseline.bigram:.4f} "
      "nats/token (recipes/baseline.py)")
  say(f"schedule: {o.steps} steps, peak lr {o.lr:g}, warmup {o.warmup_steps}, cosine to "
      f"{o.lr * o.min_lr_ratio:g}; precision {o.precision}"
      + (f" ({r.policy})" if r.policy is not None else " (float32)"))
  say("compile: " + str(r.report).replace("\n", "\n  "))
  say(f"MFU denominator: {r.peak.about}")
  say(where(o.run_dir, o.checkpoint_dir, o.tracker))
  lora = finetune.describe(state, s.lora, say) if s.lora is not None else None
  run_log.write_run_record(o.run_dir, "start", dict(
      step=int(state.step), options=dataclasses.asdict(o), params=n_params, seq=seq,
      global_batch=o.global_batch, mesh=dict(s.mesh.shape), devices=jax.device_count(),
      processes=jax.process_count(), compile_s=r.report.compile_seconds,
      resumed_from=r.resumed, peak_flops=r.peak.flops,
      flops_per_step=progress.flops_per_step(r.setup), lora=lora,
      xla_warnings=list(r.report.xla_warnings)), active=jax.process_index() == 0)
  run_log.write_run_record(o.run_dir, "data", dict(
      dataset=o.dataset, tokenizer=o.tokenizer, unigram_loss=r.baseline.unigram,
      bigram_loss=r.baseline.bigram), active=jax.process_index() == 0)


def summarize(r, state, out: dict) -> "Summary":
  """The Summary of run `r` that ended with `state`; `out`: the loop's figures (train_lm's
  `_train`, `_finish`). Said in one line and recorded as the "summary" of run.json."""
  s, ev = r.setup, out["eval_loss"]
  summary = Summary(
      final_step=int(state.step), start_step=r.start, resumed_from=r.resumed,
      stopped=out["stopped"], loss=out.get("loss"), eval_loss=ev,
      bits_per_byte=None if ev is None else evaluation.bits_per_byte(r, ev),
      bigram_loss=r.baseline.bigram, tokens_per_s=out["tokens_per_s"], mfu=out["mfu"],
      compile_s=r.report.compile_seconds, train_s=out["train_s"], wall_s=time.time() - r.t0,
      params=param_count(state), global_batch=s.o.global_batch, seq=s.cfg.seq,
      mesh=dict(s.mesh.shape), devices=jax.device_count(), processes=jax.process_count(),
      sample=out["sample"], run_dir=s.o.run_dir, state=state,
      checkpoint_dir=s.o.checkpoint_dir or None,
      metrics=os.path.join(s.o.run_dir, run_log.METRICS_FILE))
  run_log.write_run_record(s.o.run_dir, "summary", summary.record(),
                      active=jax.process_index() == 0)
  base = (f" (bigram baseline {summary.bigram_loss:.4f})"
          if summary.bigram_loss is not None else "")
  unit = (" (DPO)" if s.o.objective == "dpo" else f" nats/token{base}")
  r.say((f"done: step {summary.final_step}, last eval loss {summary.eval_loss:.4f}{unit}, "
         f"{summary.train_s:.0f} s training, {summary.wall_s:.0f} s total"
         if summary.eval_loss is not None else f"done: step {summary.final_step}")
        + f"; metrics in {summary.metrics}")
  hbm = device_memory()
  if hbm is not None:
    r.say(f"device memory: peak {hbm[0] / 2**30:.2f} GiB in use of {hbm[1] / 2**30:.2f} GiB "
          "(the busiest of this process's devices, as the runtime counts it)")
    run_log.write_run_record(s.o.run_dir, "device_memory", dict(
        peak_bytes_in_use=hbm[0], bytes_limit=hbm[1]), active=jax.process_index() == 0)
  return summary


def where(run_dir: str, checkpoint_dir: str, tracker: str = "tensorboard") -> str:
  """The line that says what a run writes where."""
  events = (f"TensorBoard events (tensorboard --logdir {run_dir})" if tracker == "tensorboard"
            else "a W&B run (wandb/)" if tracker == "wandb" else "")
  return (f"run directory {run_dir}: {run_log.METRICS_FILE}"
          + (f" and {events}" if events else "") + f", {run_log.RUN_FILE}, {rundir.LOG_FILE} "
          "(only when the libraries or XLA warn), "
          + (f"checkpoints in {checkpoint_dir}" if checkpoint_dir else "no checkpoints"))


def device_memory() -> tuple[int, int] | None:
  """(peak bytes in use, bytes limit) of the busiest local device, from the runtime's own
  counters (`Device.memory_stats`: TPU and GPU); None where it keeps none (CPU)."""
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  stats = [s for s in stats if "peak_bytes_in_use" in s]
  if not stats:
    return None
  top = max(stats, key=lambda s: s["peak_bytes_in_use"])
  return int(top["peak_bytes_in_use"]), int(top.get("bytes_limit", 0))


class Summary(NamedTuple):
  """What `train_lm` returns; its printed form leaves out the final `state`.

  `loss` is the last progress line's train loss; `eval_loss` the final eval's held-out loss
  and `bigram_loss` the corpus's add-one smoothed bigram model's on the whole held-out split
  (the level to beat, `data.baseline`), both in nats per token. `tokens_per_s` and `mfu` are
  whole-run figures: every timed step this call ran (each step after its first; evals,
  checkpoints and the sample left out), not the last progress window; None when fewer than
  two steps ran.
  """
  final_step: int
  start_step: int
  resumed_from: int | None
  stopped: str | None
  loss: float | None
  eval_loss: float | None
  bits_per_byte: float | None
  bigram_loss: float | None
  tokens_per_s: float | None
  mfu: float | None
  compile_s: float
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

  def __repr__(self):
    return "Summary(" + ", ".join(f"{k}={v!r}" for k, v in self.record().items()) + ")"

  def record(self) -> dict:
    return {k: v for k, v in self._asdict().items() if k != "state"}
