"""fnscale inside other frameworks: a Flax NNX, a Flax Linen and an Equinox model trained through `shard_step`."""
