"""The package stays small and readable: prose share, file and function sizes, no history."""

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = sorted((ROOT / "nanovllm").rglob("*.py"))
MAX_PROSE_SHARE = 0.10
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
# Words that narrate how the code came to be rather than what it does.
ORDINAL = (r"(\d+(st|nd|rd|th)|first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
           r"|\w+(teenth|ieth))")
HISTORY = re.compile(rf"\b{ORDINAL}[ -]sessions?\b|\bsessions? \d+|\bH[12]00s?\b|\blent\b"
                     r"|\d[\d,.]*k? ?tok/s|BENCHMARKS\.md|\b(19|20)\d\d-\d\d-\d\d\b", re.I)


def prose_lines(source: str) -> set[int]:
    """Line numbers holding a comment or a docstring."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
        elif token.type == tokenize.STRING and token.line.lstrip().startswith(('"""', 'r"""')):
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines


def is_kernel(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_comments_and_docstrings_are_at_most_a_tenth_of_the_package():
    total = prose = 0
    for path in PACKAGE:
        source = path.read_text()
        total += len(source.splitlines())
        prose += len(prose_lines(source))
    assert prose / total <= MAX_PROSE_SHARE, f"{prose} of {total} lines are prose"


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
