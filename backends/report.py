"""`pegainfer inspect --sm`: each compiled launch's source, PTX, SASS and resources, read from the cubin cache
with the disassembler and assembler that Triton's package carries."""

import json
import re
import subprocess
from pathlib import Path

from pegainfer.backends.manifest import Kernel, Launch, Variant, load
from pegainfer.backends.select import margin
from pegainfer.errors import PegainferError

def compiled_launches(manifest: Path, kernel: str | None) -> list[tuple[Kernel, Variant, Launch]]:
    """(kernel, variant, launch) of the manifest's chosen variants, for one kernel (by node name or kind) or all."""
    kernels = load(manifest).kernels
    chosen = [k for k in kernels if kernel in (None, k.node, k.kind)]
    if not chosen:
        names = sorted({k.node for k in kernels} | {k.kind for k in kernels})
        raise PegainferError(f"--kernel {kernel}: no such kernel; kernels: {', '.join(names)}")
    return [(k, v, launch) for k in chosen for v in k.variants for launch in v.launches]


def show(manifest: Path, kernel: str | None, what: str) -> str:
    folder = manifest.parent.parent
    parts = []
    if what == "resources":
        return resources_table(folder, compiled_launches(manifest, kernel))
    for k, variant, launch in compiled_launches(manifest, kernel):
        header = (f"// kernel %{k.node} ({k.kind}: {' + '.join(k.ops)}), variant {variant.name}, "
                  f"launch {launch.symbol}, cubin {launch.cubin}")
        parts.append(header + "\n" + _text(folder, launch, what))
    return "\n".join(parts)


def _text(folder: Path, launch: Launch, what: str) -> str:
    key = launch.key
    if what == "source":
        generated = folder / f"{key}.cu"  # TileLang's lowering, what nvcc compiled
        return _cached_text(folder / f"{key}.py") + (
            f"\n// generated CUDA\n{generated.read_text()}" if generated.is_file() else "")
    if what == "ptx":
        return _cached_text(folder / f"{key}.ptx")
    return _run_tool("cuobjdump", "-sass", str(_cached_cubin(folder / f"{key}.cubin")))


def resources_table(folder: Path, launches: list[tuple[Kernel, Variant, Launch]]) -> str:
    lines = [f"{'kernel':<30} {'variant':<22} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6} "
             f"{'local':>6} {'smem static':>12} {'smem dyn':>9} {'warps':>5}"]
    for k, variant, launch in launches:
        meta = _cached_meta(folder / f"{launch.key}.json")
        usage = {"spill_stores": 0, "spill_loads": 0, "local": 0, **meta["resources"]} if "resources" in meta \
            else resource_usage(folder / f"{launch.key}.cubin", folder / f"{launch.key}.ptx")
        lines.append(f"{k.node + ' ' + k.kind:<30.30} {variant.name:<22} {usage['registers']:>5} "
                     f"{usage['spill_stores']:>9} {usage['spill_loads']:>9} {usage['stack']:>6} {usage['local']:>6} "
                     f"{usage['shared']:>12} {launch.shared:>9} {launch.num_warps:>5}")
    return "\n".join(lines) + "\n"


def selection_table(manifest: Path) -> str:
    """Per kernel and slot: the variant the manifest launches, whether tuning or the SM's default chose it, and
    by how much it won (from the tuning times)."""
    data = load(manifest)
    lines = [f"sm_{data.sm}: backends {', '.join(f'{b} {v}' for b, v in data.backends.items())}",
             f"{'kernel':<30} {'slot':<32} {'chosen':<31} {'by':<8} {'margin':<42} alternatives"]
    for k in data.kernels:
        for s in k.selection:
            others = [label for label in s.alternatives if label != s.chosen]
            lines.append(f"{k.node + ' ' + k.kind:<30.30} {s.slot:<32} {s.chosen:<31} {s.by:<8} {margin(s):<42} "
                         f"{', '.join(others) or '-'}")
    return "\n".join(lines) + "\n"


def resource_usage(cubin: Path, ptx: Path) -> dict[str, int]:
    """Registers, stack, local and static shared memory from the cubin; spills from ptxas's own report."""
    usage_text = _run_tool("cuobjdump", "-res-usage", str(_cached_cubin(cubin)))
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage_text))
    target = re.search(r"^\.target\s+(\S+)", _cached_text(ptx), re.M).group(1)
    assembler = "ptxas-blackwell" if int(re.sub(r"\D", "", target)) >= 100 else "ptxas"
    report = _run_tool(assembler, "-v", f"--gpu-name={target}", str(ptx), "-o", "/dev/null")
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"registers": int(fields.get("REG", 0)), "stack": int(fields.get("STACK", 0)),
            "shared": int(fields.get("SHARED", 0)), "local": int(fields.get("LOCAL", 0)),
            "spill_stores": int(spills.group(1)) if spills else 0, "spill_loads": int(spills.group(2)) if spills else 0}


def _cached_text(path: Path) -> str:
    """A cache entry's text companion; compile rebuilds an entry only when its metadata or cubin is bad."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise PegainferError(f"{path}: missing from the cubin cache; delete {path.stem}.json beside it and run "
                             f"`pegainfer compile` again to rebuild the entry") from None


def _cached_cubin(path: Path) -> Path:
    if not path.is_file():
        raise PegainferError(f"{path}: missing from the cubin cache; `pegainfer compile` rebuilds it")
    return path


def _cached_meta(path: Path) -> dict:
    """An entry's metadata: compile rebuilds the entry when this file is missing or corrupt."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        raise PegainferError(f"{path}: missing or corrupt cache entry; `pegainfer compile` rebuilds it") from None


def _run_tool(name: str, *args: str) -> str:
    try:
        import triton
    except ImportError:
        raise PegainferError(f"{name} comes with Triton: pip install -e '.[compile]'") from None
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    result = subprocess.run([str(tool), *args], capture_output=True, text=True)
    if result.returncode != 0:
        reason = "; ".join(line.strip() for line in result.stderr.splitlines() if line.strip())  # one line
        raise PegainferError(f"{name} {' '.join(args)} failed: {reason or f'exit status {result.returncode}'}")
    return result.stdout + result.stderr
