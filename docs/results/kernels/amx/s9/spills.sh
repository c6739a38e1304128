#!/bin/bash
# Stack references in the inner loop of passt32 (Q4_1, AVX2) per pass size: session 8's qgemm.c against this one.
# Usage: bash spills.sh OLD_QGEMM_C NEW_QGEMM_C   (gcc, objdump; docs/results/kernels/amx/README.md section 7)
set -e
csrc=$(cd "$(dirname "$0")/../../../../../src/specdecode/csrc" && pwd)
tmp=$(mktemp -d)
for which in old new; do
  src=$([ $which = old ] && echo "$1" || echo "$2")
  for P in $([ $which = old ] && echo "1 2 4" || echo "1 2 4 6"); do
    extra=$([ $which = new ] && echo ", NULL" || echo "")
    printf '#include "%s"\n__attribute__((noinline)) void f(const uint8_t* w, int64_t nb, int64_t k, const int8_t* xq, const float* xd, const float* xs, const int32_t* xsum, float* out) { passt32(%s, SD_Q4_1, w, nb, k, xq, xd, xs, xsum, 0, out, 8, 0, 0, 8%s); }\n' "$(realpath "$src")" $P "$extra" > $tmp/i.c
    if ! gcc -O3 -std=gnu11 -ffp-contract=off -mavx2 -mfma -mf16c -DSD_VARIANT_AVX2 -DSD_PASS=$([ $which = old ] && echo 4 || echo 6) -I"$csrc" -w -c $tmp/i.c -o $tmp/i.o 2>/dev/null; then
      echo "$which P=$P: (no such pass)"; continue; fi
    objdump -d --no-show-raw-insn $tmp/i.o | awk '/<f>:/,/^$/' > $tmp/i.s
    python3 - "$which" "$P" "$tmp/i.s" <<'PY'
import re, sys
lines = open(sys.argv[3]).read().splitlines()
addr = lambda l: int(l.split(':')[0].strip(), 16) if re.match(r'\s+[0-9a-f]+:', l) else None
idx = {addr(l): i for i, l in enumerate(lines) if addr(l) is not None}
best = None
for i, l in enumerate(lines):
    m = re.search(r'\sj\w+\s+([0-9a-f]+) <', l)
    if m and int(m.group(1), 16) in idx and idx[int(m.group(1), 16)] < i:
        body = lines[idx[int(m.group(1), 16)]:i + 1]
        mb = sum('vpmaddubsw' in x for x in body)
        if mb and (best is None or mb > best[0]):
            best = (mb, len(body), sum('rsp' in x for x in body))
print(f"{sys.argv[1]} P={sys.argv[2]}: inner block loop {best[1]} instructions, {best[0]} vpmaddubsw, {best[2]} stack references")
PY
  done
done
rm -rf $tmp
