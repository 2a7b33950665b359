#!/usr/bin/env bash
# The standard speccomp benchmark: the first 2 prompts of each prompt set shipped in speccomp/data/prompts, 256 new tokens,
# greedy, every registered drafter + plain speccomp + HF prompt lookup against HF greedy generate.
# Before it, `speccomp search` picks the self-drafters' layers on this machine (once; then reused).
# Writes benchmarks/results.json and benchmarks/results.png; the table goes to stdout.
#
#   benchmarks/run.sh                      # prompts from speccomp/data/prompts (in this repository)
#   PROMPTS_DIR=/path/to/prompts benchmarks/run.sh
#   benchmarks/run.sh --drafters ngram     # extra arguments go to `speccomp bench`
#
# Run it on an otherwise idle machine: every row is timed, and other processes on the same cores
# distort speedups far more than they distort tau (see benchmarks/README.md).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROMPTS_DIR="${PROMPTS_DIR:-$HERE/../speccomp/data/prompts}"
FILES=(alpaca gsm8k humaneval vicuna_bench)

args=()
for f in "${FILES[@]}"; do
    path="$PROMPTS_DIR/$f.jsonl"
    if [[ ! -f "$path" ]]; then
        echo "run.sh: $path not found; set PROMPTS_DIR to the folder holding ${FILES[*]/%/.jsonl}" >&2
        echo "        (or benchmark the prompts shipped with speccomp: speccomp bench --json OUT.json)" >&2
        exit 2
    fi
    args+=("$path")
done

cd "$HERE/.."
# the self-drafters' layers are chosen per machine by measured tokens/s on the shipped prompts
# (not the benchmark prompts); a stored choice is reused, `speccomp search --drafter X` redoes it
for d in layer_skip early_exit; do
    speccomp search --drafter "$d" --reuse --threads "${THREADS:-2}"
done
exec speccomp bench \
    --prompts "${args[@]}" \
    --limit 2 \
    --max-new-tokens 256 \
    --drafters all \
    --threads "${THREADS:-2}" \
    --warmup 1 \
    --json benchmarks/results.json \
    --plot benchmarks/results.png \
    "$@"
