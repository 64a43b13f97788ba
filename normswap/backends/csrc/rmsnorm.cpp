// Fused CPU RMSNorm forward and backward, compiled by normswap/backends/cpu.py at first use
// (shipped as package data; its text, hence its hash, is part of the build cache key).
//
// Why it looks like this:
//
// * The op is memory bound: one read of ``x`` from DRAM (the row then stays in L1/L2 for the second
//   pass) and one write of ``y``, the same traffic as ``y.copy_(x)``.
// * ``NS_ISA`` picks explicit AVX-512 (2), AVX2+F16C+FMA (1) or portable scalar (0) code at compile
//   time. The Python side chooses it from ``torch.backends.cpu.get_cpu_capability()`` and keys the build
//   cache on it, so no ``-march=native`` binary is ever reused on a different CPU. Explicit intrinsics
//   because GCC 12 does not vectorise the bf16/fp16 conversions on its own (measured: 6-38x slower).
// * Cast order matches ``normswap.backends.eager`` (the LayerNorm order): fp32 sum of squares, ``rstd``,
//   ``x * rstd``, ``* weight`` and ``+ bias`` all in fp32 (weight and bias arrive converted to fp32 from
//   their own dtype), and one rounding to the output dtype at the store. Built with
//   ``-ffp-contract=off``: ``(x * rstd) * w + b`` stays a multiply, a multiply and an add, each rounded
//   to fp32 as the eager reference's separate ops are, instead of being fused into an FMA.
// * Threads: OpenMP. The library is linked against ``libgomp.so.1``, the same soname PyTorch loads,
//   so the dynamic loader reuses PyTorch's OpenMP runtime (one thread pool, not two fighting for cores).
#include <cstdint>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#if NS_ISA >= 1
#include <immintrin.h>
#endif

namespace {

// Software prefetch distance in the bf16 loop for the row being summed (measured: 512 B ahead helps
// rows that come from DRAM, e.g. 2048x4096: 1.71x -> 1.57x a copy).
constexpr int PREFETCH_BYTES = 512;

struct F32 { using T = float; };
struct BF16 { using T = uint16_t; };
struct F16 { using T = uint16_t; };

inline float bf16_to_f32(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u,
    4); return f; }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                   // round to nearest even
}

// Vector bf16 rounding without a NaN test (ISA 1 and 2). Safe here because every NaN this kernel can
// meet either comes from bf16 data (its low 16 bits are zero, so the rounding add cannot carry into
// the exponent) or is the x86 default NaN 0xffc00000 (same property). Inf and overflow round correctly.

#if NS_ISA >= 2  // ------------------------------------------------------- AVX-512 F/BW/VL (+BF16 at 3)
constexpr int L = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline V vload(F32, const float* p) { return _mm512_loadu_ps(p); }
inline V vload(BF16, const uint16_t* p) {
  __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
inline V vload(F16, const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#if NS_ISA >= 3
inline __m256i bf16_pack(V v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#else
inline __m512i bf16_rne(V v) {  // fp32 bits + rounding increment; the bf16 is in the high 16 bits
  __m512i u = _mm512_castps_si512(v);
  __m512i inc = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                 _mm512_set1_epi32(0x7fff));
  return _mm512_add_epi32(u, inc);
}
inline __m256i bf16_pack(V v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rne(v), 16)); }
#endif
inline void vstore(F32, float* p, V v) { _mm512_storeu_ps(p, v); }
constexpr int STREAM_ALIGN = 64;  // bytes a row start needs for non-temporal stores
inline void vstream(F32, float* p, V v) { _mm512_stream_ps(p, v); }
inline void vstream(BF16, uint16_t* p, V v) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p),
    bf16_pack(v)); }
inline void vstream(F16, uint16_t* p, V v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v,
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void vstore(BF16, uint16_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
    bf16_pack(v)); }
inline void vstore(F16, uint16_t* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v,
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define NS_HAS_F16 1

#elif NS_ISA == 1  // ------------------------------------------------------------------ AVX2 + FMA + F16C
constexpr int L = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
inline V vload(F32, const float* p) { return _mm256_loadu_ps(p); }
inline V vload(BF16, const uint16_t* p) {
  __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline V vload(F16,
    const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bf16_rne(V v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i inc = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                 _mm256_set1_epi32(0x7fff));
  return _mm256_add_epi32(u, inc);
}
inline void vstore(F32, float* p, V v) { _mm256_storeu_ps(p, v); }
constexpr int STREAM_ALIGN = 32;
inline void vstream(F32, float* p, V v) { _mm256_stream_ps(p, v); }
template <class D> inline void vstream(D d, uint16_t* p, V v) {  // 16-byte halves: stream via a buffer
  alignas(16) uint16_t buf[8];
  vstore(d, buf, v);
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
}
inline void vstore(BF16, uint16_t* p, V v) {
  __m256i r = _mm256_srli_epi32(bf16_rne(v), 16);  // 8 x u32, each <= 0xffff
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline void vstore(F16, uint16_t* p, V v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v,
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define NS_HAS_F16 1

#else  // ----------------------------------------------------------------------- portable scalar code
constexpr int L = 1;
using V = float;
inline V vzero() { return 0.0f; }
inline V vset(float a) { return a; }
inline V vadd(V a, V b) { return a + b; }
inline V vmul(V a, V b) { return a * b; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline float vsum(V a) { return a; }
inline V vload(F32, const float* p) { return *p; }
inline V vload(BF16, const uint16_t* p) { return bf16_to_f32(*p); }
inline void vstore(F32, float* p, V v) { *p = v; }
constexpr int STREAM_ALIGN = 0;  // no non-temporal stores in portable code
template <class D> inline void vstream(D d, typename D::T* p, V v) { vstore(d, p, v); }
inline void vstore(BF16, uint16_t* p, V v) { *p = f32_to_bf16(v); }
#if defined(__FLT16_MAX__)
#define NS_HAS_F16 1
inline V vload(F16, const uint16_t* p) { _Float16 h; std::memcpy(&h, p, 2); return float(h); }
inline void vstore(F16, uint16_t* p, V v) { _Float16 h = _Float16(v); std::memcpy(p, &h, 2); }
#endif
#endif

// Tail of a row (fewer than L elements): go through a small zero-padded stack buffer.
template <class D> inline V vload_tail(D d, const typename D::T* p, int n) {
  typename D::T buf[L] = {};
  std::memcpy(buf, p, size_t(n) * sizeof(typename D::T));
  return vload(d, buf);
}
template <class D> inline void vstore_tail(D d, typename D::T* p, V v, int n) {
  typename D::T buf[L];
  vstore(d, buf, v);
  std::memcpy(p, buf, size_t(n) * sizeof(typename D::T));
}

// Sum of squares of one row in fp32, four independent accumulators (latency hiding).
template <class D>
inline float sumsq(D d, const typename D::T* xr, int64_t N) {
  const int64_t nv = N / L * L;
  V a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t i = 0;
  for (; i + 4 * L <= nv; i += 4 * L) {
    V v0 = vload(d, xr + i), v1 = vload(d, xr + i + L), v2 = vload(d, xr + i + 2 * L), v3 = vload(d,
        xr + i + 3 * L);
    a0 = vfma(v0, v0, a0); a1 = vfma(v1, v1, a1); a2 = vfma(v2, v2, a2); a3 = vfma(v3, v3, a3);
  }
  for (; i < nv; i += L) { V v = vload(d, xr + i); a0 = vfma(v, v, a0); }
  if (N > nv) { V v = vload_tail(d, xr + nv, int(N - nv)); a0 = vfma(v, v, a0); }
  return vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
}

#if NS_ISA >= 3
// bf16 with AVX512-BF16: vdpbf16ps squares and pair-sums 32 bf16 values per instruction, products exact
// in fp32. It flushes fp32 denormals, so a row whose sum lands below 2^-100 is redone exactly.
inline float sumsq(BF16 d, const uint16_t* xr, int64_t N) {
  const int64_t n32 = N / 32 * 32;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n32; i += 64) {
    __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + i));
    __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + i + 32));
    a0 = _mm512_dpbf16_ps(a0, v0, v0); a1 = _mm512_dpbf16_ps(a1, v1, v1);
  }
  for (; i < n32; i += 32) {
    __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + i));
    a0 = _mm512_dpbf16_ps(a0, v0, v0);
  }
  float ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  for (; i < N; ++i) { float v = bf16_to_f32(xr[i]); ss += v * v; }
  if (!(ss >= 0x1p-100f)) ss = sumsq<BF16>(d, xr, N);  // tiny (or NaN): exact path
  return ss;
}
#endif

// Pass 2 for one row (normally still in L1/L2): normalise, scale, shift in fp32; one rounding at the store.
// NT: non-temporal stores, for outputs too large for the cache (saves the read-for-ownership).
template <class D, bool HAS_W, bool HAS_B, bool NT>
inline void scale_row(const typename D::T* xr, typename D::T* yr, int64_t N, const float* wr, const float* br,
                      float rs, const typename D::T* pf) {
  D d;
  const F32 f;
  const int64_t nv = N / L * L;
  const int tail = int(N - nv);
  const V vrs = vset(rs);
  for (int64_t i = 0; i < nv; i += L) {
#if NS_ISA >= 1
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + i), _MM_HINT_T0);  // next group's row
#endif
    V v = vmul(vload(d, xr + i), vrs);
    if (HAS_W) v = vmul(v, vload(f, wr + i));
    if (HAS_B) v = vadd(v, vload(f, br + i));
    if (NT) vstream(d, yr + i, v); else vstore(d, yr + i, v);
  }
  if (tail) {
    V v = vmul(vload_tail(d, xr + nv, tail), vrs);
    if (HAS_W) v = vmul(v, vload_tail(f, wr + nv, tail));
    if (HAS_B) v = vadd(v, vload_tail(f, br + nv, tail));
    vstore_tail(d, yr + nv, v, tail);
  }
}

#if NS_ISA >= 3
// bf16 pass 2 with 32 values per step. The generic path widens 16 bf16 with vpmovzxwd and narrows with
// vcvtneps2bf16, two lane-crossing shuffles per 16 values. Instead, 32 bf16 become two fp32 vectors by
// in-lane unpacks against zero (a bf16 is the high half of its fp32), and two fp32 vectors become 32
// bf16 by one vcvtne2ps2bf16 (round to nearest even, like vcvtneps2bf16). The unpacks reorder the
// elements: the weight and bias are laid out once per call in the order the unpacks leave the values
// in (permute_params), and one vpermw puts the result back in element order before the store. The
// order is found once, by running the same instructions on element indices (Bf16Order), so it cannot
// disagree with the code.
struct Pair { __m512 a, b; };
inline Pair widen(__m512i v) {
  const __m512i z = _mm512_setzero_si512();
  return {_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, v)), _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, v))};
}
inline __m512i narrow(Pair p) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p.b, p.a)); }

struct Bf16Order {
  int slot[32];     // slot[k]: which element of the 32 sits in lane k after widen (a: 0-15, b: 16-31)
  __m512i restore;  // vpermw indices that put narrow(widen(v)) back in element order
  Bf16Order() {
    alignas(64) uint16_t ids[32];
    for (int j = 0; j < 32; ++j) ids[j] = f32_to_bf16(float(j));  // small integers are exact in bf16
    const Pair p = widen(_mm512_load_si512(ids));
    alignas(64) float a[16], b[16];
    _mm512_store_ps(a, p.a);
    _mm512_store_ps(b, p.b);
    for (int k = 0; k < 16; ++k) { slot[k] = int(a[k]); slot[16 + k] = int(b[k]); }
    alignas(64) uint16_t z[32], idx[32];
    _mm512_store_si512(z, narrow(p));
    for (int j = 0; j < 32; ++j) idx[int(bf16_to_f32(z[j]))] = uint16_t(j);
    restore = _mm512_load_si512(idx);
  }
};
inline const Bf16Order& bf16_order() { static const Bf16Order order; return order; }

// Reorder fp32 parameters (rows of N) into the widened lane order within every full block of 32; the tail
// of each row keeps element order (the generic path reads it).
inline void permute_params(float* p, int64_t rows, int64_t N) {
  const int* slot = bf16_order().slot;
  const __m512i lo = _mm512_loadu_si512(slot), hi = _mm512_loadu_si512(slot + 16);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i + 32 <= N; i += 32) {
      float* blk = p + r * N + i;
      const __m512 a = _mm512_loadu_ps(blk), b = _mm512_loadu_ps(blk + 16);
      _mm512_storeu_ps(blk, _mm512_permutex2var_ps(a, lo, b));  // lane k <- element slot[k] of the 32
      _mm512_storeu_ps(blk + 16, _mm512_permutex2var_ps(a, hi, b));
    }
}

// Also accumulates the sum of squares of the next row's first n32 values (xn), read in the same loop: its
// loads from memory overlap this row's arithmetic and stores, and no separate reduction pass waits on them.
template <bool HAS_W, bool HAS_B, bool NT>
inline float scale_row_bf16x32(const uint16_t* xr, uint16_t* yr, int64_t n32, const float* wr, const float* br,
                               float rs, const uint16_t* xn, const uint16_t* far, __m512i restore) {
  const __m512 vrs = _mm512_set1_ps(rs);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n32; i += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(xn + i) + PREFETCH_BYTES, _MM_HINT_T0);
    if (far) _mm_prefetch(reinterpret_cast<const char*>(far + i), _MM_HINT_T0);
    const __m512bh nx = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xn + i));
    if ((i & 32) == 0) acc0 = _mm512_dpbf16_ps(acc0, nx, nx); else acc1 = _mm512_dpbf16_ps(acc1, nx, nx);
    Pair p = widen(_mm512_loadu_si512(xr + i));
    p.a = _mm512_mul_ps(p.a, vrs);
    p.b = _mm512_mul_ps(p.b, vrs);
    if (HAS_W) {
      p.a = _mm512_mul_ps(p.a, _mm512_loadu_ps(wr + i));
      p.b = _mm512_mul_ps(p.b, _mm512_loadu_ps(wr + i + 16));
    }
    if (HAS_B) {
      p.a = _mm512_add_ps(p.a, _mm512_loadu_ps(br + i));
      p.b = _mm512_add_ps(p.b, _mm512_loadu_ps(br + i + 16));
    }
    const __m512i out = _mm512_permutexvar_epi16(restore, narrow(p));
    if (NT) _mm512_stream_si512(reinterpret_cast<__m512i*>(yr + i), out);
    else _mm512_storeu_si512(yr + i, out);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

#endif

// One block of rows. Weight and bias arrive as fp32 (converted once per call) so the inner loop does
// not spend instructions widening them. HAS_W / HAS_B are template flags: no branches in the loop.
// Rows go in groups of RB: all their sums of squares first, so the out-of-order core overlaps the
// reduce/sqrt/divide latency of one row with the loads of the next, then the scaling pass while the
// group is still in L1/L2.
template <class D, bool HAS_W, bool HAS_B>
void rows(const typename D::T* x, int64_t r0, int64_t r1, int64_t N, int64_t xs, const float* w,
          int64_t wrows, const float* b, int64_t brows, typename D::T* y, float* rstd, float eps,
          bool stream) {
  D d;
  // Measured (1 thread, Zen): fp32 is memory-bound and fastest row by row; the bf16/fp16 conversions make
  // those compute-bound, and grouping 4 rows hides the per-row reduction latency.
  constexpr int RB = std::is_same<D, F32>::value ? 1 : 4;
  // Software prefetch of the next group's rows during the scaling pass overlaps their memory reads with
  // this group's arithmetic and stores. Measured: a clear win for half types and for fp32 rows of 4 KB
  // or more; for short fp32 rows the hardware prefetcher does better alone.
  const bool prefetch = !std::is_same<D, F32>::value || N * int64_t(sizeof(typename D::T)) >= 4096;
  float rsb[RB];
  for (int64_t g = r0; g < r1; g += RB) {
    const int nb = int(r1 - g < RB ? r1 - g : RB);
    for (int k = 0; k < nb; ++k) rsb[k] = sumsq(d, x + (g + k) * xs, N);
    for (int k = 0; k < nb; ++k) {
      rsb[k] = 1.0f / std::sqrt(rsb[k] / float(N) + eps);
      if (rstd) rstd[g + k] = rsb[k];
    }
    for (int k = 0; k < nb; ++k) {
      const int64_t r = g + k;
      const float* wr = HAS_W ? w + (r % wrows) * N : nullptr;
      const float* br = HAS_B ? b + (r % brows) * N : nullptr;
      typename D::T* yr = y + r * N;
      const typename D::T* pf = (prefetch && r + RB < r1) ? x + (r + RB) * xs : nullptr;
      if (stream && STREAM_ALIGN && reinterpret_cast<uintptr_t>(yr) % STREAM_ALIGN == 0)
        scale_row<D, HAS_W, HAS_B, true>(x + r * xs, yr, N, wr, br, rsb[k], pf);
      else
        scale_row<D, HAS_W, HAS_B, false>(x + r * xs, yr, N, wr, br, rsb[k], pf);
    }
  }
#if NS_ISA >= 1
  if (stream) _mm_sfence();  // make the non-temporal stores visible before returning
#endif
}


#if NS_ISA >= 3
inline float inv_rms(float ss, int64_t N, float eps) { return 1.0f / std::sqrt(ss / float(N) + eps); }

// bf16 rows, software-pipelined two rows deep: the scaling loop of row r also reads row r + 2 for its sum
// of squares, so every row is read from memory once, inside one loop that overlaps those loads with row
// r's arithmetic and stores (row r itself is in L1/L2 by then), and the divide/sqrt of row r + 2's scale
// runs during row r + 1's loop instead of stalling it. Measured: from even to ~10% faster than the grouped
// passes of rows() for bf16 (within this machine's noise at some shapes); 10-20% slower for fp32, whose
// loop is too light to carry the extra stream, so fp32 and fp16 keep rows().
template <bool HAS_W, bool HAS_B>
void rows_bf16x32(const uint16_t* x, int64_t r0, int64_t r1, int64_t N, int64_t xs, const float* w,
                  int64_t wrows, const float* b, int64_t brows, uint16_t* y, float* rstd, float eps, bool stream) {
  const BF16 d;
  const __m512i restore = bf16_order().restore;
  const int64_t n32 = N / 32 * 32;
  // Inputs past L2 size come from L3 or DRAM: also prefetch row r + 4 (measured at 2048x4096, one thread:
  // 1.6x -> 1.35x a copy); smaller inputs are compute-bound and the extra instruction only costs.
  const bool far_prefetch = (r1 - r0) * N * int64_t(sizeof(uint16_t)) >= (int64_t(8) << 20);
  float rs = r0 < r1 ? inv_rms(sumsq(d, x + r0 * xs, N), N, eps) : 0.0f;
  float rs_next = r0 + 1 < r1 ? inv_rms(sumsq(d, x + (r0 + 1) * xs, N), N, eps) : 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const uint16_t* xr = x + r * xs;
    const bool ahead = r + 2 < r1;
    const uint16_t* xa = ahead ? xr + 2 * xs : xr;  // near the end: re-read this row (from L1), unused
    uint16_t* yr = y + r * N;
    const float* wr = HAS_W ? w + (r % wrows) * N : nullptr;
    const float* br = HAS_B ? b + (r % brows) * N : nullptr;
    const uint16_t* far = far_prefetch && r + 4 < r1 ? xr + 4 * xs : nullptr;
    float ss = stream && reinterpret_cast<uintptr_t>(yr) % 64 == 0
        ? scale_row_bf16x32<HAS_W, HAS_B, true>(xr, yr, n32, wr, br, rs, xa, far, restore)
        : scale_row_bf16x32<HAS_W, HAS_B, false>(xr, yr, n32, wr, br, rs, xa, far, restore);
    if (n32 < N)
      scale_row<BF16, HAS_W, HAS_B, false>(xr + n32, yr + n32, N - n32, HAS_W ? wr + n32 : nullptr,
                                            HAS_B ? br + n32 : nullptr, rs, nullptr);
    // Finish row r + 2's sum exactly as sumsq(BF16) does, so a row's scale never depends on which
    // thread or position computed it.
    for (int64_t i = n32; i < N; ++i) { const float v = bf16_to_f32(xa[i]); ss += v * v; }
    if (ahead && !(ss >= 0x1p-100f)) ss = sumsq<BF16>(d, xa, N);  // tiny or NaN: the exact path
    if (rstd) rstd[r] = rs;
    rs = rs_next;
    rs_next = ahead ? inv_rms(ss, N, eps) : 0.0f;
  }
  if (stream) _mm_sfence();
}
#endif

// float64: plain loops (the correctness path for gradcheck-style use; the compiler vectorises them).
template <bool HAS_W, bool HAS_B>
void rows_f64(const double* x, int64_t r0, int64_t r1, int64_t N, int64_t xs, const double* w, int64_t wrows,
              const double* b, int64_t brows, double* y, float* rstd, double eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const double* xr = x + r * xs;
    double* yr = y + r * N;
    double ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < N; ++i) ss += xr[i] * xr[i];
    const double rs = 1.0 / std::sqrt(ss / double(N) + eps);
    if (rstd) rstd[r] = float(rs);
    const double* wr = HAS_W ? w + (r % wrows) * N : nullptr;
    const double* br = HAS_B ? b + (r % brows) * N : nullptr;
#pragma omp simd
    for (int64_t i = 0; i < N; ++i) {
      double v = xr[i] * rs;
      if (HAS_W) v = v * wr[i];
      if (HAS_B) v = v + br[i];
      yr[i] = v;
    }
  }
}

template <class F>
void parallel_rows(int64_t M, int nthreads, F&& f) {
  if (nthreads > M) nthreads = int(M > 0 ? M : 1);
  if (nthreads <= 1) { f(0, M); return; }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    f(M * t / n, M * (t + 1) / n);  // static contiguous split: each thread streams its own rows
  }
#else
  f(0, M);
#endif
}

// A parameter as fp32: in x's dtype D (converted into buf), or already fp32 (f32_params: the caller
// converted a parameter whose dtype differs from x's). An fp32 parameter is used in place unless the
// caller needs its own copy (to permute it), so fp32 calls and mixed-dtype calls copy nothing.
template <class D>
const float* as_f32(D d, const void* p, int64_t n, bool f32_params, bool need_copy, std::vector<float>& buf) {
  if (!p) return nullptr;
  if (f32_params || std::is_same<D, F32>::value) {
    if (!need_copy) return static_cast<const float*>(p);
    buf.assign(static_cast<const float*>(p), static_cast<const float*>(p) + n);
    return buf.data();
  }
  auto src = static_cast<const typename D::T*>(p);
  buf.resize(size_t(n) + L);
  int64_t i = 0;
  for (; i + L <= n; i += L) vstore(F32{}, buf.data() + i, vload(d, src + i));
  if (i < n) vstore_tail(F32{}, buf.data() + i, vload_tail(d, src + i, int(n - i)), int(n - i));
  return buf.data();
}

template <class D>
void launch(const void* x, int64_t M, int64_t N, int64_t xs, const void* w, int64_t wrows, const void* b,
            int64_t brows, void* y, float* rstd, double eps, int nthreads, bool stream, bool f32_params) {
  using T = typename D::T;
  std::vector<float> wbuf, bbuf;
#if NS_ISA >= 3
  constexpr bool permuted = std::is_same<D, BF16>::value;  // lane order of the 32-wide bf16 path
#else
  constexpr bool permuted = false;
#endif
  const float* W = as_f32(D{}, w, wrows * N, f32_params, permuted, wbuf);
  const float* B = as_f32(D{}, b, brows * N, f32_params, permuted, bbuf);
#if NS_ISA >= 3
  if (permuted) {
    if (W) permute_params(wbuf.data(), wrows, N);
    if (B) permute_params(bbuf.data(), brows, N);
  }
#endif
  auto X = static_cast<const T*>(x);
  auto Y = static_cast<T*>(y);
  const float e = float(eps);  // eps is added to an fp32 mean, as in the eager reference
  parallel_rows(M, nthreads, [&](int64_t r0, int64_t r1) {
#if NS_ISA >= 3
    if constexpr (std::is_same<D, BF16>::value) {
      if (W && B) rows_bf16x32<true, true>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
      else if (W) rows_bf16x32<true, false>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
      else if (B) rows_bf16x32<false, true>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
      else rows_bf16x32<false, false>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
      return;
    }
#endif
    if (W && B) rows<D, true, true>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
    else if (W) rows<D, true, false>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
    else if (B) rows<D, false, true>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
    else rows<D, false, false>(X, r0, r1, N, xs, W, wrows, B, brows, Y, rstd, e, stream);
  });
}

// ---------------------------------------------------------------------------------------- backward
// Gradients of the forward above with its output rounding treated as identity (what autograd does to
// the eager reference), all in fp32:  xhat = x * rstd,  g = dy * w,  c = mean(g * xhat),
// dx = (g - xhat * c) * rstd,  dW += dy * xhat (no intermediate rounding),  dB += dy.
// Each thread accumulates dW/dB for its contiguous block of rows into its own fp32 partial buffer;
// the caller sums the partials over threads in a fixed order (deterministic for a thread count).
template <class D, bool HAS_W, bool HAS_DW, bool HAS_DB>
void bwd_rows(const typename D::T* x, const typename D::T* dy, int64_t r0, int64_t r1, int64_t N, int64_t xs,
              int64_t dys, const float* w, int64_t prows, const float* rstd, typename D::T* dx, float* dw,
              float* db) {
  D d;
  const F32 f;
  const int64_t nv = N / L * L;
  const int tail = int(N - nv);
  for (int64_t r = r0; r < r1; ++r) {
    const typename D::T* xr = x + r * xs;
    const typename D::T* dyr = dy + r * dys;
    typename D::T* dxr = dx + r * N;
    const int64_t p = (r % prows) * N;
    const float* wr = HAS_W ? w + p : nullptr;
    float* dwr = HAS_DW ? dw + p : nullptr;
    float* dbr = HAS_DB ? db + p : nullptr;
    const V vrs = vset(rstd[r]);
    V acc = vzero();
    for (int64_t i = 0; i <= nv; i += L) {  // pass 1: c, and the parameter gradients
      const bool full = i < nv;
      if (!full && !tail) break;
      const int n = full ? L : tail;
      V xv = full ? vload(d, xr + i) : vload_tail(d, xr + i, n);
      V gy = full ? vload(d, dyr + i) : vload_tail(d, dyr + i, n);
      V xh = vmul(xv, vrs);
      V g = HAS_W ? vmul(gy, full ? vload(f, wr + i) : vload_tail(f, wr + i, n)) : gy;
      acc = vfma(g, xh, acc);
      if (HAS_DW) {
        V cur = full ? vload(f, dwr + i) : vload_tail(f, dwr + i, n);
        cur = vfma(gy, xh, cur);
        if (full) vstore(f, dwr + i, cur); else vstore_tail(f, dwr + i, cur, n);
      }
      if (HAS_DB) {
        V cur = full ? vload(f, dbr + i) : vload_tail(f, dbr + i, n);
        cur = vadd(cur, gy);
        if (full) vstore(f, dbr + i, cur); else vstore_tail(f, dbr + i, cur, n);
      }
    }
    const V vc = vset(vsum(acc) / float(N));
    for (int64_t i = 0; i <= nv; i += L) {  // pass 2: dx
      const bool full = i < nv;
      if (!full && !tail) break;
      const int n = full ? L : tail;
      V xv = full ? vload(d, xr + i) : vload_tail(d, xr + i, n);
      V gy = full ? vload(d, dyr + i) : vload_tail(d, dyr + i, n);
      V xh = vmul(xv, vrs);
      V g = HAS_W ? vmul(gy, full ? vload(f, wr + i) : vload_tail(f, wr + i, n)) : gy;
      V out = vmul(vadd(g, vmul(xh, vmul(vc, vset(-1.0f)))), vrs);
      if (full) vstore(d, dxr + i, out); else vstore_tail(d, dxr + i, out, n);
    }
  }
}

template <class D>
void launch_bwd(const void* x, const void* dy, int64_t M, int64_t N, int64_t xs, int64_t dys, const void* w,
                int64_t prows, const float* rstd, void* dx, float* dw_part, float* db_part, int nthreads,
                bool f32_params) {
  using T = typename D::T;
  std::vector<float> wbuf;
  const float* W = as_f32(D{}, w, prows * N, f32_params, false, wbuf);
  auto X = static_cast<const T*>(x); auto DY = static_cast<const T*>(dy); auto DX = static_cast<T*>(dx);
  if (nthreads > M) nthreads = int(M > 0 ? M : 1);
  if (nthreads < 1) nthreads = 1;
  const int64_t part = prows * N;
  auto body = [&](int64_t t, int64_t n) {
    const int64_t r0 = M * t / n, r1 = M * (t + 1) / n;
    float* dw = dw_part ? dw_part + t * part : nullptr;
    float* db = db_part ? db_part + t * part : nullptr;
    if (dw) std::memset(dw, 0, size_t(part) * sizeof(float));
    if (db) std::memset(db, 0, size_t(part) * sizeof(float));
    const int key = (W ? 4 : 0) | (dw ? 2 : 0) | (db ? 1 : 0);
    switch (key) {
      case 7: bwd_rows<D, true, true, true>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      case 6: bwd_rows<D, true, true, false>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      case 5: bwd_rows<D, true, false, true>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      case 4: bwd_rows<D, true, false, false>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      case 3: bwd_rows<D, false, true, true>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      case 2: bwd_rows<D, false, true, false>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      case 1: bwd_rows<D, false, false, true>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
      default: bwd_rows<D, false, false, false>(X, DY, r0, r1, N, xs, dys, W, prows, rstd, DX, dw, db); break;
    }
  };
  if (nthreads == 1) { body(0, 1); return; }
#ifdef _OPENMP
#pragma omp parallel num_threads(nthreads)
  body(omp_get_thread_num(), omp_get_num_threads());
#else
  body(0, 1);
#endif
}

}  // namespace

extern "C" {

// dtype codes: 0 float32, 1 bfloat16, 2 float16, 3 float64. Weight and bias have the dtype of x (or
// float32, see flags) and w_rows (b_rows) rows of N elements; row r of x uses weight row r % w_rows
// (per-head parameters). y is contiguous (M, N); rstd (optional, fp32, M) receives 1/sqrt(mean(x^2) + eps).
// flags bit 0: write y with non-temporal stores (for outputs larger than the last-level cache);
// bit 1: weight and bias are float32 (a parameter whose dtype differs from a half-precision x, upcast
// by the caller: the arithmetic uses it unrounded). Returns 0 on success, 1 for an unsupported dtype.
int ns_rms_norm_fwd(int dtype, const void* x, int64_t M, int64_t N, int64_t x_row_stride, const void* w,
                    int64_t w_rows, const void* b, int64_t b_rows, void* y, float* rstd, double eps,
                    int nthreads, int flags) {
  const bool stream = flags & 1, f32_params = flags & 2;
  switch (dtype) {
    case 0: launch<F32>(x, M, N, x_row_stride, w, w_rows, b, b_rows, y, rstd, eps, nthreads,
        stream, f32_params); return 0;
    case 1: launch<BF16>(x, M, N, x_row_stride, w, w_rows, b, b_rows, y, rstd, eps, nthreads,
        stream, f32_params); return 0;
#ifdef NS_HAS_F16
    case 2: launch<F16>(x, M, N, x_row_stride, w, w_rows, b, b_rows, y, rstd, eps, nthreads,
        stream, f32_params); return 0;
#endif
    case 3: {
      auto X = static_cast<const double*>(x); auto W = static_cast<const double*>(w);
      auto B = static_cast<const double*>(b); auto Y = static_cast<double*>(y);
      parallel_rows(M, nthreads, [&](int64_t r0, int64_t r1) {
        if (W && B) rows_f64<true, true>(X, r0, r1, N, x_row_stride, W, w_rows, B, b_rows, Y, rstd, eps);
        else if (W) rows_f64<true, false>(X, r0, r1, N, x_row_stride, W, w_rows, B, b_rows, Y, rstd, eps);
        else if (B) rows_f64<false, true>(X, r0, r1, N, x_row_stride, W, w_rows, B, b_rows, Y, rstd, eps);
        else rows_f64<false, false>(X, r0, r1, N, x_row_stride, W, w_rows, B, b_rows, Y, rstd, eps);
      });
      return 0;
    }
  }
  return 1;
}

// Backward for float32/bfloat16/float16 (float64 gradients use PyTorch math). x and dy: (M, N) rows
// with row strides; dx: contiguous (M, N); rstd: fp32 (M); w: prows rows of N in x's dtype (float32
// with flags bit 1, as in the forward), or null. dw_part/db_part (optional): nthreads * prows * N fp32
// each, one slice per thread; the caller sums them. Threads actually used = min(nthreads, M).
// Returns 0 on success.
int ns_rms_norm_bwd(int dtype, const void* x, const void* dy, int64_t M, int64_t N, int64_t x_row_stride,
                    int64_t dy_row_stride, const void* w, int64_t p_rows, const float* rstd, void* dx,
                    float* dw_part, float* db_part, int nthreads, int flags) {
  const bool f32_params = flags & 2;
  switch (dtype) {
    case 0:
      launch_bwd<F32>(x, dy, M, N, x_row_stride, dy_row_stride, w, p_rows, rstd, dx, dw_part, db_part,
          nthreads, f32_params);
      return 0;
    case 1:
      launch_bwd<BF16>(x, dy, M, N, x_row_stride, dy_row_stride, w, p_rows, rstd, dx, dw_part, db_part,
          nthreads, f32_params);
      return 0;
#ifdef NS_HAS_F16
    case 2:
      launch_bwd<F16>(x, dy, M, N, x_row_stride, dy_row_stride, w, p_rows, rstd, dx, dw_part, db_part,
          nthreads, f32_params);
      return 0;
#endif
  }
  return 1;
}

// Bit mask of supported dtype codes (fp16 needs F16C or a compiler with _Float16).
int ns_supported_dtypes(void) {
#ifdef NS_HAS_F16
  return 0xF;
#else
  return 0xB;
#endif
}

int ns_isa(void) { return NS_ISA; }

// n float32 values into dtype code ``dtype`` (0 float32, 1 bfloat16, 2 float16), rounded to nearest
// even: the cast of a parameter gradient accumulated in float32 (used by csrc/rmsnorm_op.cpp, where it
// saves a dispatcher call per gradient). Returns 0 on success.
int ns_f32_to(int dtype, const float* src, void* dst, int64_t n) {
  auto convert = [&](auto d) {
    using T = typename decltype(d)::T;
    T* out = static_cast<T*>(dst);
    int64_t i = 0;
    for (; i + L <= n; i += L) vstore(d, out + i, vload(F32{}, src + i));
    if (i < n) vstore_tail(d, out + i, vload_tail(F32{}, src + i, int(n - i)), int(n - i));
  };
  switch (dtype) {
    case 0: convert(F32{}); return 0;
    case 1: convert(BF16{}); return 0;
#ifdef NS_HAS_F16
    case 2: convert(F16{}); return 0;
#endif
  }
  return 1;
}

}  // extern "C"

#ifdef NS_PYTHON
// A CPython extension module over the two entry points: a METH_FASTCALL call costs ~0.1 us where a
// ctypes call with 14 arguments costs ~1.3 us, which matters for small inputs. Same positional
// arguments as the C functions (pointers as ints or None); the GIL is released while the kernel runs.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

namespace {
bool ns_args(PyObject* const* args, Py_ssize_t n, Py_ssize_t want, const int* kinds, int64_t* iv,
             double* dv) {
  if (n != want) { PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, n); return false; }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (kinds[i] == 2) { dv[i] = PyFloat_AsDouble(args[i]); }
    else if (args[i] == Py_None) { iv[i] = 0; }
    else if (kinds[i] == 1) { iv[i] = int64_t(PyLong_AsUnsignedLongLong(args[i])); }
    else { iv[i] = PyLong_AsLongLong(args[i]); }
  }
  return !PyErr_Occurred();
}

// kinds: 0 integer, 1 pointer (int or None), 2 float
PyObject* py_fwd(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static const int kinds[14] = {0, 1, 0, 0, 0, 1, 0, 1, 0, 1, 1, 2, 0, 0};
  int64_t v[14] = {}; double d[14] = {};
  if (!ns_args(args, n, 14, kinds, v, d)) return nullptr;
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = ns_rms_norm_fwd(int(v[0]), reinterpret_cast<const void*>(v[1]), v[2], v[3], v[4],
                           reinterpret_cast<const void*>(v[5]), v[6], reinterpret_cast<const void*>(v[7]),
                           v[8],
                           reinterpret_cast<void*>(v[9]), reinterpret_cast<float*>(v[10]), d[11], int(v[12]),
                           int(v[13]));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(status);
}

PyObject* py_bwd(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static const int kinds[15] = {0, 1, 1, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0};
  int64_t v[15] = {}; double d[15] = {};
  if (!ns_args(args, n, 15, kinds, v, d)) return nullptr;
  int status;
  Py_BEGIN_ALLOW_THREADS
  status = ns_rms_norm_bwd(int(v[0]), reinterpret_cast<const void*>(v[1]),
                           reinterpret_cast<const void*>(v[2]), v[3], v[4], v[5], v[6],
                           reinterpret_cast<const void*>(v[7]), v[8],
                           reinterpret_cast<const float*>(v[9]), reinterpret_cast<void*>(v[10]),
                           reinterpret_cast<float*>(v[11]), reinterpret_cast<float*>(v[12]), int(v[13]),
                           int(v[14]));
  Py_END_ALLOW_THREADS
  return PyLong_FromLong(status);
}

PyObject* py_info(PyObject*, PyObject*) { return Py_BuildValue("(ii)", ns_supported_dtypes(), ns_isa()); }

template <class F> PyCFunction as_cfunc(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f));
}
PyMethodDef methods[] = {
    {"fwd", as_cfunc(py_fwd), METH_FASTCALL, "forward"},
    {"bwd", as_cfunc(py_bwd), METH_FASTCALL, "backward"},
    {"info", py_info, METH_NOARGS, "(dtype mask, isa)"},
    {nullptr, nullptr, 0, nullptr}};
PyModuleDef module = {PyModuleDef_HEAD_INIT, "_normswap_rmsnorm", nullptr, -1, methods};
}  // namespace

PyMODINIT_FUNC PyInit__normswap_rmsnorm(void) { return PyModule_Create(&module); }
#endif
