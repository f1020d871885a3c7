"""Test configuration shared by the whole suite.

Four virtual CPU devices (for shard_map / sharding tests), strict rank promotion,
and float64 left off (references upcast explicitly with numpy where they need it).
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _flags_back_to_default():
    """Every test must leave the jbackends flags (scopes and process defaults) as it found them."""
    import jbackends as jb

    before = jb.current_flags()
    yield
    after = jb.current_flags()
    if after != before:
        jb.enable_global_flags()
        jb.reset_flags()
        pytest.fail(f"test leaked jbackends flags: {after} != {before}")
