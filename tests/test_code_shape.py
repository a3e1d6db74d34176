"""The product's code stays readable: no module over MAX_FILE_LINES, no function over MAX_FUNCTION_LINES (kernel
bodies in a DSL included), and no product module that cites a measurement round ("session 12"): history lives in
git and in the dated records of docs/benchmarks/. The product is the package less its tests and the lab."""

import ast
import re
from pathlib import Path

import pegainfer

ROOT = Path(pegainfer.__file__).parent
NOT_PRODUCT = ("tests", "lab", ".venv", "build", "aot_cache", ".gpu")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
SESSION = re.compile(r"\bsessions? \d+", re.IGNORECASE)


def product_files() -> list[Path]:
    files = sorted(path for path in ROOT.rglob("*.py")
                   if path.relative_to(ROOT).parts[0] not in NOT_PRODUCT)
    assert len(files) > 50 and ROOT / "cli.py" in files, "the walk must find the package's modules"
    return files


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_product_module_is_over_the_line_limit():
    long = [f"{path.relative_to(ROOT)} ({n} lines)" for path in product_files()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert not long, f"modules over {MAX_FILE_LINES} lines: " + ", ".join(long)


def test_no_product_function_is_over_the_line_limit():
    long = [entry for path in product_files() for entry in long_functions(path)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + ", ".join(long)


def test_no_product_module_cites_a_measurement_round():
    cited = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in product_files()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
             if SESSION.search(line)]
    assert not cited, "measurement rounds cited in product code:\n" + "\n".join(cited)


def test_the_function_check_sees_a_long_function(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text("def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "\n\ndef short():\n    return 1\n")
    assert long_functions(source, tmp_path) == [f"sample.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]
