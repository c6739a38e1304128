// The function table of one instruction-set variant of csrc/qgemm.c (C ABI), shared by the variant
// (which fills it) and the torch extension (which calls it). Bump SD_TABLE_VERSION with any change.
#pragma once
#include <stdint.h>

#define SD_TABLE_VERSION 5

typedef struct {
  int32_t version;
  const char* name;
  // x [rows, k] float32 -> int8 q [rows, k], d and s [rows, k/32] (s = d * sum q)
  void (*quantize32)(const float*, int64_t, int64_t, int8_t*, float*, float*);
  // x [rows, k] float32 -> int8 q [rows, k], d [rows, k/256], bsums int16 [rows, k/16]
  void (*quantize256)(const float*, int64_t, int64_t, int8_t*, float*, int16_t*);
  // (fmt, w, bytes per weight row, k, q, d, s, rows, out, ldo, n0, n1, n_out): out[r * ldo + n], n0 <= n < n1;
  // n_out: the weight's column count (the first n_out / 8 * 8 columns are tiles of 8, as for gemmk)
  void (*gemm32)(int, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t, float*,
                 int64_t, int64_t, int64_t, int64_t);
  // the same for K-quants (Q4_K, Q6_K: the first n_out / 8 * 8 columns are tiles of 8; a range that cuts a tile is correct, and splits of multiples of 8 waste nothing)
  void (*gemmk)(int, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const int16_t*, int64_t, float*,
                int64_t, int64_t, int64_t, int64_t);
  // (fmt, w, bytes per row, k, out [n1 - n0, k], n0, n1, n_out)
  void (*dequantize)(int, const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t, int64_t);
  // attention of nq queries: query i is head hs[i] of row rows[i]: (q [rows, ldq] float32 (a row's heads at
  // q + row * ldq, [heads, d]), heads, kv_heads, d, k / v cache float16 [kv_heads, plane, d] of this slot and
  // layer, plane (columns per kv head), visible [rows, kv_len] uint8 or NULL (every column < kv_len), kv_len,
  // scale, out [rows, ldo] float32 (a row's heads at out + row * ldo), ldo, rows int32 [nq], hs int32 [nq], nq);
  // queries that share a kv head share the float16 conversion of the keys and values all of them see
  void (*attention)(const float*, int64_t, int64_t, int64_t, int64_t, const uint16_t*, const uint16_t*, int64_t,
                    const uint8_t*, int64_t, float, float*, int64_t, const int32_t*, const int32_t*, int64_t);
  // out [n] = w * x * rsqrt(mean(x^2) + eps)  (one row)
  void (*rmsnorm)(const float*, const float*, int64_t, float, float*);
  // out [n] = silu(g) * u
  void (*silu_mul)(const float*, const float*, int64_t, float*);
  // float32 [n] -> float16 [n] (round to nearest even)
  void (*to_f16)(const float*, uint16_t*, int64_t);
} SdTable;

// One weight of a fused product (q / k / v, gate / up) for the extension's q_product_parts (lowbit.cpp): GGUF
// blocks of format fmt, n_out rows of ldw bytes, written to out[r * ldo + n] (out: the part's first column)
typedef struct {
  const uint8_t* w;
  int64_t n_out, ldw, fmt;
  float* out;
} SdPart;
