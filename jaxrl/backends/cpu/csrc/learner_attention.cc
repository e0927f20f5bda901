// jaxrl's CPU kernels for full-sequence grouped-query attention and its gradient, called from
// XLA through its FFI (jaxrl/backends/cpu/attention.py wraps them in a custom VJP; build.py
// builds them).
//
//   forward:  q [B, T, K, G, H], keys [B, K, S, H], values [B, K, S, H], mask [B, T, S] pred
//             -> out [B, T, K, G, H]
//   backward: the same, and d_out [B, T, K, G, H] -> d_q, d_keys, d_values
//
// q and out are in the projections' own layout (the G query heads that share KV head k next
// to each other), so no transpose runs around the kernels. Query (t, g) attends to the keys s
// with mask[b, t, s]; one with none attends uniformly to all S (as XLA's masked softmax does),
// and its logits get no gradient. Logits are scaled by H^-1/2. All float32.
//
// Why kernels: XLA:CPU runs this attention as batched products of ~126 x 79 x 64 per (row,
// KV head) at ~35 GFLOP/s, with the masked softmax, its gradient and transposes of q and the
// probabilities as separate passes over [B, K, G*T, S] between them. Here one (row, KV head)
// pair's whole attention (queries, keys, values, the [G*T, S] probabilities) stays in the
// core's caches. The backward recomputes the probabilities from q and the keys, as flash
// attention does, so nothing [B, K, G*T, S] is kept between the two.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxrl::ExpNonPositive;
using jaxrl::Load;
using jaxrl::Max;
using jaxrl::Splat;
using jaxrl::Store;
using jaxrl::Sum;
using jaxrl::v8;

// C[i, :N] = sum_p A(i, p) B[p, :N] for R rows i and 8 * V columns: A(i, p) = a[i * ai + p *
// ap] (any strides, so A may be a transpose), B row-major with row stride ldb.
template <int R, int V>
inline void Block(const float* a, int64_t ai, int64_t ap, const float* b, int64_t ldb,
                  int64_t P, float* c, int64_t ldc) {
  v8 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = v8{};
  for (int64_t p = 0; p < P; ++p) {
    v8 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = Load(b + p * ldb + 8 * v);
    for (int r = 0; r < R; ++r) {
      const v8 ar = Splat(a[r * ai + p * ap]);
      for (int v = 0; v < V; ++v) acc[r][v] += ar * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) Store(c + r * ldc + 8 * v, acc[r][v]);
}

template <int R>
inline void Rows(const float* a, int64_t ai, int64_t ap, const float* b, int64_t ldb,
                 int64_t P, int64_t N, float* c, int64_t ldc) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) Block<R, 2>(a, ai, ap, b + n, ldb, P, c + n, ldc);
  if (n < N) Block<R, 1>(a, ai, ap, b + n, ldb, P, c + n, ldc);
}

// C [I, N] = A [I, P] B [P, N], N a multiple of 8, in blocks of 6 rows x 16 columns (12
// accumulators: with the two B vectors and the broadcast, 15 of AVX2's 16 registers).
void MatMul(const float* a, int64_t ai, int64_t ap, const float* b, int64_t ldb, int64_t I,
            int64_t P, int64_t N, float* c, int64_t ldc) {
  int64_t i = 0;
  for (; i + 6 <= I; i += 6) Rows<6>(a + i * ai, ai, ap, b, ldb, P, N, c + i * ldc, ldc);
  const float* ar = a + i * ai;
  float* cr = c + i * ldc;
  switch (I - i) {
    case 5: Rows<5>(ar, ai, ap, b, ldb, P, N, cr, ldc); break;
    case 4: Rows<4>(ar, ai, ap, b, ldb, P, N, cr, ldc); break;
    case 3: Rows<3>(ar, ai, ap, b, ldb, P, N, cr, ldc); break;
    case 2: Rows<2>(ar, ai, ap, b, ldb, P, N, cr, ldc); break;
    case 1: Rows<1>(ar, ai, ap, b, ldb, P, N, cr, ldc); break;
    default: break;
  }
}

struct Shape {
  int64_t B, K, G, T, M, S, H, Sp;  // M = G * T; Sp: S rounded up to a multiple of 8
  float scale;
};

// x [rows, cols] row-major -> xt [cols, ld] (columns past `rows` zero).
void Transpose(const float* x, int64_t rows, int64_t cols, float* xt, int64_t ld) {
  for (int64_t j = 0; j < cols; ++j) {
    float* o = xt + j * ld;
    for (int64_t i = 0; i < rows; ++i) o[i] = x[i * cols + j];
    std::fill(o + rows, o + ld, 0.f);
  }
}

// The [T, Sp] mask of row b as 0 / 1 floats (columns past S zero).
void MaskRows(const bool* mask, const Shape& d, float* out) {
  for (int64_t t = 0; t < d.T; ++t) {
    const bool* m = mask + t * d.S;
    float* o = out + t * d.Sp;
    for (int64_t s = 0; s < d.S; ++s) o[s] = m[s] ? 1.f : 0.f;
    std::fill(o + d.S, o + d.Sp, 0.f);
  }
}

// The probabilities [M, Sp] of one pair, in place over its logits: masked softmax of scale *
// logits per row. Returns nothing; rows with no key set valid[m] = false (uniform over S).
void Softmax(float* l, const float* maskf, const Shape& d, bool* valid) {
  for (int64_t m = 0; m < d.M; ++m) {
    float* row = l + m * d.Sp;
    const float* mk = maskf + (m % d.T) * d.Sp;
    v8 mx = Splat(-FLT_MAX);
    for (int64_t s = 0; s < d.Sp; s += 8) {
      const v8 x = Load(row + s) * Splat(d.scale);
      const v8 x_or_lowest = Load(mk + s) > Splat(0.f) ? x : Splat(-FLT_MAX);
      Store(row + s, x_or_lowest);
      mx = mx > x_or_lowest ? mx : x_or_lowest;
    }
    const float top = Max(mx);
    valid[m] = top > -FLT_MAX;
    if (!valid[m]) {
      for (int64_t s = 0; s < d.Sp; ++s) row[s] = s < d.S ? 1.f / d.S : 0.f;
      continue;
    }
    v8 total = v8{};
    for (int64_t s = 0; s < d.Sp; s += 8) {
      const v8 e = ExpNonPositive(Load(row + s) - Splat(top)) * Load(mk + s);
      Store(row + s, e);
      total += e;
    }
    const v8 inv = Splat(1.f / Sum(total));
    for (int64_t s = 0; s < d.Sp; s += 8) Store(row + s, Load(row + s) * inv);
  }
}

// Scratch floats per pair: keys^T, values^T [H, Sp]; probabilities, their gradient [M, Sp];
// the mask [T, Sp]; the queries and the output's gradient packed [M, H]; and M row flags.
int64_t ScratchFloats(const Shape& d) {
  return 2 * d.H * d.Sp + 2 * d.M * d.Sp + d.T * d.Sp + 2 * d.M * d.H + d.M;
}

ffi::Error Check(const Shape& d, ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
                 ffi::Span<const int64_t> vd, ffi::Span<const int64_t> md) {
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || md.size() != 3) {
    return ffi::Error::InvalidArgument("learner_attention: want q [B,T,K,G,H], keys and "
                                       "values [B,K,S,H], mask [B,T,S]");
  }
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("learner_attention: keys != values");
  }
  if (kd[0] != d.B || kd[1] != d.K || kd[3] != d.H || md[0] != d.B || md[1] != d.T ||
      md[2] != d.S || d.H % 8 != 0 || d.S < 1) {
    return ffi::Error::InvalidArgument("learner_attention: shapes disagree (or head_dim is "
                                       "not a multiple of 8)");
  }
  return ffi::Error::Success();
}

Shape ShapeOf(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
              ffi::Span<const int64_t> md) {
  Shape d{};
  if (qd.size() != 5) return d;
  d.B = qd[0];
  d.T = qd[1];
  d.K = qd[2];
  d.G = qd[3];
  d.H = qd[4];
  d.M = d.G * d.T;
  d.S = kd.size() == 4 ? kd[2] : 0;
  d.Sp = (d.S + 7) / 8 * 8;
  d.scale = 1.f / std::sqrt(static_cast<float>(d.H));
  return d;
}

// Scratch layout of one pair.
struct Scratch {
  float *kt, *vt, *p, *dp, *maskf, *q, *g;
  bool* valid;
  Scratch(float* s, const Shape& d) {
    kt = s;
    vt = kt + d.H * d.Sp;
    p = vt + d.H * d.Sp;
    dp = p + d.M * d.Sp;
    maskf = dp + d.M * d.Sp;
    q = maskf + d.T * d.Sp;
    g = q + d.M * d.H;
    valid = reinterpret_cast<bool*>(g + d.M * d.H);
  }
};

// Where (b, t, k, g=0) starts in a [B, T, K, G, H] array, for pair i = b * K + k; a pair's
// rows of one head are T rows RowStride(d) floats apart.
int64_t RowStart(const Shape& d, int64_t i) {
  return ((i / d.K) * d.T * d.K + i % d.K) * d.G * d.H;
}
int64_t RowStride(const Shape& d) { return d.K * d.G * d.H; }

// Pair i's [G, T] query rows of x [B, T, K, G, H] into packed [M, H] (head-major).
void Pack(const float* x, const Shape& d, int64_t i, float* packed) {
  const float* base = x + RowStart(d, i);
  for (int64_t t = 0; t < d.T; ++t) {
    const float* row = base + t * RowStride(d);
    for (int64_t g = 0; g < d.G; ++g) {
      std::memcpy(packed + (g * d.T + t) * d.H, row + g * d.H, sizeof(float) * d.H);
    }
  }
}

// out rows of pair i, head by head, in [B, T, K, G, H] = a [M, S] product b [S, H].
void MatMulToRows(const float* a, int64_t lda, const float* b, const Shape& d, int64_t i,
                  float* out) {
  for (int64_t g = 0; g < d.G; ++g) {
    MatMul(a + g * d.T * lda, lda, 1, b, d.H, d.T, d.S, d.H, out + RowStart(d, i) + g * d.H,
           RowStride(d));
  }
}

// The four inputs both kernels read, checked.
struct Inputs {
  Shape d;
  const float *q, *k, *v;
  const bool* mask;
};

ffi::Error Read(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> mask, Inputs* in) {
  in->d = ShapeOf(q.dimensions(), keys.dimensions(), mask.dimensions());
  in->q = q.typed_data();
  in->k = keys.typed_data();
  in->v = values.typed_data();
  in->mask = mask.typed_data();
  return Check(in->d, q.dimensions(), keys.dimensions(), values.dimensions(),
               mask.dimensions());
}

// Pair t's queries packed into w.q and its probabilities [M, Sp] into w.p (keys^T into w.kt,
// the mask into w.maskf).
void Probabilities(const Inputs& in, int64_t t, const Scratch& w) {
  const Shape& d = in.d;
  Pack(in.q, d, t, w.q);
  Transpose(in.k + t * d.S * d.H, d.S, d.H, w.kt, d.Sp);
  MaskRows(in.mask + (t / d.K) * d.T * d.S, d, w.maskf);
  MatMul(w.q, d.H, 1, w.kt, d.Sp, d.M, d.H, d.Sp, w.p, d.Sp);
  Softmax(w.p, w.maskf, d, w.valid);
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                   ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> mask,
                   ffi::ResultBuffer<ffi::F32> out) {
  Inputs in;
  if (auto e = Read(q, keys, values, mask, &in); e.failure()) return e;
  const Shape d = in.d;
  float* op = out->typed_data();
  jaxrl::ForEachPair(pool, d.B * d.K, ScratchFloats(d), [=](int64_t t, float* scratch) {
    const Scratch w(scratch, d);
    Probabilities(in, t, w);
    // out [M, H] = P [M, S] values [S, H]
    MatMulToRows(w.p, d.Sp, in.v + t * d.S * d.H, d, t, op);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                    ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::PRED> mask,
                    ffi::Buffer<ffi::F32> d_out, ffi::ResultBuffer<ffi::F32> d_q,
                    ffi::ResultBuffer<ffi::F32> d_keys, ffi::ResultBuffer<ffi::F32> d_values) {
  Inputs in;
  if (auto e = Read(q, keys, values, mask, &in); e.failure()) return e;
  const Shape d = in.d;
  const float* gp = d_out.typed_data();
  float* dqp = d_q->typed_data();
  float* dkp = d_keys->typed_data();
  float* dvp = d_values->typed_data();
  jaxrl::ForEachPair(pool, d.B * d.K, ScratchFloats(d), [=](int64_t t, float* scratch) {
    const Scratch w(scratch, d);
    const float* kt = in.k + t * d.S * d.H;
    Probabilities(in, t, w);
    Pack(gp, d, t, w.g);
    const float* g = w.g;
    // dP [M, Sp] = d_out [M, H] values^T [H, Sp]
    Transpose(in.v + t * d.S * d.H, d.S, d.H, w.vt, d.Sp);
    MatMul(g, d.H, 1, w.vt, d.Sp, d.M, d.H, d.Sp, w.dp, d.Sp);
    // d_logits = P * (dP - rowsum(P * dP)), zero where masked (P is, but for rows with no
    // key, whose uniform P has no gradient), times the logits' scale.
    for (int64_t m = 0; m < d.M; ++m) {
      float* dpr = w.dp + m * d.Sp;
      if (!w.valid[m]) {
        std::fill(dpr, dpr + d.Sp, 0.f);
        continue;
      }
      const float* pr = w.p + m * d.Sp;
      v8 acc = v8{};
      for (int64_t s = 0; s < d.Sp; s += 8) acc += Load(pr + s) * Load(dpr + s);
      const v8 dot = Splat(Sum(acc));
      for (int64_t s = 0; s < d.Sp; s += 8) {
        Store(dpr + s, Load(pr + s) * (Load(dpr + s) - dot) * Splat(d.scale));
      }
    }
    // d_q [M, H] = dL [M, S] keys [S, H]
    MatMulToRows(w.dp, d.Sp, kt, d, t, dqp);
    // d_keys [S, H] = dL^T [S, M] q [M, H]
    MatMul(w.dp, 1, d.Sp, w.q, d.H, d.S, d.M, d.H, dkp + t * d.S * d.H, d.H);
    // d_values [S, H] = P^T [S, M] d_out [M, H]
    MatMul(w.p, 1, d.Sp, g, d.H, d.S, d.M, d.H, dvp + t * d.S * d.H, d.H);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlLearnerAttention, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlLearnerAttentionGrad, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
