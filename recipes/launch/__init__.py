"""Launchers: one process per host on this machine (`launch_local`) or on a Ray cluster (`launch_ray`, `ray_cluster`)."""
