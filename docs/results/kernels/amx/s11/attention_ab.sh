# ab.sh CTX ROUNDS VARIANT... : alternate binaries, print per-variant min of rows=1/2 all/half (AVX512VNNI and AVX2)
ctx=$1; n=$2; shift 2
for r in $(seq $n); do for t in "$@"; do for isa in AVX512VNNI AVX2; do ./${t}_$isa $ctx 3 | head -2 | awk -v t=$t -v i=$isa '{print t, i, $1, $3, $8}'; done; done; done | sort | awk '{k=$1" "$2" "$3; if(!(k in a)||$4<a[k])a[k]=$4; if(!(k in b)||$5<b[k])b[k]=$5} END{for(k in a) print k, "all", a[k], "half", b[k]}' | sort -k3,3 -k2,2 -k1,1
