#!/bin/bash
# alternated: README command 1 with --policy fixed (the default before session 10) and --policy cost-model (what auto picks for ngram); $1 = rounds; env passes ISA
cd /work/main && . .venv/bin/activate
for r in $(seq 1 $1); do
  for pol in fixed cost-model; do
    echo "== $pol round $r $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg) ISA=${SPECDECODE_KERNEL_ISA:-auto}"
    specdecode generate --compare-baseline --policy $pol 2>&1 | grep -E "^ (spec-bench|median)"
  done
done
