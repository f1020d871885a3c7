"""Test configuration shared by the whole suite.

Eight virtual CPU devices (for shard_map / sharding tests), strict rank promotion,
and float64 left off (references upcast explicitly with numpy where they need it).

The ``gpu`` lane: tests marked ``@pytest.mark.gpu`` run compiled kernels on a CUDA GPU and are
skipped where JAX sees none. On a GPU machine run them with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu`` (the default here is ``cpu``).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs compiled kernels on a CUDA GPU (skipped without one)")


def pytest_terminal_summary(terminalreporter):
    """Names the environment (CI runs the suite on the oldest and the newest JAX we support)."""
    import importlib.metadata as md
    import platform

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "absent"

    pkgs = ", ".join(f"{n} {version(n)}" for n in ("jax", "jaxlib", "flax", "chex", "opt_einsum"))
    devices = ", ".join(sorted({d.platform for d in jax.devices()}))
    terminalreporter.write_line(
        f"environment: Python {platform.python_version()}, {pkgs}; devices: {devices}"
    )


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with JAX_PLATFORMS=cuda,cpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
