"""What the TileLang and CuTe DSL backends hand the build: a cubin with its launch ABI read from the compiler's
own output (not from our plan), and nvcc/ptxas run on CUDA source with no GPU present."""

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pegainfer.errors import PegainferError


@dataclass
class NativeLaunch:
    function: str  # the kernel's symbol in the cubin
    cubin: bytes
    files: dict[str, str]  # text companions kept beside the cubin: "ptx", "cu" (generated CUDA), "py" (template)
    shared: int  # bytes of dynamic shared memory the launch needs
    threads: int  # block size (x only: every kernel here is launched with a one-dimensional block)
    abi: list[dict]  # the kernel's parameters in order, as JSON (Param.as_json's form; the build reads them)
    version: str  # the compiler's version, part of the cache key
    resources: dict[str, int] = field(default_factory=dict)  # registers, spills, static shared memory
    cluster: tuple[int, int, int] = (1, 1, 1)  # the thread block cluster the launch must ask for


def arch_name(sm: int) -> str:
    """Hopper's wgmma and setmaxnreg need the architecture-specific target sm_90a; Blackwell's tcgen05 sm_100a."""
    return f"sm_{sm}a" if sm in (90, 100) else f"sm_{sm}"


def nvcc_path() -> str:
    path = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if not path or not os.path.exists(path):
        raise PegainferError("compiling TileLang kernels needs nvcc (the CUDA toolkit) on the PATH or in $CUDA_HOME")
    return path


def compile_cuda(source: str, sm: int, include_dirs: list[str], name: str) -> tuple[str, bytes, dict[str, int]]:
    """CUDA source -> (PTX, cubin, resources): nvcc to PTX, then ptxas -v to the cubin for the one SM."""
    arch = arch_name(sm)
    nvcc = nvcc_path()
    cu = source_file(source, name)
    with tempfile.TemporaryDirectory(prefix="pegainfer-nvcc-") as folder:
        ptx, cubin = (Path(folder) / f"{name}.{suffix}" for suffix in ("ptx", "cubin"))
        flags = ["-std=c++20", "-O3", "-w", *(f"-I{d}" for d in include_dirs)]
        _run([nvcc, "-ptx", f"-arch=compute_{arch[3:]}", *flags, str(cu), "-o", str(ptx)], name)
        ptxas = str(Path(nvcc).with_name("ptxas"))
        report = _run([ptxas, "-v", f"-arch={arch}", str(ptx), "-o", str(cubin)], name)
        return ptx.read_text(), cubin.read_bytes(), parse_ptxas_report(report)


def source_file(source: str, name: str) -> Path:
    """The CUDA source in a file whose path its content fixes: nvcc names internal symbols by a hash of the path,
    so the same source then always gives the same PTX."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"pegainfer-cuda-{os.getuid()}" / digest / f"{name}.cu"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(source)
        temporary.replace(path)
    return path


def parse_ptxas_report(text: str) -> dict[str, int]:
    def number(pattern: str) -> int:
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0
    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame"),
            "shared": number(r"(\d+) bytes smem")}


def _run(command: list[str], name: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise PegainferError(f"{name}: {Path(command[0]).name} failed: {result.stderr.strip()[-2000:]}")
    return result.stdout + result.stderr


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers, stack, local and static shared memory of a cubin's one kernel (cuobjdump, which Triton carries)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = _run([str(tool), "-res-usage", handle.name], "cuobjdump")
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(fields.get("REG", 0)), "stack": int(fields.get("STACK", 0)),
            "shared": int(fields.get("SHARED", 0)), "local": int(fields.get("LOCAL", 0))}
