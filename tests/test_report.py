"""`python -m jbackends` prints every section of the environment report."""

import subprocess
import sys

import jbackends as jb


def test_report_prints_every_section_and_flag():
    out = subprocess.run([sys.executable, "-m", "jbackends"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for title in ("Versions", "Devices", "CPU", "Attention backends", "int4 matmul engines", "Flags"):
        assert f"== {title}" in text
    assert "(section failed)" not in text, text
    both = [line.split()[0] for line in text.splitlines() if " traced+compile-time " in line]
    assert {"deterministic", "cudnn_enabled"} <= set(both)
    for name, flag in jb._FLAGS.items():
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert repr(flag.default) in line
        # the kind says both when a flag is traced and also an XLA option (deterministic, cudnn_enabled)
        want = "+".join(
            k for k, on in (("traced", flag.traced), ("compile-time", flag.compiler_options)) if on
        )
        assert f" {want or 'runtime'} " in line and line.count("compile-time") == int(
            bool(flag.compiler_options)
        )
        if flag.torch:
            assert flag.torch[0] in line
