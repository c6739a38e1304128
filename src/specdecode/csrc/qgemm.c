// Low-bit products for the verification shape (1-16 rows) on x86 CPUs: GGUF blocks as the file
// stores them (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) times activations quantized to 8 bits per row.
//
//   out[r, n] = sum_k x[r, k] * w[n, k],  r < rows (a decoding step: 1; a verification: gamma + 1)
//
// Plain C with intrinsics and no torch headers: compiled once per instruction-set variant by
// specdecode/qkernel.py (gcc, seconds) and called through the table sd_table() returns.
//   SD_VARIANT_AVX2        AVX2 + FMA + F16C (the floor)
//   SD_VARIANT_AVX512      the same code with AVX-512 F/BW/VL enabled (EVEX encodings, 32 registers)
//   SD_VARIANT_AVX512VNNI  AVX-512 VNNI on 256-bit vectors: vpdpbusd / vpdpwssd replace the
//                          vpmaddubsw + vpmaddwd pairs
//
// Activations: per row, quantized alone (llama.cpp's Q8_0 / Q8_K layouts, our code):
//   act32  (for Q4_0, Q4_1, Q5_0, Q8_0): per block of 32, float d, int8 q[32], float s = d * sum(q)
//   act256 (for Q4_K, Q6_K): per block of 256, float d, int8 q[256], int16 bsums[16] (sums per 16)
// Weights: each block of a column is read once per call and unpacked once (into a 256-byte
// scratch in L1), then dotted with every row. Every (row, column) is accumulated in one fixed
// order that depends on nothing but that row and that column: neither on how many rows share
// the call, nor on how the columns are split across threads. A row's result is therefore bit for
// bit the same alone or among any rows (batch-invariant by construction), which is what keeps
// speculative decoding equal to plain decoding.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { SD_Q4_0 = 0, SD_Q4_1 = 1, SD_Q5_0 = 2, SD_Q8_0 = 3, SD_Q4_K = 4, SD_Q6_K = 5 };

#if defined(SD_VARIANT_AVX512VNNI)
#define SD_NAME "avx512vnni"
#elif defined(SD_VARIANT_AVX512)
#define SD_NAME "avx512"
#else
#define SD_NAME "avx2"
#endif

static inline float f16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {  // fixed order: (lanes 0-3 + lanes 4-7), then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// u8 [32] . s8 [32] -> 8 int32 lanes (lane i: elements 4i..4i+3). u8 values <= 127 (no saturation).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(SD_VARIANT_AVX512VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + (u8 [32] . s8 [32] pairs) * sc16: the int16 pair sums times int16 scales (per 16 elements).
static inline __m256i dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i sc16) {
#if defined(SD_VARIANT_AVX512VNNI)
  return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), sc16);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc16));
#endif
}

static inline __m256i nibbles32(const uint8_t* q) {  // 16 bytes -> 32: low nibbles, then high
  __m128i v = _mm_loadu_si128((const __m128i*)q);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

static inline __m256i bits_to_0x10(uint32_t bits) {  // byte j = 0x10 if bit j of bits is set
  const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL,
                                          0x0303030303030303LL);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  b = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
  return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
}

// ---------------------------------------------------------------------------------------------
// Activations

// x [rows, k] float32 -> q [rows, k] int8, d [rows, k/32], s [rows, k/32] (act32)
static void quantize32(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t nb = k / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + 32 * b;
      __m256 v[4], m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4), dd = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      __m256i qi[4];
      for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
      // int32 -> int8 in order (packs interleave 128-bit lanes; the permute puts them back)
      __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
      __m256i p8 = _mm256_packs_epi16(p16a, p16b);
      p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(q + r * k + 32 * b), p8);
      __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      d[r * nb + b] = dd;
      s[r * nb + b] = dd * (float)_mm_cvtsi128_si32(t4);
    }
}

// x [rows, k] float32 -> q [rows, k] int8, d [rows, k/256], bsums [rows, k/16] int16 (act256)
static void quantize256(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  const int64_t nb = k / 256;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + 256 * b;
      __m256 m = _mm256_setzero_ps();
      for (int i = 0; i < 32; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4), id = amax > 0 ? 127.0f / amax : 0.0f;
      d[r * nb + b] = amax / 127.0f;
      for (int c = 0; c < 8; ++c) {  // 32 elements at a time
        __m256i qi[4];
        for (int i = 0; i < 4; ++i)
          qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * c + 8 * i), _mm256_set1_ps(id)));
        __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(q + r * k + 256 * b + 32 * c), p8);
        for (int h = 0; h < 2; ++h) {
          __m256i t = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
          __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
          t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
          t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
          bsums[r * (k / 16) + 16 * b + 2 * c + h] = (int16_t)_mm_cvtsi128_si32(t4);
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Weights: 32-element block formats (Q4_0, Q4_1, Q5_0, Q8_0) against act32.
// A block is unpacked to 32 bytes u (unsigned, except Q8_0: signed), a scale dw and a term mw with
// w = dw * u + mw (Q8_0: w = dw * q). Per row and block: the int32 lanes of u . x, then
// acc += float(lanes) * (dw * dx), and m += mw * s (the activation block's scaled sum).

#define SD_MAX_ROWS 16

static const int kBlockBytes[6] = {18, 20, 22, 34, 144, 210};
static const int kBlockSize[6] = {32, 32, 32, 32, 256, 256};

static inline void unpack32(int fmt, const uint8_t* blk, __m256i* u, float* dw, float* mw) {
  const float d = f16(blk);
  switch (fmt) {
    case SD_Q4_0: *u = nibbles32(blk + 2); *dw = d; *mw = -8.0f * d; break;
    case SD_Q4_1: *u = nibbles32(blk + 4); *dw = d; *mw = f16(blk + 2); break;
    case SD_Q5_0: {
      uint32_t qh;
      memcpy(&qh, blk + 2, 4);
      *u = _mm256_or_si256(nibbles32(blk + 6), bits_to_0x10(qh));
      *dw = d; *mw = -16.0f * d;
      break;
    }
    default: *u = _mm256_loadu_si256((const __m256i*)(blk + 2)); *dw = d; *mw = 0.0f; break;  // Q8_0
  }
}

static void gemm32(int fmt, const uint8_t* w, int64_t ldw, int64_t k, const int8_t* xq, const float* xd,
                   const float* xs, int64_t rows, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t nb = k / 32, bytes = kBlockBytes[fmt];
  const int signed_w = fmt == SD_Q8_0;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * ldw;
    for (int64_t r0 = 0; r0 < rows; r0 += SD_MAX_ROWS) {
      const int64_t rr = rows - r0 < SD_MAX_ROWS ? rows - r0 : SD_MAX_ROWS;
      __m256 acc[SD_MAX_ROWS];
      float macc[SD_MAX_ROWS];
      for (int64_t r = 0; r < rr; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        __m256i u;
        float dw, mw;
        unpack32(fmt, wn + b * bytes, &u, &dw, &mw);
        const __m256i ua = signed_w ? _mm256_sign_epi8(u, u) : u;  // |q| for Q8_0 (sign moved to x)
        for (int64_t r = 0; r < rr; ++r) {
          const int64_t row = r0 + r;
          __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + row * k + 32 * b));
          if (signed_w) xv = _mm256_sign_epi8(xv, u);
          const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(ua, xv));
          acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * xd[row * nb + b]), acc[r]);
          macc[r] = macc[r] + mw * xs[row * nb + b];
        }
      }
      for (int64_t r = 0; r < rr; ++r) out[(r0 + r) * ldo + n] = hsum(acc[r]) + macc[r];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Weights: K-quants (Q4_K, Q6_K) against act256. A super-block of 256 is unpacked to u [8][32]
// (unsigned), int16 scale vectors sc [8] (one per 32 elements, each holding the scale of its two
// halves of 16) and the zero-point terms; every product inside the super-block is an integer.

typedef struct {
  __m256i u[8];
  __m256i sc[8];   // int16 lanes 0-7: scale of elements 0-15, lanes 8-15: of 16-31
  __m256i msc;     // int16 [16]: per 16 elements, what multiplies that half's activation sum
  float d, dmin;   // Q4_K: w = d * sc * u - dmin * m;  Q6_K: w = d * sc * (u - 32)
} SuperBlock;

static inline void unpack_q4k(const uint8_t* blk, SuperBlock* sb) {
  sb->d = f16(blk);
  sb->dmin = f16(blk + 2);
  const uint8_t* s = blk + 4;
  uint8_t sc[8], mn[8];
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
  const uint8_t* qs = blk + 16;
  for (int c = 0; c < 4; ++c) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
    sb->u[2 * c] = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    sb->u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  }
  int16_t m16[16];
  for (int j = 0; j < 8; ++j) {
    sb->sc[j] = _mm256_set1_epi16(sc[j]);
    m16[2 * j] = m16[2 * j + 1] = mn[j];
  }
  sb->msc = _mm256_loadu_si256((const __m256i*)m16);
}

static inline void unpack_q6k(const uint8_t* blk, SuperBlock* sb) {
  const uint8_t *ql = blk, *qh = blk + 128;
  const int8_t* sc = (const int8_t*)(blk + 192);
  sb->d = f16(blk + 208);
  sb->dmin = 0.0f;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  for (int h = 0; h < 2; ++h) {
    __m256i l0 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h));
    __m256i l1 = _mm256_loadu_si256((const __m256i*)(ql + 64 * h + 32));
    __m256i hb = _mm256_loadu_si256((const __m256i*)(qh + 32 * h));
    __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4);
    __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4);
    __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4);
    __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4);
    sb->u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), h0);
    sb->u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), h1);
    sb->u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), h2);
    sb->u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), h3);
  }
  int16_t s16[16];
  for (int j = 0; j < 16; ++j) s16[j] = sc[j];
  for (int j = 0; j < 8; ++j) {
    __m128i a = _mm_set1_epi16(s16[2 * j]), b = _mm_set1_epi16(s16[2 * j + 1]);
    sb->sc[j] = _mm256_set_m128i(b, a);
  }
  sb->msc = _mm256_loadu_si256((const __m256i*)s16);
}

static void gemmk(int fmt, const uint8_t* w, int64_t ldw, int64_t k, const int8_t* xq, const float* xd,
                  const int16_t* bsums, int64_t rows, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  const int64_t nb = k / 256, bytes = kBlockBytes[fmt];
  const int q6 = fmt == SD_Q6_K;
  SuperBlock sb;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * ldw;
    for (int64_t r0 = 0; r0 < rows; r0 += SD_MAX_ROWS) {
      const int64_t rr = rows - r0 < SD_MAX_ROWS ? rows - r0 : SD_MAX_ROWS;
      __m256 acc[SD_MAX_ROWS], macc[SD_MAX_ROWS];
      for (int64_t r = 0; r < rr; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        if (q6) unpack_q6k(wn + b * bytes, &sb);
        else unpack_q4k(wn + b * bytes, &sb);
        for (int64_t r = 0; r < rr; ++r) {
          const int64_t row = r0 + r;
          const int8_t* xr = xq + row * k + 256 * b;
          __m256i sumi = _mm256_setzero_si256();
          for (int j = 0; j < 8; ++j)
            sumi = dot_scaled(sumi, sb.u[j], _mm256_loadu_si256((const __m256i*)(xr + 32 * j)), sb.sc[j]);
          const __m256i bs = _mm256_loadu_si256((const __m256i*)(bsums + row * (k / 16) + 16 * b));
          const __m256i summ = _mm256_madd_epi16(sb.msc, bs);  // per pair of 16s: m * (sum of x)
          const float dx = xd[row * nb + b];
          if (q6) {  // w = d * sc * (u - 32): the zero point is an integer too
            sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(summ, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(sb.d * dx), acc[r]);
          } else {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(sb.d * dx), acc[r]);
            macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_set1_ps(sb.dmin * dx), macc[r]);
          }
        }
      }
      for (int64_t r = 0; r < rr; ++r) out[(r0 + r) * ldo + n] = hsum(acc[r]) - hsum(macc[r]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantization (tests, tools): float32 [n1 - n0, k] of columns n0..n1 (as gguf.dequantize).
static void dequantize(int fmt, const uint8_t* w, int64_t ldw, int64_t k, float* out, int64_t n0, int64_t n1) {
  const int64_t bs = kBlockSize[fmt], bytes = kBlockBytes[fmt];
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * k;
    for (int64_t b = 0; b < k / bs; ++b) {
      const uint8_t* blk = w + n * ldw + b * bytes;
      uint8_t u[256];
      if (bs == 32) {
        __m256i v;
        float dw, mw;
        unpack32(fmt, blk, &v, &dw, &mw);
        _mm256_storeu_si256((__m256i*)u, v);
        for (int i = 0; i < 32; ++i) o[32 * b + i] = fmt == SD_Q8_0 ? dw * (float)(int8_t)u[i] : dw * u[i] + mw;
      } else {
        SuperBlock sb;
        int16_t sc[8][16], m16[16];
        if (fmt == SD_Q6_K) unpack_q6k(blk, &sb);
        else unpack_q4k(blk, &sb);
        for (int j = 0; j < 8; ++j) {
          _mm256_storeu_si256((__m256i*)(u + 32 * j), sb.u[j]);
          _mm256_storeu_si256((__m256i*)sc[j], sb.sc[j]);
        }
        _mm256_storeu_si256((__m256i*)m16, sb.msc);
        for (int i = 0; i < 256; ++i) {
          const int j = i / 32, half = (i % 32) / 16;
          const float s = (float)sc[j][8 * half];
          o[256 * b + i] = fmt == SD_Q6_K ? sb.d * s * (float)((int)u[i] - 32)
                                          : sb.d * s * (float)u[i] - sb.dmin * (float)m16[2 * j];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The table the Python side reads (through ctypes) and hands to the torch extension.

typedef struct {
  int32_t version;
  const char* name;
  void (*quantize32)(const float*, int64_t, int64_t, int8_t*, float*, float*);
  void (*quantize256)(const float*, int64_t, int64_t, int8_t*, float*, int16_t*);
  void (*gemm32)(int, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const float*, int64_t, float*,
                 int64_t, int64_t, int64_t);
  void (*gemmk)(int, const uint8_t*, int64_t, int64_t, const int8_t*, const float*, const int16_t*, int64_t, float*,
                int64_t, int64_t, int64_t);
  void (*dequantize)(int, const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t);
} SdTable;

static const SdTable kTable = {1, SD_NAME, quantize32, quantize256, gemm32, gemmk, dequantize};

const SdTable* sd_table(void) { return &kTable; }
