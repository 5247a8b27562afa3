"""Benchmarks and comparisons: step overhead, attention, accumulation, checkpoints, preemption, Ray launches, the forecast fit and MaxText side by side."""
