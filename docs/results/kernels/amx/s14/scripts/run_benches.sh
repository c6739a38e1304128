# The tenth session's benchmarks, run from the repository root on a quiet machine (nothing else running), in this order.
D=docs/results/kernels/amx/s14
# 1. command 1's prompts (Spec-Bench extraction 131-135, 128 tokens) beside llama-server and OpenVINO GenAI, default kernels
uptime > $D/load_before_benches.txt
specdecode bench --target smollm2-135m --weights int4 --threads 2 --dataset spec-bench:extraction --limit 5 \
  --max-new-tokens 128 --methods 'ngram:k=5;suffix:k=5' --repeats 3 --no-peer --llama-server --openvino \
  --output $D/command1_prompts --no-progress
# 2. the same with our AVX2 kernels forced (llama-server keeps its own build)
uptime >> $D/load_before_benches.txt
SPECDECODE_KERNEL_ISA=avx2 specdecode bench --target smollm2-135m --weights int4 --threads 2 --dataset spec-bench:extraction \
  --limit 5 --max-new-tokens 128 --methods 'ngram:k=5;suffix:k=5' --repeats 3 --no-peer --llama-server \
  --output $D/command1_prompts_avx2 --no-progress
# 3. the Qwen 0.5B alone (plain decoding against llama-server's, same Q4_K_M file), the Qwen pair's prompts
uptime >> $D/load_before_benches.txt
specdecode bench --target qwen2.5-coder-0.5b --weights int4 --threads 2 \
  --dataset humaneval,spec-bench:coding,spec-bench:math_reasoning --limit 2 --max-new-tokens 64 --methods 'ngram:k=4' \
  --no-peer --llama-server --output $D/e2e_qwen05 --no-progress
uptime >> $D/load_before_benches.txt
# 4. (after a review) the Qwen pair with our AVX2 kernels forced, llama-server and OpenVINO GenAI interleaved
uptime > $D/load_before_qwen_avx2.txt
SPECDECODE_KERNEL_ISA=avx2 specdecode bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --weights int4 \
  --draft-weights int4 --threads 2 --dataset humaneval,spec-bench:coding,spec-bench:math_reasoning --limit 2 \
  --max-new-tokens 64 --methods 'draft-model:k=3;ngram:k=4' --no-peer --llama-server --openvino \
  --output $D/e2e_qwen_avx2 --no-progress
uptime >> $D/load_before_qwen_avx2.txt
