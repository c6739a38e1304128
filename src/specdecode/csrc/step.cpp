// The decoder-layer loop of the owned forward (specdecode/kv/owned.py, OwnedRunner._run) as one C++
// call per forward, without the Python loop's per-operation interpreter and dispatch cost (about 35
// tensor calls per layer: on a 135M model that is half a decoding step).
//   run:       float weights: the same ATen operations in the same order as the Python loop (the
//              same bits);
//   run_fused: GGUF-block weights: every layer on raw buffers with csrc/qgemm.c's kernels, each row
//              in one fixed order (its own arithmetic: 8-bit activations, a float16 KV cache), the whole
//              forward in one parallel region (threads meet at spin barriers between phases).
// Built with lowbit.cpp into one extension (specdecode/lowbit_kernels.py compiles and caches it).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 and its at::Tensor caster (torch/extension.h: 2-3x the compile time)
#include <pybind11/stl.h>

#include <ATen/Parallel.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "qtable.h"

const SdTable* sd_table_at(int64_t address);                                             // lowbit.cpp
// lowbit.cpp (the same translation unit, csrc/extension.cpp): SdInput, SdActs (a product's 8-bit activations, quantized
// row by row), sd_tile_count and sd_product_tiles (a range of a fused product's tiles)

namespace {

constexpr int64_t kRowBlock = 16;  // kernels.ROW_BLOCK

struct Part {
  int64_t kind = 0;  // 0: float weight [out, in]; 1: GGUF blocks [out, bytes per row]
  at::Tensor a;   // the weight
  int64_t fmt = 0, in = 0, table = 0;  // kind 1: block format, in_features, kernel table address
  std::optional<at::Tensor> bias;
};

// kernels.row_product("padded", w, x): blocks of exactly kRowBlock rows (zero-padded), F.linear each
at::Tensor padded_product(const at::Tensor& w, const at::Tensor& x) {
  const int64_t m = x.size(0);
  if (m > kRowBlock) {
    std::vector<at::Tensor> blocks;
    for (int64_t i = 0; i < m; i += kRowBlock) blocks.push_back(padded_product(w, x.slice(0, i, std::min(m, i + kRowBlock))));
    return at::cat(blocks);
  }
  at::Tensor xx = x;
  if (m < kRowBlock) xx = at::cat({x, x.new_zeros({kRowBlock - m, x.size(1)})});
  return at::linear(xx, w).slice(0, 0, m);
}

at::Tensor apply_part(const Part& p, const at::Tensor& x, bool padded) {
  if (p.kind == 0) {  // owned._mm on a float tensor
    if (padded) return padded_product(p.a, x);
    if (x.size(0) > 16 || p.a.scalar_type() != at::kFloat) return at::linear(x, p.a);
    return at::mm(p.a, x.t()).t();
  }
  TORCH_CHECK(false, "GGUF-block products run in run_fused, not in run");
  return x;
}

struct Product {
  std::vector<Part> parts;
  at::Tensor operator()(const at::Tensor& x, bool padded) const {
    if (parts.size() == 1) return apply_part(parts[0], x, padded);
    std::vector<at::Tensor> outs;
    for (const auto& p : parts) outs.push_back(apply_part(p, x, padded));
    return at::cat(outs, -1);
  }
};

int64_t product_width(const Product& prod) {
  int64_t w = 0;
  for (const auto& p : prod.parts) w += p.a.size(0);
  return w;
}

bool all_quant(const Product& prod) {
  for (const auto& p : prod.parts)
    if (p.kind != 1) return false;
  return !prod.parts.empty();
}

// rotate-half RoPE of one row's heads in place: x [heads, d], cos / sin [d]
void rope_row(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

struct Layer {
  at::Tensor ln1, ln2;
  std::optional<at::Tensor> qkv_bias;
  Product qkv, o, gate_up, down;
};

// owned._rms_norm
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor out = xf * at::rsqrt(xf.pow(2).mean({-1}, true) + eps);
  return weight * out.to(x.scalar_type());
}

// owned._apply_rope on [heads, n, d]
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor rotated = at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

// A fused product laid out for run_fused's parallel region: its parts (GGUF blocks, written side by side at out
// with row stride ldo), their tile count and the biases added after it (column, width, values)
struct ProductPlan {
  std::vector<SdPart> parts;
  SdInput in;  // inputs and activation block sizes
  int64_t tiles = 0, ldo = 0;
  float* out = nullptr;
  std::vector<std::tuple<int64_t, int64_t, const float*>> biases;
};

ProductPlan plan_product(const Product& prod, float* out, int64_t ldo) {
  ProductPlan pp;
  pp.out = out, pp.ldo = ldo;
  int64_t col = 0;
  for (const auto& p : prod.parts) {
    TORCH_CHECK(p.in == prod.parts[0].in, "the parts of a fused product take the same input");
    pp.parts.push_back({p.a.data_ptr<uint8_t>(), p.a.size(0), p.a.size(1), p.fmt, out + col});
    if (p.bias) pp.biases.emplace_back(col, p.a.size(0), p.bias->data_ptr<float>());
    col += p.a.size(0);
  }
  pp.tiles = sd_tile_count(pp.parts.data(), static_cast<int64_t>(pp.parts.size()));
  pp.in = sd_input_of(pp.parts.data(), static_cast<int64_t>(pp.parts.size()), prod.parts.at(0).in);
  return pp;
}

struct LayerPlan {
  const float *ln1 = nullptr, *ln2 = nullptr, *qkv_bias = nullptr;
  ProductPlan qkv, o, gate_up, down;
  int64_t inter = 0;
};

// The threads of run_fused's parallel region meet here between phases: the last to arrive starts the next
// generation (release), the others spin on it (acquire), so every write before the barrier is seen after it. About
// 0.06 us for 2 threads against about 0.9 us to start and end a parallel region (measured on the Intel Xeon). A
// thread that waits long (more threads than free cores) yields its core.
struct SpinBarrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> generation{0};
  void wait(int threads) {
    if (threads <= 1) return;
    const int g = generation.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) == threads - 1) {
      count.store(0, std::memory_order_relaxed);
      generation.store(g + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation.load(std::memory_order_acquire) == g;) {
      if (spins < 2048) {
        ++spins;
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }
};

// One product part from Python's (kind, weight, fmt, in_features, table, bias) tuple (kv/owned.py _native_parts).
Part part_of(const py::tuple& t) {
  Part p;
  p.kind = t[0].cast<int64_t>();
  p.a = t[1].cast<at::Tensor>();
  if (p.kind == 1) {
    p.fmt = t[2].cast<int64_t>();
    p.in = t[3].cast<int64_t>();
    p.table = t[4].cast<int64_t>();
  }
  if (!t[5].is_none()) p.bias = t[5].cast<at::Tensor>();
  if (p.kind == 1) {
    TORCH_CHECK(p.fmt >= 0 && p.fmt < 6, "unknown block format ", p.fmt);
    TORCH_CHECK(p.a.dim() == 2 && p.a.scalar_type() == at::kByte && p.a.is_contiguous(),
                "GGUF-block weight: contiguous uint8 [out, bytes per row]");
    sd_table_at(p.table);
  }
  return p;
}

}  // namespace

class LayerStack {
 public:
  LayerStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : h_(heads), kvh_(kv_heads), d_(head_dim), eps_(eps) {}

  // parts: a list of (kind, weight, fmt, in_features, table, bias) per product
  void add_layer(at::Tensor ln1, at::Tensor ln2, std::optional<at::Tensor> qkv_bias,
                 std::vector<std::vector<py::tuple>> products) {
    Layer layer{ln1, ln2, qkv_bias, {}, {}, {}, {}};
    Product* slots[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    TORCH_CHECK(products.size() == 4, "a layer has 4 products (qkv, o, gate_up, down)");
    for (int i = 0; i < 4; ++i)
      for (const auto& t : products[i]) slots[i]->parts.push_back(part_of(t));
    layers_.push_back(layer);
  }

  // The final RMSNorm (weight [hidden] float32) and the output layer (parts as add_layer's, GGUF blocks only) that
  // run_fused(..., head=true) applies inside its parallel region. Called again when the output layer changes (a
  // reduced draft vocabulary); the tensors are kept alive here.
  void set_head(at::Tensor norm, std::vector<py::tuple> parts) {
    TORCH_CHECK(norm.dim() == 1 && norm.scalar_type() == at::kFloat && norm.is_contiguous(),
                "final norm weight: contiguous float32 [hidden]");
    Product head;
    for (const auto& t : parts) head.parts.push_back(part_of(t));
    TORCH_CHECK(!head.parts.empty() && all_quant(head), "the fused output layer runs GGUF-block products only");
    head_norm_ = norm;
    head_ = head;
  }

  // The loop of OwnedRunner._run over every layer (no layer subset, no captured features).
  // x [n, hidden]; cos / sin [n, d]; k_cache / v_cache [layers, slots, kv_heads, columns, d];
  // rows [row0, row1) of the slots; columns [b, q]; start: the first column when b == 1, else -1;
  // attn_mask [b, 1, q, kv_len] bool or None.
  at::Tensor run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                    int64_t row0, int64_t row1, at::Tensor columns, int64_t start,
                    std::optional<at::Tensor> attn_mask, int64_t kv_len, bool attend_in_cache_dtype,
                    bool padded) const {
    const int64_t b = columns.size(0), q = columns.size(1), n = b * q;
    const int64_t h = h_, kvh = kvh_, d = d_;
    at::Tensor row_index = at::arange(b).unsqueeze(1);
    const auto cache_dtype = k_cache.scalar_type();
    const auto att_dtype = attend_in_cache_dtype ? cache_dtype : x.scalar_type();
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor qkv = layer.qkv(rms_norm(x, layer.ln1, eps_), padded);
      if (layer.qkv_bias) qkv = qkv + *layer.qkv_bias;
      auto parts = qkv.split_with_sizes({h * d, kvh * d, kvh * d}, -1);
      at::Tensor qs = rope(parts[0].view({n, h, d}).transpose(0, 1), cos, sin);
      at::Tensor ks = rope(parts[1].view({n, kvh, d}).transpose(0, 1), cos, sin);
      at::Tensor vs = parts[2];
      at::Tensor k_rows = k_cache.select(0, i).slice(0, row0, row1);
      at::Tensor v_rows = v_cache.select(0, i).slice(0, row0, row1);
      at::Tensor queries;
      if (start >= 0) {
        k_rows.select(0, 0).slice(1, start, start + q).copy_(ks);
        v_rows.select(0, 0).slice(1, start, start + q).copy_(vs.view({n, kvh, d}).transpose(0, 1));
        queries = qs.unsqueeze(0);
      } else {
        using at::indexing::Slice;
        k_rows.index_put_({row_index, Slice(), columns},
                          ks.reshape({kvh, b, q, d}).permute({1, 2, 0, 3}).to(cache_dtype));
        v_rows.index_put_({row_index, Slice(), columns}, vs.reshape({b, q, kvh, d}).to(cache_dtype));
        queries = qs.reshape({h, b, q, d}).transpose(0, 1);
      }
      at::Tensor attn = at::scaled_dot_product_attention(
          queries.to(att_dtype), k_rows.slice(2, 0, kv_len).to(att_dtype), v_rows.slice(2, 0, kv_len).to(att_dtype),
          attn_mask, 0.0, false, std::nullopt, h != kvh).to(x.scalar_type());
      x = x + layer.o(attn.transpose(1, 2).reshape({n, h * d}), padded);
      auto gu = layer.gate_up(rms_norm(x, layer.ln2, eps_), padded).chunk(2, -1);
      x = x + layer.down(at::silu(gu[0]) * gu[1], padded);
    }
    return x;
  }

  // Every layer in C++ on raw float32 buffers (low-bit models): the products of lowbit.cpp, RMSNorm,
  // RoPE, attention over a float16 cache and SiLU from the kernel table, each row in one fixed order,
  // so a row's result does not depend on the other rows (batch-invariant by construction).
  // x [n, hidden] float32 (n = b * q); cos / sin [n, d] float32; k_cache / v_cache float16
  // [layers, slots, kv_heads, columns, d]; rows [row0, row0 + b) of the slots; columns [b, q] int64;
  // visible [b, q, kv_len] bool or None (None: causal by column, a row sees the columns up to its own, as
  // kv/base.py causal_mask; every column when each row sits at kv_len - 1); layers: the layers to run
  // (empty: all); capture: after which layers (0 = the input) to keep x; head: also the final RMSNorm and the
  // output layer of set_head, in the same region. Returns [x, kept...], then with head: [normed [n, hidden],
  // logits [n, vocabulary rows]] float32.
  std::vector<at::Tensor> run_fused(at::Tensor x_in, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                                       at::Tensor v_cache, int64_t row0, at::Tensor columns,
                                       std::optional<at::Tensor> visible, int64_t kv_len, int64_t table,
                                       std::vector<int64_t> layers, std::vector<int64_t> capture,
                                       bool head) const {
    const SdTable* t = sd_table_at(table);
    for (int64_t li : layers) TORCH_CHECK(li >= 0 && li < static_cast<int64_t>(layers_.size()), "no layer ", li);
    for (const auto& L : layers_)
      TORCH_CHECK(all_quant(L.qkv) && all_quant(L.o) && all_quant(L.gate_up) && all_quant(L.down),
                  "the fused forward runs GGUF-block products only");
    TORCH_CHECK(columns.dim() == 2 && columns.scalar_type() == at::kLong && columns.is_contiguous(),
                "columns: contiguous int64 [b, q]");
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(0) == columns.numel(), "x: [b * q, hidden]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                sin.is_contiguous() && cos.numel() == columns.numel() * d_ && sin.numel() == cos.numel(),
                "cos / sin: contiguous float32 [b * q, head_dim]");
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() && row0 >= 0 &&
                row0 + columns.size(0) <= k_cache.size(1) && kv_len >= 1 && kv_len <= k_cache.size(3) &&
                columns.max().item<int64_t>() < kv_len && columns.min().item<int64_t>() >= 0,
                "cache rows / columns out of range");
    TORCH_CHECK(!visible || (visible->numel() == columns.numel() * kv_len), "visible: [b, q, kv_len]");
    TORCH_CHECK(k_cache.scalar_type() == at::kHalf && v_cache.scalar_type() == at::kHalf &&
                k_cache.is_contiguous() && v_cache.is_contiguous(), "the fused forward takes a contiguous float16 cache");
    TORCH_CHECK(d_ % 8 == 0 && d_ <= 256, "head_dim must be a multiple of 8, at most 256");
    TORCH_CHECK(kvh_ >= 1 && h_ % kvh_ == 0, "heads (", h_, ") must be a multiple of kv_heads (", kvh_, ")");
    const int64_t b = columns.size(0), q = columns.size(1), n = b * q;
    const int64_t h = h_, kvh = kvh_, d = d_, hidden = x_in.size(1);
    const int64_t slots = k_cache.size(1), plane = k_cache.size(3);
    const int64_t layer_stride = slots * kvh * plane * d, slot_stride = kvh * plane * d;
    at::Tensor xt = x_in.to(at::kFloat).contiguous().clone();
    float* x = xt.data_ptr<float>();
    const float* cs = cos.data_ptr<float>();
    const float* sn = sin.data_ptr<float>();
    const int64_t* col = columns.data_ptr<int64_t>();
    at::Tensor vis_t;
    const uint8_t* vis = nullptr;
    if (visible) {
      vis_t = visible->to(at::kByte).contiguous();
      vis = vis_t.data_ptr<uint8_t>();
    } else {  // causal by column: a row sees the columns up to its own (none to build when each row is the last)
      bool all_last = true;
      for (int64_t r = 0; r < columns.numel(); ++r) all_last &= col[r] == kv_len - 1;
      if (!all_last) {
        vis_t = at::empty({columns.numel(), kv_len}, at::kByte);
        uint8_t* v = vis_t.data_ptr<uint8_t>();
        for (int64_t r = 0; r < columns.numel(); ++r) {
          const int64_t seen = std::min<int64_t>(col[r] + 1, kv_len);
          std::memset(v + r * kv_len, 1, seen);
          std::memset(v + r * kv_len + seen, 0, kv_len - seen);
        }
        vis = v;
      }
    }
    uint16_t* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::Half>());
    uint16_t* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::Half>());
    std::vector<int64_t> order = layers;
    if (order.empty())
      for (size_t i = 0; i < layers_.size(); ++i) order.push_back(static_cast<int64_t>(i));
    const int64_t qkv_w = (h + 2 * kvh) * d;
    int64_t inter = 0;
    for (const auto& l : layers_) inter = std::max<int64_t>(inter, product_width(l.gate_up) / 2);
    std::vector<float> hbuf(n * hidden), qkv(n * qkv_w), att(n * h * d), tmp(n * hidden), gu(n * 2 * inter),
        act(n * inter);
    std::vector<int32_t> q_rows, q_heads;  // attention's queries, ordered by (slot, kv head, row, head)
    for (int64_t s = 0; s < b; ++s)
      for (int64_t g = 0; g < kvh; ++g)
        for (int64_t r = s * q; r < (s + 1) * q; ++r)
          for (int64_t hh = g * (h / kvh); hh < (g + 1) * (h / kvh); ++hh) {
            q_rows.push_back(static_cast<int32_t>(r));
            q_heads.push_back(static_cast<int32_t>(hh));
          }
    // every product of every layer laid out before the threads start (nothing inside the region can throw)
    std::vector<LayerPlan> plans;
    for (int64_t li : order) {
      const Layer& L = layers_.at(li);
      LayerPlan P;
      P.ln1 = L.ln1.data_ptr<float>(), P.ln2 = L.ln2.data_ptr<float>();
      P.qkv_bias = L.qkv_bias ? L.qkv_bias->data_ptr<float>() : nullptr;
      P.qkv = plan_product(L.qkv, qkv.data(), qkv_w);
      P.o = plan_product(L.o, tmp.data(), hidden);
      P.inter = product_width(L.gate_up) / 2;
      P.gate_up = plan_product(L.gate_up, gu.data(), 2 * P.inter);
      P.down = plan_product(L.down, tmp.data(), hidden);
      // the buffers above are sized for these shapes: a product of another shape is refused here, not overrun
      TORCH_CHECK(P.qkv.in.k == hidden && P.gate_up.in.k == hidden && P.o.in.k == h * d && P.down.in.k == P.inter &&
                      product_width(L.qkv) == qkv_w && product_width(L.o) == hidden &&
                      product_width(L.down) == hidden && product_width(L.gate_up) == 2 * P.inter,
                  "layer ", li, ": product shapes do not match the model's (hidden ", hidden, ", heads ", h, " x ", d,
                  ", kv heads ", kvh, ")");
      plans.push_back(std::move(P));
    }
    at::Tensor normed, logits;  // the head's input and output
    ProductPlan HP;
    if (head) {
      TORCH_CHECK(head_norm_.defined() && !head_.parts.empty(), "run_fused(head=true) before set_head");
      TORCH_CHECK(head_norm_.numel() == hidden, "final norm weight: ", head_norm_.numel(), " values, hidden ", hidden);
      normed = at::empty({n, hidden}, xt.options());
      logits = at::empty({n, product_width(head_)}, xt.options());
      HP = plan_product(head_, logits.data_ptr<float>(), logits.size(1));
      TORCH_CHECK(HP.in.k == hidden, "output layer: in_features ", HP.in.k, ", hidden ", hidden);
    }
    SdActs acts;  // the activations of the product at hand (its tiles end at a barrier before the next quantizes)
    bool any32 = head && HP.in.need32, any256 = head && HP.in.need256;
    for (const auto& P : plans)
      for (const ProductPlan* pp : {&P.qkv, &P.o, &P.gate_up, &P.down}) any32 |= pp->in.need32, any256 |= pp->in.need256;
    acts.reserve(n, std::max({hidden, h * d, inter}), any32, any256);
    std::vector<at::Tensor> kept;
    std::vector<std::vector<float*>> copies(order.size());  // per layer of order: where x is kept after it
    for (int64_t c : capture)
      if (c == 0) kept.push_back(xt.clone());
    for (size_t oi = 0; oi < order.size(); ++oi)
      for (int64_t c : capture)
        if (c == order[oi] + 1) {
          kept.push_back(at::empty_like(xt));
          copies[oi].push_back(kept.back().data_ptr<float>());
        }
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    // (inside another parallel region: this thread alone, as at::parallel_for would run inline)
    const int threads = omp_in_parallel() || at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
    SpinBarrier barrier;
    // One parallel region for the whole forward (was one per product and per attention: about 150 starts and
    // ends per SmolLM2 step): the threads go from phase to phase through spin barriers. Row-wise work (RMSNorm,
    // activation quantization, RoPE, the cache write, SiLU, residuals) is split by rows, products by tiles of 8
    // columns, attention by queries; every row / column / query is one thread's, in the order the kernels fix, so
    // the split changes no bit.
#pragma omp parallel num_threads(threads)
    {
      const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
      auto sync = [&] { barrier.wait(static_cast<int>(nt)); };
      auto tiles = [&](const ProductPlan& pp) {  // this thread's share of pp's tiles (at::parallel_for's split)
        const int64_t chunk = (pp.tiles + nt - 1) / nt;
        sd_product_tiles(t, acts, pp.in.k, n, pp.parts.data(), static_cast<int64_t>(pp.parts.size()), pp.ldo,
                         std::min(pp.tiles, tid * chunk), std::min(pp.tiles, (tid + 1) * chunk));
      };
      auto add_bias = [&](const ProductPlan& pp, int64_t r) {
        for (const auto& [col, width, bias] : pp.biases)
          for (int64_t i = 0; i < width; ++i) pp.out[r * pp.ldo + col + i] += bias[i];
      };
      for (size_t oi = 0; oi < order.size(); ++oi) {
        const int64_t li = order[oi];
        const LayerPlan& P = plans[oi];
        // 1. attention block: norm, q/k/v, RoPE, cache write, attention, output projection
        for (int64_t r = tid; r < n; r += nt) {
          t->rmsnorm(x + r * hidden, P.ln1, hidden, (float)eps_, hbuf.data() + r * hidden);
          acts.quantize_rows(t, P.qkv.in, hbuf.data(), r, r + 1);
        }
        sync();
        tiles(P.qkv);
        sync();
        uint16_t* kl = kc + li * layer_stride;
        uint16_t* vl = vc + li * layer_stride;
        for (int64_t r = tid; r < n; r += nt) {
          add_bias(P.qkv, r);
          float* row = qkv.data() + r * qkv_w;
          if (P.qkv_bias)  // (low-bit layers carry their biases in the parts; a layer-level one is added after)
            for (int64_t i = 0; i < qkv_w; ++i) row[i] += P.qkv_bias[i];
          rope_row(row, h, d, cs + r * d, sn + r * d);
          rope_row(row + h * d, kvh, d, cs + r * d, sn + r * d);
          const int64_t slot = row0 + r / q, c = col[r];
          // a row's padding past the cache's end shares its last column (kv/base.py): the first of them writes it
          if (r % q > 0 && col[r - 1] == c) continue;
          for (int64_t g = 0; g < kvh; ++g) {
            t->to_f16(row + (h + g) * d, kl + slot * slot_stride + g * plane * d + c * d, d);
            t->to_f16(row + (h + kvh + g) * d, vl + slot * slot_stride + g * plane * d + c * d, d);
          }
        }
        sync();
        // the queries in (slot, kv head, row, head) order: a thread's share runs in pieces that read one slot's
        // cache, and the queries of one kv head in a piece convert its shared keys and values once (from 4 queries)
        {
          const int64_t total = n * h, chunk = (total + nt - 1) / nt;
          const int64_t i1 = std::min(total, (tid + 1) * chunk);
          for (int64_t i = std::min(total, tid * chunk); i < i1;) {
            const int64_t slot = row0 + q_rows[i] / q;
            int64_t j = i + 1;
            while (j < i1 && row0 + q_rows[j] / q == slot) ++j;
            t->attention(qkv.data(), qkv_w, h, kvh, d, kl + slot * slot_stride, vl + slot * slot_stride, plane, vis,
                         kv_len, scale, att.data(), h * d, q_rows.data() + i, q_heads.data() + i, j - i);
            i = j;
          }
        }
        sync();
        for (int64_t r = tid; r < n; r += nt) acts.quantize_rows(t, P.o.in, att.data(), r, r + 1);
        sync();
        tiles(P.o);
        sync();
        // 2. MLP block: norm, gate / up, SiLU(gate) * up, down
        for (int64_t r = tid; r < n; r += nt) {
          add_bias(P.o, r);
          for (int64_t i = r * hidden; i < (r + 1) * hidden; ++i) x[i] += tmp[i];
          t->rmsnorm(x + r * hidden, P.ln2, hidden, (float)eps_, hbuf.data() + r * hidden);
          acts.quantize_rows(t, P.gate_up.in, hbuf.data(), r, r + 1);
        }
        sync();
        tiles(P.gate_up);
        sync();
        const int64_t I = P.inter;
        for (int64_t r = tid; r < n; r += nt) {
          add_bias(P.gate_up, r);
          t->silu_mul(gu.data() + r * 2 * I, gu.data() + r * 2 * I + I, I, act.data() + r * I);
          acts.quantize_rows(t, P.down.in, act.data(), r, r + 1);
        }
        sync();
        tiles(P.down);
        sync();
        for (int64_t r = tid; r < n; r += nt) {  // (row r is this thread's until the next layer's barrier)
          add_bias(P.down, r);
          for (int64_t i = r * hidden; i < (r + 1) * hidden; ++i) x[i] += tmp[i];
          for (float* kept_x : copies[oi]) std::memcpy(kept_x + r * hidden, x + r * hidden, sizeof(float) * hidden);
        }
      }
      if (head) {  // 3. the final norm and the output layer (row r is still this thread's; the last tiles are done)
        float* hn = normed.data_ptr<float>();
        for (int64_t r = tid; r < n; r += nt) {
          t->rmsnorm(x + r * hidden, head_norm_.data_ptr<float>(), hidden, (float)eps_, hn + r * hidden);
          acts.quantize_rows(t, HP.in, hn, r, r + 1);
        }
        sync();
        tiles(HP);
        if (!HP.biases.empty()) {
          sync();
          for (int64_t r = tid; r < n; r += nt) add_bias(HP, r);
        }
      }
    }
    std::vector<at::Tensor> result{xt};
    for (auto& k : kept) result.push_back(k);
    if (head) result.insert(result.end(), {normed, logits});
    return result;
  }

 private:
  int64_t h_, kvh_, d_;
  double eps_;
  std::vector<Layer> layers_;
  at::Tensor head_norm_;  // set_head
  Product head_;
};

void register_step(py::module_& m) {
  py::class_<LayerStack>(m, "LayerStack")
      .def(py::init<int64_t, int64_t, int64_t, double>())
      .def("add_layer", &LayerStack::add_layer)
      .def("set_head", &LayerStack::set_head)
      .def("run", &LayerStack::run, py::call_guard<py::gil_scoped_release>())
      .def("run_fused", &LayerStack::run_fused, py::call_guard<py::gil_scoped_release>());
}
