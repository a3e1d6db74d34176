"""Loads kernel source text as a module, either for Triton's JIT (to compile ahead of time) or for its CPU
interpreter (TRITON_INTERPRET=1, read when @triton.jit runs, so the module is loaded twice under two names)."""

import hashlib
import importlib.util
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Iterator

_LOADED: dict[tuple[str, bool], ModuleType] = {}


def source_folder() -> Path:
    """Triton reads a kernel's source back from its file, so generated source must live in one."""
    folder = Path(tempfile.gettempdir()) / f"pegainfer-triton-src-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load_kernel_module(source: str, name_hint: str, *, interpret: bool) -> ModuleType:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    key = (digest, interpret)
    if key in _LOADED:
        return _LOADED[key]
    path = source_folder() / f"{Path(name_hint).stem}_{digest}.py"
    if not path.exists():
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(source)
        temporary.replace(path)
    name = f"pegainfer_kernel_{digest}_{'interpreted' if interpret else 'jit'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with triton_interpret(interpret):
        spec.loader.exec_module(module)
    _LOADED[key] = module
    return module


@contextmanager
def triton_interpret(on: bool) -> Iterator[None]:
    """Triton reads TRITON_INTERPRET when a kernel is defined and again when it runs: hold it for both."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
