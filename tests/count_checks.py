"""How much the suite checks: test functions and assertions per test module, and in all (issue 58: a suite made
faster must not check less). A test function is a `def test_*` (one, however many parameters it runs with); an
assertion is an `assert` statement or a call of an assert_* function (torch.testing.assert_close, assert_same_lora,
...) or of pytest.raises, counted where it is written (in a test, a fixture or a helper of tests/).

    python tests/count_checks.py [--by-module]     # from the repository root
"""

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def counts(path):
    """-> (test functions, assertions) of one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = sum(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
                    for node in ast.walk(tree))
    asserts = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            asserts += 1
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            asserts += name.startswith("assert") or name == "raises"
    return functions, asserts


def main(argv):
    rows = {path.name: counts(path) for path in sorted(TESTS.glob("*.py"))}
    if "--by-module" in argv:
        for name, (functions, asserts) in rows.items():
            print(f"{name:40} {functions:5} {asserts:6}")
    print(f"test functions {sum(f for f, _ in rows.values())}, assertions {sum(a for _, a in rows.values())}")


if __name__ == "__main__":
    main(sys.argv[1:])
