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
// in one fixed order (two float32 accumulators per row and column, added at the end) that depends
// neither on how many rows share the call nor on how rows and columns are blocked or split across
// threads (threads split n, never k).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <type_traits>

namespace {

// out[r, c] for R rows and C consecutive output columns. Every (row, column) pair owns two float32
// accumulators (the two halves of each group, or even / odd groups of 16 for int8 groups of 16),
// updated group after group and added at the end: the same operations for any R and C, so blocking
// rows and columns differently (by row count, at a thread's last columns) never changes a result.
template <int R, int C>
void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const float* s, const float* o,
                int64_t groups, float* out, int64_t ldo) {
  __m512 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      // the group's 16 possible weights fma(q, scale, offset), q = 0..15, then a table lookup per
      // element (vpermps reads the low 4 bits of each index: the low nibble as it is)
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[c * groups + g]), _mm512_set1_ps(o[c * groups + g]));
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * ldw + 16 * g)));
      w0[c] = _mm512_permutexvar_ps(b, table);
      w1[c] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * ldx + 32 * g), x1 = _mm512_loadu_ps(x + r * ldx + 32 * g + 16);
      for (int c = 0; c < C; ++c) {
        acc[r][c][0] = _mm512_fmadd_ps(w0[c], x0, acc[r][c][0]);
        acc[r][c][1] = _mm512_fmadd_ps(w1[c], x1, acc[r][c][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
}

template <int R, int C, int G>
void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t ldw, const float* s, int64_t groups,
                float* out, int64_t ldo) {
  __m512 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
  // i: a run of 16 weights, into accumulator i % 2 (a compile-time index: the accumulators stay in registers)
  auto run = [&](int64_t i, auto which) {
    constexpr int A = decltype(which)::value;
    __m512 wv[C];
    for (int c = 0; c < C; ++c) {
      const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * ldw + 16 * i)));
      wv[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(s[c * groups + i / (G / 16)]));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + 16 * i);
      for (int c = 0; c < C; ++c) acc[r][c][A] = _mm512_fmadd_ps(wv[c], xv, acc[r][c][A]);
    }
  };
  const int64_t runs = groups * (G / 16);
  int64_t i = 0;
  for (; i + 1 < runs; i += 2) {
    run(i, std::integral_constant<int, 0>{});
    run(i + 1, std::integral_constant<int, 1>{});
  }
  if (i < runs) run(i, std::integral_constant<int, 0>{});
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][c][0], acc[r][c][1]));
}

// Rows per pass and columns per block: few rows take several columns at once (more independent
// accumulators, each activation load shared), many rows one column (the accumulators fit the 32
// registers). Passes of up to 8 rows.
template <typename Block>
void over_blocks(int64_t rows, int64_t n_out, Block block) {
  const int64_t grain = std::max<int64_t>(16, n_out / (8 * at::get_num_threads()) + 1);
  at::parallel_for(0, n_out, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int64_t r = std::min<int64_t>(8, rows - r0);
      const int64_t c = r <= 2 ? 4 : (r <= 4 ? 2 : 1);
      int64_t n = n0;
      for (; n + c <= n1; n += c) block(n, r0, r, c);
      for (; n < n1; ++n) block(n, r0, r, 1);
    }
  });
}

#define SPECDECODE_BLOCKS(CALL)                                          \
  switch (r * 8 + c) {                                                   \
    case 1 * 8 + 4: CALL(1, 4); break;                                   \
    case 2 * 8 + 4: CALL(2, 4); break;                                   \
    case 3 * 8 + 2: CALL(3, 2); break;                                   \
    case 4 * 8 + 2: CALL(4, 2); break;                                   \
    case 1 * 8 + 1: CALL(1, 1); break;                                   \
    case 2 * 8 + 1: CALL(2, 1); break;                                   \
    case 3 * 8 + 1: CALL(3, 1); break;                                   \
    case 4 * 8 + 1: CALL(4, 1); break;                                   \
    case 5 * 8 + 1: CALL(5, 1); break;                                   \
    case 6 * 8 + 1: CALL(6, 1); break;                                   \
    case 7 * 8 + 1: CALL(7, 1); break;                                   \
    default: CALL(8, 1); break;                                          \
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
  over_blocks(rows, n_out, [&](int64_t n, int64_t r0, int64_t r, int64_t c) {
    const float* xr = xp + r0 * k;
    const uint8_t* wn = wp + n * (k / 2);
    const float *sn = sp + n * groups, *on = op + n * groups;
    float* o = outp + r0 * n_out + n;
#define SPECDECODE_INT4(R, C) int4_block<R, C>(xr, k, wn, k / 2, sn, on, groups, o, n_out)
    SPECDECODE_BLOCKS(SPECDECODE_INT4)
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
  over_blocks(rows, n_out, [&](int64_t n, int64_t r0, int64_t r, int64_t c) {
    const float* xr = xp + r0 * k;
    const int8_t* wn = wp + n * k;
    const float* sn = sp + n * groups;
    float* o = outp + r0 * n_out + n;
    if (group == 16) {
#define SPECDECODE_INT8(R, C) int8_block<R, C, 16>(xr, k, wn, k, sn, groups, o, n_out)
      SPECDECODE_BLOCKS(SPECDECODE_INT8)
#undef SPECDECODE_INT8
    } else {
#define SPECDECODE_INT8(R, C) int8_block<R, C, 32>(xr, k, wn, k, sn, groups, o, n_out)
      SPECDECODE_BLOCKS(SPECDECODE_INT8)
#undef SPECDECODE_INT8
    }
  });
  return out;
}

void register_step(py::module_& m);  // step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_step(m);
  m.def("int4_linear", &int4_linear, "x [rows, in] float32 @ int4 groups-of-32 weight [out, in].T");
  m.def("int8_linear", &int8_linear, "x [rows, in] float32 @ int8 groups-of-16/32 weight [out, in].T");
}
