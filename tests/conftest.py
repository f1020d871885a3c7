"""Test configuration shared by the whole suite.

Four virtual CPU devices (for shard_map / sharding tests), strict rank promotion,
and float64 left off (references upcast explicitly with numpy where they need it).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_rank_promotion", "raise")
