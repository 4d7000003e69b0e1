"""gpud_worker: the GPU-VM daemon (broker links, heartbeats with GPU state, executors)."""
