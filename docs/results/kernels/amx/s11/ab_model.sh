# ab_model.sh MODEL CTX KS ROUNDS: base (HEAD) and new alternated, amx then avx2
for r in $(seq $4); do for isa in amx avx2; do
  echo "base $isa $(cd /tmp && SPECDECODE_KERNEL_ISA=$isa PYTHONPATH=/tmp/s11/base/src python /tmp/s11/step.py $1 $2 $3 40)"
  echo "new  $isa $(cd /tmp && SPECDECODE_KERNEL_ISA=$isa PYTHONPATH=/work/main/src python /tmp/s11/step.py $1 $2 $3 40)"
done; done
