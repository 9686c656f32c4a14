"""The project's shape, read from the source with ``ast`` (nothing is imported).

* The product (:mod:`tests.support.source` says which modules and which imports count): no
  import cycle between its modules, and no module over 400 lines.
* The tests: no test module imports another test module (a helper two test modules share lives
  in :mod:`tests.support`, a shared fixture in the folder's ``conftest.py``), and no test imports
  ``bench`` (the harness both use is :mod:`tests.support.pair`), save a test that exists to check
  a benchmark script (:data:`TESTS_OF_BENCH_SCRIPTS`). Here every import counts, at module level
  or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support.source import ROOT, find_cycle, import_graph, import_time_imports, product_modules

MAX_LINES = 400
TESTS = ROOT / "tests"
# test module → the bench module it checks (and so may import)
TESTS_OF_BENCH_SCRIPTS = {
    "tests/inference/test_gpu_check_script.py": {"bench.gpu_check"},
}


def test_the_graph_sees_the_products_imports():
    graph = import_graph(product_modules())
    assert "mlpair.inference.server" in graph and "mlpair.training.pipeline" in graph
    assert "mlpair.rpc.server" in graph["mlpair.inference.server"] or "mlpair.rpc" in graph["mlpair.inference.server"]
    assert "mlpair.contracts.schema" in graph["mlpair.training.pipeline"]
    assert not any(name.startswith("mlpair.api") for name in graph)


def test_find_cycle_reports_a_cycle_and_ignores_what_runs_later():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    tree = ast.parse(
        "import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    import z\nclass C:\n    import w\n"
        "try:\n    import v\nexcept ImportError:\n    pass\n"
    )
    assert sorted(alias.name for node in import_time_imports(tree) for alias in node.names) == ["v", "w", "x"]


def test_no_import_cycle_between_product_modules():
    cycle = find_cycle(import_graph(product_modules()))
    if cycle:
        print("import cycle:", " -> ".join(cycle))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("name", sorted(product_modules()))
def test_no_product_module_is_over_400_lines(name):
    path = product_modules()[name]
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES}): split it along a seam"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, anywhere in the file:
    ``from a.b import c`` names ``a.b`` and ``a.b.c`` (either may be the module), ``import a.b``
    names ``a.b``; a relative import is resolved against ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(), ".".join(path.relative_to(ROOT).parent.parts))


def is_test_module(name: str) -> bool:
    return name.startswith("tests.") and name.rpartition(".")[2].startswith("test_")


def modules_of_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_the_import_reader_sees_function_level_and_relative_imports():
    source = "from .test_a import x\n\ndef f():\n    from bench.pair import y\n    import tests.support.pair\n"
    found = imported_modules(source, "tests.e2e")
    assert {"tests.e2e.test_a", "bench.pair", "tests.support.pair"} <= found
    assert {m for m in found if is_test_module(m)} == {"tests.e2e.test_a"}


@pytest.mark.parametrize("path", modules_of_tests(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_test_module_imports_another_test_module(path):
    others = {m for m in imports_of(path) if is_test_module(m)}
    assert not others, (
        f"{path.relative_to(ROOT)} imports the test module(s) {sorted(others)}: move what it shares "
        "to tests/support/ (a helper) or the folder's conftest.py (a fixture)"
    )


@pytest.mark.parametrize("path", modules_of_tests(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_test_imports_bench_save_a_test_of_a_bench_script(path):
    allowed = TESTS_OF_BENCH_SCRIPTS.get(str(path.relative_to(ROOT)), set())
    benches = {m for m in imports_of(path) if m.partition(".")[0] == "bench"} - allowed
    if allowed:  # `from bench import gpu_check` names the package too
        benches.discard("bench")
    assert not benches, (
        f"{path.relative_to(ROOT)} imports {sorted(benches)}: tests and benchmarks share tests/support/ "
        "(tests.support.pair is the harness); only a test of a bench script may import it"
    )


def test_support_modules_import_no_test_module_and_no_bench():
    for path in sorted((TESTS / "support").rglob("*.py")):
        bad = {m for m in imports_of(path) if m.partition(".")[0] == "bench" or is_test_module(m)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
