// What jaxrl's CPU attention kernels share (decode_attention.cc, learner_attention.cc): 8-lane
// float vectors, e^x for x <= 0, and the loop that spreads (row, KV head) pairs over the
// calling thread and XLA's intra-op pool.
#ifndef JAXRL_BACKENDS_CPU_SIMD_H_
#define JAXRL_BACKENDS_CPU_SIMD_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxrl {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

inline v8 Load(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline void Store(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }

inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline float Sum(v8 x) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += x[i];
  return s;
}

inline float Max(v8 x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, x[i]);
  return m;
}

// e^x for x <= 0, 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7), 2^n built in the exponent bits. Inputs below -87 (the
// smallest normal's log) give ~1e-38 instead of 0: a softmax weight that small changes
// nothing. std::exp one lane at a time was most of the decode kernel's time.
inline v8 ExpNonPositive(v8 x) {
  const v8 lo = Splat(-87.f);
  x = x < lo ? lo : x;
  const v8 magic = Splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const v8 n = (x * Splat(1.44269504f) + magic) - magic;
  const v8 r = (x - n * Splat(0.693145752f)) - n * Splat(1.42860677e-6f);
  v8 p = Splat(1.f / 720);
  p = p * r + Splat(1.f / 120);
  p = p * r + Splat(1.f / 24);
  p = p * r + Splat(1.f / 6);
  p = p * r + Splat(0.5f);
  p = p * r + Splat(1.f);
  p = p * r + Splat(1.f);
  const vi8 bits = (__builtin_convertvector(n, vi8) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Runs fn(t, scratch) for t in [0, pairs) on the calling thread and up to the pool's size of
// helpers, each with its own `scratch_floats` floats of scratch. Each claims the next pair
// until none is left. The caller waits only for pairs a helper has claimed: a helper that
// starts late (the pool busy) finds nothing left to do, and one that never starts holds up no
// one.
template <typename Fn>
void ForEachPair(xla::ffi::ThreadPool pool, int64_t pairs, int64_t scratch_floats, Fn fn) {
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto work = std::make_shared<Work>();
  auto drain = [work, fn, pairs, scratch_floats]() {
    std::unique_ptr<float[]> scratch;
    int64_t t;
    while ((t = work->next.fetch_add(1, std::memory_order_relaxed)) < pairs) {
      if (!scratch) scratch.reset(new float[scratch_floats]);
      fn(t, scratch.get());
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), pairs) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([drain]() { drain(); });
  drain();
  while (work->done.load(std::memory_order_acquire) < pairs) std::this_thread::yield();
}

}  // namespace jaxrl

#endif  // JAXRL_BACKENDS_CPU_SIMD_H_
