// Low-bit products for the verification shape (1-16 rows) on x86 CPUs: GGUF blocks as the file
// stores them (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) times activations quantized to 8 bits per row.
//
//   out[r, n] = sum_k x[r, k] * w[n, k],  r < rows (a decoding step: 1; a verification: gamma + 1)
//
// Plain C with intrinsics and no torch headers: compiled once per instruction-set variant by
// specdecode/lowbit_kernels.py (gcc, seconds) and called through the table sd_table() returns.
//   SD_VARIANT_AVX2        AVX2 + FMA + F16C (the floor)
//   SD_VARIANT_AVX512      the same code with AVX-512 F/BW/VL enabled (EVEX encodings, 32 registers;
//                          a Q5_0 tail column's fifth bits as a byte mask)
//   SD_VARIANT_AVXVNNI     the AVX2 code with AVX-VNNI's VEX vpdpbusd / vpdpwssd in place of the vpmaddubsw +
//                          vpmaddwd pairs, for CPUs with AVX-VNNI and no AVX-512 (Intel Alder Lake and later client
//                          cores, Sierra Forest)
//   SD_VARIANT_AVX512VNNI  AVX-512 VNNI on 256-bit vectors: vpdpbusd / vpdpwssd replace the
//                          vpmaddubsw + vpmaddwd pairs (Q8_0: one vpdpbusd on q + 128)
//   SD_VARIANT_AMX         the VNNI variant, plus AMX-INT8 tile products for whole groups of 16 rows of
//                          calls of many rows (from 48 rows for the 32-weight formats, 32 for Q4_K, 16 for
//                          Q6_K: a prompt's prefill pieces; amx_pass32, amx_passk: the same integers, then
//                          the VNNI float operations)
// Every variant computes the same integers and the same float operations in the same order: their
// results are identical bit for bit (tests/test_lowbit.py).
//
// Activations: per row, quantized alone (llama.cpp's Q8_0 / Q8_K layouts, our code):
//   act32  (for Q4_0, Q4_1, Q5_0, Q8_0): per block of 32, float d, int8 q[32], float s = d * sum(q)
//   act256 (for Q4_K, Q6_K): per block of 256, float d, int8 q[256], int16 bsums[16] (sums per 16)
// Weights: every format runs as tiles of 8 output columns (repacked at load, the same bytes per weight:
// passt32 for Q4_0 / Q4_1 / Q5_0 / Q8_0, passt for Q4_K, passt6 for Q6_K): one vpdpbusd (vpmaddubsw) per 4
// weights of the 8 columns, each column's integer sum in its own lane, no horizontal sums. A tile's block
// is read and unpacked once per pass of rows (6 or 8 rows, their accumulators in registers; AVX2 / AVX-VNNI / AVX-512 unpack a
// tile once per call when its rows take several passes, not Q8_0) and dotted with
// every row of the pass. The last n_out % 8 columns keep a column layout and do a tile lane's exact
// operations (tail32, passk). Every (row, column) is accumulated in one fixed
// order that depends on nothing but that row and that column: neither on how many rows share
// the call, nor on how the columns are split across threads. A row's result is therefore bit for
// bit the same alone or among any rows (batch-invariant by construction), which is what keeps
// speculative decoding equal to plain decoding.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "qtable.h"

enum { SD_Q4_0 = 0, SD_Q4_1 = 1, SD_Q5_0 = 2, SD_Q8_0 = 3, SD_Q4_K = 4, SD_Q6_K = 5 };

#if defined(SD_VARIANT_AMX)  // the VNNI variant plus AMX-INT8 tiles for groups of 16 rows (amx_pass32, amx_passk)
#define SD_VARIANT_AVX512VNNI
#define SD_AMX 1
#define SD_NAME "amx"
#elif defined(SD_VARIANT_AVX512VNNI)
#define SD_NAME "avx512vnni"
#elif defined(SD_VARIANT_AVX512)
#define SD_NAME "avx512"
#elif defined(SD_VARIANT_AVXVNNI)  // AVX2's code (16 registers, no masks) with AVX-VNNI's VEX dot products
#define SD_VARIANT_AVX2
#define SD_NAME "avxvnni"
#else
#define SD_NAME "avx2"
#endif
// SD_VNNI: 4-byte dot products (vpdpbusd) and int16 pair dot products (vpdpwssd) on 256-bit vectors, EVEX
// (AVX-512 VNNI + VL) or VEX (AVX-VNNI: Intel Alder Lake and later, Sierra Forest), in place of
// AVX2's vpmaddubsw + vpmaddwd (+ vpaddd): the same integers (no vpmaddubsw pair here reaches int16's limit)
#if defined(SD_VARIANT_AVX512VNNI)
#define SD_VNNI 1
#define sd_dpbusd _mm256_dpbusd_epi32
#define sd_dpwssd _mm256_dpwssd_epi32
#elif defined(SD_VARIANT_AVXVNNI)
#define SD_VNNI 1
#define sd_dpbusd _mm256_dpbusd_avx_epi32
#define sd_dpwssd _mm256_dpwssd_avx_epi32
#else
#define SD_VNNI 0
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

// u8 [32] . s8 [32] -> 8 int32 lanes (lane i: elements 4i..4i+3). u8 values <= 128, s8 in -127..127:
// a vpmaddubsw pair is at most 2 * 128 * 127 = 32512, inside int16 (no saturation).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if SD_VNNI
  return sd_dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + (u8 [32] . s8 [32] pairs) * sc16: the int16 pair sums times int16 scales (per 16 elements).
static inline __m256i dot_scaled(__m256i acc, __m256i u, __m256i s, __m256i sc16) {
#if SD_VNNI
  return sd_dpwssd(acc, _mm256_maddubs_epi16(u, s), sc16);
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

// max |x| over n floats (n a multiple of 8), in a fixed order
static inline float absmax(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

static inline int32_t hsum_i32(__m256i t) {
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  return _mm_cvtsi128_si32(t4);
}

// 32 floats times id, rounded to nearest (ties to even) -> 32 int8 at q; qi: the four int32 vectors
static inline void quantize_block(const float* x, float id, int8_t* q, __m256i qi[4]) {
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(id)));
  // int32 -> int8 in order (packs interleave 128-bit lanes; the permute puts them back)
  __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256((__m256i*)q, p8);
}

// x [rows, k] float32 -> q [rows, k] int8, d [rows, k/32], s [rows, k/32] (act32)
static void quantize32(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s) {
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + 32 * b;
      const float amax = absmax(xb, 32), dd = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
      __m256i qi[4];
      quantize_block(xb, id, q + r * k + 32 * b, qi);
      d[r * nb + b] = dd;
      s[r * nb + b] = dd * (float)hsum_i32(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
    }
}

// x [rows, k] float32 -> q [rows, k] int8, d [rows, k/256], bsums [rows, k/16] int16 (act256)
static void quantize256(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  const int64_t nb = k / 256;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * k + 256 * b;
      const float amax = absmax(xb, 256), id = amax > 0 ? 127.0f / amax : 0.0f;
      d[r * nb + b] = amax / 127.0f;
      for (int c = 0; c < 8; ++c) {  // 32 elements at a time
        __m256i qi[4];
        quantize_block(xb + 32 * c, id, q + r * k + 256 * b + 32 * c, qi);
        for (int h = 0; h < 2; ++h)
          bsums[r * (k / 16) + 16 * b + 2 * c + h] = (int16_t)hsum_i32(_mm256_add_epi32(qi[2 * h], qi[2 * h + 1]));
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Weights: 32-element block formats (Q4_0, Q4_1, Q5_0, Q8_0) against act32: tiles of 8 columns (passt32
// below). The last n_out % 8 columns keep a column layout (tail32): a row's blocks repacked at load
// (specdecode/lowbit_kernels.py ``_columns``, same bytes) as one array per block field:
//   Q4_0: d[nb] f16 | qs[nb][16]          Q4_1: d[nb] | m[nb] | qs[nb][16]
//   Q5_0: d[nb] | qh[nb] u32 | qs[nb][16]  Q8_0: d[nb] | qs[nb][32]
// A block unpacks to 32 bytes u (unsigned; Q8_0: signed q) with w = d * (u - z) (Q4_1: w = d * u + m).

static const int kBlockBytes[6] = {18, 20, 22, 34, 144, 210};
static const int kBlockSize[6] = {32, 32, 32, 32, 256, 256};

typedef struct {
  const uint8_t *d, *m, *qh, *qs;
  int qs_bytes;
} Soa;

static inline Soa soa(int fmt, const uint8_t* row, int64_t nb) {
  Soa a = {row, 0, 0, 0, 16};
  switch (fmt) {
    case SD_Q4_0: a.qs = row + 2 * nb; break;
    case SD_Q4_1: a.m = row + 2 * nb; a.qs = row + 4 * nb; break;
    case SD_Q5_0: a.qh = row + 2 * nb; a.qs = row + 6 * nb; break;
    default: a.qs = row + 2 * nb; a.qs_bytes = 32; break;  // Q8_0
  }
  return a;
}

static inline __m256i unpack32(int fmt, const Soa* a, int64_t b) {
  switch (fmt) {
    case SD_Q5_0: {
      uint32_t qh;
      memcpy(&qh, a->qh + 4 * b, 4);
#if defined(SD_VARIANT_AVX2)
      return _mm256_or_si256(nibbles32(a->qs + 16 * b), bits_to_0x10(qh));
#else  // AVX-512 BW/VL: the fifth bits are a byte mask; one masked add puts 0x10 where they are set
      const __m256i lo = nibbles32(a->qs + 16 * b);
      return _mm256_mask_add_epi8(lo, (__mmask32)qh, lo, _mm256_set1_epi8(0x10));
#endif
    }
    case SD_Q8_0: return _mm256_loadu_si256((const __m256i*)(a->qs + 32 * b));
    default: return nibbles32(a->qs + 16 * b);  // Q4_0, Q4_1
  }
}

// Rows per pass of the 32-weight tiles, per variant (array sizes, the passes compiled and, unless SD_PASS32 overrides
// it, the pass size): every row keeps its accumulators in registers, 16 vector registers on AVX2, 32 with AVX-512.
#ifndef SD_PASS
#if defined(SD_VARIANT_AVX2) && !SD_VNNI  // avxvnni: 8 (see below)
#define SD_PASS 6
#else
#define SD_PASS 8
#endif
#endif
#if SD_PASS != 4 && SD_PASS != 6 && SD_PASS != 8
#error "SD_PASS must be 4, 6 or 8 (the pass sizes gemm32's switch compiles)"
#endif
// K-quant passes keep four vectors per row (two integer sums, two float accumulators) next to the
// unpacked weights and scales: four rows fit the registers of every variant, more spill (measured:
// six rows of a Q4_K pass cost as much as eleven).
#define SD_PASSK 4
// Q6_K tiles (passt6): 1 (with lowbit.py's Q6K_TILES = True). Then Q6_K columns after the last tile take a
// tile lane's scalar float order (0.85x on their own, at most 7 columns per weight)
#define SD_Q6K_TILES 1
#define SD_INLINE static inline __attribute__((always_inline))
// An empty asm that takes v and gives it back in a register: gcc can no longer see through the value, so it keeps a
// chain of integer additions in the written order instead of reassociating it into a tree whose partial sums
// outlive the registers (AVX2: 16) and spill (bits are unaffected: the sums are exact integers either way)
#define SD_OPAQUE(v) __asm__("" : "+v"(v))
#define SD_TILE 8  // output columns per tile (Q4_K, Q6_K and, as lowbit_kernels.TILED32 says, 32-weight formats)

// A tile's eight results (lane c: column c) -> dst[c0..c1) (a range that cuts the tile writes only its part)
SD_INLINE void store_tile(float* dst, __m256 o, int c0, int c1) {
  if (c0 == 0 && c1 == SD_TILE) {
    _mm256_storeu_ps(dst, o);
  } else {
    float tmp[8];
    _mm256_storeu_ps(tmp, o);
    for (int c = c0; c < c1; ++c) dst[c] = tmp[c];
  }
}

// Software prefetch of the weight stream SD_PREFETCH bytes ahead of the block being read (a tile's blocks, and
// tile after tile, are one ascending stream per thread). On the Intel Xeon (2 cores of a large server part) the
// hardware prefetchers alone read about 18 GB/s where a sum reads 30: the Qwen 1.5B's one-token step took
// 55.7 ms with them alone and 32.5 ms (the byte limit) with 4 KB ahead (2 KB: 33.5, 8 KB: 33.6); 4 tokens 73.4 ->
// 41.9 ms; AVX2 forced 58.5 -> 34.2 and 83.7 -> 45.8; SmolLM2 2.45 -> 2.23 ms (docs/results/kernels/amx/).
// Not measured on the AMD EPYC machines yet (their hardware prefetchers reached 70-80% of the byte limit alone;
// -DSD_PREFETCH=0 builds the passes without it for an A/B). A prefetch past the end of a weight never faults.
#ifndef SD_PREFETCH
#define SD_PREFETCH 4096
#endif
SD_INLINE void prefetch_ahead(const uint8_t* p, int bytes) {
  if (SD_PREFETCH)
    for (int l = 0; l < bytes; l += 64) _mm_prefetch((const char*)(p + SD_PREFETCH + l), _MM_HINT_T0);
}

// The same for a pair of tiles read side by side (ta, tb: block pos bytes into tiles A and B = A + tile, tile bytes
// each): the next bytes a pair reads are A's and B's at the same offset, and after the tiles' ends the next pair's
// (A + 2 tile, B + 2 tile): each stream is prefetched SD_PREFETCH_PAIR bytes ahead of its own block, across B (A's
// stream) and into the next pair (tiles shorter than SD_PREFETCH_PAIR: a stream's lines land partly in the other
// stream's next tile; every line is still fetched ahead). Prefetching ta + SD_PREFETCH and tb + SD_PREFETCH instead left the start of B
// unfetched at every pair (A's stream reached it only as A ended): Q4_K tile pairs of 1,536 inputs streamed at
// 0.80-0.93x single tiles on the Intel Xeon (docs/results/kernels/amx/README.md).
#ifndef SD_PREFETCH_PAIR
#define SD_PREFETCH_PAIR SD_PREFETCH
#endif
SD_INLINE void prefetch_pair(const uint8_t* ta, const uint8_t* tb, int64_t pos, int64_t tile, int bytes) {
  if (SD_PREFETCH_PAIR) {
    const int64_t ahead = SD_PREFETCH_PAIR + (pos + SD_PREFETCH_PAIR >= tile ? tile : 0);
    for (int l = 0; l < bytes; l += 64) {
      _mm_prefetch((const char*)(ta + ahead + l), _MM_HINT_T0);
      _mm_prefetch((const char*)(tb + ahead + l), _MM_HINT_T0);
    }
  }
}

static inline int32_t load_i32(const void* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

// ---------------------------------------------------------------------------------------------
// 32-weight formats as tiles of 8 output columns (specdecode/lowbit_tiles32.py repacks them at load, the
// same bytes per weight). Columns 8t..8t+7 (t < n_out / 8) occupy weight rows 8t..8t+7 (8 * ldw contiguous
// bytes); block b of the eight (32 weights of each column) sits at byte 8 * B * b, B the format's block bytes:
//   Q4_0 (8 x 18 = 144 bytes): d[8] f16 | nibbles [128]
//   Q4_1 (8 x 20 = 160):       d[8] f16 | m[8] f16 | nibbles [128]
//   Q5_0 (8 x 22 = 176):       d[8] f16 | fifth bits [32] | nibbles [128]
//   Q8_0 (8 x 34 = 272):       d[8] f16 | u [8][32], u = q + 128 (unsigned)
// Weight vector g < 8 of a block (32 bytes) holds weights 4g..4g+3 of the 8 columns, 4 bytes per column:
// byte 4c + e = weight 4g + e of column c. Nibbles: vector h < 4, byte 4c + e holds weight 4h + e of column
// c (low nibble) and weight 4(h + 4) + e (high nibble), so vectors g and g + 4 come from one load. Fifth bits
// (Q5_0): byte 4c + e, bit g = the fifth bit of weight 4g + e of column c (one shift and one and per vector).
//
// Why: one vpdpbusd (AVX2 / AVX-512: vpmaddubsw, vpmaddwd) of vector g with the 4 activation bytes 4g..4g+3
// broadcast to every lane adds column c's 4 products into int32 lane c. Eight of them give the block's exact
// integer dot product of each column in its own lane: no horizontal sums (the column kernel this replaced
// needed one per 8 blocks and row: 1.5-3x slower), and the 8 columns' float16 scales convert in one
// instruction. Every (row, column) then takes, per block:
//   isum = u . x - z * sum(x)          (integers, exact; z = 8 for Q4_0, 16 for Q5_0, 128 for Q8_0's u,
//                                       0 for Q4_1; sum(x): the activation block's integer sum, xsum)
//   acc  = fma(float(isum), d * dx, acc)
//   macc = fma(m, s, macc)             (Q4_1 only: its float minimum m; s = dx * sum(x), from quantize32)
// and out = acc (Q4_1: acc + macc), blocks in order: one fixed order per (row, column).
// Integer bounds: AVX2 / AVX-512 add vpmaddubsw results in int16: 4-bit u: 8 vectors x 2 x 15 x 127 = 30480;
// Q5_0 (u < 32): 4 vectors x 2 x 31 x 127 = 31496, so two int16 sums per block; Q8_0's u = q + 128 < 256 would
// overflow a vpmaddubsw pair, so those variants take |q| and move q's sign onto x (pairs <= 2 x 128 x 127)
// and sum each vpmaddubsw in int32: sum(q x) = sum(u x) - 128 sum(x), the VNNI integers exactly. The last
// n_out % 8 columns keep the column layout (soa()) and do a tile lane's integers and float operations
// (tail32): a column's bits do not depend on whether it sits in a tile (fused q / k / v, a reduced LM head).

// Rows per pass of the tiles: SD_PASS (above), per variant, measured at 1-256 rows (docs/results/kernels/tiled32/
// report.txt; docs/results/kernels/amx/s9/pass_size_ab.txt): VNNI 8 rows (4: 1.03-1.14x slower); AVX-512 8; AVX-VNNI 8
// (docs/results/kernels/amx/s13/step_pass.txt: 8 rows in one pass 0.90x the time of 6 + 2); AVX2 6
// (16 registers: the passes keep the zero point and Q4_1's minimum term out of the vector loop; passes of 4 took
// 1.06-1.29x the time at 5 and 6 rows, about the same elsewhere). The pass size changes nothing in a row's arithmetic.
#ifndef SD_PASS32
#define SD_PASS32(fmt) SD_PASS
#endif
// Passes of up to SD_MACC_INLINE rows keep Q4_1's minimum term in the block loop (passt32): registers to spare, and
// a second loop over the blocks cost 1-2 row passes 1.06-1.14x (s9/pass_size_ab.txt; AVX-512 VNNI: every pass, 32
// registers; AVX-VNNI: 2, as AVX2, 16 registers)
#ifndef SD_MACC_INLINE
#if defined(SD_VARIANT_AVX512VNNI)
#define SD_MACC_INLINE SD_PASS
#elif defined(SD_VARIANT_AVX512)
#define SD_MACC_INLINE 4
#else
#define SD_MACC_INLINE 2
#endif
#endif

static inline int tile32_bytes(int fmt) {  // bytes of one block of a tile (8 columns)
  switch (fmt) {
    case SD_Q4_0: return 144;
    case SD_Q4_1: return 160;
    case SD_Q5_0: return 176;
    default: return 272;
  }
}

static inline int zero_point32(int fmt) {  // z of isum = u . x - z * sum(x) (a tile lane's; Q8_0: on u)
  return fmt == SD_Q4_0 ? 8 : fmt == SD_Q5_0 ? 16 : fmt == SD_Q8_0 ? 128 : 0;
}

// bit g of every byte -> 0x10 (a 16-bit shift moves bit g of both its bytes to bit 4; the mask drops the rest)
static inline __m256i fifth_bits(__m256i hb, int g) {
  const __m256i m10 = _mm256_set1_epi8(0x10);
  switch (g) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(hb, 4), m10);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(hb, 3), m10);
    case 2: return _mm256_and_si256(_mm256_slli_epi16(hb, 2), m10);
    case 3: return _mm256_and_si256(_mm256_slli_epi16(hb, 1), m10);
    case 4: return _mm256_and_si256(hb, m10);
    case 5: return _mm256_and_si256(_mm256_srli_epi16(hb, 1), m10);
    case 6: return _mm256_and_si256(_mm256_srli_epi16(hb, 2), m10);
    default: return _mm256_and_si256(_mm256_srli_epi16(hb, 3), m10);
  }
}

// weight vector g of the tile block at t: the unsigned values u (Q8_0: u = q + 128)
static inline __m256i tile32_vector(int fmt, const uint8_t* t, int g) {
  if (fmt == SD_Q8_0) return _mm256_loadu_si256((const __m256i*)(t + 16 + 32 * g));
  const uint8_t* q = t + (fmt == SD_Q4_1 ? 32 : fmt == SD_Q5_0 ? 48 : 16);
  const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * (g % 4)));
  __m256i u = _mm256_and_si256(g < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
  if (fmt == SD_Q5_0) u = _mm256_or_si256(u, fifth_bits(_mm256_loadu_si256((const __m256i*)(t + 16)), g));
  return u;
}

// Rows r0..r0+P of one tile (8 columns at wt); columns c0..c1 of it are written (the tile is computed whole:
// a column's result is the same whichever of its neighbours are written). Per block the weight vectors are
// read once and dotted with every row of the pass (vector-outer, row-inner: P independent integer chains).
// (VNNI: keep in step with passt32_pair, which runs two tiles of this in 512-bit vectors)
SD_INLINE void passt32(const int P, const int fmt, const uint8_t* wt, int64_t nb, int64_t k, const int8_t* xq,
                       const float* xd, const float* xs, const int32_t* xsum, int64_t r0, float* out, int64_t ldo,
                       int64_t n, int c0, int c1, const uint8_t* un) {
  __m256 acc[SD_PASS], macc[SD_PASS];
  for (int r = 0; r < P; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  const int macc_inline = P <= SD_MACC_INLINE;  // Q4_1's minimum term in the block loop (else in a loop of its own)
#if SD_VNNI
  const int z = zero_point32(fmt);
#else
  // Two live registers per row for the 4-bit formats in long passes (AVX2 has 16): the block's integer sum being
  // built (int16 or int32) and the float accumulator (Q5_0's second half: three; short passes: Q4_1's macc too). The zero point's correction joins the integer sum after the vector loop, and in passes of more
  // than SD_MACC_INLINE rows Q4_1's minimum term (macc) runs as a second loop over the blocks below: the same
  // operations in the same order per (row, column), so the same bits. Passes of 4 rows that kept 4 registers per
  // row spilled (47 stack references per block; docs/results/kernels/amx/README.md section 7).
  const __m256i ones = _mm256_set1_epi16(1);
  const int zshift = fmt == SD_Q4_0 ? 3 : fmt == SD_Q5_0 ? 4 : 0;  // z = 8 (Q4_0), 16 (Q5_0); Q4_1 and Q8_0 (sum(q x)): 0
#endif
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = wt + (int64_t)tile32_bytes(fmt) * b;
    prefetch_ahead(t, tile32_bytes(fmt));
    const int8_t* xb = xq + r0 * k + 32 * b;
    __m256i s[SD_PASS];
#if SD_VNNI
    for (int r = 0; r < P; ++r) s[r] = z ? _mm256_set1_epi32(-z * xsum[(r0 + r) * nb + b]) : _mm256_setzero_si256();
    // A vpdpbusd waits for its accumulator (several cycles) while two can start per cycle: with fewer than 8 rows,
    // one chain of 8 per row leaves the units idle, so each row's 8 products run as 2 or 4 independent chains
    // (vector g in chain g % chains), summed at the end: integer sums, the same int32 in any order, so the same bits.
    const int chains = P <= 2 ? 4 : P <= 4 ? 2 : 1;
    __m256i c[SD_PASS][4];
    for (int r = 0; r < P; ++r)
      for (int j = 0; j < chains; ++j) c[r][j] = j ? _mm256_setzero_si256() : s[r];
#pragma GCC unroll 8  // g must be a constant in tile32_vector (shift counts, the nibble half)
    for (int g = 0; g < 8; ++g) {
#if defined(SD_VARIANT_AVX2)  // avxvnni: a call of many rows unpacks each tile once (unpack_tile32), as on AVX2
      const __m256i u = un ? _mm256_loadu_si256((const __m256i*)(un + 256 * b + 32 * g)) : tile32_vector(fmt, t, g);
#else
      const __m256i u = tile32_vector(fmt, t, g);
#endif
      for (int r = 0; r < P; ++r)
        c[r][g % chains] = sd_dpbusd(c[r][g % chains], u, _mm256_set1_epi32(load_i32(xb + r * k + 4 * g)));
    }
    for (int r = 0; r < P; ++r) {
      s[r] = c[r][0];
      for (int j = 1; j < chains; ++j) s[r] = _mm256_add_epi32(s[r], c[r][j]);
    }
#else
    if (fmt == SD_Q8_0) {
#pragma GCC unroll 8  // g must be a constant in tile32_vector (shift counts, the nibble half)
      for (int g = 0; g < 8; ++g) {
        const __m256i q = _mm256_xor_si256(tile32_vector(fmt, t, g), _mm256_set1_epi8((char)0x80)), a = _mm256_sign_epi8(q, q);
        for (int r = 0; r < P; ++r) {
          const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xb + r * k + 4 * g)), q);
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, x), ones);
          s[r] = g ? _mm256_add_epi32(s[r], p) : p;
          if (P > SD_MACC_INLINE) SD_OPAQUE(s[r]);
        }
      }
    } else {
      const int span = fmt == SD_Q5_0 ? 4 : 8;  // vectors per int16 sum (see the bounds above)
      __m256i s16[SD_PASS];
      for (int r = 0; r < P; ++r) s16[r] = _mm256_setzero_si256();  // (set at g = 0; this quiets gcc)
#pragma GCC unroll 8  // g must be a constant in tile32_vector (shift counts, the nibble half)
      for (int g = 0; g < 8; ++g) {
        const __m256i u = un ? _mm256_loadu_si256((const __m256i*)(un + 256 * b + 32 * g)) : tile32_vector(fmt, t, g);
        for (int r = 0; r < P; ++r) {
          const __m256i p = _mm256_maddubs_epi16(u, _mm256_set1_epi32(load_i32(xb + r * k + 4 * g)));
          s16[r] = g % span ? _mm256_add_epi16(s16[r], p) : p;
          if (P > SD_MACC_INLINE) SD_OPAQUE(s16[r]);  // short passes: registers to spare, and a tree of sums is shorter
          if (g % span == span - 1) {
            const __m256i w = _mm256_madd_epi16(s16[r], ones);
            s[r] = g == span - 1 ? w : _mm256_add_epi32(s[r], w);
          }
        }
      }
    }
    if (zshift)
      for (int r = 0; r < P; ++r)
        s[r] = _mm256_sub_epi32(s[r], _mm256_slli_epi32(_mm256_set1_epi32(xsum[(r0 + r) * nb + b]), zshift));
#endif
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)t));
    const __m256 mw = fmt == SD_Q4_1 && macc_inline ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + 16))) : dw;
    for (int r = 0; r < P; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dw, _mm256_set1_ps(xd[i])), acc[r]);
      if (fmt == SD_Q4_1 && macc_inline) macc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[i]), macc[r]);
    }
  }
  if (fmt == SD_Q4_1 && !macc_inline)  // the minimum term, blocks in order (see above)
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(wt + (int64_t)tile32_bytes(fmt) * b + 16)));
      for (int r = 0; r < P; ++r) macc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[(r0 + r) * nb + b]), macc[r]);
    }
  for (int r = 0; r < P; ++r) {
    const __m256 o = fmt == SD_Q4_1 ? _mm256_add_ps(acc[r], macc[r]) : acc[r];
    store_tile(out + (r0 + r) * ldo + n, o, c0, c1);
  }
}

#if defined(SD_VARIANT_AVX512VNNI)
// Two tiles at once on 512-bit vectors (VNNI): lanes 0-7 = tile A's 8 columns, lanes 8-15 = tile B's. Every
// lane runs the instructions of the VNNI branch of passt32 (above) / passt / passt6 (below) on the same
// integers and floats, in the same order (integer sums may associate differently, e.g. passt32's chains of
// short passes: they are exact, so the int32 is the same) (a 512-bit vpdpbusd / vpmulld / vcvtdq2ps / vfmadd is the 256-bit one
// on each half), so a column's bits are the same whether its tile runs alone or in a pair: an edit to one of
// those kernels needs the same edit to its _pair twin (tests/test_lowbit.py compares them on VNNI machines).
// What changes is the work per weight: one broadcast of 4 activation bytes feeds 16 columns, halving the
// loads and the instructions per multiply-add (docs/results/kernels/pair512/).
#ifndef SD_PASSZ
#define SD_PASSZ 8
#endif
#ifndef SD_PAIR_TILES  // 0: tiles one at a time (the A/B builds, docs/results/kernels/pair512)
#define SD_PAIR_TILES 1
#endif
// The fewest rows that run pairs, per format (Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q6_K). Pairs win wherever the weights
// come from the caches (1.03-1.4x at 1-64 rows), but a real model streams them from memory, and two tiles read
// side by side (two streams 8 weight rows apart) then read at about half the speed of one: on the Qwen 1.5B,
// the 0.5B and SmolLM2 (2 threads, 256 tokens of context) pairs cost 1.1-1.5x at 1-4 rows and win from 8 rows
// for the K-quants (1.09-1.18x), from 16 for the 32-weight formats (1.0-1.2x), and in a prefill's pieces of
// 512 rows (pair512/model_ab.txt; what was tried to stream pairs at full speed: pair512/README.md).
// With the weights prefetched (prefetch_ahead), on the Intel Xeon (docs/results/kernels/amx/pairs_ab.txt, the
// same script): SmolLM2's Q4_1 pairs from 4 rows run 4 / 6 / 8 rows 1.09 / 1.19 / 1.25x faster (Q4_0: the same
// code, taken along); the 0.5B's Q5_0 / Q8_0 lost 1.1x at 4-6 rows (kept at 16); short-row K-quant pairs at 8 rows
// lost 1.10x on the 1.5B (kept at 8, as the AMD EPYC measured). Not re-measured on the AMD machines. (Superseded:)
// With each stream of a pair prefetched ahead of its own block and into the next pair (prefetch_pair; the
// half-speed streams above were the start of tile B left unfetched), on the Intel Xeon: Q5_0 / Q8_0 pairs from 4
// rows run the 0.5B's 4 / 6 / 8 tokens 1.08 / 1.16 / 1.25x faster, SmolLM2 (its Q8_0 weights) 1.03-1.04x; the
// 1.5B's short-row K-quant pairs at 8 rows went from 1.10x slower to even (kept at 8); pairs from 2 rows for the
// 32-weight formats: 0.99-1.06x, within the noise (docs/results/kernels/amx/pairs_ab.txt, run 3).
// -DSD_PAIR_AB makes it a variable that pair512/ab_model.py sets in a running forward.
#ifdef SD_PAIR_AB
int sd_pair_min_rows[6] = {4, 4, 4, 4, 8, 8};
#else
static const int sd_pair_min_rows[6] = {4, 4, 4, 4, 8, 8};
#endif
// The fewest rows that run K-quant pairs at nb super-blocks per row (streamed weights, 2 threads, Q4_K / Q6_K, pairs
// over single tiles: 8,960 inputs 1.12-1.26x at 2 rows, 1.49-1.54x at 4; 4,864: 0.94-1.01x at 2, 1.29x at 3,
// 1.42x at 4; 3,072: 0.64x at 2, 0.98-1.22x at 4, 1.38x at 6; docs/results/kernels/longk/)
static inline int pair_rows_long(int64_t nb, int fallback) {
  const int most = nb >= 32 ? 2 : nb >= 16 ? 3 : nb >= 12 ? 6 : fallback;
  return most < fallback ? most : fallback;
}
static inline __m512i join_i(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512 join_f(__m256 lo, __m256 hi) {
  return _mm512_castsi512_ps(join_i(_mm256_castps_si256(lo), _mm256_castps_si256(hi)));
}
static inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return join_i(_mm256_loadu_si256((const __m256i*)a), _mm256_loadu_si256((const __m256i*)b));
}
SD_INLINE void store_pair(float* dst, __m512 o) { _mm512_storeu_ps(dst, o); }  // tiles A, B adjacent in dst

// weight vector g of two tile blocks (tile A's in lanes 0-7, tile B's in 8-15), as tile32_vector
static inline __m512i tile32_vector_pair(int fmt, const uint8_t* ta, const uint8_t* tb, int g) {
  if (fmt == SD_Q8_0) return load_pair(ta + 16 + 32 * g, tb + 16 + 32 * g);
  const int o = fmt == SD_Q4_1 ? 32 : fmt == SD_Q5_0 ? 48 : 16;
  const __m512i v = load_pair(ta + o + 32 * (g % 4), tb + o + 32 * (g % 4));
  __m512i u = _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F));
  if (fmt == SD_Q5_0) {  // fifth_bits on 512 bits: bit g of every byte -> 0x10
    const __m512i hb = load_pair(ta + 16, tb + 16);
    const __m512i m = g < 4 ? _mm512_slli_epi16(hb, 4 - g) : g == 4 ? hb : _mm512_srli_epi16(hb, g - 4);
    u = _mm512_or_si512(u, _mm512_and_si512(m, _mm512_set1_epi8(0x10)));
  }
  return u;
}

// passt32 for whole tiles A = wa and B = wa + 8 ldw (columns n .. n + 15), each lane as passt32's
SD_INLINE void passt32_pair(const int P, const int fmt, const uint8_t* wa, const uint8_t* wb, int64_t nb, int64_t k,
                            const int8_t* xq, const float* xd, const float* xs, const int32_t* xsum, int64_t r0,
                            float* out, int64_t ldo, int64_t n) {
  const int z = zero_point32(fmt);
  __m512 acc[SD_PASSZ], macc[SD_PASSZ];
  for (int r = 0; r < P; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *ta = wa + (int64_t)tile32_bytes(fmt) * b, *tb = wb + (int64_t)tile32_bytes(fmt) * b;
    prefetch_pair(ta, tb, (int64_t)(tile32_bytes(fmt)) * b, (int64_t)(tile32_bytes(fmt)) * nb, tile32_bytes(fmt));
    const int8_t* xb = xq + r0 * k + 32 * b;
    __m512i s[SD_PASSZ];
    for (int r = 0; r < P; ++r) s[r] = z ? _mm512_set1_epi32(-z * xsum[(r0 + r) * nb + b]) : _mm512_setzero_si512();
#pragma GCC unroll 8  // g must be a constant in tile32_vector_pair
    for (int g = 0; g < 8; ++g) {
      const __m512i u = tile32_vector_pair(fmt, ta, tb, g);
      for (int r = 0; r < P; ++r) s[r] = _mm512_dpbusd_epi32(s[r], u, _mm512_set1_epi32(load_i32(xb + r * k + 4 * g)));
    }
    const __m512 dw = join_f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)ta)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)tb)));
    const __m512 mw = fmt == SD_Q4_1 ? join_f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ta + 16))),
                                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tb + 16)))) : dw;
    for (int r = 0; r < P; ++r) {
      const int64_t i = (r0 + r) * nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(dw, _mm512_set1_ps(xd[i])), acc[r]);
      if (fmt == SD_Q4_1) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[i]), macc[r]);
    }
  }
  for (int r = 0; r < P; ++r) store_pair(out + (r0 + r) * ldo + n, fmt == SD_Q4_1 ? _mm512_add_ps(acc[r], macc[r]) : acc[r]);
}
#endif

#if defined(SD_AMX)
// ---------------------------------------------------------------------------------------------
// AMX-INT8 (Intel Xeon Sapphire Rapids and later; the "amx" variant: the VNNI code plus this). A tile
// dot product (tdpbsud: signed activations x unsigned weights) computes, for 16 activation rows and 16
// columns at once, the exact int32 sums that 8 vpdpbusd per row compute in passt32_pair / passt_pair /
// passt6_pair: the unpacked weights of a tile pair, stored as the pair's vectors g (byte 4c + e = weight
// 4g + e of column c, 64 bytes), are exactly a B tile (K / 4 rows of 64 bytes), and 16 rows' activations
// with stride k are an A tile. The integers are the same (exact sums), and every float operation after
// them is the pair kernel's, in its order: a column's bits do not change (tests/test_lowbit.py compares
// the amx variant with avx512vnni bit for bit). Where it pays: many rows (a prompt's prefill pieces; from
// sd_amx_min_rows below): the weights of a pair are unpacked once per call into a workspace (L1 at short rows,
// L2 at long ones: up to 300 KB for Q4_K at 8,960 inputs) and every group of 16 rows reads them from there; per
// 16 rows and 32 weights one tile instruction replaces 128 vpdpbusd. Rows left after the last whole group of 16
// run the VNNI passes.
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SD_AMX_ROWS 16
typedef struct {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} AmxConfig;

#define SD_ARCH_REQ_XCOMP_PERM 0x1023  // arch_prctl request (Linux 5.16+)
#define SD_XFEATURE_XTILEDATA 18       // the tile data state component
static int amx_state;  // 0: not asked yet, 1: the kernel lets this process use the tile registers, -errno: refused
// Linux hands out the tile state only on request; the permission is per process. Refused (an old kernel, a
// hypervisor): the VNNI passes run everything, and sd_amx_state() says so (lowbit_kernels.kernel_status).
static int amx_ready(void) {
  int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
  if (s == 0) {
    s = syscall(SYS_arch_prctl, SD_ARCH_REQ_XCOMP_PERM, SD_XFEATURE_XTILEDATA) == 0 ? 1 : (errno ? -errno : -1);
    __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
  }
  return s > 0;
}
// 1: tile products run in this process; -errno: Linux refused the tile state (the VNNI passes run everything)
int sd_amx_state(void) {
  amx_ready();
  return __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
}
// Tiles 0-3: C (16 rows x 16 int32); 4-5: A (16 rows x kbytes activations); 6-7: B (kbytes / 4 rows x 64 bytes).
static void amx_configure(int kbytes) {
  AmxConfig c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = SD_AMX_ROWS, c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = SD_AMX_ROWS, c.colsb[t] = (uint16_t)kbytes;
  for (int t = 6; t < 8; ++t) c.rows[t] = (uint8_t)(kbytes / 4), c.colsb[t] = 64;
  _tile_loadconfig(&c);
}
// Four products C_i = A_i . B_i (tiles 0-3), each from zero, stored to c + 256 i (int32 [16][16] each):
// a[i] 16 activation rows (stride lda bytes), b[i] the B tile (rows of 64 bytes).
SD_INLINE void amx_four(const int8_t* const a[4], int64_t lda, const uint8_t* const b[4], int32_t* c) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, a[0], lda); _tile_loadd(6, b[0], 64); _tile_dpbsud(0, 4, 6);
  _tile_loadd(5, a[1], lda); _tile_loadd(7, b[1], 64); _tile_dpbsud(1, 5, 7);
  _tile_loadd(4, a[2], lda); _tile_loadd(6, b[2], 64); _tile_dpbsud(2, 4, 6);
  _tile_loadd(5, a[3], lda); _tile_loadd(7, b[3], 64); _tile_dpbsud(3, 5, 7);
  _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
}
// The fewest rows that run tile products, per format (Q4_0 Q4_1 Q5_0 Q8_0 Q4_K Q6_K): the workspace (a pair's
// weights unpacked and stored) pays for itself over several groups of 16 rows. Tile products over VNNI pairs
// (docs/results/kernels/amx/README.md: 2 threads, one shape per format of the Qwen 1.5B / 0.5B and SmolLM2):
// 16 rows 0.77-1.06x for the 32-weight formats and Q4_K, 1.25-1.33x for Q6_K; 32 rows 0.91-1.14x / 1.28x (Q4_K)
// / 1.73x (Q6_K); 128 rows 1.07-1.38x / 1.76x / 1.60x; 512 rows 1.08-1.34x / 1.69x / 2.44x (48 rows, between the
// 32 and 128 points, not measured alone). Groups of fewer than 16 rows (tiles configured to 8-15 rows) lost to
// the VNNI passes at 8-12 rows: 0.55-1.07x; not kept.
#ifdef SD_AMX_AB
int sd_amx_min_rows[6] = {48, 48, 48, 48, 32, 16};
#else
static const int sd_amx_min_rows[6] = {48, 48, 48, 48, 32, 16};
#endif
// Rows of a call that run tile products (whole groups of 16; the rest runs VNNI passes)
static inline int64_t amx_rows_of(int fmt, int64_t rows) {
  return rows >= sd_amx_min_rows[fmt] ? rows / SD_AMX_ROWS * SD_AMX_ROWS : 0;
}
static void* amx_alloc(size_t bytes) {  // 64-byte aligned workspace
  void* p = aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) abort();
  return p;
}

// 32-weight formats: per block of the pair, workspace = its 8 weight vectors (512 bytes: the B tile), dw, mw
#define SD_AMX_B32 640
static void amx_unpack32(int fmt, const uint8_t* wa, const uint8_t* wb, int64_t nb, uint8_t* ws) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *ta = wa + (int64_t)tile32_bytes(fmt) * b, *tb = wb + (int64_t)tile32_bytes(fmt) * b;
    prefetch_pair(ta, tb, (int64_t)(tile32_bytes(fmt)) * b, (int64_t)(tile32_bytes(fmt)) * nb, tile32_bytes(fmt));
    uint8_t* o = ws + SD_AMX_B32 * b;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) _mm512_store_si512((__m512i*)(o + 64 * g), tile32_vector_pair(fmt, ta, tb, g));
    const __m512 dw = join_f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)ta)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)tb)));
    const __m512 mw = fmt == SD_Q4_1 ? join_f(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ta + 16))),
                                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tb + 16)))) : dw;
    _mm512_store_ps((float*)(o + 512), dw);
    _mm512_store_ps((float*)(o + 576), mw);
  }
}
// Rows r0 .. r0 + 16 of the pair unpacked at ws (columns n .. n + 15): passt32_pair's operations per lane
SD_INLINE void amx_pass32(const int fmt, const uint8_t* ws, int64_t nb, int64_t k, const int8_t* xq, const float* xd,
                       const float* xs, const int32_t* xsum, int64_t r0, float* out, int64_t ldo, int64_t n) {
  const int z = zero_point32(fmt);
  __m512 acc[SD_AMX_ROWS], macc[SD_AMX_ROWS];
  for (int r = 0; r < SD_AMX_ROWS; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  int32_t c[4 * 256] __attribute__((aligned(64)));
  for (int64_t b0 = 0; b0 < nb; b0 += 4) {
    const int m = nb - b0 < 4 ? (int)(nb - b0) : 4;
    const int8_t* a[4];
    const uint8_t* bt[4];
    for (int i = 0; i < 4; ++i) {  // a short last round repeats its last block (results unused)
      const int64_t b = b0 + (i < m ? i : m - 1);
      a[i] = xq + r0 * k + 32 * b;
      bt[i] = ws + SD_AMX_B32 * b;
    }
    amx_four(a, k, bt, c);
    for (int i = 0; i < m; ++i) {
      const int64_t b = b0 + i;
      const __m512 dw = _mm512_load_ps((const float*)(ws + SD_AMX_B32 * b + 512));
      const __m512 mw = _mm512_load_ps((const float*)(ws + SD_AMX_B32 * b + 576));
      for (int r = 0; r < SD_AMX_ROWS; ++r) {
        const int64_t x = (r0 + r) * nb + b;
        const __m512i s = _mm512_add_epi32(_mm512_load_si512((const __m512i*)(c + 256 * i + 16 * r)), _mm512_set1_epi32(-z * xsum[x]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(xd[x])), acc[r]);
        if (fmt == SD_Q4_1) macc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[x]), macc[r]);
      }
    }
  }
  for (int r = 0; r < SD_AMX_ROWS; ++r)
    store_pair(out + (r0 + r) * ldo + n, fmt == SD_Q4_1 ? _mm512_add_ps(acc[r], macc[r]) : acc[r]);
}
#endif

// Column n after the last tile (column layout, soa()), every row: a tile lane's integers (any order: exact)
// and its float operations in its order.
static void tail32(int fmt, const Soa* a, int64_t nb, int64_t k, const int8_t* xq, const float* xd, const float* xs,
                   const int32_t* xsum, int64_t rows, float* out, int64_t ldo, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.0f, macc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t i = r * nb + b;
      const __m256i u = unpack32(fmt, a, b), x = _mm256_loadu_si256((const __m256i*)(xq + r * k + 32 * b));
      const int32_t isum = fmt == SD_Q8_0 ? hsum_i32(dot_u8s8(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u)))  // q . x
                                          : hsum_i32(dot_u8s8(u, x)) - zero_point32(fmt) * xsum[i];
      acc = fmaf((float)isum, f16(a->d + 2 * b) * xd[i], acc);
      if (fmt == SD_Q4_1) macc = fmaf(f16(a->m + 2 * b), xs[i], macc);
    }
    out[r * ldo + n] = fmt == SD_Q4_1 ? acc + macc : acc;
  }
}

#if !defined(SD_VARIANT_AVX512VNNI)
// A tile's weight vectors unpacked once for all the passes of a call of many rows (tile32_vector's bytes, block b's
// vector g at un + 256 b + 32 g): the passes then load them instead of unpacking each again (4-bit: an and, or a
// shift and an and, per vector and pass; Q5_0 three more). The same bytes, so the same integers and bits.
#ifndef SD_NO_UNPACK
#define SD_NO_UNPACK 0
#endif
static void unpack_tile32(int fmt, const uint8_t* wt, int64_t nb, uint8_t* un) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = wt + (int64_t)tile32_bytes(fmt) * b;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) _mm256_storeu_si256((__m256i*)(un + 256 * b + 32 * g), tile32_vector(fmt, t, g));
  }
}
#endif

static void gemm32(int fmt, const uint8_t* w, int64_t ldw, int64_t k, const int8_t* xq, const float* xd,
                   const float* xs, int64_t rows, float* out, int64_t ldo, int64_t n0, int64_t n1, int64_t n_out) {
  const int64_t nb = k / 32;
  const int64_t tiled = n_out / SD_TILE * SD_TILE;
  // each activation block's integer sum (the integer zero points, passt32 / tail32)
  int32_t* xsum = (int32_t*)malloc(sizeof(int32_t) * (size_t)(rows * nb + 1));
  if (!xsum) abort();
  for (int64_t i = 0; i < rows * nb; ++i)
    xsum[i] = hsum_i32(dot_u8s8(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i*)(xq + 32 * i))));
  int64_t n = n0;
#if defined(SD_VARIANT_AVX512VNNI)
  // whole tiles two at a time (passt32_pair); an odd one runs alone below
#if defined(SD_AMX)
  // (only where the pair loop below runs a pair: the same conditions as its first iteration)
  const int pairs_run = SD_PAIR_TILES && rows >= sd_pair_min_rows[fmt] && n % SD_TILE == 0 && n + 2 * SD_TILE <= n1 &&
                        n + 2 * SD_TILE <= tiled;
  const int64_t amx_rows = pairs_run && amx_rows_of(fmt, rows) && amx_ready() ? amx_rows_of(fmt, rows) : 0;
  uint8_t* ws = amx_rows ? (uint8_t*)amx_alloc((size_t)(SD_AMX_B32 * nb)) : NULL;
  if (amx_rows) amx_configure(32);
#else
  const int64_t amx_rows = 0;
#endif
  for (; SD_PAIR_TILES && rows >= sd_pair_min_rows[fmt] && n % SD_TILE == 0 && n + 2 * SD_TILE <= n1 && n + 2 * SD_TILE <= tiled;
       n += 2 * SD_TILE) {
#if defined(SD_AMX)
    if (amx_rows) {
      amx_unpack32(fmt, w + n * ldw, w + (n + SD_TILE) * ldw, nb, ws);
      for (int64_t r0 = 0; r0 < amx_rows; r0 += SD_AMX_ROWS) switch (fmt) {  // one copy per format (its zero point, Q4_1's sums)
          case SD_Q4_0: amx_pass32(SD_Q4_0, ws, nb, k, xq, xd, xs, xsum, r0, out, ldo, n); break;
          case SD_Q4_1: amx_pass32(SD_Q4_1, ws, nb, k, xq, xd, xs, xsum, r0, out, ldo, n); break;
          case SD_Q5_0: amx_pass32(SD_Q5_0, ws, nb, k, xq, xd, xs, xsum, r0, out, ldo, n); break;
          default: amx_pass32(SD_Q8_0, ws, nb, k, xq, xd, xs, xsum, r0, out, ldo, n); break;
        }
    }
#endif
    for (int64_t r0 = amx_rows; r0 < rows; r0 += SD_PASSZ) {
      const int64_t p = rows - r0 < SD_PASSZ ? rows - r0 : SD_PASSZ;
      switch (fmt * 16 + p) {
#define SD_CASE(F, P) case F * 16 + P: passt32_pair(P, F, w + n * ldw, w + (n + SD_TILE) * ldw, nb, k, xq, xd, xs, xsum, r0, out, ldo, n); break;
#define SD_ROWS(F) SD_CASE(F, 1) SD_CASE(F, 2) SD_CASE(F, 3) SD_CASE(F, 4) SD_CASE(F, 5) SD_CASE(F, 6) SD_CASE(F, 7) SD_CASE(F, 8)
        SD_ROWS(SD_Q4_0) SD_ROWS(SD_Q4_1) SD_ROWS(SD_Q5_0) SD_ROWS(SD_Q8_0)
#undef SD_ROWS
#undef SD_CASE
        default: abort();
      }
    }
  }
#if defined(SD_AMX)
  if (amx_rows) _tile_release();
  free(ws);
#endif
#endif
  // more rows than one pass (a prompt's pieces; not Q8_0, whose vectors unpack in one xor): each tile unpacked once
  const int pass = SD_PASS32(fmt);
#if defined(SD_VARIANT_AVX512VNNI)
  uint8_t* un = NULL;
#else
  uint8_t* un = !SD_NO_UNPACK && rows > pass && fmt != SD_Q8_0 && n < n1 && n < tiled ? (uint8_t*)malloc((size_t)(256 * nb)) : NULL;
#endif
  for (; n < n1 && n < tiled; n = n / SD_TILE * SD_TILE + SD_TILE) {
    const int64_t base = n / SD_TILE * SD_TILE;
    const int c0 = (int)(n - base), c1 = (int)((n1 < base + SD_TILE ? n1 : base + SD_TILE) - base);
#if !defined(SD_VARIANT_AVX512VNNI)
    if (un) unpack_tile32(fmt, w + base * ldw, nb, un);
#endif
    for (int64_t r0 = 0; r0 < rows; r0 += pass) {
      const int64_t p = rows - r0 < pass ? rows - r0 : pass;
      switch (fmt * 16 + p) {
#define SD_CASE(F, P) case F * 16 + P: passt32(P, F, w + base * ldw, nb, k, xq, xd, xs, xsum, r0, out, ldo, base, c0, c1, un); break;
#define SD_ROWS(F) SD_CASE(F, 1) SD_CASE(F, 2) SD_CASE(F, 3) SD_CASE(F, 4) SD_MORE(F)
#if SD_PASS > 6
#define SD_MORE(F) SD_CASE(F, 5) SD_CASE(F, 6) SD_CASE(F, 7) SD_CASE(F, 8)
#elif SD_PASS > 4
#define SD_MORE(F) SD_CASE(F, 5) SD_CASE(F, 6)
#else
#define SD_MORE(F)
#endif
        SD_ROWS(SD_Q4_0) SD_ROWS(SD_Q4_1) SD_ROWS(SD_Q5_0) SD_ROWS(SD_Q8_0)
#undef SD_MORE
#undef SD_ROWS
#undef SD_CASE
        default: abort();  // a pass above SD_PASS (an SD_PASS32 override): never leave outputs unwritten
      }
    }
  }
  free(un);
  for (; n < n1; ++n) {
    const Soa a = soa(fmt, w + n * ldw, nb);
    tail32(fmt, &a, nb, k, xq, xd, xs, xsum, rows, out, ldo, n);
  }
  free(xsum);
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

static inline __m256i pick16(__m256i v, int lo, int hi) {  // low lane: int16 lo, high lane: int16 hi
  const __m256i idx = _mm256_setr_epi8(2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
                                       2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1, 2 * lo, 2 * lo + 1,
                                       2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1,
                                       2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1, 2 * hi, 2 * hi + 1);
  return _mm256_shuffle_epi8(v, idx);
}

// Q4_K's 6-bit scales and minimums of its 8 sub-blocks: 12 bytes at blk + 4, repacked at load
// (specdecode/lowbit_kernels.py, the same 12 bytes) so that they decode in a few vector instructions. With
// v[0..7] the scales and v[8..15] the minimums: byte i < 8 holds the low four bits of v[i] (low nibble)
// and of v[8 + i] (high nibble); bytes 8..11 hold the high two bits, value 4t + b at bits 2t..2t+1 of
// byte 8 + b. Returns the 16 values as bytes, v[0] first.
static inline __m128i q4k_scale_bytes(const uint8_t* s) {
  const __m128i lo = _mm_loadl_epi64((const __m128i*)s);
  const __m128i nib = _mm_and_si128(_mm_unpacklo_epi64(lo, _mm_srli_epi16(lo, 4)), _mm_set1_epi8(0x0F));
  uint32_t h;
  memcpy(&h, s + 8, 4);
  // dword t: h shifted so that field t of every byte lands on bits 4-5 (t = 0: << 4, 1: << 2, 2: as is, 3: >> 2)
  __m128i hv = _mm_srlv_epi32(_mm_sllv_epi32(_mm_set1_epi32((int)h), _mm_setr_epi32(4, 2, 0, 0)),
                              _mm_setr_epi32(0, 0, 0, 2));
  return _mm_or_si128(nib, _mm_and_si128(hv, _mm_set1_epi8(0x30)));
}

// sc = the 8 scales as int16 in both 128-bit lanes; msc = the minimums, each twice (one per 16 elements)
static inline void q4k_scales(const uint8_t* blk, __m256i* sc, __m256i* msc) {
  const __m128i v = q4k_scale_bytes(blk + 4);
  *sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(v, v));
  *msc = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
}

static inline void unpack_q4k(const uint8_t* blk, SuperBlock* sb) {
  sb->d = f16(blk);
  sb->dmin = f16(blk + 2);
  __m256i sc;
  q4k_scales(blk, &sc, &sb->msc);
  const uint8_t* qs = blk + 16;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
    sb->u[2 * c] = _mm256_and_si256(v, m4);
    sb->u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
  for (int j = 0; j < 8; ++j) sb->sc[j] = pick16(sc, j, j);
}

static inline void unpack_q6k(const uint8_t* blk, SuperBlock* sb) {
  const uint8_t *ql = blk, *qh = blk + 128;
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
  // 16 int8 scales, one per 16 elements: sub-block j takes scales 2j (low lane) and 2j + 1 (high lane)
  const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));
  const __m256i lo = _mm256_permute2x128_si256(s16, s16, 0x00), hi = _mm256_permute2x128_si256(s16, s16, 0x11);
  for (int j = 0; j < 4; ++j) {
    sb->sc[j] = pick16(lo, 2 * j, 2 * j + 1);
    sb->sc[j + 4] = pick16(hi, 2 * j, 2 * j + 1);
  }
  sb->msc = s16;
}

// Two sub-blocks (u0: scale vector c0, u1: c1) of P rows: x at sub-block offsets j0, j1 (x 32 bytes)
#define SD_PAIR(u0, c0, j0, u1, c1, j1)                                                                  \
  for (int r = 0; r < P; ++r) {                                                                         \
    const int8_t* xr = xq + (r0 + r) * k + 256 * b;                                                     \
    s0[r] = dot_scaled(s0[r], u0, _mm256_loadu_si256((const __m256i*)(xr + 32 * (j0))), c0);           \
    s1[r] = dot_scaled(s1[r], u1, _mm256_loadu_si256((const __m256i*)(xr + 32 * (j1))), c1);           \
  }

// Rows r0..r0+P of one column of K-quant super-blocks, unpacked in registers as they are read (every
// row of the pass consumes them). Integer sums inside a super-block (exact in any order), one float
// accumulator per row across super-blocks (and one for Q4_K's minimums), whatever P.
SD_INLINE void passk(const int P, const int q6, const uint8_t* wn, int64_t nb, int64_t k, const int8_t* xq,
                     const float* xd, const int16_t* bsums, int64_t r0, float* out, int64_t ldo, int64_t n) {
  __m256 acc[SD_PASSK];
  float qacc[SD_PASSK], qmacc[SD_PASSK];
  for (int r = 0; r < P; ++r) acc[r] = _mm256_setzero_ps(), qacc[r] = qmacc[r] = 0.0f;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s0[SD_PASSK], s1[SD_PASSK], msc;
    for (int r = 0; r < P; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
    float d, dmin = 0.0f;
    if (q6) {
      const uint8_t* blk = wn + 210 * b;
      d = f16(blk + 208);
      const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));
      msc = s16;
      for (int h = 0; h < 2; ++h) {
        const __m256i sh = h ? _mm256_permute2x128_si256(s16, s16, 0x11) : _mm256_permute2x128_si256(s16, s16, 0x00);
        const __m256i l0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
        const __m256i u0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
        const __m256i u1 = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
        SD_PAIR(u0, pick16(sh, 0, 1), 4 * h, u1, pick16(sh, 2, 3), 4 * h + 1)
        const __m256i u2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
        const __m256i u3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
        SD_PAIR(u2, pick16(sh, 4, 5), 4 * h + 2, u3, pick16(sh, 6, 7), 4 * h + 3)
      }
    } else {
      const uint8_t* blk = wn + 144 * b;
      d = f16(blk);
      dmin = f16(blk + 2);
      __m256i sc;
      q4k_scales(blk, &sc, &msc);
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 16 + 32 * c));
        const __m256i u0 = _mm256_and_si256(v, m4), u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        SD_PAIR(u0, pick16(sc, 2 * c, 2 * c), 2 * c, u1, pick16(sc, 2 * c + 1, 2 * c + 1), 2 * c + 1)
      }
    }
    for (int r = 0; r < P; ++r) {
      const int64_t row = r0 + r;
      __m256i sumi = _mm256_add_epi32(s0[r], s1[r]);
      const __m256i bs = _mm256_loadu_si256((const __m256i*)(bsums + row * (k / 16) + 16 * b));
      const __m256i summ = _mm256_madd_epi16(msc, bs);  // per pair of 16s: m * (sum of x)
      const float dx = xd[row * nb + b];
      if (q6) {  // w = d * sc * (u - 32): the zero point is an integer too (a tile lane's operations, see passt6)
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(summ, 5));
#if SD_Q6K_TILES
        qacc[r] = fmaf((float)hsum_i32(sumi), d * dx, qacc[r]);
#else
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * dx), acc[r]);
#endif
      } else {  // Q4_K (a column after the last tile): the integers and float operations of a tile's lane
        qacc[r] = fmaf((float)hsum_i32(sumi), d * dx, qacc[r]);
        qmacc[r] = fmaf((float)hsum_i32(summ), dmin * dx, qmacc[r]);
      }
    }
  }
  for (int r = 0; r < P; ++r) out[(r0 + r) * ldo + n] = q6 ? (SD_Q6K_TILES ? qacc[r] : hsum(acc[r])) : qacc[r] - qmacc[r];
}
#undef SD_PAIR

// ---------------------------------------------------------------------------------------------
// Q4_K tiles: eight output columns repacked together at load (specdecode/lowbit.py ``repack``, the same
// 144 bytes per 256 weights per column). Columns 8t..8t+7 (t < n_out / 8) occupy rows 8t..8t+7 of the
// weight (8 * nb * 144 contiguous bytes), super-block b of the eight at byte 1152 * b:
//   [0, 16)     d of the 8 columns (float16)           [16, 32)   dmin of the 8 columns (float16)
//   [32, 96)    byte i: low 4 bits of scale S[i] (low nibble) and of minimum M[i] (high nibble)
//   [96, 128)   byte i: high 2 bits of M[i] (bits 0-1), M[32 + i] (2-3), S[i] (4-5), S[32 + i] (6-7)
//               S[8j + c]: the scale of sub-block j of column c; M[16p + 2c + e]: the minimum of
//               sub-block 2p + e of column c
//   [128, 1152) sub-block j at 128 + 128 j: four 32-byte vectors h < 4, byte 4c + e: weight 32j + 4h + e
//               of column c (low nibble), weight 32j + 4(h + 4) + e (high nibble)
// One vpdpbusd (AVX2: vpmaddubsw) multiplies 4 consecutive weights of the 8 columns by the same 4
// activation bytes (a broadcast load): each column's sum stays in its lane, no horizontal sums. Per
// (row, sub-block) the 8 columns' scales apply once to the exact integer sum (VNNI: vpmulld on the
// int32 sums; AVX2: the int16 sums, at most 8 * 2 * 15 * 127 = 30480, through vpmaddwd with the scale
// twice per lane: the same integers); the minimums through the activations' sums per 32; per
// super-block one float multiply-add with the 8 columns' d * dx and one with dmin * dx. The last
// n_out % 8 columns keep the column layout above (passk), which computes the same integers and the same
// float operations as a tile's lane: a column's bits do not depend on whether it sits in a tile (fused
// q / k / v, a reduced LM head).
#define SD_TILE_SB 1152
#if defined(SD_VARIANT_AVX2)
#define SD_PASST 4
#else
#define SD_PASST 8
#endif

typedef struct {
  __m256i sc[8];  // VNNI: int32 scale per column lane; AVX2 / AVX-512: the scale as both int16 of the lane
  __m256i mp[4];  // int16 pairs per column lane: minimums of sub-blocks 2p, 2p + 1
  __m256 d, dmin;
} TileScales;

static inline __m256i tile_scale(__m128i eight) {  // 8 bytes (low half) -> one scale per 32-bit lane
#if SD_VNNI
  return _mm256_cvtepu8_epi32(eight);
#else
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(eight, eight));
#endif
}

static inline void tile_scales(const uint8_t* t, TileScales* s) {
  s->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)t));
  s->dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(t + 16)));
  const __m256i n0 = _mm256_loadu_si256((const __m256i*)(t + 32)), n1 = _mm256_loadu_si256((const __m256i*)(t + 64));
  const __m256i h = _mm256_loadu_si256((const __m256i*)(t + 96));
  const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i s0 = _mm256_or_si256(_mm256_and_si256(n0, m0f), _mm256_and_si256(h, m30));
  const __m256i s1 = _mm256_or_si256(_mm256_and_si256(n1, m0f), _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
  const __m256i mm0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n0, 4), m0f), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
  const __m256i mm1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n1, 4), m0f), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
  s->mp[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mm0));
  s->mp[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mm0, 1));
  s->mp[2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(mm1));
  s->mp[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(mm1, 1));
  const __m128i q[4] = {_mm256_castsi256_si128(s0), _mm256_extracti128_si256(s0, 1), _mm256_castsi256_si128(s1),
                        _mm256_extracti128_si256(s1, 1)};
  for (int i = 0; i < 4; ++i) {
    s->sc[2 * i] = tile_scale(q[i]);
    s->sc[2 * i + 1] = tile_scale(_mm_unpackhi_epi64(q[i], q[i]));
  }
}

// Rows r0..r0+P of one tile (8 columns at wt); xs: per row and super-block the 8 activation sums per 32
// (int16). Columns c0..c1 of the tile are written (a tile is computed whole: a column's result is the
// same whichever of its neighbours are written).
// (VNNI: keep in step with passt_pair, which runs two tiles of this in 512-bit vectors)
SD_INLINE void passt(const int P, const uint8_t* wt, int64_t nb, int64_t k, const int8_t* xq, const float* xd,
                     const int16_t* xs, int64_t r0, float* out, int64_t ldo, int64_t n, int c0, int c1) {
  __m256 acc[SD_PASST], macc[SD_PASST];
  for (int r = 0; r < P; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = wt + SD_TILE_SB * b;
    prefetch_ahead(t, SD_TILE_SB);
    TileScales s;
    tile_scales(t, &s);
    __m256i sumi[SD_PASST];
    for (int r = 0; r < P; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const uint8_t* qj = t + 128 + 128 * j;
      __m256i u[8];
      for (int h = 0; h < 4; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qj + 32 * h));
        u[h] = _mm256_and_si256(v, m4);
        u[h + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      }
      for (int r = 0; r < P; ++r) {
        const int8_t* xr = xq + (r0 + r) * k + 256 * b + 32 * j;
#if SD_VNNI
        // two chains of four (a vpdpbusd waits for its accumulator: one chain of eight would wait 8 latencies)
        __m256i dot0 = sd_dpbusd(_mm256_setzero_si256(), u[0], _mm256_set1_epi32(load_i32(xr)));
        __m256i dot1 = sd_dpbusd(_mm256_setzero_si256(), u[4], _mm256_set1_epi32(load_i32(xr + 16)));
        for (int g = 1; g < 4; ++g) {
          dot0 = sd_dpbusd(dot0, u[g], _mm256_set1_epi32(load_i32(xr + 4 * g)));
          dot1 = sd_dpbusd(dot1, u[g + 4], _mm256_set1_epi32(load_i32(xr + 4 * g + 16)));
        }
        const __m256i scaled = _mm256_mullo_epi32(_mm256_add_epi32(dot0, dot1), s.sc[j]);
#else
        __m256i d16 = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(load_i32(xr)));
        for (int g = 1; g < 8; ++g) d16 = _mm256_add_epi16(d16, _mm256_maddubs_epi16(u[g], _mm256_set1_epi32(load_i32(xr + 4 * g))));
        const __m256i scaled = _mm256_madd_epi16(d16, s.sc[j]);
#endif
        sumi[r] = _mm256_add_epi32(sumi[r], scaled);
      }
    }
    for (int r = 0; r < P; ++r) {
      const int16_t* xr = xs + ((r0 + r) * nb + b) * 8;
      __m256i summ = _mm256_madd_epi16(s.mp[0], _mm256_set1_epi32(load_i32(xr)));
      for (int p = 1; p < 4; ++p) summ = _mm256_add_epi32(summ, _mm256_madd_epi16(s.mp[p], _mm256_set1_epi32(load_i32(xr + 2 * p))));
      const __m256 dx = _mm256_set1_ps(xd[(r0 + r) * nb + b]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(s.d, dx), acc[r]);
      macc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(s.dmin, dx), macc[r]);
    }
  }
  for (int r = 0; r < P; ++r) {
    const __m256 o = _mm256_sub_ps(acc[r], macc[r]);
    store_tile(out + (r0 + r) * ldo + n, o, c0, c1);
  }
}

// Q6_K tiles (lowbit.py ``_q6k_tile``, the same 210 bytes per 256 weights per column): per super-block of
// the 8 columns 1680 bytes:
//   [0, 16)      d of the 8 columns (float16)
//   [16, 144)    int8 scale of 16 weights: byte 16 + 8 i + c: weights 16 i .. 16 i + 15 of column c
//   [144, 1680)  sub-block j at 144 + 192 j (read in order): 128 bytes of low 4 bits, as Q4_K's tiles (four
//                vectors h, byte 4c + e: weight 32j + 4h + e of column c in the low nibble, 32j + 4(h + 4) + e
//                in the high one), then 64 bytes of high 2 bits (two vectors v, byte 4c + e, bits 2q..2q+1:
//                weight 32j + 4(4v + q) + e of column c)
// w = d * sc * (u - 32), u < 64: per (row, 16 weights) one int32 sum per column (AVX2: two vpmaddubsw
// pairs add in int16, at most 2 * 2 * 63 * 127 = 32004, then vpmaddwd with the scale twice per lane;
// VNNI: vpdpbusd and vpmulld), the zero point through the activations' sums per 16 (32 * sum sc * bsum),
// per super-block one float multiply-add with the 8 columns' d * dx.
#define SD_TILE_SB6 1680

typedef struct {
  __m256i sc[16];  // VNNI: int32 scale per column lane; AVX2 / AVX-512: the scale as both int16 of the lane
  __m256i mp[8];   // int16 pairs per column lane: scales of 16-weight groups 2p, 2p + 1
  __m256 d;
} TileScales6;

static inline void tile_scales6(const uint8_t* t, TileScales6* s) {
  s->d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)t));
  for (int i = 0; i < 16; ++i) {
    const __m128i c = _mm_loadl_epi64((const __m128i*)(t + 16 + 8 * i));
#if SD_VNNI
    s->sc[i] = _mm256_cvtepi8_epi32(c);
#else
    s->sc[i] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c, c));
#endif
  }
  for (int p = 0; p < 8; ++p) {
    const __m128i q = _mm_loadu_si128((const __m128i*)(t + 16 + 16 * p));
    s->mp[p] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(q, _mm_unpackhi_epi64(q, q)));
  }
}

static inline __m256i q6_high(__m256i hv, int q) {  // bits 2q..2q+1 of every byte -> bits 4-5
  const __m256i m30 = _mm256_set1_epi8(0x30);
  switch (q) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30);
    case 2: return _mm256_and_si256(hv, m30);
    default: return _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30);
  }
}

// (VNNI: keep in step with passt6_pair, which runs two tiles of this in 512-bit vectors)
SD_INLINE void passt6(const int P, const uint8_t* wt, int64_t nb, int64_t k, const int8_t* xq, const float* xd,
                      const int16_t* bsums, int64_t r0, float* out, int64_t ldo, int64_t n, int c0, int c1) {
  __m256 acc[SD_PASST];
  for (int r = 0; r < P; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* t = wt + SD_TILE_SB6 * b;
    prefetch_ahead(t, SD_TILE_SB6);
    TileScales6 s;
    tile_scales6(t, &s);
    __m256i sumi[SD_PASST];
    for (int r = 0; r < P; ++r) sumi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const uint8_t *ql = t + 144 + 192 * j, *qh = ql + 128;
      const __m256i h0 = _mm256_loadu_si256((const __m256i*)qh), h1 = _mm256_loadu_si256((const __m256i*)(qh + 32));
      __m256i u[8];
      for (int h = 0; h < 4; ++h) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(ql + 32 * h));
        u[h] = _mm256_or_si256(_mm256_and_si256(v, m4), q6_high(h0, h));
        u[h + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), q6_high(h1, h));
      }
      for (int r = 0; r < P; ++r) {
        const int8_t* xr = xq + (r0 + r) * k + 256 * b + 32 * j;
#if SD_VNNI
        __m256i da = sd_dpbusd(_mm256_setzero_si256(), u[0], _mm256_set1_epi32(load_i32(xr)));
        __m256i db = sd_dpbusd(_mm256_setzero_si256(), u[4], _mm256_set1_epi32(load_i32(xr + 16)));
        for (int g = 1; g < 4; ++g) {
          da = sd_dpbusd(da, u[g], _mm256_set1_epi32(load_i32(xr + 4 * g)));
          db = sd_dpbusd(db, u[g + 4], _mm256_set1_epi32(load_i32(xr + 4 * g + 16)));
        }
        const __m256i scaled = _mm256_add_epi32(_mm256_mullo_epi32(da, s.sc[2 * j]), _mm256_mullo_epi32(db, s.sc[2 * j + 1]));
#else
        __m256i p[8];
        for (int g = 0; g < 8; ++g) p[g] = _mm256_maddubs_epi16(u[g], _mm256_set1_epi32(load_i32(xr + 4 * g)));
        const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), s.sc[2 * j]),
                                           _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), s.sc[2 * j]));
        const __m256i c = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), s.sc[2 * j + 1]),
                                           _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), s.sc[2 * j + 1]));
        const __m256i scaled = _mm256_add_epi32(a, c);
#endif
        sumi[r] = _mm256_add_epi32(sumi[r], scaled);
      }
    }
    for (int r = 0; r < P; ++r) {
      const int16_t* br = bsums + (r0 + r) * (k / 16) + 16 * b;
      __m256i summ = _mm256_madd_epi16(s.mp[0], _mm256_set1_epi32(load_i32(br)));
      for (int p = 1; p < 8; ++p) summ = _mm256_add_epi32(summ, _mm256_madd_epi16(s.mp[p], _mm256_set1_epi32(load_i32(br + 2 * p))));
      const __m256i total = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(summ, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(s.d, _mm256_set1_ps(xd[(r0 + r) * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < P; ++r) store_tile(out + (r0 + r) * ldo + n, acc[r], c0, c1);
}

#if defined(SD_VARIANT_AVX512VNNI)
// Q4_K, tiles A = wa and B = wa + 8 ldw (columns n .. n + 15, both whole)
SD_INLINE void passt_pair(const int P, const uint8_t* wa, const uint8_t* wb, int64_t nb, int64_t k, const int8_t* xq,
                          const float* xd, const int16_t* xs, int64_t r0, float* out, int64_t ldo, int64_t n) {
  __m512 acc[SD_PASSZ], macc[SD_PASSZ];
  for (int r = 0; r < P; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *ta = wa + SD_TILE_SB * b, *tb = wb + SD_TILE_SB * b;
    prefetch_pair(ta, tb, (int64_t)(SD_TILE_SB) * b, (int64_t)(SD_TILE_SB) * nb, SD_TILE_SB);
    TileScales sa, sb;
    tile_scales(ta, &sa);
    tile_scales(tb, &sb);
    __m512i sc[8], mp[4];
    for (int j = 0; j < 8; ++j) sc[j] = join_i(sa.sc[j], sb.sc[j]);
    for (int q = 0; q < 4; ++q) mp[q] = join_i(sa.mp[q], sb.mp[q]);
    const __m512 d = join_f(sa.d, sb.d), dmin = join_f(sa.dmin, sb.dmin);
    __m512i sumi[SD_PASSZ];
    for (int r = 0; r < P; ++r) sumi[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i u[8];
      for (int h = 0; h < 4; ++h) {
        const __m512i v = load_pair(ta + 128 + 128 * j + 32 * h, tb + 128 + 128 * j + 32 * h);
        u[h] = _mm512_and_si512(v, m4);
        u[h + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
      }
      for (int r = 0; r < P; ++r) {
        const int8_t* xr = xq + (r0 + r) * k + 256 * b + 32 * j;
        __m512i dot0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(load_i32(xr)));
        __m512i dot1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4], _mm512_set1_epi32(load_i32(xr + 16)));
        for (int g = 1; g < 4; ++g) {
          dot0 = _mm512_dpbusd_epi32(dot0, u[g], _mm512_set1_epi32(load_i32(xr + 4 * g)));
          dot1 = _mm512_dpbusd_epi32(dot1, u[g + 4], _mm512_set1_epi32(load_i32(xr + 4 * g + 16)));
        }
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(_mm512_add_epi32(dot0, dot1), sc[j]));
      }
    }
    for (int r = 0; r < P; ++r) {
      const int16_t* xr = xs + ((r0 + r) * nb + b) * 8;
      __m512i summ = _mm512_madd_epi16(mp[0], _mm512_set1_epi32(load_i32(xr)));
      for (int q = 1; q < 4; ++q) summ = _mm512_add_epi32(summ, _mm512_madd_epi16(mp[q], _mm512_set1_epi32(load_i32(xr + 2 * q))));
      const __m512 dx = _mm512_set1_ps(xd[(r0 + r) * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(d, dx), acc[r]);
      macc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, dx), macc[r]);
    }
  }
  for (int r = 0; r < P; ++r) store_pair(out + (r0 + r) * ldo + n, _mm512_sub_ps(acc[r], macc[r]));
}

// Q6_K, tiles A and B as passt_pair
SD_INLINE void passt6_pair(const int P, const uint8_t* wa, const uint8_t* wb, int64_t nb, int64_t k, const int8_t* xq,
                           const float* xd, const int16_t* bsums, int64_t r0, float* out, int64_t ldo, int64_t n) {
  __m512 acc[SD_PASSZ];
  for (int r = 0; r < P; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *ta = wa + SD_TILE_SB6 * b, *tb = wb + SD_TILE_SB6 * b;
    prefetch_pair(ta, tb, (int64_t)(SD_TILE_SB6) * b, (int64_t)(SD_TILE_SB6) * nb, SD_TILE_SB6);
    TileScales6 sa, sb;
    tile_scales6(ta, &sa);
    tile_scales6(tb, &sb);
    __m512i sc[16], mp[8];
    for (int i = 0; i < 16; ++i) sc[i] = join_i(sa.sc[i], sb.sc[i]);
    for (int q = 0; q < 8; ++q) mp[q] = join_i(sa.mp[q], sb.mp[q]);
    const __m512 d = join_f(sa.d, sb.d);
    __m512i sumi[SD_PASSZ];
    for (int r = 0; r < P; ++r) sumi[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const int64_t o = 144 + 192 * j;
      const __m512i h0 = load_pair(ta + o + 128, tb + o + 128), h1 = load_pair(ta + o + 160, tb + o + 160);
      __m512i u[8];
      for (int h = 0; h < 4; ++h) {
        const __m512i v = load_pair(ta + o + 32 * h, tb + o + 32 * h);
        // q6_high on 512 bits: bits 2h..2h+1 of every byte -> bits 4-5
        const __m512i hi0 = h == 0 ? _mm512_slli_epi16(h0, 4) : h == 1 ? _mm512_slli_epi16(h0, 2) : h == 2 ? h0 : _mm512_srli_epi16(h0, 2);
        const __m512i hi1 = h == 0 ? _mm512_slli_epi16(h1, 4) : h == 1 ? _mm512_slli_epi16(h1, 2) : h == 2 ? h1 : _mm512_srli_epi16(h1, 2);
        u[h] = _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(hi0, m30));
        u[h + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(hi1, m30));
      }
      for (int r = 0; r < P; ++r) {
        const int8_t* xr = xq + (r0 + r) * k + 256 * b + 32 * j;
        __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_set1_epi32(load_i32(xr)));
        __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4], _mm512_set1_epi32(load_i32(xr + 16)));
        for (int g = 1; g < 4; ++g) {
          da = _mm512_dpbusd_epi32(da, u[g], _mm512_set1_epi32(load_i32(xr + 4 * g)));
          db = _mm512_dpbusd_epi32(db, u[g + 4], _mm512_set1_epi32(load_i32(xr + 4 * g + 16)));
        }
        const __m512i scaled = _mm512_add_epi32(_mm512_mullo_epi32(da, sc[2 * j]), _mm512_mullo_epi32(db, sc[2 * j + 1]));
        sumi[r] = _mm512_add_epi32(sumi[r], scaled);
      }
    }
    for (int r = 0; r < P; ++r) {
      const int16_t* br = bsums + (r0 + r) * (k / 16) + 16 * b;
      __m512i summ = _mm512_madd_epi16(mp[0], _mm512_set1_epi32(load_i32(br)));
      for (int q = 1; q < 8; ++q) summ = _mm512_add_epi32(summ, _mm512_madd_epi16(mp[q], _mm512_set1_epi32(load_i32(br + 2 * q))));
      const __m512i total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32(summ, 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(xd[(r0 + r) * nb + b])), acc[r]);
    }
  }
  for (int r = 0; r < P; ++r) store_pair(out + (r0 + r) * ldo + n, acc[r]);
}
#endif

#if defined(SD_AMX)
// K-quants on AMX. The sub-block scales go into the weights: per weight W = sc * u (Q4_K: sc < 64, u < 16, so
// 0 <= W < 1024) or W = sc * (u - 32) (Q6_K: |W| <= 4096), which a tile cannot hold in one byte, so W is split
// into two bytes, W = 256 hi + lo (Q4_K, unsigned) or 128 hi + lo (Q6_K, lo < 128, hi signed), and one super-
// block's integer is sum(x * lo) + 256 (128) * sum(x * hi): two accumulating tile products over all 256 weights
// (K = 64 per tile). That integer is exactly passt_pair's sumi (sum over sub-blocks of sc times the sub-block's
// u . x) and passt6_pair's total (sumi - 32 * sum sc * bsum): the same int32, then the same float operations.
// Per super-block of the pair, workspace: lo [4 B tiles of 16 x 64 bytes] | hi [the same] | Q4_K: mp[4], d, dmin.
#define SD_AMX_BK4 8576  // lo 4096 | hi 4096 | mp[4] 256 | d 64 | dmin 64
#define SD_AMX_BK6 8256  // lo 4096 | hi 4096 | d 64
// u (bytes) times the 32-bit lane's scale s (|s| < 2^15), split: *lo = low bits, *hi = the rest (see above)
SD_INLINE void scaled_bytes(__m512i u, __m512i s, int q6, __m512i* lo, __m512i* hi) {
  const __m512i s16 = _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s, 16)), m8 = _mm512_set1_epi16(0xFF);
  __m512i e = _mm512_and_si512(u, m8), o = _mm512_srli_epi16(u, 8);
  if (q6) e = _mm512_sub_epi16(e, _mm512_set1_epi16(32)), o = _mm512_sub_epi16(o, _mm512_set1_epi16(32));
  e = _mm512_mullo_epi16(e, s16);
  o = _mm512_mullo_epi16(o, s16);
  if (q6) {
    const __m512i m7 = _mm512_set1_epi16(0x7F);
    *lo = _mm512_or_si512(_mm512_and_si512(e, m7), _mm512_slli_epi16(_mm512_and_si512(o, m7), 8));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(e, 7), m8), _mm512_slli_epi16(_mm512_srai_epi16(o, 7), 8));
  } else {
    *lo = _mm512_or_si512(_mm512_and_si512(e, m8), _mm512_slli_epi16(o, 8));
    *hi = _mm512_or_si512(_mm512_srli_epi16(e, 8), _mm512_andnot_si512(m8, o));
  }
}
// weight vector u (B row `row` of sub-block j) scaled by s and split: lo at o + 512 j + 64 row, hi 4096 further
SD_INLINE void store_scaled(uint8_t* o, int j, int row, __m512i u, __m512i s, int q6) {
  __m512i lo, hi;
  scaled_bytes(u, s, q6, &lo, &hi);
  _mm512_store_si512((__m512i*)(o + 512 * j + 64 * row), lo);
  _mm512_store_si512((__m512i*)(o + 4096 + 512 * j + 64 * row), hi);
}
static void amx_unpackk(int fmt, const uint8_t* wa, const uint8_t* wb, int64_t nb, uint8_t* ws) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    if (fmt == SD_Q4_K) {
      const uint8_t *ta = wa + SD_TILE_SB * b, *tb = wb + SD_TILE_SB * b;
      prefetch_pair(ta, tb, (int64_t)(SD_TILE_SB) * b, (int64_t)(SD_TILE_SB) * nb, SD_TILE_SB);
      uint8_t* o = ws + SD_AMX_BK4 * b;
      TileScales sa, sb;
      tile_scales(ta, &sa);
      tile_scales(tb, &sb);
      for (int j = 0; j < 8; ++j) {
        const __m512i sc = join_i(sa.sc[j], sb.sc[j]);
        for (int h = 0; h < 4; ++h) {  // passt_pair's u[h], u[h + 4]: B rows 8j + h, 8j + h + 4
          const __m512i v = load_pair(ta + 128 + 128 * j + 32 * h, tb + 128 + 128 * j + 32 * h);
          store_scaled(o, j, h, _mm512_and_si512(v, m4), sc, 0);
          store_scaled(o, j, h + 4, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4), sc, 0);
        }
      }
      for (int q = 0; q < 4; ++q) _mm512_store_si512((__m512i*)(o + 8192 + 64 * q), join_i(sa.mp[q], sb.mp[q]));
      _mm512_store_ps((float*)(o + 8448), join_f(sa.d, sb.d));
      _mm512_store_ps((float*)(o + 8512), join_f(sa.dmin, sb.dmin));
    } else {
      const uint8_t *ta = wa + SD_TILE_SB6 * b, *tb = wb + SD_TILE_SB6 * b;
      prefetch_pair(ta, tb, (int64_t)(SD_TILE_SB6) * b, (int64_t)(SD_TILE_SB6) * nb, SD_TILE_SB6);
      uint8_t* o = ws + SD_AMX_BK6 * b;
      TileScales6 sa, sb;
      tile_scales6(ta, &sa);
      tile_scales6(tb, &sb);
      for (int j = 0; j < 8; ++j) {
        const int64_t t = 144 + 192 * j;
        const __m512i h0 = load_pair(ta + t + 128, tb + t + 128), h1 = load_pair(ta + t + 160, tb + t + 160);
        const __m512i s0 = join_i(sa.sc[2 * j], sb.sc[2 * j]), s1 = join_i(sa.sc[2 * j + 1], sb.sc[2 * j + 1]);
        for (int h = 0; h < 4; ++h) {  // passt6_pair's u[h] (weights 4h.., scale 2j), u[h + 4] (scale 2j + 1)
          const __m512i v = load_pair(ta + t + 32 * h, tb + t + 32 * h);
          const __m512i hi0 = h == 0 ? _mm512_slli_epi16(h0, 4) : h == 1 ? _mm512_slli_epi16(h0, 2) : h == 2 ? h0 : _mm512_srli_epi16(h0, 2);
          const __m512i hi1 = h == 0 ? _mm512_slli_epi16(h1, 4) : h == 1 ? _mm512_slli_epi16(h1, 2) : h == 2 ? h1 : _mm512_srli_epi16(h1, 2);
          store_scaled(o, j, h, _mm512_or_si512(_mm512_and_si512(v, m4), _mm512_and_si512(hi0, m30)), s0, 1);
          store_scaled(o, j, h + 4, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4), _mm512_and_si512(hi1, m30)), s1, 1);
        }
      }
      _mm512_store_ps((float*)(o + 8192), join_f(sa.d, sb.d));
    }
  }
}

// Rows r0 .. r0 + 16 of the K-quant pair unpacked at ws (columns n .. n + 15), per super-block four tile
// accumulators: lo and hi of the even and of the odd 64-weight chunks (chains of two products each)
static void amx_passk(int fmt, const uint8_t* ws, int64_t nb, int64_t k, const int8_t* xq, const float* xd,
                      const int16_t* xs, int64_t r0, float* out, int64_t ldo, int64_t n) {
  __m512 acc[SD_AMX_ROWS], macc[SD_AMX_ROWS];
  for (int r = 0; r < SD_AMX_ROWS; ++r) acc[r] = macc[r] = _mm512_setzero_ps();
  int32_t c[4 * 256] __attribute__((aligned(64)));
  const int q6 = fmt == SD_Q6_K;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* x0 = xq + r0 * k + 256 * b;
    const uint8_t* o = ws + (q6 ? SD_AMX_BK6 : SD_AMX_BK4) * b;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
#define SD_CHUNKS(DP)                                                                                      \
  _tile_loadd(4, x0, k);       _tile_loadd(6, o, 64);        DP(0, 4, 6); _tile_loadd(7, o + 4096, 64); DP(2, 4, 7); \
  _tile_loadd(5, x0 + 64, k);  _tile_loadd(6, o + 1024, 64); DP(1, 5, 6); _tile_loadd(7, o + 5120, 64); DP(3, 5, 7); \
  _tile_loadd(4, x0 + 128, k); _tile_loadd(6, o + 2048, 64); DP(0, 4, 6); _tile_loadd(7, o + 6144, 64); DP(2, 4, 7); \
  _tile_loadd(5, x0 + 192, k); _tile_loadd(6, o + 3072, 64); DP(1, 5, 6); _tile_loadd(7, o + 7168, 64); DP(3, 5, 7);
    if (q6) {
      SD_CHUNKS(_tile_dpbssd)  // hi is signed
    } else {
      SD_CHUNKS(_tile_dpbsud)
    }
#undef SD_CHUNKS
    _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
    if (q6) {
      const __m512 d = _mm512_load_ps((const float*)(o + 8192));
      for (int r = 0; r < SD_AMX_ROWS; ++r) {
        const __m512i lo = _mm512_add_epi32(_mm512_load_si512((const __m512i*)(c + 16 * r)), _mm512_load_si512((const __m512i*)(c + 256 + 16 * r)));
        const __m512i hi = _mm512_add_epi32(_mm512_load_si512((const __m512i*)(c + 512 + 16 * r)), _mm512_load_si512((const __m512i*)(c + 768 + 16 * r)));
        const __m512i total = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 7));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(xd[(r0 + r) * nb + b])), acc[r]);
      }
    } else {
      __m512i mp[4];
      for (int q = 0; q < 4; ++q) mp[q] = _mm512_load_si512((const __m512i*)(o + 8192 + 64 * q));
      const __m512 d = _mm512_load_ps((const float*)(o + 8448)), dmin = _mm512_load_ps((const float*)(o + 8512));
      for (int r = 0; r < SD_AMX_ROWS; ++r) {
        const __m512i lo = _mm512_add_epi32(_mm512_load_si512((const __m512i*)(c + 16 * r)), _mm512_load_si512((const __m512i*)(c + 256 + 16 * r)));
        const __m512i hi = _mm512_add_epi32(_mm512_load_si512((const __m512i*)(c + 512 + 16 * r)), _mm512_load_si512((const __m512i*)(c + 768 + 16 * r)));
        const __m512i sumi = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 8));
        const int16_t* xr = xs + ((r0 + r) * nb + b) * 8;
        __m512i summ = _mm512_madd_epi16(mp[0], _mm512_set1_epi32(load_i32(xr)));
        for (int q = 1; q < 4; ++q) summ = _mm512_add_epi32(summ, _mm512_madd_epi16(mp[q], _mm512_set1_epi32(load_i32(xr + 2 * q))));
        const __m512 dx = _mm512_set1_ps(xd[(r0 + r) * nb + b]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, dx), acc[r]);
        macc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, dx), macc[r]);
      }
    }
  }
  for (int r = 0; r < SD_AMX_ROWS; ++r)
    store_pair(out + (r0 + r) * ldo + n, q6 ? acc[r] : _mm512_sub_ps(acc[r], macc[r]));
}
#endif

static void gemmk(int fmt, const uint8_t* w, int64_t ldw, int64_t k, const int8_t* xq, const float* xd,
                  const int16_t* bsums, int64_t rows, float* out, int64_t ldo, int64_t n0, int64_t n1, int64_t n_out) {
  const int64_t nb = k / 256;
  const int64_t tiled = fmt == SD_Q4_K || (SD_Q6K_TILES && fmt == SD_Q6_K) ? n_out / SD_TILE * SD_TILE : 0;  // tiles
  int64_t n = n0;
  if (n < tiled) {
    // Q4_K: the activations' sums per 32 (exact in int16: at most 32 * 127), per row and super-block
    int16_t* xs = NULL;
    if (fmt == SD_Q4_K) {
      xs = (int16_t*)malloc(sizeof(int16_t) * (size_t)(rows * nb * 8 + 1));
      if (!xs) abort();
      for (int64_t i = 0; i < rows * nb * 8; ++i) xs[i] = (int16_t)(bsums[2 * i] + bsums[2 * i + 1]);
    }
#if defined(SD_VARIANT_AVX512VNNI)
    // whole tiles two at a time (passt_pair, passt6_pair); an odd one runs alone below
    // long rows take pairs from fewer rows (pair_rows_long): one tile at a time, 2-7 rows' activations (36 KB at
    // 8,960 inputs and 4 rows) leave L1 while each tile's weights stream past, and their multiply-adds ran at
    // 1.1-1.4x the rate of one row (short rows: 2x); a pair reads each activation for 16 columns
    const int pairs = SD_PAIR_TILES && rows >= pair_rows_long(nb, sd_pair_min_rows[fmt]);
#if defined(SD_AMX)
    // (only where the pair loop below runs a pair: the same conditions as its first iteration)
    const int pairs_run = pairs && n % SD_TILE == 0 && n + 2 * SD_TILE <= n1 && n + 2 * SD_TILE <= tiled;
    const int64_t amx_rows = pairs_run && amx_rows_of(fmt, rows) && amx_ready() ? amx_rows_of(fmt, rows) : 0;
    uint8_t* ws = amx_rows ? (uint8_t*)amx_alloc((size_t)((fmt == SD_Q4_K ? SD_AMX_BK4 : SD_AMX_BK6) * nb)) : NULL;
    if (amx_rows) amx_configure(64);
#else
    const int64_t amx_rows = 0;
#endif
    for (; pairs && n % SD_TILE == 0 && n + 2 * SD_TILE <= n1 && n + 2 * SD_TILE <= tiled; n += 2 * SD_TILE) {
      const uint8_t *wa = w + n * ldw, *wb = wa + SD_TILE * ldw;
#if defined(SD_AMX)
      if (amx_rows) {
        amx_unpackk(fmt, wa, wb, nb, ws);
        for (int64_t r0 = 0; r0 < amx_rows; r0 += SD_AMX_ROWS) amx_passk(fmt, ws, nb, k, xq, xd, xs, r0, out, ldo, n);
      }
#endif
      for (int64_t r0 = amx_rows; r0 < rows; r0 += SD_PASSZ) {
        const int64_t p = rows - r0 < SD_PASSZ ? rows - r0 : SD_PASSZ;
        switch (p) {
#define SD_CASE(P) case P: if (fmt == SD_Q4_K) passt_pair(P, wa, wb, nb, k, xq, xd, xs, r0, out, ldo, n); \
                           else passt6_pair(P, wa, wb, nb, k, xq, xd, bsums, r0, out, ldo, n); break;
          SD_CASE(1) SD_CASE(2) SD_CASE(3) SD_CASE(4)
#if SD_PASSZ > 4
          SD_CASE(5) SD_CASE(6) SD_CASE(7) SD_CASE(8)
#endif
#undef SD_CASE
          default: abort();  // a pass above 8 rows (an SD_PASSZ override): never leave outputs unwritten
        }
      }
    }
#if defined(SD_AMX)
    if (amx_rows) _tile_release();
    free(ws);
#endif
#endif
    for (; n < n1 && n < tiled; n = n / SD_TILE * SD_TILE + SD_TILE) {
      const int64_t base = n / SD_TILE * SD_TILE;
      const int c0 = (int)(n - base), c1 = (int)((n1 < base + SD_TILE ? n1 : base + SD_TILE) - base);
      const uint8_t* wt = w + base * ldw;
      for (int64_t r0 = 0; r0 < rows; r0 += SD_PASST) {
        const int64_t p = rows - r0 < SD_PASST ? rows - r0 : SD_PASST;
        switch (p) {
#define SD_CASE(P) case P: if (fmt == SD_Q4_K) passt(P, wt, nb, k, xq, xd, xs, r0, out, ldo, base, c0, c1); \
                           else passt6(P, wt, nb, k, xq, xd, bsums, r0, out, ldo, base, c0, c1); break;
          SD_CASE(1) SD_CASE(2) SD_CASE(3) SD_CASE(4)
#if SD_PASST > 4
          SD_CASE(5) SD_CASE(6) SD_CASE(7) SD_CASE(8)
#endif
#undef SD_CASE
        }
      }
    }
    free(xs);
  }
  for (; n < n1; ++n) {
    const uint8_t* wn = w + n * ldw;
    for (int64_t r0 = 0; r0 < rows; r0 += SD_PASSK) {
      const int64_t p = rows - r0 < SD_PASSK ? rows - r0 : SD_PASSK;
      switch (p) {
#define SD_CASE(P) case P: if (fmt == SD_Q6_K) passk(P, 1, wn, nb, k, xq, xd, bsums, r0, out, ldo, n); \
                           else passk(P, 0, wn, nb, k, xq, xd, bsums, r0, out, ldo, n); break;
        SD_CASE(1) SD_CASE(2) SD_CASE(3) SD_CASE(4)
#undef SD_CASE
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dequantization (tests, tools): float32 [n1 - n0, k] of columns n0..n1 (as gguf.dequantize).
static void dequantize(int fmt, const uint8_t* w, int64_t ldw, int64_t k, float* out, int64_t n0, int64_t n1,
                       int64_t n_out) {
  const int64_t bs = kBlockSize[fmt], bytes = kBlockBytes[fmt];
  const int64_t tiled = fmt == SD_Q4_K || (SD_Q6K_TILES && fmt == SD_Q6_K) ? n_out / SD_TILE * SD_TILE : 0;
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * k;
    if (n < tiled && fmt == SD_Q6_K) {  // a Q6_K tile (see passt6)
      const int c = (int)(n % SD_TILE);
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* t = w + (n - c) * ldw + SD_TILE_SB6 * b;
        const float d = f16(t + 2 * c);
        for (int i = 0; i < 256; ++i) {
          const int j = i / 32, g = (i % 32) / 4, e = i % 4;
          const int lo = t[144 + 192 * j + 32 * (g % 4) + 4 * c + e], hi = t[144 + 192 * j + 128 + 32 * (g / 4) + 4 * c + e];
          const int u = ((g < 4 ? lo : lo >> 4) & 15) | (((hi >> (2 * (g % 4))) & 3) << 4);
          const float s = (float)(int8_t)t[16 + 8 * (i / 16) + c];
          o[256 * b + i] = d * s * (float)(u - 32);
        }
      }
      continue;
    }
    if (bs == 32 && n < n_out / SD_TILE * SD_TILE) {  // a 32-weight tile (see passt32)
      const int c = (int)(n % SD_TILE);
      for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* t = w + (n - c) * ldw + (int64_t)tile32_bytes(fmt) * b;
        const float d = f16(t + 2 * c), m = fmt == SD_Q4_1 ? f16(t + 16 + 2 * c) : 0.0f;
        const uint8_t* q = t + (fmt == SD_Q4_1 ? 32 : fmt == SD_Q5_0 ? 48 : 16);
        for (int i = 0; i < 32; ++i) {
          const int g = i / 4, e = i % 4;
          int u = fmt == SD_Q8_0 ? q[32 * g + 4 * c + e] : (q[32 * (g % 4) + 4 * c + e] >> (g < 4 ? 0 : 4)) & 15;
          if (fmt == SD_Q5_0) u |= ((t[16 + 4 * c + e] >> g) & 1) << 4;
          o[32 * b + i] = fmt == SD_Q4_1 ? d * (float)u + m : d * (float)(u - zero_point32(fmt));
        }
      }
      continue;
    }
    if (n < tiled) {  // a Q4_K tile (see passt): column c of the tile at rows n - c .. n - c + 7
      const int c = (int)(n % SD_TILE);
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* t = w + (n - c) * ldw + SD_TILE_SB * b;
        const float d = f16(t + 2 * c), dmin = f16(t + 16 + 2 * c);
        for (int j = 0; j < 8; ++j) {
          const int is = 8 * j + c, im = 16 * (j / 2) + 2 * c + j % 2;
          const int hs = (t[96 + (is & 31)] >> (is < 32 ? 4 : 6)) & 3, hm = (t[96 + (im & 31)] >> (im < 32 ? 0 : 2)) & 3;
          const int sc = (t[32 + is] & 15) | (hs << 4), m = (t[32 + im] >> 4) | (hm << 4);
          const float s = (float)sc;
          for (int i = 0; i < 32; ++i) {
            const int g = i / 4, byte = t[128 + 128 * j + 32 * (g % 4) + 4 * c + i % 4];
            const int u = g < 4 ? byte & 15 : byte >> 4;
            o[256 * b + 32 * j + i] = d * s * (float)u - dmin * (float)m;
          }
        }
      }
      continue;
    }
    for (int64_t b = 0; b < k / bs; ++b) {
      const uint8_t* blk = w + n * ldw + b * bytes;  // K-quants (32-blocks: repacked, see soa())
      uint8_t u[256];
      if (bs == 32) {
        const Soa a = soa(fmt, w + n * ldw, k / 32);
        _mm256_storeu_si256((__m256i*)u, unpack32(fmt, &a, b));
        const float d = f16(a.d + 2 * b), m = fmt == SD_Q4_1 ? f16(a.m + 2 * b) : 0.0f;
        for (int i = 0; i < 32; ++i)
          o[32 * b + i] = fmt == SD_Q8_0 ? d * (float)(int8_t)u[i]
                          : fmt == SD_Q4_1 ? d * (float)u[i] + m : d * (float)(u[i] - zero_point32(fmt));
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
// The rest of a decoder layer, row by row: each row's arithmetic in one fixed order, so a row's
// result does not depend on the other rows (the same batch-invariance as the products).

// e^x for x <= 88 (x < -87: 0), relative error about 2e-7: 2^n * p(r), r = x - n ln 2
static inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

static inline __m256 load_h8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// Attention's value pass keeps this many vectors of accumulators in registers (AVX2: 16 registers, so
// d = 128 runs in two passes over the values; AVX-512 variants: 32 registers, one pass)
#if defined(SD_VARIANT_AVX512) || defined(SD_VARIANT_AVX512VNNI)
#define SD_ATT_CHUNK 16
#else
#define SD_ATT_CHUNK 8
#endif

// The scores of eight keys from their lane-wise partial products v[0..7] (lane l of v[j]: the sum over
// i of q[8i + l] * k_j[8i + l]): key j's score is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of
// v[j], a tree that does not depend on which keys share the group (a missing key is a zero vector).
static inline __m256 scores8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // low lanes: (l0+l1)+(l2+l3) of keys
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Partial products of the query (qs: scaled, [DV] vectors in memory) with cnt <= 8 keys (kj[0..cnt)),
// lane-wise, i in order; v[cnt..8) = 0. DV: d / 8, a constant where it is inlined.
SD_INLINE void partial8(const float* qs, const uint16_t* const kj[8], int cnt, int64_t DV, __m256 v[8]) {
  for (int j = 0; j < 8; ++j) v[j] = _mm256_setzero_ps();
  if (cnt == 8) {
    for (int64_t i = 0; i < DV; ++i) {
      const __m256 qi = _mm256_loadu_ps(qs + 8 * i);
      for (int j = 0; j < 8; ++j) v[j] = _mm256_fmadd_ps(qi, load_h8(kj[j] + 8 * i), v[j]);
    }
  } else {
    for (int j = 0; j < cnt; ++j)
      for (int64_t i = 0; i < DV; ++i) v[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + 8 * i), load_h8(kj[j] + 8 * i), v[j]);
  }
}

// partial8 of 8 keys already converted to float32 (kb: key j at kb + 8 * DV * j): the same products in the
// same order (a float16 -> float32 conversion is exact, so a key reads the same floats either way)
SD_INLINE void partial8_f32(const float* qs, const float* kb, int64_t DV, __m256 v[8]) {
  for (int j = 0; j < 8; ++j) v[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < DV; ++i) {
    const __m256 qi = _mm256_loadu_ps(qs + 8 * i);
    for (int j = 0; j < 8; ++j) v[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(kb + 8 * DV * j + 8 * i), v[j]);
  }
}

// Keys / values converted to float32 at a time (a multiple of 8): 8 KB at d = 64, inside L1
#define SD_ATT_KEYS 32
// Fewest queries of one call that read a float32 copy of their shared keys and values (attention_d)
#ifndef SD_ATT_SHARE_MIN
#define SD_ATT_SHARE_MIN 4
#endif

#if defined(SD_VARIANT_AVX512) || defined(SD_VARIANT_AVX512VNNI)
// The AVX-512 variants run attention's float32 work on 16 lanes with the bits of the 8-lane code (tested on
// every variant: tests/test_lowbit.py). Scores: two keys per vector (lanes 0-7 key 2m, lanes 8-15 key 2m + 1),
// each lane the same chain of fused multiply-adds as partial8_f32's; then scores8's tree on 16 lanes (hadd16 is
// vhaddps per 128-bit block: the same additions). Values: 16 output dimensions per vector, each lane its own sum
// over the keys in order, as on 8 lanes. Half the multiply-adds of the 8-lane code (docs/results/kernels/amx/).
#define SD_ATT512 1
static inline __m512 hadd16(__m512 a, __m512 b) {  // per 128-bit block: a0 + a1, a2 + a3, b0 + b1, b2 + b3
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}
// scores8 of 8 keys converted in pairs (kb: key 2m's floats 8i..8i+7 then key 2m + 1's at kb + (m * DV + i) * 16)
// for two queries at once (qa, qb; eight independent chains of multiply-adds, each key vector loaded once)
SD_INLINE void scores8_pairs(const float* qa, const float* qb, const float* kb, int64_t DV, __m256* sa, __m256* sb) {
  __m512 z[8];
  for (int m = 0; m < 8; ++m) z[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < DV; ++i) {  // (a 256-bit load broadcast to both halves: AVX-512 F)
    const __m512 xa = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double*)(qa + 8 * i))));
    const __m512 xb = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double*)(qb + 8 * i))));
    for (int m = 0; m < 4; ++m) {
      const __m512 kv = _mm512_loadu_ps(kb + (m * DV + i) * 16);
      z[m] = _mm512_fmadd_ps(xa, kv, z[m]);
      z[4 + m] = _mm512_fmadd_ps(xb, kv, z[4 + m]);
    }
  }
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int h = 0; h < 2; ++h) {
    const __m512* y = z + 4 * h;
    // blocks of u: 0 = keys 0 2 4 6, lanes 0-3 summed as ((l0 + l1) + (l2 + l3)); 1 = their lanes 4-7; 2 / 3 = keys 1 3 5 7
    const __m512 u = hadd16(hadd16(y[0], y[1]), hadd16(y[2], y[3]));
    const __m512 w = _mm512_add_ps(u, _mm512_shuffle_f32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1)));  // blocks 0 + 1, 2 + 3
    *(h ? sb : sa) = _mm512_castps512_ps256(_mm512_permutexvar_ps(order, w));
  }
}
// The value sums of QN queries (p[qq]: its probabilities of the cnt keys at kb, [cnt][16 DZ] floats; acc[qq]: its
// running sums, [16 DZ]), each key vector loaded once for all of them: QN * DZ independent chains (one query's DZ
// chains alone wait on the multiply-add latency). Each lane sums its keys in order, as on 8 lanes.
SD_INLINE void values16(const int QN, const int64_t DZ, const float* const p[4], const float* kb, int64_t cnt,
                        float* const acc[4]) {
  // the caller keeps QN * DZ <= 16 (its QB); said here so gcc drops the switch cases a constant DZ rules out
  if (QN * DZ > 16) __builtin_unreachable();
  __m512 a[16];
  for (int qq = 0; qq < QN; ++qq)
    for (int64_t v = 0; v < DZ; ++v) a[qq * DZ + v] = _mm512_loadu_ps(acc[qq] + 16 * v);
  for (int64_t j = 0; j < cnt; ++j)
    for (int64_t v = 0; v < DZ; ++v) {
      const __m512 kv = _mm512_loadu_ps(kb + j * 16 * DZ + 16 * v);
      for (int qq = 0; qq < QN; ++qq) a[qq * DZ + v] = _mm512_fmadd_ps(_mm512_set1_ps(p[qq][j]), kv, a[qq * DZ + v]);
    }
  for (int qq = 0; qq < QN; ++qq)
    for (int64_t v = 0; v < DZ; ++v) _mm512_storeu_ps(acc[qq] + 16 * v, a[qq * DZ + v]);
}
#else
#define SD_ATT512 0
#endif

// Attention of nq queries that read one kv head: query i is head hs[i] of row rows[i] (q + rows[i] * ldq +
// hs[i] * d; its visible columns visible + rows[i] * kv_len, or every column < kv_len when visible is NULL;
// its result out + rows[i] * ldo + hs[i] * d). The keys and values every query sees (the columns before the
// first one some query does not see: a verification's cached context) are converted from float16 once and
// read by every query (the heads of a GQA group, the rows of a verification), instead of once per query
// (from SD_ATT_SHARE_MIN queries of a call: fewer read the float16 cache directly);
// each query's arithmetic is that of a query alone: its scores of eight keys by rank (keys scored eight at a
// time, the tree of scores8), its softmax, its value sums in column order, so a row's result does not depend
// on the other rows or on which queries share the call. A token-tree node (whose ancestors sit in scattered
// columns) sums exactly as the same path fed as a chain. work: nq * (2 d + kv_len + 8) + SD_ATT_KEYS * d floats.
SD_INLINE void attention_d(const float* q, int64_t ldq, int64_t heads, int64_t kv_heads, const int64_t DV,
                           const uint16_t* kc, const uint16_t* vc, int64_t plane, const uint8_t* visible,
                           int64_t kv_len, float scale, float* out, int64_t ldo, const int32_t* rows,
                           const int32_t* hs, int64_t nq, float* work) {
  const int64_t group = heads / kv_heads, d = 8 * DV;
  const int64_t g = hs[0] / group;
  const uint16_t* kh = kc + g * plane * d;
  const uint16_t* vh = vc + g * plane * d;
  float* qsb = work;                  // [nq][d] scaled queries
  float* accb = qsb + nq * d;         // [nq][d] value sums
  float* mvb = accb + nq * d;         // [nq][8] running maxima (lanes)
  float* pbase = mvb + nq * 8;        // [nq][kv_len] scores, then probabilities, by rank
  float* kb = pbase + nq * kv_len;    // [SD_ATT_KEYS][d] converted keys / values
  int64_t c = kv_len;                 // columns [0, c) are visible to every query
  for (int64_t i = 0; i < nq; ++i) {
    const float* qh = q + rows[i] * ldq + hs[i] * d;
    for (int64_t v = 0; v < DV; ++v)
      _mm256_storeu_ps(qsb + i * d + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(qh + 8 * v), _mm256_set1_ps(scale)));
    _mm256_storeu_ps(mvb + 8 * i, _mm256_set1_ps(-INFINITY));
    if (visible && (i == 0 || rows[i] != rows[i - 1])) {
      const uint8_t* vis = visible + rows[i] * kv_len;
      int64_t j = 0;
      while (j < c && vis[j]) ++j;
      c = j;
    }
  }
  // Queries that share their keys with at most two others read them straight from the float16 cache (steps 2 and
  // 4): the shared float32 copy (steps 1 and 3) pays from 4 queries (SmolLM2's one-token step, 3 heads per kv head:
  // about 0.9x the time at 2,000 tokens of context; docs/results/kernels/amx/s11/). The same bits either way.
  if (nq < SD_ATT_SHARE_MIN) c = 0;
  const int64_t c8 = c / 8 * 8;
  // 1. scores of the shared keys: eight at a time by rank (rank = column below c), every query per chunk
  for (int64_t j0 = 0; j0 < c8; j0 += SD_ATT_KEYS) {
    const int64_t cnt = c8 - j0 < SD_ATT_KEYS ? c8 - j0 : SD_ATT_KEYS;
    prefetch_ahead((const uint8_t*)(kh + j0 * d), (int)(cnt * d * 2));
    for (int64_t j = 0; j < cnt; ++j)  // (SD_ATT512: in pairs of keys, scores8_pairs)
      for (int64_t v = 0; v < DV; ++v)
        _mm256_storeu_ps(kb + (SD_ATT512 ? ((j / 2) * DV + v) * 16 + (j % 2) * 8 : j * d + 8 * v), load_h8(kh + (j0 + j) * d + 8 * v));
#if SD_ATT512
    for (int64_t i = 0; i < nq; i += 2) {  // two queries at a time (an odd last one twice, its copy unused)
      const int64_t i2 = i + 1 < nq ? i + 1 : i;
      __m256 mva = _mm256_loadu_ps(mvb + 8 * i), mvb2 = _mm256_loadu_ps(mvb + 8 * i2);
      for (int64_t m = 0; m < cnt; m += 8) {
        __m256 sa, sb;
        scores8_pairs(qsb + i * d, qsb + i2 * d, kb + m * d, DV, &sa, &sb);
        _mm256_storeu_ps(pbase + i * kv_len + j0 + m, sa);
        _mm256_storeu_ps(pbase + i2 * kv_len + j0 + m, sb);
        mva = _mm256_max_ps(mva, sa);
        mvb2 = _mm256_max_ps(mvb2, sb);
      }
      _mm256_storeu_ps(mvb + 8 * i, mva);
      _mm256_storeu_ps(mvb + 8 * i2, mvb2);
    }
#else
    for (int64_t i = 0; i < nq; ++i) {
      __m256 mv = _mm256_loadu_ps(mvb + 8 * i), v[8];
      for (int64_t m = 0; m < cnt; m += 8) {
        partial8_f32(qsb + i * d, kb + m * d, DV, v);
        const __m256 sc = scores8(v);
        _mm256_storeu_ps(pbase + i * kv_len + j0 + m, sc);
        mv = _mm256_max_ps(mv, sc);
      }
      _mm256_storeu_ps(mvb + 8 * i, mv);
    }
#endif
  }
  // 2. each query's other visible keys (ranks from c8 on), its maximum, probabilities and their sum
  for (int64_t i = 0; i < nq; ++i) {
    const float* qs = qsb + i * d;
    float* scratch = pbase + i * kv_len;
    const uint8_t* vis = visible ? visible + rows[i] * kv_len : NULL;
    __m256 mv = _mm256_loadu_ps(mvb + 8 * i), v[8];
    const uint16_t* kj[8];
    int64_t nv = c8;
    int cnt = 0;
    for (int64_t j = c8; j < kv_len; ++j) {
      if (vis && !vis[j]) continue;
      kj[cnt++] = kh + j * d;
      if (cnt == 8) {
        partial8(qs, kj, 8, DV, v);
        const __m256 sc = scores8(v);
        _mm256_storeu_ps(scratch + nv, sc);
        mv = _mm256_max_ps(mv, sc);
        nv += 8;
        cnt = 0;
      }
    }
    if (cnt) {
      partial8(qs, kj, cnt, DV, v);
      float t[8];
      _mm256_storeu_ps(t, scores8(v));
      for (int k = 0; k < cnt; ++k) {
        scratch[nv + k] = t[k];
        mv = _mm256_max_ps(mv, _mm256_set1_ps(t[k]));
      }
      nv += cnt;
    }
    float mx[8];
    _mm256_storeu_ps(mx, mv);
    float m = mx[0];
    for (int k = 1; k < 8; ++k) m = mx[k] > m ? mx[k] : m;  // a maximum: exact in any order
    __m256 sum = _mm256_setzero_ps();
    const __m256 mb = _mm256_set1_ps(m);
    int64_t i8 = 0;
    for (; i8 + 8 <= nv; i8 += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scratch + i8), mb));
      _mm256_storeu_ps(scratch + i8, p);
      sum = _mm256_add_ps(sum, p);
    }
    if (i8 < nv) {
      float t[8];
      const int rest = (int)(nv - i8);
      for (int k = 0; k < 8; ++k) t[k] = k < rest ? scratch[i8 + k] : m;
      __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(t), mb));
      p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rest),
                                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
      _mm256_storeu_ps(t, p);
      for (int k = 0; k < rest; ++k) scratch[i8 + k] = t[k];
      sum = _mm256_add_ps(sum, p);
    }
    mvb[8 * i] = 1.0f / hsum(sum);  // the maxima are spent: keep 1 / sum here
    for (int64_t v8 = 0; v8 < DV; ++v8) _mm256_storeu_ps(accb + i * d + 8 * v8, _mm256_setzero_ps());
  }
  // 3. the values of the shared columns in order, converted once per chunk; each output lane is its own sum
  // (SD_ATT_CHUNK vectors of it in registers at a time: the chunking changes no result)
  for (int64_t j0 = 0; j0 < c; j0 += SD_ATT_KEYS) {
    const int64_t cnt = c - j0 < SD_ATT_KEYS ? c - j0 : SD_ATT_KEYS;
    prefetch_ahead((const uint8_t*)(vh + j0 * d), (int)(cnt * d * 2));
    for (int64_t j = 0; j < cnt; ++j)
      for (int64_t v = 0; v < DV; ++v) _mm256_storeu_ps(kb + j * d + 8 * v, load_h8(vh + (j0 + j) * d + 8 * v));
#if SD_ATT512
    if (DV % 2 == 0 && DV <= 32) {  // 16 dimensions per vector (at most 16 vectors), queries in blocks of QB
      const int64_t DZ = DV / 2;
      const int QB = DZ <= 4 ? 4 : DZ <= 8 ? 2 : 1;
      for (int64_t i = 0; i < nq; i += QB) {
        const int qn = nq - i < QB ? (int)(nq - i) : QB;
        const float* p[4];
        float* acc[4];
        for (int qq = 0; qq < qn; ++qq) p[qq] = pbase + (i + qq) * kv_len + j0, acc[qq] = accb + (i + qq) * d;
        switch (qn) {
          case 4: values16(4, DZ, p, kb, cnt, acc); break;
          case 3: values16(3, DZ, p, kb, cnt, acc); break;
          case 2: values16(2, DZ, p, kb, cnt, acc); break;
          default: values16(1, DZ, p, kb, cnt, acc); break;
        }
      }
      continue;
    }
#endif
    for (int64_t i = 0; i < nq; ++i) {
      const float* p = pbase + i * kv_len + j0;
      for (int64_t c0 = 0; c0 < DV; c0 += SD_ATT_CHUNK) {
        const int64_t c1 = c0 + SD_ATT_CHUNK < DV ? c0 + SD_ATT_CHUNK : DV;
        __m256 acc[32];
        for (int64_t v = c0; v < c1; ++v) acc[v - c0] = _mm256_loadu_ps(accb + i * d + 8 * v);
        for (int64_t j = 0; j < cnt; ++j) {
          const __m256 pj = _mm256_set1_ps(p[j]);
          for (int64_t v = c0; v < c1; ++v) acc[v - c0] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(kb + j * d + 8 * v), acc[v - c0]);
        }
        for (int64_t v = c0; v < c1; ++v) _mm256_storeu_ps(accb + i * d + 8 * v, acc[v - c0]);
      }
    }
  }
  // 4. each query's other visible values (ranks from c on), then the scale by 1 / sum
  for (int64_t i = 0; i < nq; ++i) {
    const float* scratch = pbase + i * kv_len;
    const uint8_t* vis = visible ? visible + rows[i] * kv_len : NULL;
    const __m256 inv = _mm256_set1_ps(mvb[8 * i]);
    float* o = out + rows[i] * ldo + hs[i] * d;
#if SD_ATT512
    if (DV % 2 == 0 && DV <= 32) {  // (d > 256: the 8-lane code)
      const int64_t DZ = DV / 2;
      __m512 acc[16];
      for (int64_t v = 0; v < DZ; ++v) acc[v] = _mm512_loadu_ps(accb + i * d + 16 * v);
      int64_t rank = c;
      for (int64_t j = c; j < kv_len; ++j) {
        if (vis && !vis[j]) continue;
        const __m512 pj = _mm512_set1_ps(scratch[rank++]);
        const uint16_t* vj = vh + j * d;
        for (int64_t v = 0; v < DZ; ++v)
          acc[v] = _mm512_fmadd_ps(pj, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(vj + 16 * v))), acc[v]);
      }
      for (int64_t v = 0; v < DZ; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[v], _mm512_set1_ps(mvb[8 * i])));
      continue;
    }
#endif
    for (int64_t c0 = 0; c0 < DV; c0 += SD_ATT_CHUNK) {
      const int64_t c1 = c0 + SD_ATT_CHUNK < DV ? c0 + SD_ATT_CHUNK : DV;
      __m256 acc[32];
      for (int64_t v = c0; v < c1; ++v) acc[v - c0] = _mm256_loadu_ps(accb + i * d + 8 * v);
      int64_t rank = c;
      for (int64_t j = c; j < kv_len; ++j) {
        if (vis && !vis[j]) continue;
        const __m256 pj = _mm256_set1_ps(scratch[rank++]);
        const uint16_t* vj = vh + j * d;
        for (int64_t v = c0; v < c1; ++v) acc[v - c0] = _mm256_fmadd_ps(pj, load_h8(vj + 8 * v), acc[v - c0]);
      }
      for (int64_t v = c0; v < c1; ++v) _mm256_storeu_ps(o + 8 * v, _mm256_mul_ps(acc[v - c0], inv));
    }
  }
}

// Queries per attention_d call at most by memory: their scores stay within about 1 MB (L2) whatever the context
static inline int64_t att_batch(int64_t d, int64_t kv_len) {
  const int64_t per = 2 * d + kv_len + 8, most = ((int64_t)1 << 18) / per;
  return most < 1 ? 1 : most;
}

// (q, ldq, heads, kv_heads, d, kc, vc, plane, visible, kv_len, scale, out, ldo, rows, hs, nq): the queries
// (rows[i], hs[i]) in runs that share a kv head, each run as attention_d in batches of att_batch (qtable.h)
static void attention(const float* q, int64_t ldq, int64_t heads, int64_t kv_heads, int64_t d, const uint16_t* kc,
                      const uint16_t* vc, int64_t plane, const uint8_t* visible, int64_t kv_len, float scale,
                      float* out, int64_t ldo, const int32_t* rows, const int32_t* hs, int64_t nq) {
  // at most 16 rows' queries of a kv head at once: a prompt's rows (causal) share all but their last few keys
  const int64_t group = heads / kv_heads, most = att_batch(d, kv_len) < 16 * group ? att_batch(d, kv_len) : 16 * group;
  const int64_t batch = nq < most ? nq : most;
  float* work = (float*)malloc(sizeof(float) * (size_t)(batch * (2 * d + kv_len + 8) + SD_ATT_KEYS * d + 8));
  if (!work) abort();
  for (int64_t i0 = 0; i0 < nq;) {
    int64_t i1 = i0 + 1;
    while (i1 < nq && i1 - i0 < batch && hs[i1] / group == hs[i0] / group) ++i1;
    if (d == 64)
      attention_d(q, ldq, heads, kv_heads, 8, kc, vc, plane, visible, kv_len, scale, out, ldo, rows + i0, hs + i0, i1 - i0, work);
    else if (d == 128)
      attention_d(q, ldq, heads, kv_heads, 16, kc, vc, plane, visible, kv_len, scale, out, ldo, rows + i0, hs + i0, i1 - i0, work);
    else
      attention_d(q, ldq, heads, kv_heads, d / 8, kc, vc, plane, visible, kv_len, scale, out, ldo, rows + i0, hs + i0, i1 - i0, work);
    i0 = i1;
  }
  free(work);
}

static void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  __m256 s = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    s = _mm256_fmadd_ps(v, v, s);
  }
  float ss = hsum(s);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(ss / (float)n + eps);
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv))));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

static void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void to_f16(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

// ---------------------------------------------------------------------------------------------
// The table the Python side reads (through ctypes) and hands to the torch extension.

static const SdTable kTable = {SD_TABLE_VERSION, SD_NAME, quantize32, quantize256, gemm32, gemmk, dequantize,
                               attention, rmsnorm, silu_mul, to_f16};

const SdTable* sd_table(void) { return &kTable; }
