#!/usr/bin/env bash
# On the GPU: decode steps of 17 to 256 rows, in one call. Each GEMM's slot variants at 24-256 rows (lab/rows_probe.py,
# against torch), where a step's time goes at batch 64, 128 and 256 (step_profile.py, kernels summed by name), and
# `pegainfer bench decode` at batch 1-256, context 128 and 1024; a short table of each on stdout, logs under $OUT.
#   carry [".gpu/cache_qwen3"]:  PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 bash scripts/gpu/decode_rows.sh [--no-probe]
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/env.sh
[ "${1:-}" = --no-probe ] || { timeout 200 python3 lab/rows_probe.py --out "$OUT" > "$OUT/probe.txt" 2>&1
python3 - "$OUT/rows_probe.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
best = {}
for r in rows:
    if "us" in r:
        best.setdefault((r["kernel"], r["rows"]), []).append((r["us"], r["variant"].split(":")[-1], r["rel_err"]))
for (kernel, n), cands in best.items():
    cands.sort()
    print(f"{kernel:<7} rows {n:<3} " + "  ".join(f"{v} {us:.1f}" for us, v, _ in cands[:5]))
PY
}
timeout 150 python3 scripts/gpu/step_profile.py qwen3-4b --batch 64 128 256 --context 128 --steps 10 \
    --out "$OUT/prof" > "$OUT/profile.txt" 2>&1
for b in 64 128 256; do
    python3 - "$OUT/prof/batch$b.json" "$b" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
by = {}
for r in d["kernels"]:
    by[r["name"][:40]] = by.get(r["name"][:40], 0) + r["charged_us"]
print(f"batch {sys.argv[2]}: span {d['span_us']:.0f} us: " + ", ".join(f"{n} {us:.0f}" for n, us in
      sorted(by.items(), key=lambda kv: -kv[1])[:7]))
PY
done
rm -f "$OUT"/prof/trace_*.json
timeout 200 python3 -m pegainfer.cli bench decode qwen3-4b --batch 1,16,32,64,128,256 --context 128,1024 --steps 20 \
    2>&1 | tail -13
