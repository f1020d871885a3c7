"""``tests/conftest.py``'s THINNED table names tests by node id: a renamed or moved test would silently
fall out of the thinning (and run in full), and a stale key would hide that. Every key must name a
test function (or a class's test method) that exists, and a thinned one (k > 0) must be parametrized."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _thinned() -> dict:
    tree = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "THINNED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/conftest.py has no THINNED table")


def _functions(tree) -> dict:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _parametrized(func, fixtures_with_params: set) -> bool:
    """A parametrize decorator, or an argument that is a fixture with ``params`` (the int4 grids)."""
    args = {a.arg for a in func.args.args}
    return bool(args & fixtures_with_params) or any(
        "parametrize" in ast.unparse(d) for d in func.decorator_list
    )


def test_every_thinned_key_names_a_test_that_exists():
    thinned = _thinned()
    assert thinned, "THINNED is empty"
    every_test_def = {}  # method name -> definitions anywhere under tests/ (inherited grids)
    fixtures_with_params = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for name, func in _functions(ast.parse(path.read_text())).items():
            every_test_def.setdefault(name, []).append(func)
            decorators = [ast.unparse(d) for d in func.decorator_list]
            if any("fixture" in d and "params=" in d for d in decorators):
                fixtures_with_params.add(name)
    problems = []
    for key, k in thinned.items():
        if not isinstance(k, int) or k < 0:
            problems.append(f"{key}: k must be an int >= 0, got {k!r}")
        path, *names = key.split("::")
        if not (ROOT / path).is_file():
            problems.append(f"{key}: no file {path}")
            continue
        tree = ast.parse((ROOT / path).read_text())
        tops = (ast.FunctionDef, ast.AsyncFunctionDef)
        if len(names) == 1:
            func = {n.name: n for n in tree.body if isinstance(n, tops)}.get(names[0])
            defs = [func] if func else []
        elif len(names) == 2:
            cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == names[0]), None)
            if cls is None:
                problems.append(f"{key}: no class {names[0]} in {path}")
                continue
            own = [n for n in cls.body if isinstance(n, tops) and n.name == names[1]]
            # An inherited method: defined in a base class somewhere under tests/.
            defs = own or (every_test_def.get(names[1], []) if cls.bases else [])
        else:
            problems.append(f"{key}: expected path::test or path::Class::test")
            continue
        if not defs:
            problems.append(f"{key}: no such test")
        elif k and not any(_parametrized(f, fixtures_with_params) for f in defs):
            problems.append(f"{key}: k = {k} but the test is not parametrized")
    assert not problems, "stale THINNED keys in tests/conftest.py:\n" + "\n".join(problems)


def test_every_case_also_kept_exists():
    """ALSO_KEEP names cases by full node id: a renamed case would silently stop running by default."""
    import ast as _ast
    import re
    import subprocess
    import sys

    text = (ROOT / "tests" / "conftest.py").read_text()
    ids = _ast.literal_eval(re.search(r"^ALSO_KEEP = (\(.*?^\))", text, re.S | re.M).group(1))
    assert ids, "ALSO_KEEP is empty"
    files = sorted({i.split("::", 1)[0] for i in ids})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "--extended",
            "-p",
            "no:cacheprovider",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    collected = set(out.stdout.split())
    missing = [i for i in ids if i not in collected]
    assert not missing, f"ALSO_KEEP names cases that no longer exist: {missing}"
