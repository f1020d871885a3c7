"""Test configuration shared by the whole suite.

Eight virtual CPU devices (for shard_map / sharding tests), strict rank promotion,
and float64 left off (references upcast explicitly with numpy where they need it).

The ``gpu`` lane: tests marked ``@pytest.mark.gpu`` run compiled kernels on a CUDA GPU and are
skipped where JAX sees none. On a GPU machine run them with
``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu`` (the default here is ``cpu``).

The ``extended`` cases: the big parameter grids below are thinned in the default run (the README's
test line, which CI runs in three environments, must stay near 15 minutes on 2 cores): of each test
named in ``THINNED`` the default run keeps every k-th parametrized case (in collection order) and
the first case of each backend (ISA, engine, dtype, ...: see ``_thin``), and deselects the rest; a case
declared with ``marks=pytest.mark.extended`` (a hand-picked grid's) is deselected too.
``python -m pytest --extended`` (or ``JBACKENDS_EXTENDED_TESTS=1``) runs every case; run it after touching
a kernel, and before a release. CI's gpu-machine environment runs its files with ``--extended``.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        default=False,
        help="run every case of the thinned parameter grids (tests/conftest.py THINNED)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs compiled kernels on a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "extended: a case the default run leaves out (run with --extended)")


THINNED = {  # node id without parameters -> k: every k-th case (_thin), 0: none; test_thinned_grids checks
    "tests/attention/test_jaxnn_dropin.py::test_grad_of_grad_matches_math_on_every_backend": 12,
    "tests/attention/test_jaxnn_dropin.py::test_upstream_mask_modes_with_gradients": 12,
    "tests/attention/test_jaxnn_dropin.py::test_upstream_gqa_vmap_and_lse_cotangent": 9,
    "tests/attention/test_jaxnn_dropin.py::test_extensions_fully_masked_rows_give_mean_of_v": 4,
    "tests/attention/test_jaxnn_dropin.py::test_lengths_and_structural_masks_fully_masked_rows_match_jaxnn": 4,
    "tests/attention/test_jaxnn_dropin.py::test_residual_gradient_is_jaxnn_zero_and_true_on_request": 4,
    "tests/attention/test_jaxnn_dropin.py::test_residual_in_input_dtype_and_vjp_with_that_cotangent": 7,
    "tests/attention/test_jaxnn_dropin.py::test_padded_rows_gradients_like_jaxnn": 14,
    "tests/attention/test_jaxnn_dropin.py::test_upstream_bias_gradient": 4,
    "tests/attention/test_jaxnn_dropin.py::test_zero_option_and_torch_api_give_zeros": 3,
    "tests/attention/test_jaxnn_dropin.py::test_finfo_min_padding_bias_like_jaxnn": 9,
    "tests/attention/test_jaxnn_dropin.py::test_bool_mask_fully_masked_rows_match_jaxnn_with_grads": 3,
    "tests/attention/test_jaxnn_dropin.py::test_traced_scale_like_jaxnn": 2,
    "tests/attention/test_jaxnn_dropin.py::test_cudnn_second_order_matches_math": 3,
    "tests/attention/test_jaxnn_dropin.py::test_upstream_local_window_without_mask": 2,
    "tests/attention/test_math.py::TestMath::test_grid": 0,  # MATH against itself (test_math has a float64 check)
    "tests/attention/test_xla_flash.py::TestXlaFlash::test_grid": 4,
    "tests/attention/test_cpp_flash.py::TestCpuFlash::test_grid": 8,
    "tests/attention/test_xla_mem_efficient.py::TestXlaMemEfficient::test_grid": 3,
    "tests/int4/test_pallas_triton.py::test_swap_ab_and_byte_planes_compute_the_same_product": 6,
    "tests/int4/test_pallas_triton.py::test_w4a16_search_space_options_near_float64": 3,
    "tests/attention/test_pallas_parity.py::test_mem_efficient": 3,
    "tests/attention/test_pallas_parity.py::test_flash": 3,
    "tests/attention/test_pallas_parity.py::test_decode": 2,
    "tests/attention/test_mosaic_flash.py::test_forward_and_gradient_lower_for_cuda": 4,
    "tests/test_gpu_benchmarks.py::test_tune_gpu_mosaic_cases_plumbing": 0,
    "tests/attention/test_bad_inputs.py::test_empty_dimensions_give_torchs_result_on_every_backend": 4,
    "tests/attention/test_xla_mem_efficient.py::test_bias_broadcast_patterns_and_bias_grad": 3,
    "tests/int4/test_impls.py::test_cpp_weight_only_bfloat16": 12,
    "tests/test_sharding.py::test_sequence_split_runs_a_ring": 3,
    "tests/test_sharding.py::test_sharded_inputs_stay_sharded_with_no_all_gather": 6,
    "tests/test_sharding.py::test_heads_split_finer_than_the_kv_heads_are_gathered_not_crashed": 2,
    "tests/test_sharding.py::test_dropout_stays_sharded_and_drops_what_one_device_drops": 2,
    "tests/int4/test_impls.py::test_cpp_group_path_every_isa": 12,
    "tests/attention/test_pallas_base.py::TestPallasDecodeInterpret::test_grid": 3,
    "tests/attention/test_xla_flash.py::test_block_skipping_matches_reference": 3,
    "tests/attention/test_cpp_flash.py::test_bias_and_mask_broadcasts": 6,
    "tests/attention/test_cpp_flash.py::test_threaded_paths_match_reference": 7,
    "tests/attention/test_cpp_flash.py::test_broadcast_bias_gradient_is_summed_in_the_kernel": 6,
    "tests/attention/test_cpp_flash.py::test_rows_of_large_negative_logits_keep_their_gradients": 3,
    "tests/test_flags.py::test_bad_input": 3,
    "tests/int4/test_edge_cases.py::test_nonfinite_rows_follow_torch_on_every_engine": 2,
    "tests/attention/test_pallas_base.py::TestPallasFlashInterpret::test_grid": 2,
    "tests/attention/test_pallas_base.py::TestPallasMemEfficientInterpret::test_grid": 3,
    "tests/int4/test_impls.py::TestXla::test_bit_exact": 3,
    "tests/attention/test_bad_inputs.py::test_any_finite_scale_is_accepted_like_torch": 3,
    "tests/int4/test_pallas_triton.py::test_w4a8_heuristic_configs_bit_exact": 3,
    "tests/int4/test_pallas_triton.py::test_w4a8_windows_wider_than_the_group": 2,
    "tests/attention/test_cpp_flash.py::test_block_ranges_match_reference": 3,
    "tests/int4/test_impls.py::test_cpp_weight_only_float32_blocked": 4,
    "tests/int4/test_edge_cases.py::test_int4_linear_keeps_the_layer_dtype": 4,
    "tests/int4/test_edge_cases.py::test_dyn_quant_grad_is_straight_through_on_every_engine": 2,
    "tests/attention/test_cpp_flash.py::test_soft_cap_matches_reference": 2,
    "tests/int4/test_impls.py::test_cpp_weight_only_one_row_integer_dots": 2,
    "tests/attention/test_mosaic_flash.py::test_overlapped_forward_lowers_for_cuda": 2,
    "tests/int4/test_impls.py::TestPallasInterpret::test_bit_exact": 3,
    "tests/int4/test_edge_cases.py::test_nonfinite_bfloat16_rows_follow_torchs_bfloat16_kernel": 2,
    "tests/int4/test_reference.py::test_reference_equals_numpy_float64": 2,
    "tests/test_sharding.py::test_int4_keeps_row_and_feature_sharding": 2,
    "tests/attention/test_pallas_export.py::test_forward_and_backward_lower_to_triton_for_cuda": 2,
    "tests/test_gpu_benchmarks.py::test_tune_gpu_smoke": 0,
    "tests/test_gpu_benchmarks.py::test_attention_gpu_smoke": 0,
    "tests/test_gpu_benchmarks.py::test_gpu_session_script_limits_and_bad_settings": 0,
    "tests/attention/test_math.py::test_structure_empties_rows_matches_the_full_mask": 0,
    "tests/int4/test_edge_cases.py::test_nonfinite_rows_large_m_paths": 0,
    "tests/test_gpu_benchmarks.py::test_attention_gpu_feature_rows_of_the_mosaic_kernel": 0,
    "tests/int4/test_impls.py::test_long_channelwise_rows_exact": 0,
}

# Cases the default run keeps on top of THINNED's stride (full node ids; test_thinned_grids checks they
# exist): a stride knows nothing of the features inside a grid's case objects, and a test's own filter
# can turn a kept case into a refusal check, so these features' values are checked by name (found by
# mutating the kernels: each case here is the one default case that fails on such a bug).
ALSO_KEEP = (
    # the decode kernel's dropout (its 1 / (1 - p) rescale) and key lengths
    "tests/attention/test_pallas_parity.py::test_decode[t16_dropout_bf16]",
    "tests/attention/test_pallas_parity.py::test_decode[t5_causal_lower_right_lengths]",
    "tests/attention/test_pallas_base.py::TestPallasDecodeInterpret::test_grid[float32-none-T7S45-H32-G2-none-p0.0-lengths-jit]",
    # the XLA engine's segment ids, and its dropout in bfloat16 (forward and gradients)
    "tests/attention/test_xla_flash.py::TestXlaFlash::test_grid[float32-top_left-T37S37-H32-G4-none-p0.0-segments-jit]",
    "tests/attention/test_xla_flash.py::TestXlaFlash::test_grid[bfloat16-lower_right-T29S45-H64-G2-none-p0.25-plain-jit]",
    # the Pallas flash kernel's dropout (bfloat16), the memory-efficient one's additive bias with dropout
    "tests/attention/test_pallas_base.py::TestPallasFlashInterpret::test_grid[bfloat16-lower_right-T29S45-H64-G2-none-p0.25-plain-jit]",
    "tests/attention/test_pallas_base.py::TestPallasMemEfficientInterpret::test_grid[float32-top_left-T37S37-H32-G1-additive-p0.25-plain-eager]",
    # second order with lengths + window, soft cap + dropout, bias + mask on a fast backend each
    "tests/attention/test_jaxnn_dropin.py::test_grad_of_grad_matches_math_on_every_backend[lengths_window-flash_cpp]",
    "tests/attention/test_jaxnn_dropin.py::test_grad_of_grad_matches_math_on_every_backend[softcap_dropout-efficient]",
    "tests/attention/test_jaxnn_dropin.py::test_grad_of_grad_matches_math_on_every_backend[bias_mask-efficient]",
)

# Parameters naming a backend, an ISA, an engine or a kernel: in a grid over more parameters, each
# of their values keeps a case, and so does each value of a small axis (at most _SMALL_AXIS values,
# not numbers: a dtype, a flag, a bias kind). A test whose only parameter is the backend keeps every
# k-th backend and the CPU default path's (_DEFAULT_BACKENDS).
_COVERED_AXES = frozenset({"name", "impl", "isa", "engine", "kernel", "backend"})
_SMALL_AXIS = 4
_DEFAULT_BACKENDS = frozenset({"flash_cpp", "cpp"})


def _small_axis(values):
    """A parameter with few values that are not numbers (sizes are thinned by the stride alone)."""
    numeric = all(v.lstrip("-").replace(".", "", 1).isdigit() for v in values)
    return len(values) <= _SMALL_AXIS and not numeric


def _thin(config, items):
    """Marks the cases THINNED leaves out ``extended`` and, without --extended, deselects them.

    Of a thinned test the default run keeps every k-th case (collection order) and, on top, the first
    case of each value not yet kept of the axes the comment above _COVERED_AXES names: a plain stride
    can fall in step with a parameter's period and leave a backend or a dtype out."""
    run_all = config.getoption("--extended") or os.environ.get("JBACKENDS_EXTENDED_TESTS") == "1"
    groups = {}
    for item in items:
        key = item.nodeid.split("[", 1)[0]
        if key in THINNED:
            groups.setdefault(key, []).append(item)
    left_out = set()
    for key, group in groups.items():
        k, seen = THINNED[key], set()
        params = [getattr(item, "callspec", None) for item in group]
        params = [{(n, repr(v)) for n, v in c.params.items()} if c else set() for c in params]
        values = {}
        for vals in params:
            for n, v in vals:
                values.setdefault(n, set()).add(v)
        if len(values) > 1:
            axes = {n for n, vs in values.items() if n in _COVERED_AXES or _small_axis(vs)}
            cover = [{(n, v) for n, v in vals if n in axes} for vals in params]
        else:  # one parameter (the backend, or a list of cases): the default path's case
            cover = [
                {(n, v) for n, v in vals if n in _COVERED_AXES and v.strip("'") in _DEFAULT_BACKENDS}
                for vals in params
            ]
        for i, (item, want) in enumerate(zip(group, cover)):
            if item.nodeid in ALSO_KEEP:
                continue
            if k and (i % k == 0 or not want <= seen):
                seen |= want
            else:
                left_out.add(item)
                item.add_marker(pytest.mark.extended)
    # A case marked `extended` where it is declared (`pytest.param(..., marks=pytest.mark.extended)`: a
    # hand-picked grid whose default cases are chosen, not strided) is left out the same way.
    left_out |= {item for item in items if item.get_closest_marker("extended") is not None}
    if left_out and not run_all:
        config.hook.pytest_deselected(items=[it for it in items if it in left_out])
        items[:] = [it for it in items if it not in left_out]


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
    _thin(config, items)
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
