"""Smell detectors: file and function sizes, and code that speaks of the design, not its history."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = sorted((ROOT / "nanovllm").rglob("*.py"))
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
# Words that narrate how the code came to be rather than what it does.
ORDINAL = (r"(\d+(st|nd|rd|th)|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
           r"|\w+(teenth|ieth))")
HISTORY = re.compile(rf"\b{ORDINAL}[ -]sessions?\b|\bsessions? \d+|\bH[12]00s?\b|\blent\b"
                     r"|\d[\d,.]*k? ?tok/s|BENCHMARKS\.md|\b(19|20)\d\d-\d\d-\d\d\b", re.I)


def is_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_no_file_is_over_the_limit():
    long = {p.relative_to(ROOT).as_posix(): n for p in PACKAGE
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_outside_the_kernels_is_over_the_limit():
    long = {}
    for path in PACKAGE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not is_kernel(node):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_code_and_tests_speak_of_the_design_not_its_history():
    paths = PACKAGE + sorted((ROOT / "tests").rglob("*.py"))
    found = [f"{p.relative_to(ROOT).as_posix()}:{i}: {line.strip()}"
             for p in paths if p != pathlib.Path(__file__).resolve()
             for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "\n".join(found[:20])


def test_the_package_imports_nothing_from_the_scripts_or_tests():
    outside = re.compile(r"^\s*(from|import)\s+(tests|tools|benchmarks|scripts|bench)\b", re.M)
    found = [p.relative_to(ROOT).as_posix() for p in PACKAGE if outside.search(p.read_text())]
    assert not found, found
