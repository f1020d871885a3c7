"""Execute every notebook in notebooks/ on CPU (what CI runs), with nbclient.

Each notebook runs in a fresh kernel with the installed jbackends, from the notebooks/ directory. A cell
that raises (the notebooks assert their own numbers: backends agree, loss decreases, ...) fails the
test with the cell's traceback. Notebooks are committed without outputs; this test checks that too.
"""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_four_notebooks_exist():
    assert [p.name for p in PATHS] == [
        "01_quickstart.ipynb",
        "02_attention.ipynb",
        "03_int4.ipynb",
        "04_training_loop.ipynb",
    ]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_committed_clean_and_colab_ready(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name} has outputs"
    first, install = nb.cells[0], code[0]
    assert first.cell_type == "markdown" and "colab-badge.svg" in first.source
    assert f"notebooks/{path.name}" in first.source
    assert 'if "google.colab" in sys.modules' in install.source and "%pip install" in install.source
    assert "@ git+" in install.source  # from the repository: jbackends is not on PyPI


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    env_before = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"  # the kernel inherits the environment
    try:
        client = nbclient.NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
        )
        client.execute()
    finally:
        if env_before is None:
            os.environ.pop("JAX_PLATFORMS", None)
        else:
            os.environ["JAX_PLATFORMS"] = env_before
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "local run: using the installed jbackends" in outputs
