"""Bad input that would otherwise run, or end in a traceback: every recipe's command line
refuses it with one `error:` line naming the bad value and exit status 2; a mistyped mesh or
rule axis is refused with the closest name; a float16 step and its state agree on precision;
a loss that is not a scalar is named by its shape on the whole batch; a state built with
another optimizer is refused naming both.
"""
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import fnscale as fs

ROOT = pathlib.Path(__file__).resolve().parent.parent

# One bad command line per recipe: (recipe, argv, what the error line must name).
CASES = [
    ("plan", ["--target=v9", "--verify=0"], "'v9'"),
    ("show_topology", ["--topology=v9-8"], "'v9-8'"),
    ("baseline", ["--dataset=no_such_corpus"], "'no_such_corpus'"),
    ("plot_run", ["/no/such/run_dir"], "'/no/such/run_dir'"),
    ("train_tokenizer", ["--vocab_size=10"], "vocab_size=10"),
    ("pretokenize", ["--out=unused", "--shard_mb=-1"], "--shard_mb=-1"),
    ("train_lm", ["--checkpoint_every=-1"], "--checkpoint_every=-1 must be >= 0"),
    ("train_lm", ["--dataset=tiny_corpus", "--mesh=data=2,fsdpp=4"],
     "--mesh: axis 'fsdpp' is not one the axis conventions give a meaning"),
    ("bench/accumulation", ["gpu"], "['gpu']"),
    ("bench/attention", ["--iters=0"], "--iters: 0 must be >= 1"),
    ("bench/attention", ["--implementations", "cudnn"],
     "--implementations ['cudnn'] can't run on cpu"),
    ("bench/attention", ["--shapes", "1x128"],
     "--shapes entry '1x128': expected BATCHxSEQxHEADSxKV_HEADSxHEAD"),
    ("bench/attention", ["--tpu"], "tpu=True but no TPU was found"),  # train_lm's options
    ("bench/checkpoint", ["--sizes_mib=abc"], "--sizes_mib='abc'"),
    ("bench/chip", ["--case=gpt-nano,remat=sometimes"], "'sometimes'"),
    ("bench/crash", ["--kill_at=0"], "--kill_at: 0 must be >= 1"),
    ("bench/chip", ["--tpu"], "tpu=True but no TPU was found"),  # train_lm's options
    ("bench/context", ["--figures=speed"], "'speed'"),
    ("bench/int8_matmul", ["--shapes=64x32"], "'64x32' is not MxKxN"),
    ("bench/int8_matmul", ["--reps=0"], "--reps: 0 must be >= 1"),
    ("bench/int8_matmul", ["--tiles=256"], "--tiles '256' is not BMxBN"),
    ("bench/compare_maxtext", ["--layers=0"], "--layers: '0' is not an int >= 1"),
    ("bench/compare_maxtext", ["--mesh=context=4", "--context_strategy=ulysses",
                               "--load_balance"], "ulysses: MaxText's Ulysses takes neither"),
    ("bench/compare_maxtext", ["--fnscale_python=/nope/python", "--sides=fnscale"],
     "--fnscale_python=/nope/python does not exist"),
    ("bench/forecast_fit", ["--bogus=1"], "--bogus=1"),
    ("bench/hf_checkpoint", ["--dir=unused", "--seq=0"], "--seq: 0 must be >= 1"),
    ("bench/launch_ray", ["--repeats=0"], "--repeats: 0 must be >= 1"),
    ("bench/loader", ["--batches=-3"], "--batches: -3 must be >= 1"),
    ("bench/lora", ["--prepare=unused", "--compile"], "give one of --prepare=DIR and --compile"),
    ("bench/memory", ["--seq=0"], "--seq: 0 must be >= 1"),
    ("bench/moe_forecast", ["--json"], "--json: expected one argument"),
    ("bench/moe_layer", ["--k=0"], "--k: 0 must be >= 1"),
    ("bench/pipeline", ["--microbatches=4,x"], "'x' is not an int"),
    ("bench/preemption", ["--steps=0"], "--steps: 0 must be >= 1"),
    ("bench/replica_check", ["--calls=0"], "--calls: 0 must be >= 1"),
    ("bench/step", ["--steps=0"], "--steps=0"),
    ("bench/step", ["--topology=2x2x4"], "topology from override says 1 slice(s) x 2x2x4 = 16 "
     "devices, but 8 cpu devices are present; fix: leave the override out"),
    ("bench/tokenizing", ["--vocab_size=10"], "vocab_size=10"),
    ("launch/launch_local", ["--num_processes=0", "--", "recipes/train_lm.py"],
     "num_processes=0"),
    ("launch/launch_ray", ["--hosts=2", "--max_restarts=-1", "--", "recipes/train_lm.py"],
     "max_restarts=-1"),
]


@pytest.fixture(scope="module")
def refusals():
  """Every case run as `python recipes/RECIPE.py ARGS` would, in one Python start-up."""
  r = subprocess.run([sys.executable, "tests/recipe_help.py", "argv",
                      json.dumps([[name, args] for name, args, _ in CASES])],
                     cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
  assert len(rows) == len(CASES), r.stderr[-2000:]
  return rows


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_command_line_is_one_error_line_and_exit_2(refusals, i):
  name, args, names = CASES[i]
  row = refusals[i]
  assert (row["recipe"], row["args"]) == (name, args)
  err = row["err"]
  assert "Traceback" not in err and "usage:" not in err, err
  errors = [line for line in err.splitlines() if line.startswith("error:")]
  assert len(errors) == 1, err
  assert names in errors[0], errors[0]
  assert row["rc"] == 2, (row["rc"], err)


def test_every_recipe_with_a_command_line_has_a_case():
  mains = {str(p.relative_to(ROOT / "recipes").with_suffix(""))
           for folder in ("", "bench", "launch") for p in (ROOT / "recipes" / folder).glob("*.py")
           if '__name__ == "__main__"' in p.read_text()}
  assert mains == {name for name, _, _ in CASES}


def test_mistyped_mesh_axis_of_train_lm_names_the_closest(tmp_path):
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  with pytest.raises(fs.InputError, match=r"--mesh: axis 'fsdpp' .*; did you mean 'fsdp'\?"):
    train_lm.train_lm(dataset="tiny_corpus", mesh="data=2,fsdpp=4", run_dir=str(tmp_path / "r"))
  assert not (tmp_path / "r").exists()  # refused before anything is written


def test_a_stage_axis_with_a_model_whose_layers_are_not_stages_is_refused(tmp_path):
  """A GPT on data=2,stage=4 used to train with 'stage' as one more data axis, unsaid. The
  message names the axis given, not a --microbatches=0 the user never passed."""
  from recipes import train_lm  # pylint: disable=import-outside-toplevel
  with pytest.raises(fs.InputError, match=r"^a 'stage' axis of 4 on mesh \{'data': 2, 'stage': "
                                          r"4\}: pipeline stages need .*this one's don't") as e:
    train_lm.train_lm(dataset="tiny_corpus", mesh="data=2,stage=4", steps=1,
                      run_dir=str(tmp_path / "r"))
  assert "--microbatches=" not in str(e.value)


# ------------------------------------------------------------------- float16 and the state

F16 = "params=float32,compute=float16,output=float32"


def _loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def f16_case():
  mesh = fs.make_mesh("data=8")
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(8, 4)) * 0.1, jnp.float32)}
  batch = {"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
           "y": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)}
  return mesh, params, batch


def test_float16_step_with_a_state_without_loss_scale_is_refused(f16_case):
  mesh, params, batch = f16_case
  opt = optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh)  # no policy: no loss scale
  step = fs.shard_step(fs.train_step(_loss, opt, policy=F16), mesh)
  with pytest.raises(fs.StepError, match=r"train_step computes in float16 \(its policy\) but "
                     r"the state has no loss scale.*fix: give fs.init_state the same policy"):
    step(state, batch)


@pytest.mark.parametrize("policy, what", [
    (None, "no policy"),
    ("params=float32,compute=bfloat16,output=float32", "a policy computing in bfloat16")])
def test_state_built_for_float16_with_another_step_is_refused(f16_case, policy, what):
  mesh, params, batch = f16_case
  opt = optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh, policy=F16)
  step = fs.shard_step(fs.train_step(_loss, opt, policy=policy), mesh)
  with pytest.raises(fs.StepError, match=r"the state was built for float16 compute .* but "
                     rf"train_step has {what}; fix: give fs.train_step the same policy"):
    step(state, batch)


def test_float16_state_and_step_that_agree_scale_the_loss(f16_case):
  mesh, params, batch = f16_case
  opt = optax.sgd(0.1)
  step = fs.shard_step(fs.train_step(_loss, opt, policy=F16), mesh)
  _, m = step(fs.init_state(params, opt, mesh=mesh, policy=F16), batch)
  assert float(m["loss_scale"]) == 2.0**15  # jmp's dynamic scale starts at 2**15
  x, y, w = (np.asarray(a, np.float64) for a in (batch["x"], batch["y"], params["w"]))
  np.testing.assert_allclose(float(m["loss"]), np.mean((x @ w - y) ** 2), rtol=1e-2)
  # A loss scale given explicitly (no policy asked for it) goes with any step.
  plain = fs.shard_step(fs.train_step(_loss, opt), mesh)
  state = fs.init_state(params, opt, mesh=mesh, loss_scale=jmp.StaticLossScale(jnp.float32(8)))
  _, m = plain(state, batch)
  assert float(m["loss_scale"]) == 8.0


# ------------------------------------------------------------ the loss and the optimizer


@pytest.mark.parametrize("accum_steps, accum_gather", [
    (1, "auto"), (2, "once"), (2, "per_microbatch")])
def test_a_loss_that_is_not_a_scalar_is_named_by_its_shape_on_the_whole_batch(
    f16_case, accum_steps, accum_gather):
  # Per example, not a mean: on the 16-row batch it is (16, 4), whatever part of the batch
  # one device's microbatch holds (one row per device per microbatch here).
  mesh, params, batch = f16_case
  per_example = lambda p, b: (b["x"] @ p["w"] - b["y"]) ** 2
  opt = optax.sgd(0.1)
  step = fs.shard_step(fs.train_step(per_example, opt, accum_steps=accum_steps,
                                     accum_gather=accum_gather), mesh)
  with pytest.raises(fs.StepError, match=r"loss_fn returned a loss of shape \(16, 4\) on the "
                     r"whole batch, expected a scalar; fix: take the mean over the batch"):
    step(fs.init_state(params, opt, mesh=mesh), batch)


def test_an_integer_loss_is_refused_rather_than_training_nothing(f16_case):
  # A count's gradient is zero: the step ran with grad_norm 0 and nothing trained.
  mesh, params, batch = f16_case
  count = lambda p, b: jnp.sum(b["x"] @ p["w"] > 0)
  opt = optax.sgd(0.1)
  with pytest.raises(fs.StepError, match=r"loss_fn returned a loss of dtype int32, expected a "
                     r"float: an integer's gradient is zero"):
    fs.shard_step(fs.train_step(count, opt), mesh)(fs.init_state(params, opt, mesh=mesh), batch)


def test_has_aux_with_a_loss_alone_names_what_it_returned(f16_case):
  mesh, params, batch = f16_case
  opt = optax.sgd(0.1)
  step = fs.shard_step(fs.train_step(_loss, opt, has_aux=True), mesh)
  with pytest.raises(fs.StepError, match=r"loss_fn returned a float32\[\] array; with "
                     r"has_aux=True it must return \(loss, aux\)"):
    step(fs.init_state(params, opt, mesh=mesh), batch)


def _with_rows(p, b):
  err = jnp.sum((b["x"] @ p["w"] - b["y"]) ** 2, axis=1)
  return jnp.mean(err), {"err": err, "worst": jnp.max(err), "n": jnp.sum(err >= 0)}


@pytest.mark.parametrize("accum_steps, accum_gather", [(2, "once"), (2, "per_microbatch")])
def test_a_value_per_row_in_aux_under_accumulation_is_refused_naming_it(
    f16_case, accum_steps, accum_gather):
  """Accumulation averaged a per-row aux leaf elementwise over microbatches (and shards):
  (16,) came back as (8,) or (1,) of mixed rows, silently. Refused naming the leaf; without
  accumulation the rows come back whole, as on one device (numpy)."""
  mesh, params, batch = f16_case
  opt = optax.sgd(0.1)
  state = fs.init_state(params, opt, mesh=mesh)
  step = fs.shard_step(fs.train_step(_with_rows, opt, has_aux=True, accum_steps=accum_steps,
                                     accum_gather=accum_gather), mesh)
  with pytest.raises(fs.StepError, match=r"aux leaf 'err' has shape \(\d+,\), a value per row "
                     r"of the \d+ rows the loss sees at a time.*fix: return it reduced"):
    step(state, batch)
  _, m = fs.shard_step(fs.train_step(_with_rows, opt, has_aux=True), mesh)(state, batch)
  x, y, w = (np.asarray(a, np.float64) for a in (batch["x"], batch["y"], params["w"]))
  want = np.sum((x @ w - y) ** 2, axis=1)
  np.testing.assert_allclose(np.asarray(m["aux"]["err"]), want, rtol=1e-5)
  assert float(m["aux"]["worst"]) == pytest.approx(want.max(), rel=1e-5)
  assert int(m["aux"]["n"]) == 16


def test_a_vector_as_long_as_the_microbatch_but_not_per_row_is_averaged(f16_case):
  # The mean of each of x's 8 features, on microbatches of 8 rows: as long as the rows, but
  # not a value per row (twice the rows, the same 8), so averaged as aux floats are: the
  # batch's feature means (equal microbatches). A BatchNorm's statistics are such a leaf.
  mesh, params, batch = f16_case
  opt = optax.sgd(0.1)
  means = lambda p, b: (_loss(p, b), {"mean": jnp.mean(b["x"], axis=0)})
  step = fs.shard_step(fs.train_step(means, opt, has_aux=True, accum_steps=2,
                                     accum_gather="per_microbatch"), mesh)
  _, m = step(fs.init_state(params, opt, mesh=mesh), batch)
  np.testing.assert_allclose(np.asarray(m["aux"]["mean"]),
                             np.asarray(batch["x"], np.float64).mean(axis=0), rtol=1e-5)


def test_a_weighted_loss_that_is_not_two_scalars_is_named_on_the_whole_batch(f16_case):
  mesh, params, batch = f16_case
  sums = lambda p, b: (jnp.sum((b["x"] @ p["w"] - b["y"]) ** 2, axis=1), 4.0 * len(b["x"]))
  opt = optax.sgd(0.1)
  step = fs.shard_step(fs.train_step(sums, opt, weighted=True, accum_steps=2), mesh)
  with pytest.raises(fs.StepError, match=r"float32\[16\].* on the whole batch as its loss; "
                     r"with weighted=True it must be \(sum, weight\), two scalars"):
    step(fs.init_state(params, opt, mesh=mesh), batch)


@pytest.mark.parametrize("built_with, stepped_with, have, want", [
    (optax.sgd(0.1), optax.adam(0.1), r"\(EmptyState, EmptyState\) with 0 arrays",
     r"\(ScaleByAdamState, EmptyState\) with 3 arrays"),
    (optax.adam(0.1), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1)),
     r"\(ScaleByAdamState, EmptyState\) with 3 arrays",
     r"\(EmptyState, ScaleByAdamState, EmptyState\) with 3 arrays")])
def test_a_state_built_with_another_optimizer_is_refused_naming_both(
    f16_case, built_with, stepped_with, have, want):
  mesh, params, batch = f16_case
  state = fs.init_state(params, built_with, mesh=mesh)
  step = fs.shard_step(fs.train_step(_loss, stepped_with), mesh)
  with pytest.raises(fs.StepError, match=rf"the state's opt_state is {have}, but train_step's "
                     rf"optimizer makes {want} for these params: .* fix: give fs.init_state "
                     "the optimizer given to fs.train_step"):
    step(state, batch)


def test_a_state_with_the_same_optimizer_built_again_steps(f16_case):
  # Two optax.adam objects are the same optimizer: the check compares what they make, not
  # the objects. One sgd step moves w by -lr * the mean-squared-error gradient.
  mesh, params, batch = f16_case
  state = fs.init_state(params, optax.sgd(0.1), mesh=mesh)
  new, _ = jax.jit(fs.train_step(_loss, optax.sgd(0.1)))(state, batch)
  x, y, w = (np.asarray(a, np.float64) for a in (batch["x"], batch["y"], params["w"]))
  grad = 2 * x.T @ (x @ w - y) / y.size
  np.testing.assert_allclose(np.asarray(new.params["w"]), w - 0.1 * grad, rtol=1e-4, atol=1e-6)
