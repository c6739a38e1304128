# The raw outputs behind docs/benchmarks.md's ninth-session avxvnni figures (quiet machine, run from the repo root)
D=docs/results/kernels/amx/s13; S=$D/scripts
{ cat /proc/loadavg; python $D/../check_bits.py avxvnni avx2 1,2,3,4,5,6,7,8,9,12,16,17,33,53,100; } > $D/check_bits_avxvnni.txt 2>&1
{ cat /proc/loadavg; python $S/products.py avx2,avxvnni,avx512vnni; cat /proc/loadavg; } > $D/products.txt 2>&1
{ cat /proc/loadavg; for r in 1 2; do for v in avx2 avxvnni; do echo "$v $(SPECDECODE_KERNEL_ISA=$v python $D/../s11/step.py smollm2-135m 256 1,2,3,4,6,8,16 200 2>/dev/null | tail -1)"; done; done
  for v in avx2 avxvnni; do echo "$v $(SPECDECODE_KERNEL_ISA=$v python $D/../s11/step.py qwen2.5-coder-1.5b 256 1,2,4,8 15 2>/dev/null | tail -1)"; done; cat /proc/loadavg; } > $D/step_avxvnni.txt
{ cat /proc/loadavg; for r in 1 2; do for e in "" "-DSD_PASS=6"; do echo "avxvnni [$e] $(EXTRA="$e" SPECDECODE_KERNEL_ISA=avxvnni python $S/step_flags.py smollm2-135m 256 1,2,3,4,6,8,16 200 2>/dev/null | tail -1)"; done; done; cat /proc/loadavg; } > $D/step_pass.txt
{ cat /proc/loadavg; for r in 1 2; do for e in "" "-DSD_MACC_INLINE=6" "-DSD_PASS=4" "-DSD_PASS32(f)=2" "-DSD_PASS32(f)=3" "-DSD_PASS32(f)=2 -DSD_NO_UNPACK=1"; do echo "avx2 [$e] $(EXTRA="$e" SPECDECODE_KERNEL_ISA=avx2 python $S/step_flags.py smollm2-135m 256 1,2,3,4,6,8 200 2>/dev/null | tail -1)"; done; done; cat /proc/loadavg; } > $D/avx2_pass_tries.txt
