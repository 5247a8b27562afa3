"""Recipes: complete jobs built on fnscale's public API, meant to be run and copied.

`train_lm.py` is the main job; `lm/` holds its models (GPT, Llama), data and run log;
`launch/` starts it on several processes or a Ray cluster; `bench/` measures fnscale (and
compares it with MaxText); `examples/` embed fnscale in Flax and Equinox. The small commands
at this level (`plan.py`, `show_topology.py`, `baseline.py`, `plot_run.py`,
`train_tokenizer.py`) are tools around a run.
"""
