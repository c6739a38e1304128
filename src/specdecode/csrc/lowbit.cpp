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

#include <optional>
#include <type_traits>

namespace {

// Where a group's scale (and offset) come from, per output column: float32 or float16 values per
// group, or two levels as in GGUF's k-quants: an integer per group times a float32 per super-block
// of `per` groups (computed here in float32 exactly as the dequantizer computes it: one rounding).
struct F32Scales {
  const float *s, *o;
  int64_t ld;
  float scale(int c, int64_t g) const { return s[c * ld + g]; }
  float offset(int c, int64_t g) const { return o[c * ld + g]; }
};
struct F16Scales {
  const uint16_t *s, *o;
  int64_t ld;
  float scale(int c, int64_t g) const { return _cvtsh_ss(s[c * ld + g]); }
  float offset(int c, int64_t g) const { return _cvtsh_ss(o[c * ld + g]); }
};
template <typename Int>
struct KScales {
  const Int *sc, *m;  // per group
  const float *d, *dmin;  // per super-block
  int64_t ld, ld_super, per;
  float scale(int c, int64_t g) const { return d[c * ld_super + g / per] * static_cast<float>(sc[c * ld + g]); }
  float offset(int c, int64_t g) const { return -(dmin[c * ld_super + g / per] * static_cast<float>(m[c * ld + g])); }
};

// out[r, c] for R rows and C consecutive output columns. Every (row, column) pair owns two float32
// accumulators (the two halves of each group, or even / odd groups of 16 for int8 groups of 16),
// updated group after group and added at the end: the same operations for any R and C, so blocking
// rows and columns differently (by row count, at a thread's last columns) never changes a result.
template <int R, int C, typename Scales>
void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, const Scales& sc, int64_t groups,
                float* out, int64_t ldo) {
  __m512 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 w0[C], w1[C];
    for (int c = 0; c < C; ++c) {
      // the group's 16 possible weights fma(q, scale, offset), q = 0..15, then a table lookup per
      // element (vpermps reads the low 4 bits of each index: the low nibble as it is)
      const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc.scale(c, g)), _mm512_set1_ps(sc.offset(c, g)));
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

template <int R, int C, int G, typename Scales>
void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t ldw, const Scales& sc, int64_t groups,
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
      wv[c] = _mm512_mul_ps(_mm512_cvtepi32_ps(b), _mm512_set1_ps(sc.scale(c, i / (G / 16))));
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

void check_scales(const torch::Tensor& t, int64_t n_out, int64_t groups, const char* what) {
  TORCH_CHECK(t.is_contiguous() && t.dim() == 2 && t.size(0) == n_out && t.size(1) == groups, what,
              ": a contiguous [out, groups] tensor");
}

// Runs `body(scales)` with the accessor the scale tensors call for, at output column n.
template <typename Body>
void with_scales(const torch::Tensor& scales, const torch::Tensor& offsets, const std::optional<torch::Tensor>& d,
                 const std::optional<torch::Tensor>& dmin, int64_t n, int64_t groups, Body body) {
  const auto kind = scales.scalar_type();
  if (d) {
    const int64_t ld_super = d->size(1), per = groups / ld_super;
    if (kind == torch::kUInt8) {
      body(KScales<uint8_t>{scales.data_ptr<uint8_t>() + n * groups, offsets.data_ptr<uint8_t>() + n * groups,
                            d->data_ptr<float>() + n * ld_super, dmin->data_ptr<float>() + n * ld_super, groups,
                            ld_super, per});
    } else {
      body(KScales<int8_t>{scales.data_ptr<int8_t>() + n * groups, scales.data_ptr<int8_t>() + n * groups,
                           d->data_ptr<float>() + n * ld_super, d->data_ptr<float>() + n * ld_super, groups, ld_super,
                           per});
    }
  } else if (kind == torch::kFloat16) {
    const auto* o = reinterpret_cast<const uint16_t*>(offsets.data_ptr<at::Half>());
    body(F16Scales{reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()) + n * groups, o + n * groups, groups});
  } else {
    body(F32Scales{scales.data_ptr<float>() + n * groups, offsets.data_ptr<float>() + n * groups, groups});
  }
}

void check_kinds(const torch::Tensor& scales, const torch::Tensor& offsets, const std::optional<torch::Tensor>& d,
                 const std::optional<torch::Tensor>& dmin, int64_t n_out, int64_t groups, bool int8) {
  check_scales(scales, n_out, groups, "scales");
  check_scales(offsets, n_out, groups, "offsets");
  if (d) {
    TORCH_CHECK(scales.scalar_type() == (int8 ? torch::kInt8 : torch::kUInt8), "two-level scales: ",
                int8 ? "int8" : "uint8", " per group");
    TORCH_CHECK(offsets.scalar_type() == scales.scalar_type(), "two-level offsets: the scales' dtype");
    TORCH_CHECK(d->scalar_type() == torch::kFloat32 && d->is_contiguous() && d->dim() == 2 && d->size(0) == n_out &&
                    d->size(1) > 0 && groups % d->size(1) == 0, "super-block scales: contiguous float32 [out, super-blocks]");
    TORCH_CHECK(dmin && dmin->scalar_type() == torch::kFloat32 && dmin->sizes() == d->sizes() && dmin->is_contiguous(),
                "super-block offsets: like the super-block scales");
  } else {
    TORCH_CHECK((scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kFloat16) &&
                    offsets.scalar_type() == scales.scalar_type(), "scales / offsets: float32 or float16");
  }
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor offsets,
                          std::optional<torch::Tensor> d, std::optional<torch::Tensor> dmin) {
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous(), "qweight: contiguous uint8 [out, in/2]");
  const int64_t n_out = qweight.size(0), k = qweight.size(1) * 2, groups = k / 32;
  check_x(x, k);
  TORCH_CHECK(k % 32 == 0, "in_features must be a multiple of 32");
  check_kinds(scales, offsets, d, dmin, n_out, groups, false);
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* outp = out.data_ptr<float>();
  over_blocks(rows, n_out, [&](int64_t n, int64_t r0, int64_t r, int64_t c) {
    const float* xr = xp + r0 * k;
    const uint8_t* wn = wp + n * (k / 2);
    float* o = outp + r0 * n_out + n;
    with_scales(scales, offsets, d, dmin, n, groups, [&](const auto& sc) {
#define SPECDECODE_INT4(R, C) int4_block<R, C>(xr, k, wn, k / 2, sc, groups, o, n_out)
      SPECDECODE_BLOCKS(SPECDECODE_INT4)
#undef SPECDECODE_INT4
    });
  });
  return out;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t group,
                          std::optional<torch::Tensor> d) {
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.is_contiguous(), "qweight: contiguous int8 [out, in]");
  TORCH_CHECK(group == 16 || group == 32, "group must be 16 or 32");
  const int64_t n_out = qweight.size(0), k = qweight.size(1), groups = k / group;
  check_x(x, k);
  TORCH_CHECK(k % group == 0, "in_features must be a multiple of the group");
  check_kinds(scales, scales, d, d, n_out, groups, true);
  const int64_t rows = x.size(0);
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = qweight.data_ptr<int8_t>();
  float* outp = out.data_ptr<float>();
  over_blocks(rows, n_out, [&](int64_t n, int64_t r0, int64_t r, int64_t c) {
    const float* xr = xp + r0 * k;
    const int8_t* wn = wp + n * k;
    float* o = outp + r0 * n_out + n;
    with_scales(scales, scales, d, d, n, groups, [&](const auto& sc) {
      if (group == 16) {
#define SPECDECODE_INT8(R, C) int8_block<R, C, 16>(xr, k, wn, k, sc, groups, o, n_out)
        SPECDECODE_BLOCKS(SPECDECODE_INT8)
#undef SPECDECODE_INT8
      } else {
#define SPECDECODE_INT8(R, C) int8_block<R, C, 32>(xr, k, wn, k, sc, groups, o, n_out)
        SPECDECODE_BLOCKS(SPECDECODE_INT8)
#undef SPECDECODE_INT8
      }
    });
  });
  return out;
}

void register_step(py::module_& m);  // step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_step(m);
  m.def("int4_linear", &int4_linear, "x [rows, in] float32 @ int4 groups-of-32 weight [out, in].T",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("offsets"), py::arg("d") = py::none(),
        py::arg("dmin") = py::none());
  m.def("int8_linear", &int8_linear, "x [rows, in] float32 @ int8 groups-of-16/32 weight [out, in].T",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("group"), py::arg("d") = py::none());
}
