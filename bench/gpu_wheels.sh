#!/bin/sh
# The wheels bench/gpu.py and tests/plugins/ckpt/test_cuda.py need on a GPU machine without network that has python3
# 3.12, CUDA torch, numpy, psutil, xxhash, nvidia-ml-py, rich, prometheus-client and pytest already: what `stead
# run`, its agent (whose command line imports the Kubernetes platform: aiohttp, kubernetes_asyncio, PyYAML) and the
# ckpt plugin import besides, at the versions of .venv, into .whl/ (git-ignored: carry it to the machine). grpcio
# and protobuf come too, at our versions: aetcd's generated code, imported by every stead command, needs grpcio >=
# 1.66.2 and protobuf >= 5.27.2. anyio comes at our version: the machine's may be older than the API stead uses
# (4.16's BlockingPortal.call_async; a GPU machine's 4.15.1 broke every flash checkpoint hook). cryptography (with
# cffi and pycparser) for the test suite's fixtures. stead's own wheel is there only for its entry points (plugins
# and platforms are found through them): the run deletes its package and imports stead from the source tree.
#
#   sh bench/gpu_wheels.sh          # then, on the GPU machine, from the repository root:
#   python3 -c "import zipfile,glob;[zipfile.ZipFile(w).extractall('.whl/site') for w in glob.glob('.whl/*.whl')]" \
#     && rm -rf .whl/site/stead && PYTHONPATH=$PWD/.whl/site:$PWD python3 bench/gpu.py
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  aetcd==1.0.0 attrs==26.1.0 betterproto2==0.10.0 grpclib==0.4.9 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 \
  multidict==7.2.1 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  structlog==26.1.0 setproctitle==1.3.8 typing_extensions==4.16.0 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 propcache==0.5.4 yarl==1.25.1 \
  PyYAML==6.0.4 kubernetes_asyncio==36.1.0 certifi==2026.10.19.post1 python-dateutil==4.0.0 six==1.17.0 \
  urllib3==2.8.0 grpcio==1.85.3 protobuf==7.36.2 anyio==4.16.0 idna==3.20 cryptography==50.0.2 cffi==2.1.1 \
  pycparser==3.12
rm -f .whl/stead-*.whl
src=$(mktemp -d)
git archive HEAD | tar -x -C "$src"
.venv/bin/pip wheel -q --no-deps --no-build-isolation --no-index -w .whl "$src"
rm -rf "$src"
du -sh .whl
