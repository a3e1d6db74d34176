"""A new architecture is one DAG file: no architecture's name may appear in the layers below the DAG files (ir/,
frontends/, passes/, backends/, runtime/), in code or in comments."""

import re
from pathlib import Path

import pegainfer
from pegainfer.frontends.registry import dag_modules

LAYERS = ("ir", "frontends", "passes", "backends", "runtime")
ROOT = Path(pegainfer.__file__).parent


def architecture_names() -> set[str]:
    """Every DAG file's architectures, model type and module name, and its family (the name before its digits)."""
    names = set()
    for module in dag_modules().values():
        stem = module.__name__.rsplit(".", 1)[1]
        names |= {*module.ARCHITECTURES, module.MODEL_TYPE, stem, re.match(r"[a-z]+", stem).group(0)}
    return {name.lower() for name in names}


def test_the_layers_below_the_dag_files_name_no_architecture():
    names = architecture_names()
    assert {"qwen", "llama", "gemma", "mistral", "qwen3_moe"} <= names, "the search must cover every DAG file"
    pattern = re.compile("|".join(sorted(map(re.escape, names), key=len, reverse=True)), re.IGNORECASE)
    found = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".json", ".txt", ".cu", ".toml"):
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                    if pattern.search(line):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "architecture names outside models/:\n" + "\n".join(found)
