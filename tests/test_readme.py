"""The README's Python blocks run as written (the tour is what users copy first)."""

import pathlib
import re

import jbackends as jb

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"README.md block {i}", "exec"), {"__name__": "readme"})
    finally:
        jb.enable_global_flags()
        jb.reset_flags()
