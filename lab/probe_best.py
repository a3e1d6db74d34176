"""The fastest decode cases of a gemm_probe.py run, per GEMM and row count, plain and programmatic: a short table
where the probe's own lists every case (`python3 lab/probe_best.py $OUT/decode_probe.json [--top N]`)."""

import argparse
import json
from pathlib import Path


def matched(row: dict) -> bool:
    """A case ran and its outputs (plain and programmatic) matched torch's."""
    return "error" not in row and row.get("rel_err", 1.0) < 1e-2 and row.get("pdl_rel_err", 0.0) < 1e-2


def best(rows: list[dict], key: str, top: int) -> list[dict]:
    """The `top` cases of least `key` (us or pdl_us) whose result matched torch's."""
    timed = [r for r in rows if key in r and matched(r)]
    return sorted(timed, key=lambda r: r[key])[:top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("probe", type=Path, help="a decode_probe.json")
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    if not args.probe.is_file():
        parser.error(f"no such file: {args.probe} (gemm_probe.py run writes $OUT/decode_probe.json)")
    probe = json.loads(args.probe.read_text())
    copy = probe["copy_tb_per_s"] * 1e12
    for r in (r for r in probe["rows"] if not matched(r)):
        print(f"WRONG {r['case']} rows {r['rows']}: {r.get('error') or (r.get('rel_err'), r.get('pdl_rel_err'))}")
    groups = {}
    for r in probe["rows"]:
        groups.setdefault((r["case"].split()[0], r["rows"]), []).append(r)
    print(f"copy {copy / 1e12:.2f} TB/s")
    for (gemm, count), rows in groups.items():
        for key in ("us", "pdl_us"):
            share = lambda r: r["n"] * r["k"] * 2 / (r[key] * 1e-6) / copy  # noqa: E731
            picks = ", ".join(f"{r['case'].split(' ', 1)[1]} {r[key]:.1f} ({share(r):.0%})"
                              for r in best(rows, key, args.top))
            print(f"{gemm:<7}{count:>3} {'plain' if key == 'us' else 'PDL':<5} {picks}")


if __name__ == "__main__":
    main()
