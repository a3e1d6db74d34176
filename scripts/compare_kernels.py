"""Are two trees' kernels the same? `build CACHE` compiles, for sm_90 and with every installed backend, the
Qwen3-4B plan and every architecture's small plan (its DAG file's TINY_CONFIG) into CACHE; `diff A B` compares,
launch by launch in plan order, each launch's generated CUDA (TileLang's), its PTX and its cubin's SASS (not the
Python templates, which a refactor rewrites), and prints every launch that differs. A refactor of the kernel half
passes when `diff` finds nothing; renamed kernels or variants are matched by position, and their names reported.

    python scripts/compare_kernels.py build /tmp/before      # on the tree before the change
    python scripts/compare_kernels.py build /tmp/after       # on the tree after it
    python scripts/compare_kernels.py diff /tmp/before /tmp/after
"""

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

SM = 90
FULL_MODELS = ("qwen3-4b",)
_NVCC_ID = re.compile(r"(_INTERNAL_|_GLOBAL__N__)[0-9a-f]{8}_")  # nvcc's ids of one compilation (its temp path)
_SASS_NOISE = re.compile(r"^\s*(code for sm_\d+|Function : \S+|\.section.*|\s*/\*[0-9a-f]{4}\*/\s*$)")


def build(cache: Path, jobs: int) -> None:
    from pegainfer.cli import main
    from pegainfer.frontends.registry import dag_modules

    with tempfile.TemporaryDirectory() as folder:
        models = list(FULL_MODELS)
        for architecture, dag in sorted(dag_modules().items()):
            config = Path(folder) / architecture / "config.json"
            config.parent.mkdir()
            config.write_text(json.dumps(dag.TINY_CONFIG))
            models.append(str(config))
        for model in models:
            if main(["compile", model, "--sm", str(SM), "--jobs", str(jobs), "--cache-dir", str(cache)]) != 0:
                sys.exit(f"compare_kernels: compiling {model} failed")


def launches(cache: Path) -> dict[str, list[tuple[str, dict]]]:
    """Manifest name -> [(kernel/variant/launch label, launch record)] in plan order."""
    out = {}
    for manifest in sorted((cache / f"sm_{SM}" / "manifests").glob("*.json")):
        data = json.loads(manifest.read_text())
        rows = []
        for kernel in data["kernels"]:
            for group in ("variants", "candidates"):  # what the plan launches, then every candidate compiled
                for variant in kernel[group]:
                    for index, launch in enumerate(variant["launches"]):
                        rows.append((f"{kernel['node']}/{group}/{variant['name']}/{index}", launch))
        out[manifest.stem] = rows
    return out


def texts(cache: Path, launch: dict) -> dict[str, str]:
    """The launch's generated CUDA and PTX as text ('' where the backend writes none), nvcc's ids masked."""
    folder = cache / f"sm_{SM}"
    stem = launch["cubin"].removesuffix(".cubin")
    return {suffix: _NVCC_ID.sub(r"\1id_", (folder / f"{stem}.{suffix}").read_text())
            if (folder / f"{stem}.{suffix}").is_file() else "" for suffix in ("cu", "ptx")}


def same_sass(before: Path, launch_a: dict, after: Path, launch_b: dict) -> bool:
    """Identical cubins (by their recorded sha256) have identical SASS; others are disassembled and compared."""
    if launch_a["sha256"] == launch_b["sha256"]:
        return True
    return sass(before / f"sm_{SM}" / launch_a["cubin"]) == sass(after / f"sm_{SM}" / launch_b["cubin"])


def sass(cubin: Path) -> str:
    from pegainfer.backends.report import _run_tool  # Triton's cuobjdump

    listing = _run_tool("cuobjdump", "-sass", str(cubin))
    return "\n".join(line for line in listing.splitlines() if not _SASS_NOISE.match(line))


def diff(before: Path, after: Path) -> int:
    old, new = launches(before), launches(after)
    problems = [f"manifest {name} is only in {before}" for name in old.keys() - new.keys()]
    problems += [f"manifest {name} is only in {after}" for name in new.keys() - old.keys()]
    renamed, same = [], 0
    for name in sorted(old.keys() & new.keys()):
        if len(old[name]) != len(new[name]):
            problems.append(f"{name}: {len(old[name])} launches before, {len(new[name])} after")
            continue
        for (label_a, launch_a), (label_b, launch_b) in zip(old[name], new[name]):
            if label_a != label_b:
                renamed.append(f"{label_a} -> {label_b}")
            text_a, text_b = texts(before, launch_a), texts(after, launch_b)
            changed = [kind for kind in text_a if text_a[kind] != text_b[kind]]
            changed += [] if same_sass(before, launch_a, after, launch_b) else ["sass"]
            if changed:
                problems.append(f"{name} {label_b}: {', '.join(changed)} differ")
            else:
                same += 1
    for line in sorted(set(renamed)):
        print(f"renamed: {line}")
    for line in problems:
        print(f"DIFFERS: {line}")
    print(f"compare_kernels: {same} launches identical in source, PTX and SASS; {len(problems)} differences")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="compile the plans into CACHE")
    build_parser.add_argument("cache", type=Path)
    build_parser.add_argument("--jobs", type=int, default=2)
    diff_parser = commands.add_parser("diff", help="compare two caches launch by launch")
    diff_parser.add_argument("before", type=Path)
    diff_parser.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "build":
        build(args.cache, args.jobs)
        return 0
    return diff(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
