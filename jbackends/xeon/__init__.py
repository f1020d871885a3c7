"""`torch.backends.xeon`, for JAX: the `run_cpu` launcher (`python -m jbackends.xeon.run_cpu --help`)."""
