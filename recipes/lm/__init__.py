"""The main job's pieces, one module per job: its options (`options`), the run as
they decide it (`run_setup`), start-up (`startup`), data and batches (`data`, `batches`, and
token caches: `cache`, `shards`, `chat`, `packing`), checkpoints, evaluation and sampling
(`evaluation`, `sampling`), the progress line and clock (`progress`), the start-up lines and
summary (`summary`), the run directory and its log (`rundir`, `run_log`), a profiler window
(`profiling`), stalled training (`stalls`); the models (`gpt`, `llama` with its shape and
costs in `llama_config` and its layout on a mesh in `llama_layout`, `moe`, `models`,
`hf_maps`, and the token-embedding lookup they share, `embedding`); and every recipe's
command line (`cli`).

Imports point one way: the recipes (`train_lm.py`, the tools, `bench/`, `launch/`,
`examples/`) import `lm/`, `lm/` imports fnscale, never the reverse
(tests/test_imports.py).
"""
