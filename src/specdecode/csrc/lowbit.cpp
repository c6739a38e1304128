// The torch side of the low-bit products: activation quantization, the thread split and the
// dequantization, around the instruction-set variant of csrc/qgemm.c that the caller picked.
//
// This file holds no intrinsics: it builds with the compiler's default flags on any x86-64 CPU.
// The variant's function table (qgemm.c's sd_table(), loaded by specdecode/lowbit_kernels.py) arrives as an
// address with every call, so tests and benchmarks can run any variant the CPU executes side by side.
//
// Products split the output columns over threads, never the rows or the reduction: a (row, column) result is
// computed by one thread in the order qgemm.c fixes, whatever the thread count and the row count. (Work that stays
// within one row, such as quantizing it, may go to any one thread: the row is that thread's alone.)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and its at::Tensor caster (torch/extension.h: 2-3x the compile time)
#include <ATen/Parallel.h>

#include <vector>

#include <tuple>

#include "qtable.h"

namespace {

constexpr int kFormats = 6;
constexpr int kBlockBytes[kFormats] = {18, 20, 22, 34, 144, 210};  // Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q6_K
constexpr int kBlockSize[kFormats] = {32, 32, 32, 32, 256, 256};

const SdTable* table_of(int64_t address) {
  TORCH_CHECK(address != 0, "no low-bit kernel variant loaded");
  const auto* t = reinterpret_cast<const SdTable*>(address);
  TORCH_CHECK(t->version == SD_TABLE_VERSION, "low-bit kernel table version ", t->version, ", expected ",
              SD_TABLE_VERSION, " (a kernel compiled from another source)");
  return t;
}

void check_weight(const at::Tensor& w, int64_t fmt, int64_t k) {
  TORCH_CHECK(fmt >= 0 && fmt < kFormats, "unknown block format ", fmt);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "weight: contiguous uint8 [out, bytes per row]");
  TORCH_CHECK(k % kBlockSize[fmt] == 0 && w.size(1) == k / kBlockSize[fmt] * kBlockBytes[fmt],
              "weight rows hold ", w.size(1), " bytes; ", k, " inputs of this format take ",
              k / kBlockSize[fmt] * kBlockBytes[fmt]);
}

}  // namespace

const SdTable* sd_table_at(int64_t address) { return table_of(address); }

// What a fused product multiplies: its inputs k and the activation block sizes its parts need (32-weight formats:
// act32; K-quants: act256)
struct SdInput {
  int64_t k = 0;
  bool need32 = false, need256 = false;
};

SdInput sd_input_of(const SdPart* parts, int64_t nparts, int64_t k) {
  SdInput in;
  in.k = k;
  for (int64_t i = 0; i < nparts; ++i) (kBlockSize[parts[i].fmt] == 32 ? in.need32 : in.need256) = true;
  return in;
}

// The 8-bit activations of a fused product's input rows [rows, k]. Sized once for the most rows and inputs of a
// forward; each row is quantized alone (the same bits whichever thread does it, and whatever rows share the call).
struct SdActs {
  std::vector<int8_t> q32, q256;
  std::vector<float> d32, s32, d256;
  std::vector<int16_t> b256;

  // room for rows of up to most_k inputs in the block sizes asked for
  void reserve(int64_t rows, int64_t most_k, bool need32, bool need256) {
    const size_t n = static_cast<size_t>(rows * most_k);
    if (need32 && q32.size() < n) q32.resize(n), d32.resize(n / 32), s32.resize(n / 32);
    if (need256 && q256.size() < n) q256.resize(n), d256.resize(n / 256 + 1), b256.resize(n / 16);
  }
  // rows [r0, r1) of x [rows, in.k]
  void quantize_rows(const SdTable* t, const SdInput& in, const float* x, int64_t r0, int64_t r1) {
    const int64_t k = in.k;
    if (r1 <= r0) return;
    if (in.need32)
      t->quantize32(x + r0 * k, r1 - r0, k, q32.data() + r0 * k, d32.data() + r0 * (k / 32), s32.data() + r0 * (k / 32));
    if (in.need256)
      t->quantize256(x + r0 * k, r1 - r0, k, q256.data() + r0 * k, d256.data() + r0 * (k / 256),
                     b256.data() + r0 * (k / 16));
  }
};

// Tiles of 8 columns over all parts of a fused product (threads split whole tiles; a part's last one may be shorter)
int64_t sd_tile_count(const SdPart* parts, int64_t nparts) {
  int64_t tiles = 0;
  for (int64_t i = 0; i < nparts; ++i) tiles += (parts[i].n_out + 7) / 8;
  return tiles;
}

// Tiles [t0, t1) of the parts (numbered part after part) for rows < rows, from the quantized activations a
void sd_product_tiles(const SdTable* t, const SdActs& a, int64_t k, int64_t rows, const SdPart* parts, int64_t nparts, int64_t ldo,
                      int64_t t0, int64_t t1) {
  int64_t first = 0;
  for (int64_t i = 0; i < nparts && first < t1; ++i) {
    const SdPart& p = parts[i];
    const int64_t count = (p.n_out + 7) / 8;
    const int64_t s = std::max(t0, first) - first, e = std::min(t1, first + count) - first;
    first += count;
    if (s >= e) continue;
    const int64_t n0 = 8 * s, n1 = std::min<int64_t>(p.n_out, 8 * e);
    if (kBlockSize[p.fmt] == 32)
      t->gemm32(static_cast<int>(p.fmt), p.w, p.ldw, k, a.q32.data(), a.d32.data(), a.s32.data(), rows, p.out, ldo,
                n0, n1, p.n_out);
    else
      t->gemmk(static_cast<int>(p.fmt), p.w, p.ldw, k, a.q256.data(), a.d256.data(), a.b256.data(), rows, p.out, ldo,
               n0, n1, p.n_out);
  }
}

// out[r * ldo + n] = x[r] . w[n] for every part, rows r < rows, n < n_out: the activations quantized once per
// block size (32-weight formats, K-quants), then one thread split over the tiles of all parts together: one
// parallel region per fused product instead of one per weight (SmolLM2's k / v weights are 24 tiles each: the
// region's start and end cost about what their products do). A (row, column) result is one thread's, in the
// order qgemm.c fixes, whatever the split: the same bits as each part alone. (The C++ layer loop runs the same
// pieces, SdActs and sd_product_tiles, inside its one parallel region per forward: step.cpp.)
void q_product_parts(const SdTable* t, const float* x, int64_t rows, int64_t k, const SdPart* parts, int64_t nparts,
                     int64_t ldo) {
  const SdInput in = sd_input_of(parts, nparts, k);
  SdActs a;
  a.reserve(rows, k, in.need32, in.need256);
  a.quantize_rows(t, in, x, 0, rows);
  const int64_t tiles = sd_tile_count(parts, nparts), grain = std::max<int64_t>(1, tiles / (8 * at::get_num_threads()) + 1);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) { sd_product_tiles(t, a, k, rows, parts, nparts, ldo, t0, t1); });
}

// out[r * ldo + n] = x[r] . w[n] for rows r < rows, n < n_out (q_product_parts of one weight)
void q_product(const SdTable* t, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n_out,
               int64_t ldw, int64_t fmt, float* out, int64_t ldo) {
  const SdPart part{w, n_out, ldw, fmt, out};
  q_product_parts(t, x, rows, k, &part, 1, ldo);
}

// x [rows, k] float32 -> the 8-bit activations the format multiplies:
//   32-blocks: (q [rows, k] int8, d [rows, k/32] float32, s [rows, k/32] float32 = d * sum q)
//   K-quants:  (q [rows, k] int8, d [rows, k/256] float32, bsums [rows, k/16] int16)
std::tuple<at::Tensor, at::Tensor, at::Tensor> q_quantize(at::Tensor x, int64_t fmt, int64_t table) {
  const SdTable* t = table_of(table);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in_features] tensor");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(fmt >= 0 && fmt < kFormats && k % kBlockSize[fmt] == 0, "in_features ", k, " does not fit the format");
  auto q = at::empty({rows, k}, at::kChar);
  if (kBlockSize[fmt] == 32) {
    auto d = at::empty({rows, k / 32}, at::kFloat), s = at::empty({rows, k / 32}, at::kFloat);
    t->quantize32(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
    return {q, d, s};
  }
  auto d = at::empty({rows, k / 256}, at::kFloat), b = at::empty({rows, k / 16}, at::kShort);
  t->quantize256(x.data_ptr<float>(), rows, k, q.data_ptr<int8_t>(), d.data_ptr<float>(), b.data_ptr<int16_t>());
  return {q, d, b};
}

// x [rows, k] float32 @ w.T -> [rows, out] float32, w: GGUF blocks of ``fmt``, [out, bytes per row]
at::Tensor q_linear(at::Tensor x, at::Tensor w, int64_t fmt, int64_t table) {
  const SdTable* t = table_of(table);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in_features] tensor");
  const int64_t k = x.size(1);
  check_weight(w, fmt, k);
  const int64_t rows = x.size(0), n_out = w.size(0);
  auto out = at::empty({rows, n_out}, at::kFloat);
  q_product(t, x.data_ptr<float>(), rows, k, w.data_ptr<uint8_t>(), n_out, w.size(1), fmt, out.data_ptr<float>(), n_out);
  return out;
}

// x [rows, k] float32 @ the weights side by side -> [rows, sum of outs] float32: one fused product (the C++ layer
// loop's q / k / v and gate / up: q_product_parts), for tests against q_linear of each weight
at::Tensor q_linear_parts(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> fmts, int64_t table) {
  const SdTable* t = table_of(table);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [rows, in_features] tensor");
  TORCH_CHECK(!ws.empty() && ws.size() == fmts.size(), "one format per weight");
  const int64_t k = x.size(1), rows = x.size(0);
  int64_t width = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(ws[i], fmts[i], k);
    width += ws[i].size(0);
  }
  auto out = at::empty({rows, width}, at::kFloat);
  std::vector<SdPart> parts;
  int64_t col = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    parts.push_back({ws[i].data_ptr<uint8_t>(), ws[i].size(0), ws[i].size(1), fmts[i], out.data_ptr<float>() + col});
    col += ws[i].size(0);
  }
  q_product_parts(t, x.data_ptr<float>(), rows, k, parts.data(), static_cast<int64_t>(parts.size()), width);
  return out;
}

// float32 [out, k] weights of GGUF blocks (what gguf.dequantize gives, in float32 arithmetic)
at::Tensor q_dequantize(at::Tensor w, int64_t fmt, int64_t k, int64_t table) {
  const SdTable* t = table_of(table);
  check_weight(w, fmt, k);
  const int64_t n_out = w.size(0);
  auto out = at::empty({n_out, k}, at::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n_out, 64, [&](int64_t n0, int64_t n1) {
    t->dequantize(static_cast<int>(fmt), wp, w.size(1), k, op + n0 * k, n0, n1, n_out);
  });
  return out;
}

std::string q_variant(int64_t table) { return table_of(table)->name; }

void register_step(py::module_& m);  // step.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_step(m);
  m.def("q_linear", &q_linear, "x [rows, in] float32 @ GGUF-block weight [out, bytes].T -> [rows, out] float32",
        py::call_guard<py::gil_scoped_release>());
  m.def("q_linear_parts", &q_linear_parts, "x [rows, in] float32 @ several GGUF-block weights side by side (one fused "
        "product) -> [rows, sum of outs] float32", py::call_guard<py::gil_scoped_release>());
  m.def("q_quantize", &q_quantize, "x [rows, in] float32 -> (int8 q, scales, sums) as the format multiplies");
  m.def("q_dequantize", &q_dequantize, "float32 [out, in] of GGUF-block weights");
  m.def("q_variant", &q_variant, "the name of a kernel table's instruction-set variant");
}
