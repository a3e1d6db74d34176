"""Copies chosen manifests of a cubin cache, and only the cubins they name, into a new cache folder: the device
tool carries at most 64 MB a call, and a cache that compiled several models holds far more.

    python scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_qwen3 --sm 90 Qwen3ForCausalLM-009ff5ea75fd ...

A manifest is named by its file's stem (see `ls CACHE/sm_90/manifests`) or by a glob of stems."""

import argparse
import json
import shutil
from pathlib import Path


def cubins_of(manifest: dict) -> set[str]:
    """Every cubin any variant or candidate of the manifest launches."""
    names = set()
    for kernel in manifest["kernels"]:
        for group in ("variants", "candidates"):
            for variant in kernel.get(group) or []:
                names |= {launch["cubin"] for launch in variant["launches"] if launch.get("cubin")}
    return names


def slim(source: Path, target: Path, sm: int, patterns: list[str]) -> tuple[int, int]:
    src, dst = source / f"sm_{sm}", target / f"sm_{sm}"
    manifests = sorted({path for pattern in patterns for path in (src / "manifests").glob(f"{pattern}.json")})
    if not manifests:
        raise SystemExit(f"no manifest in {src / 'manifests'} matches {patterns}")
    (dst / "manifests").mkdir(parents=True, exist_ok=True)
    cubins = set()
    for path in manifests:
        shutil.copy2(path, dst / "manifests" / path.name)
        cubins |= cubins_of(json.loads(path.read_text()))
    for name in cubins:
        shutil.copy2(src / name, dst / name)
    return len(manifests), len(cubins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("manifests", nargs="+", help="manifest stems or globs of them")
    parser.add_argument("--sm", type=int, default=90)
    args = parser.parse_args()
    count, cubins = slim(args.source, args.target, args.sm, args.manifests)
    print(f"{count} manifests, {cubins} cubins -> {args.target}")


if __name__ == "__main__":
    main()
