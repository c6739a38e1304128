#!/bin/bash
# Interleaved A/B of csrc/qgemm.c's attention: OLD and NEW sources, one thread (taskset), fastest of 300 calls,
# at the models' shapes (heads, kv heads, head size, visible keys). Usage: run_ab.sh OLD_qgemm.c NEW_qgemm.c
set -e
here=$(cd "$(dirname "$0")" && pwd); inc=$(cd "$here/../../../../src/specdecode/csrc" && pwd); tmp=$(mktemp -d)
for v in old new; do src=$([ $v = old ] && realpath "$1" || realpath "$2")
  gcc -O3 -std=gnu11 -mavx2 -mfma -mf16c -DSD_VARIANT_AVX2 -I"$inc" -DQGEMM="\"$src\"" "$here/attention_ab.c" -o "$tmp/${v}_avx2" -lm -w
  gcc -O3 -std=gnu11 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni -DSD_VARIANT_AVX512VNNI -I"$inc" \
      -DQGEMM="\"$src\"" "$here/attention_ab.c" -o "$tmp/${v}_avx512vnni" -lm -w
done
for shape in "9 3 64 256" "9 3 64 2000" "14 2 64 256" "12 2 128 256" "12 2 128 2000"; do
  for var in avx2 avx512vnni; do line="heads,kv,d,keys=${shape// /,} $var:"
    for r in 1 2 3; do for v in old new; do line="$line $v $(taskset -c 1 "$tmp/${v}_$var" $shape 300 | cut -d' ' -f1)us"; done; done
    echo "$line"; done; done
