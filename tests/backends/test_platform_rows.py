"""Rows answered from the platform: cpu, cuda/cudnn/mps/miopen probes, and the honest False rows."""

import platform

import jax
import pytest

import jbackends as jb
from jbackends._src import cpu_info


CPUINFO_AVX512 = (
    "processor : 0\nflags : fpu sse4_2 avx avx2 fma avx512f avx512bw avx512dq avx512vl avx512_vnni\n"
)
CPUINFO_AVX2 = "processor : 0\nflags : fpu sse4_2 avx avx2 fma\n"
CPUINFO_OLD = "processor : 0\nflags : fpu sse4_2\n"
CPUINFO_ARM = "processor : 0\nFeatures : fp asimd sve\n"


@pytest.mark.parametrize(
    "text, machine, want",
    [
        (CPUINFO_AVX512, "x86_64", "AVX512"),
        (CPUINFO_AVX2, "x86_64", "AVX2"),
        (CPUINFO_OLD, "x86_64", "NO AVX"),
        ("flags : avx\n", "x86_64", "DEFAULT"),
        (CPUINFO_ARM, "aarch64", "SVE"),
        ("", "ppc64le", "VSX"),
        ("", "s390x", "Z VECTOR"),
    ],
)
def test_cpu_capability_from_cpuinfo(text, machine, want):
    assert cpu_info.capability_from(machine, cpu_info.parse_cpuinfo(text)) == want


def test_cpu_capability_matches_this_host():
    got = jb.cpu.get_cpu_capability()
    feats = cpu_info.host_features()
    if platform.machine() == "x86_64":
        assert got == cpu_info.capability_from("x86_64", feats)
        if got == "AVX512":
            assert "avx512f" in feats


def test_xla_cpu_target_respects_max_isa_flag():
    feats = cpu_info.parse_cpuinfo(CPUINFO_AVX512)
    t = cpu_info.xla_cpu_target("x86_64", feats, "")
    assert t["isa"] == "AVX512_VNNI" and t["max_isa_flag"] is None
    capped = cpu_info.xla_cpu_target("x86_64", feats, "--xla_cpu_max_isa=AVX2 --other=1")
    assert capped["isa"] == "AVX2" and capped["host_isa"] == "AVX512_VNNI"
    assert cpu_info.xla_cpu_target("aarch64", frozenset(), "")["isa"] is None
    assert set(jb.cpu.xla_cpu_target()) == {"machine", "isa", "host_isa", "max_isa_flag", "isas"}


def test_max_isa_names_are_accepted_by_installed_xla():
    # Every ISA we report is a value XLA:CPU accepts for --xla_cpu_max_isa.
    f = jax.jit(lambda x: x + 1, compiler_options={"xla_cpu_max_isa": "AVX2"})
    assert float(f(1.0)) == 2.0


def test_cuda_cudnn_rows_agree_with_jax():
    cuda_devices = [
        d for d in jax.devices() if d.platform == "gpu" and "cuda" in d.client.platform_version.lower()
    ]
    assert jb.cuda.is_available() == bool(cuda_devices)
    if jb.cuda.is_available():
        assert jb.cuda.is_built()
    if not jb.cuda.is_built():
        assert jb.cudnn.version() is None and jb.cudnn.is_available() is False
    else:
        v = jb.cudnn.version()
        assert v is None or v > 8000
    assert jb.cudnn.is_acceptable(jax.numpy.ones(2)) == (
        jb.cudnn.is_available() and jax.default_backend() == "gpu"
    )
    assert jb.cudnn.is_acceptable(jax.numpy.ones(2, jax.numpy.int32)) is False


def test_mps_and_miopen_rows():
    assert jb.mps.is_built() == bool(jb._src.platforms.distributions_with_prefix("jax-metal"))
    assert jb.mps.is_available() is False or jb.mps.is_built()
    assert jb.mps.is_macos_or_newer(1, 0) == (platform.system() == "Darwin")
    with pytest.raises(TypeError, match="major"):
        jb.mps.is_macos_or_newer("13", 0)
    assert jb.miopen.immediate is False
    jb.miopen.immediate = False
    with pytest.raises(RuntimeError, match="benchmark"):
        jb.miopen.immediate = True


def test_honest_false_rows():
    assert jb.cusparselt.is_available() is False and jb.cusparselt.version() is None
    assert jb.openmp.is_available() is False
    assert jb.kleidiai.is_available() is False
    assert jb.mkl.is_available() is False
    assert jb.nnpack.is_available() is False
    assert jb.nnpack.set_flags(False) == (False,)
    with jb.nnpack.flags(enabled=False):
        pass
    with pytest.raises(RuntimeError, match="conv_general_dilated"):
        jb.nnpack.set_flags(True)
    with pytest.raises(RuntimeError, match="NNPACK"):
        with jb.nnpack.flags(enabled=True):
            pass


def test_xnnpack_and_mkldnn_read_the_compiled_hlo():
    hlo = cpu_info.probe_cpu_dot_hlo()
    libs = cpu_info.cpu_dot_libraries(hlo)
    assert jb.xnnpack.enabled == bool({"xnnpack", "ynnpack"} & libs)
    assert jb.mkldnn.is_available() == ("onednn" in libs)
    assert ("ynn_fusion" in hlo or "xnn_fusion" in hlo) == jb.xnnpack.enabled
    assert cpu_info.cpu_dot_libraries('fusion kind=kCustom "__xnn_fusion"') == {"xnnpack"}
    assert cpu_info.cpu_dot_libraries("custom_call_target=\"__onednn$matmul\"") == {"onednn"}


def test_cuda_library_preferences():
    try:
        assert jb.cuda.preferred_blas_library() == "cublas"
        assert jb.cuda.preferred_blas_library("hipblaslt") == "cublaslt"
        assert jb.compiler_options()["xla_gpu_enable_cublaslt"] is True
        assert jb.cuda.preferred_blas_library("default") == "cublas"
        with pytest.raises(ValueError, match="composable"):
            jb.cuda.preferred_blas_library("ck")
        with pytest.raises(ValueError, match="cublaslt"):
            jb.cuda.preferred_blas_library("mkl")
        assert jb.cuda.preferred_linalg_library() == "default"
        assert jb.cuda.preferred_linalg_library("MAGMA") == "magma"
        with jb.with_backends(preferred_linalg_library="cusolver"):
            assert jb.cuda.preferred_linalg_library() == "cusolver"
        assert jb.cuda.preferred_linalg_library() == "magma"
        with pytest.raises(ValueError, match="cusolver"):
            jb.cuda.preferred_linalg_library("lapack")
        with pytest.raises(TypeError, match="preferred_linalg_library.*expects a str"):
            jb.cuda.preferred_linalg_library(3)  # the flag parser names the flag
        assert jb.cuda.preferred_rocm_fa_library() == "default"
        with pytest.raises(ValueError, match="sdpa_kernel"):
            jb.cuda.preferred_rocm_fa_library("ck")
    finally:
        jb.reset_flags()
