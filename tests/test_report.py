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
    for name, flag in jb._FLAGS.items():
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert repr(flag.default) in line
        if flag.torch:
            assert flag.torch[0] in line
