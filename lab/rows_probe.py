"""Decode GEMMs of 17 to 256 rows: every variant of the slot serving the rows (the swapped tiles, Triton's), the
prefill tile of the row-unbounded slot and, up to 64 rows, the TileLang tiles of the 16-row slot run over more rows
(their M is dynamic: blocks of 16 rows), each launched as the runtime launches it and checked against torch, timed
over weight copies past the L2 as gemm_case does. The 16-row planes tile is left out: its scratch holds 16 rows.

    PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 python3 lab/rows_probe.py --out $OUT   # on the GPU, after env.sh
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "gpu"))

from kernels import GEMM_KINDS, Runner, copy_bandwidth, gemm_case, slot_variants  # noqa: E402

from pegainfer.backends import manifest as manifests  # noqa: E402
from pegainfer.backends.cache import cache_root, manifest_path  # noqa: E402
from pegainfer.backends.planning import gemm_roles  # noqa: E402
from pegainfer.frontends.load import embedded_configs, load_spec  # noqa: E402
from pegainfer.ir.graph import KERNEL  # noqa: E402
from pegainfer.passes.pipeline import lower  # noqa: E402


def candidates(kernel, rows: int) -> list:
    """The slot's variants, the prefill tile, and up to 64 rows the 16-row slot's TileLang tiles but the planes one."""
    prefill = [v for v in kernel.candidates if v.max_rows is None and not v.min_sizes and v.backend == "tilelang"]
    sixteen = [v for v in slot_variants(kernel, 16) if v.backend == "tilelang" and "planes" not in v.label]
    return slot_variants(kernel, rows) + prefill[:1] + (sixteen if rows <= 64 else [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="*", default=[24, 32, 48, 64, 96, 128, 192, 256])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    spec = load_spec(embedded_configs()["qwen3-4b"])
    lowered, _ = lower(spec.graph)
    path = manifest_path(cache_root(), 90, spec)
    runner = Runner(path.parent.parent, manifests.load(path), pdl=True)
    copy = copy_bandwidth() / 1e12
    rows_out = []
    for graph in lowered.all_graphs():
        for node in (n for n in graph.nodes if n.op == KERNEL and n.attrs["kind"] in GEMM_KINDS):
            kernel, roles = runner.kernel(graph.name, node.name), gemm_roles(node)
            k = graph.value_types()[roles["weight"]].shape[1]
            for rows in args.rows:
                rows_out += gemm_case(runner, kernel, roles, k, rows, candidates(kernel, rows), "decode")
            (args.out / "rows_probe.json").write_text(json.dumps({"copy_tb_per_s": copy, "rows": rows_out}, indent=1))
    print(f"copy {copy:.2f} TB/s")
    for r in rows_out:
        if "error" in r:
            print(f"{r['kernel']:<8} {r['variant']:<26} rows{r['rows']:<3} ERROR {r['error'][:70]}")
        elif "tb_per_s" in r:
            print(f"{r['kernel']:<8} {r['variant']:<26} rows{r['rows']:<3} err {r.get('rel_err', 0):.1e} "
                  f"{r['us']:7.1f} us {r['tb_per_s']:.2f} TB/s ({r['tb_per_s'] / copy:.0%})")


if __name__ == "__main__":
    main()
