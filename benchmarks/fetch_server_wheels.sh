#!/usr/bin/env bash
# Download, into .whl/ at the repository root, the wheels `tokenmill serve` needs on the GPU benchmark
# machine (Python 3.12, x86_64, no fastapi/uvicorn/pydantic/prometheus_client/starlette there, but
# anyio, h11, httpx, click, typing-extensions, aiohttp and uvloop already installed).
#
# Run it on a machine with internet access, carry .whl/ over, and install there with:
#   python3 -m pip install --no-index --find-links .whl fastapi uvicorn pydantic prometheus-client
#
# Versions are pinned to the ones the server tests run with. typing-extensions and anyio are
# included in case the machine's own copies are older than pydantic / starlette need (pip keeps the
# installed ones when they are recent enough).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST=.whl

PACKAGES=(
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  annotated-doc==0.0.7          # fastapi
  opentelemetry-api==1.45.2     # fastapi (its telemetry middleware imports it)
  uvicorn==0.54.0
  prometheus-client==0.26.0
  typing-extensions==4.16.0     # fallback, see above
  anyio==4.16.0                 # fallback, see above
  xgrammar==0.2.9               # structured output (bench structured, GPU tests)
  apache-tvm-ffi==0.1.15.post2  # xgrammar
  pyzmq==27.3.0                 # the channel between the API server and the engine process
  msgpack==1.2.4                # its messages
)

mkdir -p "$DEST"
for spec in "${PACKAGES[@]}"; do
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "$spec"
done
echo "wheels in $DEST:"
ls -1 "$DEST"
du -sh "$DEST"
