#!/usr/bin/env bash
# `jobsvc bench` on a GPU host: the code path of the CPU runs, with the regular vllm package
# (`bash ops/setup.sh gpu`) and one shard per GPU (its service worker bound to that GPU, whose
# engine the standalone arm drives directly too), on the reuse, unique and uneven workloads.
#
#   bash ops/gpu-bench.sh [RESULTS_DIR]       default: bench-out/gpu-<UTC time>
#
# Writes RESULTS_DIR/<workload>.json and .png, and logs under RESULTS_DIR/logs/<workload>/.
# GPUS (default: every GPU `nvidia-smi -L` lists), TRIALS (default 7) and BENCH_ARGS (more
# `jobsvc bench` options, such as --fresh-engines) shape the run; any JOBSVC_* variable set
# beforehand wins over the defaults below. Needs Redis at
# JOBSVC_REDIS_URL and an existing PostgreSQL database at JOBSVC_DATABASE_URL.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

if .venv/bin/python -c 'import sys; from jobsvc.workers.bootstrap import is_cpu_build; sys.exit(not is_cpu_build())'; then
  echo "this environment has the CPU build of vLLM; run: bash ops/setup.sh gpu" >&2
  exit 1
fi
if [ -z "${GPUS:-}" ]; then
  command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found; set GPUS=N" >&2; exit 1; }
  GPUS="$(nvidia-smi -L | grep -c '^GPU ' || true)"
fi
[ "$GPUS" -ge 1 ] 2>/dev/null || { echo "no GPUs to bench on (GPUS=$GPUS)" >&2; exit 1; }
trials="${TRIALS:-7}"

# Llama-3.1-8B's shape with random weights: the real model's compute and KV-cache bytes per
# token, without a download. The real Llama 3 tokenizer cannot be fetched, so the directory
# links the tiny model's tokenizer instead: every ID it produces (< 4096) is valid in the
# 128,256-entry vocabulary, the synthetic documents keep the token counts of the CPU runs, and
# the config's bos/eos IDs are that tokenizer's (0, 1), not Llama 3's. Sampled IDs the tokenizer
# lacks decode to no text; the bench counts tokens, not text.
export JOBSVC_MODEL="${JOBSVC_MODEL:-$repo/ops/llama-3.1-8b-shape}"
export JOBSVC_LOAD_FORMAT="${JOBSVC_LOAD_FORMAT:-dummy}"
export JOBSVC_ENFORCE_EAGER="${JOBSVC_ENFORCE_EAGER:-false}"
# Far above the longest prompt of these workloads (about 2,500 tokens) without sizing the
# engine for the config's 131,072.
export JOBSVC_MAX_MODEL_LEN="${JOBSVC_MAX_MODEL_LEN:-8192}"
# vLLM's block size on GPUs; the router hashes prefixes in blocks of the same size.
export JOBSVC_BLOCK_SIZE="${JOBSVC_BLOCK_SIZE:-16}"
# Each GPU holds one resident engine, the service worker's, which the standalone arm drives
# directly as well: on 80 GB, 0.9 of it is 16 GB of weights and the rest mostly KV cache.
# With --own-standalone-engines in BENCH_ARGS each GPU holds two engines: give each 0.45.
export JOBSVC_GPU_MEMORY_UTILIZATION="${JOBSVC_GPU_MEMORY_UTILIZATION:-0.9}"
JOBSVC_BENCH_DEVICES="${JOBSVC_BENCH_DEVICES:-$(seq -s ' ' 0 $((GPUS - 1)))}"
export JOBSVC_BENCH_DEVICES
export JOBSVC_DATABASE_URL="${JOBSVC_DATABASE_URL:-postgresql://postgres@127.0.0.1/jobsvc_bench}"

results="${1:-bench-out/gpu-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$results"
results="$(cd "$results" && pwd)"
{
  nvidia-smi -L || true
  .venv/bin/python -c 'import vllm; print("vllm", vllm.__version__)'
  env | grep '^JOBSVC_' | grep -v '^JOBSVC_DATABASE_URL=' | sort
} >"$results/environment.txt"

for workload in reuse unique "$repo/ops/workloads/uneven.jsonl"; do
  name="$(basename "$workload" .jsonl)"
  logs="$results/logs/$name"
  mkdir -p "$logs"
  echo "$name: $GPUS shard(s), $trials pairs; progress in $logs/progress.log" >&2
  # Run from the log directory: the bench writes its workers' logs to ./bench-logs.
  (cd "$logs" && "$repo/.venv/bin/jobsvc" bench --workload "$workload" --shards "$GPUS" \
    --trials "$trials" --json "$results/$name.json" --plot "$results/$name.png" \
    ${BENCH_ARGS:-} 2>progress.log)
done
echo "results in $results" >&2
