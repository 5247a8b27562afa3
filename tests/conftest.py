"""Simulated devices must be set before jax initialises its backend."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several test processes may load libtpu (for TPU ahead-of-time compiles) at once; its
# machine-wide lock would otherwise fail all but the first.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
