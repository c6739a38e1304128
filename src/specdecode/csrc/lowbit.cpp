// Weight-only low-bit products for decoding and verification on x86 CPUs with AVX-512.
//
// out[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (one decoding step: 1; a verification:
// gamma + 1; a batch: rows x tokens), where w is stored as GGUF-style groups of consecutive k:
//   int4:  w = scale[n, g] * q + offset[n, g], q in 0..15, group of 32 (16 bytes: byte j holds
//          element j in its low nibble and element j + 16 in its high nibble);
//   int8:  w = scale[n, g] * q, q in -128..127, group of 16 or 32.
// Every weight byte is read once per call, whatever the number of rows; each group is expanded
// to float32 in registers and multiplied into every row's accumulators.
//
// Row invariance (what keeps speculative output equal to plain decoding): out[m, n] is accumulated
// in one fixed order (four float32 accumulators per row and column, added in a fixed order at the
// end) that depends neither on how many rows share the call nor on how rows are blocked or how the
// columns are split across threads (threads split n, never k).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <type_traits>

namespace {

// out[r, n] for R rows of one output column n. Every row owns four float32 accumulators (even /
// odd group x first / second half of the group), updated group after group and added in a fixed
// order at the end: the same operations whatever R, so passing rows in blocks of any size never
// changes a result. One column at a time keeps three memory streams per thread (weights, scales,
// offsets), which the hardware prefetchers follow; interleaving several columns' streams was
// slower on the 1.5B's large matrices.
template <int R>
void int4_block(const float* x, int64_t ldx, const uint8_t* w, const float* s, const float* o, int64_t groups,
                float* out, int64_t ldo) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // one group into accumulators P, P + 1 (a compile-time pair, so the accumulators stay in registers)
  auto group = [&](int64_t g, auto pair) {
    constexpr int P = decltype(pair)::value;
    // the group's 16 possible weights fma(q, scale, offset), q = 0..15, then a table lookup per
    // element (vpermps reads the low 4 bits of each index: the low nibble as it is)
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[g]), _mm512_set1_ps(o[g]));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * g)));
    const __m512 w0 = _mm512_permutexvar_ps(b, table);
    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    const float* xg = x + 32 * g;
    for (int r = 0; r < R; ++r) {
      acc[r][P] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xg + r * ldx), acc[r][P]);
      acc[r][P + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xg + r * ldx + 16), acc[r][P + 1]);
    }
  };
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    group(g, std::integral_constant<int, 0>{});
    group(g + 1, std::integral_constant<int, 2>{});
  }
  if (g < groups) group(g, std::integral_constant<int, 0>{});
  for (int r = 0; r < R; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

template <int R, int G>
void int8_block(const float* x, int64_t ldx, const int8_t* w, const float* s, int64_t groups, float* out,
                int64_t ldo) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  // run i of 16 weights into accumulator A (compile-time): i % 4
  auto run = [&](int64_t i, auto which) {
    constexpr int A = decltype(which)::value;
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * i)));
    const __m512 wv = _mm512_mul_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(s[i / (G / 16)]));
    for (int r = 0; r < R; ++r) acc[r][A] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * ldx + 16 * i), acc[r][A]);
  };
  const int64_t runs = groups * (G / 16);
  int64_t i = 0;
  for (; i + 3 < runs; i += 4) {
    run(i, std::integral_constant<int, 0>{});
    run(i + 1, std::integral_constant<int, 1>{});
    run(i + 2, std::integral_constant<int, 2>{});
    run(i + 3, std::integral_constant<int, 3>{});
  }
  for (; i < runs; ++i) run(i, std::integral_constant<int, 0>{});
  for (int r = 0; r < R; ++r)
    out[r * ldo] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

constexpr int kRowsPerPass = 5;  // 4 accumulators per row: 20 registers, with the weights and tables 26 of 32

// Threads split the output columns; every column runs its rows in passes of kRowsPerPass.
template <typename Block>
void over_blocks(int64_t rows, int64_t n_out, Block block) {
  const int64_t grain = std::max<int64_t>(16, n_out / (8 * at::get_num_threads()) + 1);
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) block(n, r0, std::min<int64_t>(kRowsPerPass, rows - r0));
  });
}

#define SPECDECODE_ROWS(CALL) \
  switch (r) {                \
    case 1: CALL(1); break;   \
    case 2: CALL(2); break;   \
    case 3: CALL(3); break;   \
    case 4: CALL(4); break;   \
    default: CALL(5); break;  \
  }

void check_x(const torch::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in_features] tensor");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " features, the weight ", k);
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor offsets) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous(), "qweight: contiguous uint8 [out, in/2]");
  const int64_t n_out = qweight.size(0), k = qweight.size(1) * 2, groups = k / 32;
  check_x(x, k);
  TORCH_CHECK(k % 32 == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(scales.is_contiguous() && offsets.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
              offsets.scalar_type() == torch::kFloat32 && scales.numel() == n_out * groups && offsets.numel() == n_out * groups,
              "scales / offsets: contiguous float32 [out, in/32]");
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *op = offsets.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  over_blocks(rows, n_out, [&](int64_t n, int64_t r0, int64_t r) {
    const float* xr = xp + r0 * k;
    const uint8_t* wn = wp + n * (k / 2);
    const float *sn = sp + n * groups, *on = op + n * groups;
    float* o = outp + r0 * n_out + n;
#define SPECDECODE_INT4(R) int4_block<R>(xr, k, wn, sn, on, groups, o, n_out)
    SPECDECODE_ROWS(SPECDECODE_INT4)
#undef SPECDECODE_INT4
  });
  return out;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t group) {
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(), "qweight: contiguous int8 [out, in]");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  const int64_t n_out = qweight.size(0), k = qweight.size(1), groups = k / group;
  check_x(x, k);
  TORCH_CHECK(k % group == 0, "in_features must be a multiple of the group");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == n_out * groups,
              "scales: contiguous float32 [out, in/group]");
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  over_blocks(rows, n_out, [&](int64_t n, int64_t r0, int64_t r) {
    const float* xr = xp + r0 * k;
    const int8_t* wn = wp + n * k;
    const float* sn = sp + n * groups;
    float* o = outp + r0 * n_out + n;
    if (group == 16) {
#define SPECDECODE_INT8(R) int8_block<R, 16>(xr, k, wn, sn, groups, o, n_out)
      SPECDECODE_ROWS(SPECDECODE_INT8)
#undef SPECDECODE_INT8
    } else {
#define SPECDECODE_INT8(R) int8_block<R, 32>(xr, k, wn, sn, groups, o, n_out)
      SPECDECODE_ROWS(SPECDECODE_INT8)
#undef SPECDECODE_INT8
    }
  });
  return out;
}

// The float32 weights [out, in] of int4 / int8 groups (a prompt's prefill: one dequantization,
// then one many-row matrix product), with the kernel's own arithmetic: fma(q, scale, offset).
torch::Tensor int4_dequantize(torch::Tensor qweight, torch::Tensor scales, torch::Tensor offsets) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous(), "qweight: contiguous uint8 [out, in/2]");
  const int64_t n_out = qweight.size(0), k = qweight.size(1) * 2, groups = k / 32;
  TORCH_CHECK(scales.is_contiguous() && offsets.is_contiguous() && scales.numel() == n_out * groups &&
              offsets.numel() == n_out * groups && scales.scalar_type() == torch::kFloat32 &&
              offsets.scalar_type() == torch::kFloat32, "scales / offsets: contiguous float32 [out, in/32]");
  auto out = torch::empty({n_out, k}, torch::kFloat32);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float *sp = scales.data_ptr<float>(), *op = offsets.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  at::parallel_for(0, n_out * groups, 1024, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // i = n * groups + g
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(sp[i]), _mm512_set1_ps(op[i]));
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * i)));
      _mm512_storeu_ps(outp + 32 * i, _mm512_permutexvar_ps(b, table));
      _mm512_storeu_ps(outp + 32 * i + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table));
    }
  });
  return out;
}

torch::Tensor int8_dequantize(torch::Tensor qweight, torch::Tensor scales, int64_t group) {
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(), "qweight: contiguous int8 [out, in]");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  const int64_t n_out = qweight.size(0), k = qweight.size(1), runs = n_out * k / 16;
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == n_out * k / group,
              "scales: contiguous float32 [out, in/group]");
  auto out = torch::empty({n_out, k}, torch::kFloat32);
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  at::parallel_for(0, runs, 2048, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // i: a run of 16 weights (groups never straddle a row)
      const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * i)));
      _mm512_storeu_ps(outp + 16 * i, _mm512_mul_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(sp[i * 16 / group])));
    }
  });
  return out;
}

void register_step(py::module_& m);  // step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_step(m);
  m.def("int4_dequantize", &int4_dequantize, "float32 [out, in] weights of int4 groups of 32");
  m.def("int8_dequantize", &int8_dequantize, "float32 [out, in] weights of int8 groups");
  m.def("int4_linear", &int4_linear, "x [rows, in] float32 @ int4 groups-of-32 weight [out, in].T");
  m.def("int8_linear", &int8_linear, "x [rows, in] float32 @ int8 groups-of-16/32 weight [out, in].T");
}
