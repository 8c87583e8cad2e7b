"""The runtime: actor runner, process entry points, topology, in-process loop, launcher, metrics, logs."""
