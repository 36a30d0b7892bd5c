// The private step's Gaussian noise in one pass over the gradient (see lipdp/noise.py).
//
// * LipdpAddGaussianNoise(x, stddev): y = x + stddev * z, float32, z i.i.d. N(0, 1), in one
//   pass (read x, write y) instead of TensorFlow's eight (uniforms, logarithm, square root,
//   cosine, sine, products, concatenation, sum). The uniforms are those of TensorFlow's
//   RandomUniform: the Philox4x32-10 generator, seeded from the attributes seed / seed2
//   (both 0: a random seed) by GuardedPhiloxRandom, with RandomUniform's reservation of
//   counters, and u = Uint32ToFloat(bits) = (bits mod 2^23) / 2^23 in [0, 1). The group g of
//   four outputs (x0, x1, x2, x3) of the generator at counter c + g gives
//   z[4g] = r(x0) cos(2 pi u(x1)), z[4g + 1] = r(x0) sin(2 pi u(x1)), and z[4g + 2],
//   z[4g + 3] the same from (x2, x3), with r(x) = sqrt(-2 ln(1 - u(x))): the Box-Muller
//   transform, whose two outputs are independent standard normals for independent uniforms.
//   With the same seeds, RandomUniform draws exactly these uniforms (the tests check it).
//   With a non-empty attribute `message`, a non-finite x fails the op with it, as
//   CheckNumerics would (the check reads x in the same pass).
// * LipdpBoxMuller(a, b): (r(a), cos(2 pi u(b)), sin(2 pi u(b))) of uint32 tensors, the
//   functions the noise is made of, so that the tests can check them on every one of their
//   2^23 inputs (r within 1.2 * 2^-23 relative, sine and cosine within 1.7 * 2^-24 absolute
//   of exact; the noise is fl(r * cos), fl(r * sin)).
//
// The functions are written branch-free on float32 with IEEE operations only (+, -, *, /,
// sqrt; compiled with -ffp-contract=off), so that the compiler vectorises them, and the
// vector versions for AVX-512 and AVX2 give the same bits as the scalar one (Philox is integer
// arithmetic, exact in any of them):
// * r: 1 - u is exact; ln w = e ln 2 + ln m with w = 2^e m, m in [sqrt(1/2), sqrt(2)), and
//   ln m = 2 atanh(s) = 2 (s + s^3/3 + ... + s^9/9), s = (m - 1)/(m + 1), |s| <= 0.172 (the
//   terms left out, from s^11/11 on, add up to about 2^-29 relative); ln 2 split so that the
//   high part of e ln 2 is exact. r(u) <= sqrt(2 * 23 ln 2) = 5.65, as the TF-ops version's.
// * cosine and sine: 4u = q + f exactly (q the quadrant), the angle pi/2 g with
//   g = min(f, 1 - f) <= 1/2 (exact), Taylor polynomials of degree 9 (sine) and 10 (cosine)
//   on [0, pi/4] (the first terms left out are below 2^-28), then the quadrant's symmetries:
//   no rounding of 2 pi u, which TensorFlow's sin(2 pi u) commits (up to 2^-21 absolute).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/guarded_philox_random.h"
#include "tensorflow/core/util/work_sharder.h"

// x86-64-v4 (AVX-512 with its DQ extension, GCC 11 on) multiplies Philox's 64-bit lanes in one
// instruction where plain AVX-512F emulates it with three: 0.77-0.86x the noise's time on 2
// cores (784 x 1024 tensors, four alternated processes).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define LIPDP_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LIPDP_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LIPDP_VECTOR_CLONES
#endif

namespace lipdp_noise {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OkStatus;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
namespace errors = ::tensorflow::errors;
namespace shape_inference = ::tensorflow::shape_inference;

// Counters of Philox computed side by side (one vector register's worth of each word).
constexpr int kLanes = 16;
// RandomUniform reserves this many 128-bit samples per output (GuardedPhiloxRandom).
constexpr int kReservePerOutput = 256;

inline float Unit(uint32_t bits) {  // TensorFlow's Uint32ToFloat: [0, 1), multiples of 2^-23
  const uint32_t one_to_two = (127u << 23) | (bits & 0x7fffffu);
  float value;
  std::memcpy(&value, &one_to_two, sizeof(value));
  return value - 1.0f;
}

inline float Radius(uint32_t bits) {  // sqrt(-2 ln(1 - u))
  const float w = 1.0f - Unit(bits);  // exact, in [2^-23, 1]
  uint32_t w_bits;
  std::memcpy(&w_bits, &w, sizeof(w));
  int32_t exponent = static_cast<int32_t>(w_bits >> 23) - 127;
  const uint32_t m_bits = (w_bits & 0x7fffffu) | (127u << 23);
  float m;
  std::memcpy(&m, &m_bits, sizeof(m));  // [1, 2)
  const bool above = m > 1.41421356f;
  m = above ? 0.5f * m : m;
  exponent = above ? exponent + 1 : exponent;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float series = (1.0f / 9.0f) * s2 + 1.0f / 7.0f;
  series = series * s2 + 1.0f / 5.0f;
  series = series * s2 + 1.0f / 3.0f;
  series = series * s2 + 1.0f;
  const float e = static_cast<float>(exponent);
  // ln 2 = 0.693145751953125 (exact in 15 bits: e times it is exact) + 1.4286068e-06.
  const float ln_w = e * 0.693145751953125f + (e * 1.4286068203e-06f + 2.0f * s * series);
  return std::sqrt(-2.0f * ln_w);
}

inline void CosSin(uint32_t bits, float* cosine, float* sine) {  // of 2 pi u
  const float quarters = 4.0f * Unit(bits);  // exact
  const int quadrant = static_cast<int>(quarters);
  const float f = quarters - static_cast<float>(quadrant);  // exact, [0, 1)
  const bool upper = f > 0.5f;
  const float g = upper ? 1.0f - f : f;  // exact, [0, 1/2]
  const float x = g * 1.57079632679489662f;
  const float x2 = x * x;
  float sine_poly = (1.0f / 362880.0f) * x2 - 1.0f / 5040.0f;
  sine_poly = sine_poly * x2 + 1.0f / 120.0f;
  sine_poly = sine_poly * x2 - 1.0f / 6.0f;
  const float sin_x = x + x * x2 * sine_poly;
  float cosine_poly = (-1.0f / 3628800.0f) * x2 + 1.0f / 40320.0f;
  cosine_poly = cosine_poly * x2 - 1.0f / 720.0f;
  cosine_poly = cosine_poly * x2 + 1.0f / 24.0f;
  cosine_poly = cosine_poly * x2 - 0.5f;
  const float cos_x = 1.0f + x2 * cosine_poly;
  // (sin, cos) of pi/2 f, then of pi/2 (quadrant + f).
  const float sin_f = upper ? cos_x : sin_x;
  const float cos_f = upper ? sin_x : cos_x;
  const float sin_turned = (quadrant & 1) ? cos_f : sin_f;
  const float cos_turned = (quadrant & 1) ? sin_f : cos_f;
  *sine = (quadrant & 2) ? -sin_turned : sin_turned;
  *cosine = ((quadrant + 1) & 2) ? -cos_turned : cos_turned;
}

// y[i] = x[i] + stddev * z[i] for the groups [begin, end) of four outputs (i < size);
// returns whether every x[i] read was finite.
LIPDP_VECTOR_CLONES
bool AddNoise(uint32_t key0, uint32_t key1, const uint32_t* counter, int64_t begin,
              int64_t end, const float* x, float stddev, float* y, int64_t size) {
  uint32_t non_finite = 0;
  const uint64_t counter_low = (static_cast<uint64_t>(counter[1]) << 32) | counter[0];
  const uint64_t counter_high = (static_cast<uint64_t>(counter[3]) << 32) | counter[2];
  for (int64_t start = begin; start < end; start += kLanes) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int j = 0; j < kLanes; ++j) {  // the 128-bit counters c + group
      const uint64_t group = static_cast<uint64_t>(start + j);
      const uint64_t low = counter_low + group;
      const uint64_t high = counter_high + (low < group ? 1 : 0);
      c0[j] = static_cast<uint32_t>(low);
      c1[j] = static_cast<uint32_t>(low >> 32);
      c2[j] = static_cast<uint32_t>(high);
      c3[j] = static_cast<uint32_t>(high >> 32);
    }
    float z[4][kLanes];
    for (int j = 0; j < kLanes; ++j) {
      uint32_t w0 = c0[j], w1 = c1[j], w2 = c2[j], w3 = c3[j];
      uint32_t k0 = key0, k1 = key1;
      for (int round = 0; round < 10; ++round) {  // Philox4x32-10, as tsl::random::PhiloxRandom
        const uint64_t product0 = static_cast<uint64_t>(0xD2511F53u) * w0;
        const uint64_t product1 = static_cast<uint64_t>(0xCD9E8D57u) * w2;
        const uint32_t next0 = static_cast<uint32_t>(product1 >> 32) ^ w1 ^ k0;
        const uint32_t next2 = static_cast<uint32_t>(product0 >> 32) ^ w3 ^ k1;
        w1 = static_cast<uint32_t>(product1);
        w3 = static_cast<uint32_t>(product0);
        w0 = next0;
        w2 = next2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      const float r0 = Radius(w0), r1 = Radius(w2);
      float cos0, sin0, cos1, sin1;
      CosSin(w1, &cos0, &sin0);
      CosSin(w3, &cos1, &sin1);
      z[0][j] = r0 * cos0;
      z[1][j] = r0 * sin0;
      z[2][j] = r1 * cos1;
      z[3][j] = r1 * sin1;
    }
    const int64_t groups = end - start < kLanes ? end - start : kLanes;
    for (int64_t j = 0; j < groups; ++j) {
      for (int64_t k = 0; k < 4; ++k) {
        const int64_t i = 4 * (start + j) + k;
        if (i >= size) continue;
        uint32_t bits;
        std::memcpy(&bits, &x[i], sizeof(bits));
        non_finite |= (bits & 0x7f800000u) == 0x7f800000u;  // all exponent bits: inf or NaN
        y[i] = x[i] + stddev * z[k][j];
      }
    }
  }
  return non_finite == 0;
}

REGISTER_OP("LipdpAddGaussianNoise")
    .Input("x: float")
    .Input("stddev: float")
    .Output("y: float")
    .Attr("seed: int = 0")
    .Attr("seed2: int = 0")
    .Attr("message: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
      c->set_output(0, c->input(0));
      return OkStatus();
    });

class AddGaussianNoiseOp : public OpKernel {
 public:
  explicit AddGaussianNoiseOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, generator_.Init(ctx));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("message", &message_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& stddev = ctx->input(1);
    OP_REQUIRES(ctx, stddev.dims() == 0,
                errors::InvalidArgument("stddev must be a scalar, got shape ",
                                        stddev.shape().DebugString()));
    Tensor* y = nullptr;
    OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({0}, 0, x.shape(), &y));
    const int64_t size = x.NumElements();
    if (size == 0) return;
    const auto generator = generator_.ReserveRandomOutputs(size, kReservePerOutput);
    const uint32_t counter[4] = {generator.counter()[0], generator.counter()[1],
                                 generator.counter()[2], generator.counter()[3]};
    const uint32_t key0 = generator.key()[0], key1 = generator.key()[1];
    const float* in = x.flat<float>().data();
    float* out = y->flat<float>().data();
    const float scale = stddev.scalar<float>()();
    const int64_t groups = (size + 3) / 4;
    const int64_t blocks = (groups + kLanes - 1) / kLanes;
    std::atomic<bool> finite(true);
    auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
    ::tensorflow::Shard(threads->num_threads, threads->workers, blocks, 64 * kLanes * 4,
                        [&](int64_t first, int64_t last) {
                          if (!AddNoise(key0, key1, counter, first * kLanes,
                                        std::min(last * kLanes, groups), in, scale, out, size)) {
                            finite.store(false);
                          }
                        });
    OP_REQUIRES(ctx, message_.empty() || finite.load(),
                errors::InvalidArgument(message_, " : Tensor had NaN or Inf values"));
  }

 private:
  ::tensorflow::GuardedPhiloxRandom generator_;
  std::string message_;
};

REGISTER_KERNEL_BUILDER(Name("LipdpAddGaussianNoise").Device(DEVICE_CPU), AddGaussianNoiseOp);

REGISTER_OP("LipdpBoxMuller")
    .Input("a: uint32")
    .Input("b: uint32")
    .Output("radius: float")
    .Output("cosine: float")
    .Output("sine: float")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &shape));
      for (int i = 0; i < 3; ++i) c->set_output(i, shape);
      return OkStatus();
    });

class BoxMullerOp : public OpKernel {
 public:
  explicit BoxMullerOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    OP_REQUIRES(ctx, a.shape() == b.shape(),
                errors::InvalidArgument("a and b must have the same shape"));
    Tensor *radius = nullptr, *cosine = nullptr, *sine = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, a.shape(), &radius));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, a.shape(), &cosine));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, a.shape(), &sine));
    const auto a_flat = a.flat<uint32_t>();
    const auto b_flat = b.flat<uint32_t>();
    auto r = radius->flat<float>();
    auto c = cosine->flat<float>();
    auto s = sine->flat<float>();
    for (int64_t i = 0; i < a.NumElements(); ++i) {
      r(i) = Radius(a_flat(i));
      CosSin(b_flat(i), &c(i), &s(i));
    }
  }
};

REGISTER_KERNEL_BUILDER(Name("LipdpBoxMuller").Device(DEVICE_CPU), BoxMullerOp);

}  // namespace lipdp_noise
