"""train_lm's optimizers (--optimizer, --mu_dtype; recipes/lm/optimizers.py): the state each
keeps, its update against optax's own, the memory pre-flight's choice among them where the
default's state doesn't fit, and a checkpoint of another optimizer refused on resuming."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fnscale as fs
from fnscale import FitError
from recipes import train_lm
from recipes.lm import llama, memory, optimizers, run_setup
from recipes.lm.options import Options


def _params():
  return {"wte": jnp.ones((256, 128)), "blocks": {"w_up": jnp.full((2, 128, 512), 0.5),
                                                   "norm": jnp.ones((2, 128))}}


def _optimizer(**kw):
  o = Options.of(lr=1e-2, warmup_steps=2, schedule_steps=10, **kw)
  return run_setup.optimizer(o.step, o.schedule)


def test_each_option_keeps_its_optimizers_state():
  """AdamW keeps both moments at the params' shapes (the first in --mu_dtype); Adafactor a
  row and a column vector per matrix (its two largest dims) and no first moment."""
  params = _params()
  states = {name: _optimizer(**kw)[0].init(params) for name, kw in (
      ("f32", {}), ("bf16", dict(mu_dtype="bfloat16")), ("factored", dict(optimizer="adafactor")))}
  for name, mu in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
    adam = states[name][1][0]
    assert isinstance(adam, optax.ScaleByAdamState)
    assert adam.mu["blocks"]["w_up"].dtype == mu
    assert adam.mu["blocks"]["w_up"].shape == (2, 128, 512)
    assert adam.nu["wte"].dtype == jnp.float32
  factored = states["factored"][1][0]
  assert isinstance(factored, optax.FactoredState)
  assert factored.v_row["blocks"]["w_up"].shape == (2, 128)
  assert factored.v_col["blocks"]["w_up"].shape == (2, 512)
  assert factored.v_row["wte"].shape == (128,) and factored.v_col["wte"].shape == (256,)
  kinds = [type(x).__name__ for x in jax.tree.leaves(
      states["factored"], is_leaf=lambda x: hasattr(x, "_fields"))]
  assert "ScaleByAdamState" not in kinds and "EmaState" not in kinds
  held = lambda s: sum(x.size for x in jax.tree.leaves(s))
  n = sum(x.size for x in jax.tree.leaves(params))
  assert held(states["f32"]) == 2 * n + 2 and held(states["factored"]) < n / 20


@pytest.mark.parametrize("name", optimizers.OPTIMIZERS)
def test_the_weight_decay_is_lr_times_decay_on_the_w_leaves_only(name):
  """With zero gradients the update is the decoupled decay alone: each "w*" leaf loses
  lr x decay of itself (AdamW's form; optax's Adafactor adds its decay after the lr), the
  norm keeps its value."""
  params, lr, decay = _params(), 1e-2, 0.1
  opt = optimizers.transformation(name, lr, weight_decay=decay)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = opt.update(zeros, opt.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(new["wte"], 1 - lr * decay, rtol=1e-6)
  np.testing.assert_allclose(new["blocks"]["w_up"], 0.5 * (1 - lr * decay), rtol=1e-6)
  np.testing.assert_array_equal(new["blocks"]["norm"], 1.0)


@pytest.mark.slow
def test_an_adafactor_step_over_8_devices_is_optax_on_one():
  """Two steps of a tiny Llama under fs.train_step over an fsdp=8 mesh (the factored state
  split as fnscale splits it) against optax's Adafactor and jax.grad on one device."""
  cfg = llama.model_config("llama-tiny", 16, layers=2, d_model=64, heads=4, kv_heads=2,
                           d_mlp=128, vocab=64)
  opt = _optimizer(optimizer="adafactor")[0]
  loss = functools.partial(llama.loss_fn, cfg=cfg)
  mesh = fs.make_mesh({"fsdp": 8})
  state = fs.init_state(functools.partial(llama.init_params, cfg), opt, mesh=mesh,
                        rules=llama.RULES, logical_axes=llama.logical_axes(cfg),
                        key=jax.random.key(0))
  step = fs.shard_step(fs.train_step(loss, opt), mesh, rules=llama.RULES,
                       logical_axes=llama.logical_axes(cfg))
  params = jax.tree.map(np.asarray, jax.device_get(state.params))
  ref_state = opt.init(params)
  ids = jax.random.randint(jax.random.key(1), (2, 8, 17), 0, 64)
  for i in range(2):
    batch = {"inputs": ids[i, :, :-1], "targets": ids[i, :, 1:]}
    state, metrics = step(state, batch)
    ref_loss, grads = jax.value_and_grad(loss)(params, batch)
    updates, ref_state = opt.update(grads, ref_state, params)
    params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               jax.device_get(state.params), params)


def test_mu_dtype_with_adafactor_is_refused():
  with pytest.raises(fs.InputError, match=r"--mu_dtype=bfloat16 with --optimizer=adafactor: "
                     r"Adafactor keeps no first moment; fix: "):
    run_setup.decide(Options.of(optimizer="adafactor", mu_dtype="bfloat16"), None, print)


@pytest.fixture(scope="module")
def v5e(tpu_devices):
  """(topology, mesh, the Llama, its float32 params' bytes P) on one described v5e chip: a
  Llama whose params outweigh its activations at 1 row of 32 tokens 50 to 1, so that its
  step holds about P of params, P of gradients and the optimizer's state."""
  del tpu_devices  # skips without libtpu
  devices = fs.target_devices("v5e:1x1")
  cfg = llama.model_config("llama-tiny", 32, layers=4, d_model=512, heads=8, kv_heads=2,
                           d_mlp=2048, vocab=32768)
  shapes = jax.eval_shape(functools.partial(llama.init_params, cfg), jax.random.key(0))
  return (fs.detect_topology(devices=devices), fs.make_mesh({"data": 1}, devices=devices),
          memory.Model(llama, cfg, "llama"), 4 * sum(x.size for x in jax.tree.leaves(shapes)))


def _choose(v5e, monkeypatch, cap, **options):
  topo, mesh, model, P = v5e
  monkeypatch.setattr(memory, "limit", lambda mesh: cap * P)
  said = []
  step = memory.choose(Options.of(**options).step, "float32", model, topo, mesh, 1,
                       said.append)
  return step, said


@pytest.mark.slow
def test_the_preflight_shrinks_the_optimizer_state_where_adamws_does_not_fit(v5e, monkeypatch):
  """By a hand count, AdamW's step holds 4 P (params, gradients, two moments), its first
  moment in bfloat16 3.5 P, Adafactor 2 P; a choice must fit 90% of the device. At 3.95 P
  the first moment goes to bfloat16, at 3 P Adafactor runs, and either is said in one line;
  at 4.5 P nothing changes. The remat, accumulation and rows left open or fixed alike."""
  for given in ({}, dict(batch_size=1, remat=False, accum_steps=1)):
    o, said = _choose(v5e, monkeypatch, 4.5, **given)
    assert (o.optimizer, o.mu_dtype, said) == ("adamw", "float32", [])
    o, said = _choose(v5e, monkeypatch, 3.95, **given)
    assert (o.optimizer, o.mu_dtype) == ("adamw", "bfloat16")
    assert len(said) == 1 and said[0].startswith("memory: batch_size=1, accum_steps=1, ")
    assert "--mu_dtype=bfloat16 (" in said[0]
    o, said = _choose(v5e, monkeypatch, 3.0, **given)
    assert (o.optimizer, o.mu_dtype) == ("adafactor", None)
    assert len(said) == 1 and "--optimizer=adafactor (" in said[0]


@pytest.mark.slow
def test_an_optimizer_the_user_named_is_kept_and_the_fix_names_the_others(v5e, monkeypatch):
  """--optimizer or --mu_dtype given: the pre-flight changes neither; where it doesn't fit,
  the error's fix is the optimizer that would; where nothing fits one device, it says even
  Adafactor doesn't."""
  o, said = _choose(v5e, monkeypatch, 3.95, mu_dtype="bfloat16")
  assert (o.optimizer, o.mu_dtype, said) == ("adamw", "bfloat16", [])
  for given in (dict(optimizer="adamw"), dict(mu_dtype="float32")):
    with pytest.raises(FitError, match=r"with --optimizer=adamw --mu_dtype=float32 nothing "
                       r"fits, whatever the remat and accumulation; fix: --batch_size=1 "
                       r"--accum_steps=1 "
                       r"--(no)?remat --mu_dtype=bfloat16 \("):
      _choose(v5e, monkeypatch, 3.95, **given)
  with pytest.raises(FitError, match=r"fix: --batch_size=1 --accum_steps=1 --(no)?remat "
                     r"--optimizer=adafactor \("):
    _choose(v5e, monkeypatch, 3.0, optimizer="adamw")
  with pytest.raises(FitError, match=r"fix: a smaller model, or more devices to split it over "
                     r"\(--mesh=fsdp=N\): nothing fits one device, even with "
                     r"--optimizer=adafactor"):
    _choose(v5e, monkeypatch, 1.5)


@pytest.mark.slow
def test_resuming_with_another_optimizer_is_one_error_naming_the_fix(tmp_path, capfd):
  """A run checkpointed under AdamW, restarted with --optimizer=adafactor: the checkpoint's
  state has no place in Adafactor's; one `error:` line says which optimizer and the fix."""
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("".join(f"def f{i}(x):\n  return x * {i}\n" for i in range(400)))
  argv = ["train_lm", "--model_config=nano", "--mesh=data=-1", "--seq=32", "--global_batch=8",
          f"--dataset={corpus}", f"--run_dir={tmp_path / 'run'}", "--eval_batches=1",
          "--sample_len=0", "--checkpoint_every=2"]
  assert train_lm.main(argv + ["--steps=2"]) == 0
  capfd.readouterr()
  assert train_lm.main(argv + ["--steps=4", "--optimizer=adafactor"]) == 2
  err = capfd.readouterr().err
  assert err.startswith(f"error: --run_dir={tmp_path / 'run'} holds a run with other options: "
                        "optimizer='adafactor' (the run's: 'adamw'), mu_dtype=None (the run's: "
                        "'float32'); "), err
  assert err.strip().endswith("the run's options to resume it: --optimizer=adamw "
                              "--mu_dtype=float32"), err
  assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("options,kind", [(dict(optimizer="adafactor"), optax.FactoredState),
                                          (dict(mu_dtype="bfloat16"), optax.ScaleByAdamState)])
def test_mesh_auto_plans_the_state_of_the_runs_optimizer(tmp_path, monkeypatch, options, kind):
  """--mesh=auto hands the planner the optimizer the run asked for (its state is what each
  candidate mesh must hold), not AdamW in float32: the state it would init, read here."""
  seen = {}

  class Planned(Exception):
    pass

  def plan(init, loss, optimizer, batch, target, plan_options):
    seen["state"] = jax.eval_shape(optimizer.init, _params())
    raise Planned
  monkeypatch.setattr(fs.analysis, "plan", plan)
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("def f(x):\n  return x\n" * 400)
  with pytest.raises(Planned):
    train_lm.train_lm(model_config="nano", mesh="auto", seq=32, global_batch=8,
                      dataset=str(corpus), run_dir=str(tmp_path / "run"), **options)
  states = [s for s in jax.tree.leaves(seen["state"], is_leaf=lambda s: isinstance(s, kind))
            if isinstance(s, kind)]
  assert states, seen["state"]
  if kind is optax.ScaleByAdamState:
    assert {x.dtype for x in jax.tree.leaves(states[0].mu)} == {jnp.dtype("bfloat16")}
