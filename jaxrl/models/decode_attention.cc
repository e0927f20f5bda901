// jaxrl's CPU kernel for one decode step's grouped-query attention, called from XLA through
// its FFI (jaxrl/models/decode_attention.py builds, loads and registers it).
//
//   q [B, K, G, H] f32, keys [B, K, S, H] f32, values [B, K, S, H] f32, pos [B] s32
//   -> out [B, K, G, H] f32
//
// Slot b's G query heads on KV head k attend to cache positions 0..pos[b] (all S positions
// when pos[b] >= S, as the sampler feeds an idle slot; uniformly over all S when pos[b] < 0,
// as XLA's masked softmax does). Same result as jaxrl.models.llama's XLA path to float
// rounding.
//
// Why a kernel: XLA:CPU runs this as two batched products of 2 x 64 x S per (slot, KV head)
// with a masked softmax between them, three kernels that each pass over [B, K, G, S] and run
// the products at ~15 GFLOP/s. This reads each position's key and value row once per (slot,
// KV head), only up to the slot's position, and keeps the G logits rows in a small scratch.
// The (slot, KV head) pairs are shared between the calling thread and XLA's intra-op pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline float Sum(v8 x) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += x[i];
  return s;
}

constexpr int kMaxChunks = 32;  // head_dim up to 256

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
    // Four keys at a time: four independent accumulators keep the FMA pipes busy.
    for (; s + 4 <= n; s += 4) {
      const float* k0 = k + s * H;
      v8 a0 = qv[0] * Load(k0), a1 = qv[0] * Load(k0 + H);
      v8 a2 = qv[0] * Load(k0 + 2 * H), a3 = qv[0] * Load(k0 + 3 * H);
      for (int c = 1; c < C; ++c) {
        a0 += qv[c] * Load(k0 + 8 * c);
        a1 += qv[c] * Load(k0 + H + 8 * c);
        a2 += qv[c] * Load(k0 + 2 * H + 8 * c);
        a3 += qv[c] * Load(k0 + 3 * H + 8 * c);
      }
      l[s] = Sum(a0), l[s + 1] = Sum(a1), l[s + 2] = Sum(a2), l[s + 3] = Sum(a3);
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
    for (int64_t s = 0; s < n; ++s) {
      l[s] = std::exp(l[s] - mx);
      total += l[s];
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

// Work shared by the calling thread and the pool's helpers: each claims the next (slot, KV
// head) pair until none is left. The caller waits only for pairs a helper has claimed, so a
// helper that starts late (the pool busy) or never finds nothing to do and no one waits on it.
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

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
  const int64_t pairs = B * K;
  auto run = [=](int64_t t, float* logits) {
    const int64_t p = pp[t / K];
    const int64_t n = p < 0 ? S : std::min<int64_t>(p + 1, S);
    Attend(qp + t * G * H, kp + t * S * H, vp + t * S * H, G, C, n, p < 0, scale,
           op + t * G * H, logits);
  };
  auto work = std::make_shared<Work>();
  auto drain = [work, run, pairs, G, S]() {
    std::unique_ptr<float[]> logits;
    int64_t t;
    while ((t = work->next.fetch_add(1, std::memory_order_relaxed)) < pairs) {
      if (!logits) logits.reset(new float[G * S]);
      run(t, logits.get());
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), pairs) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->done.load(std::memory_order_acquire) < pairs) std::this_thread::yield();
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
