"""The main job's pieces, one module per job, in the order `train_lm.py` uses them.

Options and the run:
- `options`: every option's flag, keyword, default, help line and range.
- `cli`: every recipe's command line; bad input is one `error:` line, exit 2.
- `hardware`: `--topology`, `--mesh_shape`, `--tpu`, defined once.
- `run_setup`: the run decided and checked before anything is written (the one owner of
  defaults, the mesh, the model and the optimizer).
- `startup`: simulated devices, the compile cache, the job's processes, shutdown at exit.
- `memory`: the memory pre-flight: the run fits its devices or says how it would.
- `optimizers`: one optax transformation per `--optimizer` / `--mu_dtype`.
- `rundir`: where a run lives, and that its directory holds this run.
- `summary`: the start-up lines and the `Summary` a run returns.

Data:
- `data`: a text corpus as tokens, a held-out split, the baseline to beat.
- `tokens`: a Hugging Face `tokenizer.json` read, and the vocabulary a model needs.
- `batches`: train_lm's batches, windows of a corpus or packed rows, this process's rows.
- `cache`: sources tokenized once into ArrayRecord shards with a manifest.
- `shards`: one tokenized shard written (`recipes/pretokenize.py`'s processes).
- `packing`: a weighted mixture of caches packed into rows with segment ids.
- `chat`: conversations by the chat template, loss on the assistant turns.
- `preference`: (prompt, chosen, rejected) rows for DPO.

Models:
- `models`: the model modules by name, Hugging Face checkpoints in and out.
- `gpt`: a GPT-2-style decoder as a pytree and pure functions.
- `llama`: a Llama-style decoder (the GPT's interface); `llama_config` its shapes and
  costs; `llama_layout` its params and activations on a mesh; `layers` RMSNorm and RoPE.
- `moe`: mixture-of-experts decoders (the Llama's interface).
- `deepseek`: a DeepSeek-V3-style decoder: latent attention, biased routing, dense first layers.
- `hf_maps`: Hugging Face families: config.json, param names and transforms.
- `hf_fields`: what the families share: config.json fields read or refused, RoPE, the Llama's
  map; `hf_gemma`, `hf_moe` (Mixtral, Qwen3-MoE), `hf_deepseek`: those families (through
  `hf_maps`).
- `embedding`: the token-embedding lookup of a split table, positions under `context`.
- `remat`: what a block keeps for its backward pass (the policies).
- `int8`: int8 matmuls with per-channel scales and straight-through gradients.

Training and after:
- `finetune`: LoRA and DPO runs (`--lora_rank`, `--objective=dpo`); `dpo` its loss.
- `checkpoints`: resume from the newest good checkpoint, save only finite states.
- `emergency`: frequent emergency copies beside the checkpoints; a restart takes the newer.
- `peer_copies`: node-local emergency copies, each process's shards and a replica of its peer's.
- `stopping`: preemption (SIGTERM) and Ctrl-C, losing nothing saved.
- `stalls`: steps that did not train, counted and stopped with the cause.
- `evaluation`: the held-out loss and the text the model writes; `sampling` the loop.
- `progress`: the progress line and the clock; `run_log` metrics.jsonl and TensorBoard;
  `profiling` a window of steps traced; `goodput` where the run's wall time went.

Imports point one way: the recipes (`train_lm.py`, the tools, `bench/`, `launch/`,
`examples/`) import `lm/`, `lm/` imports fnscale, never the reverse
(tests/test_imports.py).
"""
