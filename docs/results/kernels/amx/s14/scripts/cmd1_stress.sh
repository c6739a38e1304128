# README command 1 (generate --compare-baseline: plain and speculative, two runs each per prompt, all four compared)
# in N processes, cycling: quiet / a CPU hog for the whole run / amx tiles off (avx512vnni forced, same few-row code)
N=${1:-36}
for i in $(seq 1 $N); do
  mode=$((i % 3)); HOG=; ISA=
  [ $mode = 1 ] && { python -c "import time; t=time.time()
while time.time()-t < 60: pass" & HOG=$!; }
  [ $mode = 2 ] && ISA=avx512vnni
  res=$(SPECDECODE_KERNEL_ISA=$ISA specdecode generate --compare-baseline --json 2>/tmp/s14/err_$i.txt | python -c "
import sys, json
recs=[json.loads(l) for l in sys.stdin if l.startswith('{')]
eq=sum(r['matches_baseline'] for r in recs)
sp=sorted(r['speedup'] for r in recs)
diff=[r.get('difference') for r in recs if not r['matches_baseline']]
print(f'{eq}/{len(recs)} median {sp[len(sp)//2]:.2f}x', diff if diff else '')")
  [ -n "$HOG" ] && kill $HOG 2>/dev/null; wait 2>/dev/null
  echo "$i $([ $mode = 0 ] && echo quiet || ([ $mode = 1 ] && echo hog || echo avx512vnni)) $(grep -o '[a-z0-9]* kernel[^;]*' /tmp/s14/err_$i.txt | head -1 | cut -c1-60) $res"
done
echo done
