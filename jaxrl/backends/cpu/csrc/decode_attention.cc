// jaxrl's CPU kernel for one decode step's grouped-query attention, called from XLA through
// its FFI (jaxrl/backends/cpu/build.py builds, loads and registers it; attention.py calls it).
//
//   q [B, K, G, H] f32, keys [B, K, S, H] f32, values [B, K, S, H] f32, pos [B] s32
//   -> out [B, K, G, H] f32
//
// Slot b's G query heads on KV head k attend to cache positions 0..pos[b] (all S positions
// when pos[b] >= S, as the sampler feeds an idle slot; uniformly over all S when pos[b] < 0,
// as XLA's masked softmax does). Same result as jaxrl.models.attention's XLA path to float
// rounding.
//
// Why a kernel: XLA:CPU runs this as two batched products of 2 x 64 x S per (slot, KV head)
// with a masked softmax between them, three kernels that each pass over [B, K, G, S] and run
// the products at ~15 GFLOP/s. This reads each position's key and value row once per (slot,
// KV head), only up to the slot's position, and keeps the G logits rows in a small scratch.
// The (slot, KV head) pairs are shared between the calling thread and XLA's intra-op pool.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxrl::Load;
using jaxrl::Splat;
using jaxrl::Sum;
using jaxrl::v8;
using jaxrl::ExpNonPositive;

constexpr int kMaxChunks = 32;  // head_dim up to 256

// The dot products of q [H] (pre-scaled, as C chunks) with 8 consecutive keys [8, H]: one
// accumulator per key over the chunks, then one transpose-and-add of the 8 accumulators
// (summing each to one lane one at a time cost more than the products on AVX2).
inline v8 Dot8(const v8* qv, const float* k, int64_t H, int C) {
  v8 a[8];
  for (int j = 0; j < 8; ++j) a[j] = qv[0] * Load(k + j * H);
  for (int c = 1; c < C; ++c) {
    const v8 qc = qv[c];
    for (int j = 0; j < 8; ++j) a[j] += qc * Load(k + j * H + 8 * c);
  }
#if defined(__AVX__)
  __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]);
  __m256 t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]);
  __m256 t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [k0..k3 low halves | k0..k3 high halves]
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // the same for k4..k7
  return (v8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                           _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8 r;
  for (int j = 0; j < 8; ++j) r[j] = Sum(a[j]);
  return r;
#endif
}

// One (slot, KV head): G queries [G, H] against keys and values [S, H], positions [0, n).
// C = H / 8 vector chunks; logits is scratch of G * n floats.
inline void Attend(const float* q, const float* k, const float* v, int64_t G, int C,
                   int64_t n, bool uniform, float scale, float* out, float* logits) {
  const int64_t H = 8 * int64_t{C};
  for (int64_t g = 0; g < G; ++g) {
    v8 qv[kMaxChunks];
    for (int c = 0; c < C; ++c) qv[c] = Load(q + g * H + 8 * c) * scale;
    float* l = logits + g * n;
    int64_t s = 0;
    for (; s + 8 <= n; s += 8) {
      const v8 d = Dot8(qv, k + s * H, H, C);
      std::memcpy(l + s, &d, sizeof(d));
    }
    for (; s < n; ++s) {
      v8 a = qv[0] * Load(k + s * H);
      for (int c = 1; c < C; ++c) a += qv[c] * Load(k + s * H + 8 * c);
      l[s] = Sum(a);
    }
    if (uniform) std::fill(l, l + n, 0.f);
    float mx = l[0];
    for (int64_t s = 1; s < n; ++s) mx = std::max(mx, l[s]);
    float total = 0.f;
    int64_t s8 = 0;
    for (; s8 + 8 <= n; s8 += 8) {
      const v8 e = ExpNonPositive(Load(l + s8) - Splat(mx));
      std::memcpy(l + s8, &e, sizeof(e));
      total += Sum(e);
    }
    for (; s8 < n; ++s8) {
      l[s8] = std::exp(l[s8] - mx);
      total += l[s8];
    }
    const float inv = 1.f / total;
    v8 acc[kMaxChunks];
    for (int c = 0; c < C; ++c) acc[c] = v8{};
    for (int64_t s = 0; s < n; ++s) {
      const float p = l[s] * inv;
      for (int c = 0; c < C; ++c) acc[c] += p * Load(v + s * H + 8 * c);
    }
    std::memcpy(out + g * H, acc, sizeof(float) * H);
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> keys, ffi::Buffer<ffi::F32> values,
                           ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto kd = keys.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || values.dimensions().size() != 4 ||
      pos.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("decode_attention: want q [B,K,G,H], keys and values "
                                       "[B,K,S,H], pos [B]");
  }
  const int64_t B = qd[0], K = qd[1], G = qd[2], H = qd[3], S = kd[2];
  if (kd[0] != B || kd[1] != K || kd[3] != H || pos.dimensions()[0] != B || S < 1 ||
      H % 8 != 0 || H / 8 > kMaxChunks) {
    return ffi::Error::InvalidArgument("decode_attention: shapes disagree, or head_dim is not "
                                       "a multiple of 8 up to 256");
  }
  const int C = static_cast<int>(H / 8);
  const float scale = 1.f / std::sqrt(static_cast<float>(H));
  const float* qp = q.typed_data();
  const float* kp = keys.typed_data();
  const float* vp = values.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  auto run = [=](int64_t t, float* logits) {
    const int64_t p = pp[t / K];
    const int64_t n = p < 0 ? S : std::min<int64_t>(p + 1, S);
    Attend(qp + t * G * H, kp + t * S * H, vp + t * S * H, G, C, n, p < 0, scale,
           op + t * G * H, logits);
  };
  jaxrl::ForEachPair(pool, B * K, G * S, run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
