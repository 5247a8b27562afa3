"""Checkpoints: save and restore a sharded train state with orbax, on any mesh.

`save` / `restore` / `manager` write and read a state through orbax's CheckpointManager (the
state's shardings decide where each restored shard lands, so a state saved on one mesh
restores onto another); `steps`, `latest_step` and `last_save_seconds` read a directory;
`all_finite` / `nonfinite_leaves` guard what is saved; `fingerprint` names values a
checkpoint leaves out (a LoRA run's frozen base); `check_shared_directory` makes sure
every process of a job sees the same directory before anything trains. `hf` reads Hugging
Face safetensors checkpoints into sharded params and writes them back (`hf.load`,
`hf.export`; the `hf` extra); `peft` writes LoRA adapters (`fnscale.lora`) as a Hugging Face
PEFT adapter.

Layer: imports the core pipeline and `fnscale.multihost` (to agree on a step across
processes); never `fnscale.analysis` or the package root.
"""
from fnscale.checkpoint import hf, peft
from fnscale.checkpoint._fingerprint import fingerprint
from fnscale.checkpoint._shared_dir import check_shared_directory
from fnscale.checkpoint.store import (
    Manager,
    all_finite,
    close,
    last_save_seconds,
    latest_step,
    manager,
    nonfinite_leaves,
    restore,
    save,
    steps,
    wait,
)

__all__ = [
    "save", "restore", "manager", "Manager", "wait", "close", "steps", "latest_step",
    "last_save_seconds", "all_finite", "nonfinite_leaves", "check_shared_directory", "fingerprint", "hf", "peft",
]
