#!/usr/bin/env bash
# On the GPU: vLLM's request fields, /v1/responses and /v1/messages through `pegainfer serve --device cuda` on the
# small checkpoint with Qwen3's chat template (allowed_token_ids drawn on the host from the step's logits beside
# plain rows; stop strings kept; token ids; streamed against whole answers). Prints a table last.
#   carry [".gpu/feat_small", ".gpu/cache_feat", ".gpu/wheels", ".gpu/xg"]:  bash scripts/gpu/api_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl .gpu/xg/*.whl || exit 1
. scripts/gpu/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site PEGAINFER_CACHE=${PEGAINFER_CACHE:-$PWD/.gpu/cache_feat}
rm -rf /tmp/api_ck && cp -r .gpu/feat_small /tmp/api_ck
python3 - <<'PY'
import json, pathlib
path = pathlib.Path("/tmp/api_ck/tokenizer_config.json")
template = pathlib.Path("tests/qwen3_chat_template.jinja").read_text()
path.write_text(json.dumps(json.loads(path.read_text()) | {"chat_template": template}))
PY
python3 -m pegainfer.cli serve --model-path /tmp/api_ck --device cuda --port 8000 --served-model-name small \
    --gpu-memory-utilization 0.2 --max-model-len 1024 --enable-auto-tool-choice --tool-call-parser hermes \
    --reasoning-parser qwen3 >"$OUT/serve.log" 2>&1 &
pid=$!
python3 scripts/gpu/api_check.py http://127.0.0.1:8000 2>&1 | tee "$OUT/api_check.txt"
kill $pid; wait $pid 2>/dev/null
grep -c Traceback "$OUT/serve.log" | sed 's/^/tracebacks in the server log: /'
