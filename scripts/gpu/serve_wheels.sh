#!/usr/bin/env bash
# Here (CPU machine): the wheels `pegainfer serve`, `transformers serve` and SGLang's client need that the GPU
# image lacks (it has httpx, anyio, h11, uvloop, click, jinja2, tqdm), for its Python 3.12, into .gpu/wheels
# (carried with .gpu).
# Pinned to releases whose own needs the image meets (newer fastapi wants opentelemetry-api, newer openai httpx2).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .gpu/wheels
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .gpu/wheels fastapi==0.115.12 starlette==0.46.2 uvicorn==0.34.3 pydantic==2.11.7 pydantic-core==2.33.2 \
    annotated-types==0.7.0 typing-inspection==0.4.1 openai==1.99.9 distro==1.9.0 \
    jiter==0.10.0 sniffio==1.3.1
# SGLang's benchmark client (serve.sh's $SGLANG_CONC): 0.4.6.post5's bench_serving.py is one file needing aiohttp,
# requests, numpy, tqdm and transformers; run as a script, it imports nothing else of SGLang. SGLANG=0 leaves it out
# (the carry is 64 MB in all); XGRAMMAR=1 adds xgrammar's wheels (structured outputs) to .gpu/xg.
[ "${SGLANG:-1}" = 0 ] || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .gpu/wheels sglang==0.4.6.post5 aiohttp==3.12.15 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 \
    frozenlist==1.8.0 multidict==6.9.1 propcache==0.5.4 yarl==1.25.1 idna==3.20 requests==2.32.5 urllib3==2.5.0 \
    certifi==2025.8.3 charset-normalizer==3.4.3
[ "${XGRAMMAR:-0}" = 0 ] || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $PLATFORMS -d .gpu/xg xgrammar==0.2.9 apache-tvm-ffi==0.1.12
ls .gpu/wheels; du -sh .gpu/wheels
