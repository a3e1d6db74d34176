#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu/prepare_sweeps.sh here: issue 38's serving sweeps and decode rows of the
# other model lines, FP8 and structured outputs, each PART in turn, run from .gpu/src (one commit's tree: env.sh's
# PEGAINFER_SRC), with a short table last and everything under $OUT/sweeps.tgz. The two calls planned on 2026-12-06
# (docs/benchmarks/2026-12-06-model-lines-fp8-structured-sweeps.md; not run then: no machine could be started):
#   carry [".gpu/src", ".gpu/wheels", ".gpu/cache_models"]:
#       PEGAINFER_CACHE=$PWD/.gpu/cache_models bash scripts/gpu/sweeps.sh card serve:qwen3.5-4b:bf16:1,32,64 \
#           serve:deepseek-v2-lite:bf16:1,32,64 decode:qwen3.5-4b decode:deepseek-v2-lite
#   carry [".gpu/src", ".gpu/wheels", ".gpu/xg", ".gpu/cache_qwen3_fp8"]:
#       PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3_fp8 bash scripts/gpu/sweeps.sh card structured \
#           serve:qwen3-4b:bf16:1,64,128 serve:qwen3-4b:fp8:1,64,128 serve:qwen3-4b:fp8kv:1,64,128
# PARTs:
#   card: the GPU's name, and its device-to-device copy bandwidth (bytes read + written, 4 GiB, median of 20), by
#       which `bench decode`'s floors (priced at the H200's 4.29 TB/s) are repriced for this card
#   decode:CONFIG: `pegainfer bench decode CONFIG --batch $DECODE_BATCH (1,16,64) --context 128,1024 --steps 20`
#   serve:CONFIG:VARIANT:C1,C2,..: scripts/gpu/serve.sh on a random CONFIG checkpoint at those concurrencies (1024
#       in, 128 out, greedy, ignore_eos, word tokenizer), one start; VARIANT bf16, fp8 (--quantization fp8: W8A8,
#       a scale per channel), fp8kv (and --kv-cache-dtype fp8), kvfp8 (bf16 weights, FP8 KV cache) or plain (bf16,
#       --no-async-scheduling: every step's tokens read before the next is launched); models whose
#       max_position_embeddings pass 40960 get --max-model-len 4096 (the sweep needs 1152)
#   structured: a Qwen3-4B-shape checkpoint with a byte-level BPE tokenizer (JSON needs punctuation), served with
#       xgrammar (.gpu/xg), and scripts/gpu/structured_sweep.py at concurrency $STRUCTURED_CONC (32): the same load
#       with a JSON schema on every request against none, two rounds each; structured:plain: the same server with
#       --no-async-scheduling
#   async:CONFIG: scripts/gpu/async_check.py, async scheduling against plain steps in-process (tokens, wall time)
#   gate:CASE,CASE,..: the 4B golden gate against Hugging Face bf16 (scripts/gpu/check.py's gate4b), those cases
#       (batch4, batch1, graph_batch9, graph_batch17/33/65/129, mixed_steps, ...)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PEGAINFER_SRC=${PEGAINFER_SRC:-$PWD/.gpu/src}
FINAL_OUT=${OUT:-/tmp/out}
mkdir -p "$FINAL_OUT"
export OUT=/tmp/sweeps_out  # serve.sh's tarballs and every log; back as one tarball (8 files come back at most)
mkdir -p "$OUT"
save() { tar czf "$FINAL_OUT/sweeps.tgz" -C "$OUT" . 2>/dev/null; cp "$OUT/summary.txt" "$FINAL_OUT/" 2>/dev/null; }
trap save EXIT  # and after each part: a call cut off at its limit still brings back the parts it finished
. scripts/gpu/env.sh
echo "tree: $(cat "$PEGAINFER_SRC/COMMIT" 2>/dev/null || echo working tree); cache: $PEGAINFER_CACHE" | tee "$OUT/summary.txt"
BW=4.29e12
for part in "$@"; do
    echo "=== $part ($(date +%T))"
    case $part in
    card)
        nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv,noheader \
            | tee "$OUT/card.txt"
        BW=$(python3 - <<'PY'
import torch
n = 1 << 31  # 4 GiB of bf16 each way
a, b = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_(), torch.empty(n, dtype=torch.bfloat16, device="cuda")
times = []
for i in range(23):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); b.copy_(a); end.record(); end.synchronize()
    if i >= 3:
        times.append(start.elapsed_time(end) / 1e3)
times.sort()
print(f"{2 * a.numel() * a.element_size() / times[len(times) // 2]:.4g}")
PY
)
        echo "copy bandwidth (read + write): $BW B/s" | tee -a "$OUT/card.txt" "$OUT/summary.txt"
        cat "$OUT/card.txt" >>"$OUT/summary.txt"
        ;;
    decode:*)
        config=${part#decode:}
        timeout 300 python3 -m pegainfer.cli bench decode "$config" --batch "${DECODE_BATCH:-1,16,64}" \
            --context 128,1024 --steps 20 --result-file "$OUT/decode_$config.json" 2>&1 | tee "$OUT/decode_$config.txt"
        python3 - "$OUT/decode_$config.json" "$BW" "$config" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
report, bw, name = json.load(open(sys.argv[1])), float(sys.argv[2]), sys.argv[3]
print(f"decode {name}: batch context ms/step, floor ms at this card's {bw / 1e12:.2f} TB/s (share)")
for r in report["decode"]:
    floor = r["floor_ms"] * 4.29e12 / bw
    print(f"  b{r['batch']:<3} ctx {r['context']:<5} {r['ms_per_step']:7.2f} ms  floor {floor:6.2f} ({floor / r['ms_per_step']:.0%})")
PY
        ;;
    serve:*)
        IFS=: read -r _ config variant concs <<<"$part"
        case $variant in
            bf16) flags="" ;;
            fp8) flags="--quantization fp8" ;;
            fp8kv) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
            kvfp8) flags="--kv-cache-dtype fp8" ;;
            plain) flags="--no-async-scheduling" ;;
            *) echo "unknown variant $variant"; continue ;;
        esac
        long=$(python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c = c.get('text_config', c); print(int(c['max_position_embeddings'] > 40960))" "models/configs/$config.json")
        [ "$long" = 1 ] && flags="$flags --max-model-len 4096"
        MODEL_CONFIG=$config LABEL=$config-$variant CONC="${concs//,/ }" STARTS=first SMALL=0 SERVE_FLAGS="$flags" \
            bash scripts/gpu/serve.sh pegainfer 2>&1 | tee "$OUT/serve_$config-$variant.txt"
        { echo "serve $config $variant ($flags):"; grep -A8 '^ *conc ' "$OUT/serve_$config-$variant.txt" \
            | grep -v '^--' ; grep -A8 'sglang client' "$OUT/serve_$config-$variant.txt" | grep -v '^--';
            grep -E 'startup_seconds|random_checkpoint' "$OUT/serve_$config-$variant.txt"; } \
            >>"$OUT/summary.txt"
        ;;
    structured|structured:plain)
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_xg .gpu/xg/*.whl || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .gpu/wheels/*.whl || exit 1
        export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site_xg
        [ -f /tmp/qwen3-4b-bpe/config.json ] || python3 scripts/gpu/random_checkpoint.py qwen3-4b /tmp/qwen3-4b-bpe \
            --tokenizer bpe 2>&1 | tee "$OUT/structured_checkpoint.txt"
        way=$([ "$part" = structured:plain ] && echo --no-async-scheduling); tag=${way:+_plain}
        python3 -m pegainfer.cli serve --model-path /tmp/qwen3-4b-bpe --device cuda --port 8000 $way \
            --served-model-name qwen3-4b --trace-steps "$OUT/structured_trace$tag.jsonl" \
            >"$OUT/structured_serve$tag.log" 2>&1 &
        pid=$!
        python3 - "$pid" <<'PY' || { tail -30 "$OUT/structured_serve$tag.log"; kill $pid; continue; }
import os, sys, time, httpx
for _ in range(1200):
    try:
        if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    if not os.path.exists(f"/proc/{sys.argv[1]}"):  # the server exited: no use waiting
        sys.exit(1)
    time.sleep(0.5)
sys.exit(1)
PY
        timeout 300 python3 scripts/gpu/structured_sweep.py --model qwen3-4b --tokenizer /tmp/qwen3-4b-bpe \
            --concurrency "${STRUCTURED_CONC:-32}" --trace "$OUT/structured_trace$tag.jsonl" \
            --out "$OUT/structured$tag" 2>&1 | tee "$OUT/structured$tag.txt"
        kill $pid; wait $pid
        { echo "structured outputs, concurrency ${STRUCTURED_CONC:-32}${way:+ ($way)}:"
          tail -6 "$OUT/structured$tag.txt"; } >>"$OUT/summary.txt"
        grep -c Traceback "$OUT/structured_serve$tag.log"
        ;;
    async:*)
        timeout 300 python3 "$PEGAINFER_SRC/scripts/gpu/async_check.py" "${part#async:}" --out "$OUT/async" 2>&1 \
            | tee "$OUT/async.txt"
        { echo "async scheduling, in-process:"; tail -4 "$OUT/async.txt"; } >>"$OUT/summary.txt"
        ;;
    gate:*)
        cases=${part#gate:}
        (cd "$PEGAINFER_SRC" && PYTHONPATH=$PYTHONPATH:scripts/gpu timeout 400 python3 scripts/gpu/check.py \
            --small /tmp/none --out "$OUT/gate" --skip small sampling bench hf --gate-cases ${cases//,/ }) \
            2>&1 | tee "$OUT/gate.txt"
        { echo "gate (regret / mean / p99):"; grep qwen3_4b_hf_gate "$OUT/gate.txt"; } >>"$OUT/summary.txt"
        ;;
    *) echo "unknown part $part" ;;
    esac
    save
done
echo "=== summary"
cat "$OUT/summary.txt"
