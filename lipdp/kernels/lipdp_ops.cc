// Fused CPU kernels for lipdp's GroupSort2 and L2-norm pooling (see lipdp/kernels/__init__.py).
//
// TensorFlow runs each elementwise op as a separate pass over memory; these layers took 3-4
// passes (and a copy of the activations) forward and again backward. Each kernel below reads
// its inputs once and writes its output once, and computes exactly what the reference
// implementation in lipdp/layers computes:
//
// * LipdpPairPermute(keys, values): for each pair of channels (c, c + C/2) ("halves") or
//   (2i, 2i + 1) ("interleaved") of the last axis, swaps the two `values` where the pair of
//   `keys` is out of order (first member >= second member, so ties swap too). Only
//   comparisons and copies: no rounding. GroupSort2 is LipdpPairPermute(x, x), and its
//   backward pass LipdpPairPermute(x, dy): the same permutation (an involution, so it is its
//   own transpose).
// * LipdpL2NormPool(x): y = coef * sqrt((sum over the window of x^2) / area) over disjoint
//   pool_h x pool_w windows ('valid': trailing rows/columns dropped), NHWC; the order of
//   operations of deel-lip's ScaledL2NormPooling2D (square, average, square root, scale),
//   hence the rounding analysis of lipdp.rounding.block_norm_error.
// * LipdpL2NormPoolGrad(x, dy): deel-lip's backward pass of that layer,
//   dx = ((dy * coef) / (2 (sqrt(s / area) + eps)) / area) * (2 x), and 0 * (2 x) on
//   dropped pixels.
//
// * LipdpSortPool(x) / LipdpSortPoolGrad(x, dy): GroupSort2 followed by that pooling,
//   LipdpL2NormPool(LipdpPairPermute(x, x)), and its backward pass,
//   LipdpPairPermute(x, LipdpL2NormPoolGrad(LipdpPairPermute(x, x), dy)), in one pass each
//   way: each pair's sorted values are formed on the fly, window by window, and squared and
//   summed in the pooling kernel's order, so the results are the composition's bit for bit,
//   without the sorted activations (written, then read twice) in memory.
//
// Compiled with -ffp-contract=off: no fused multiply-add changes a rounding.

#include <cmath>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/work_sharder.h"

namespace lipdp {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OkStatus;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
namespace shape_inference = ::tensorflow::shape_inference;

void ParallelFor(OpKernelContext* ctx, int64_t units, int64_t cost_per_unit,
                 const std::function<void(int64_t, int64_t)>& work) {
  auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  ::tensorflow::Shard(threads->num_threads, threads->workers, units, cost_per_unit, work);
}

REGISTER_OP("LipdpPairPermute")
    .Input("keys: float")
    .Input("values: float")
    .Output("permuted: float")
    .Attr("interleaved: bool = false")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle shape;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &shape));
      c->set_output(0, shape);
      return OkStatus();
    });

class PairPermuteOp : public OpKernel {
 public:
  explicit PairPermuteOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("interleaved", &interleaved_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& keys = ctx->input(0);
    const Tensor& values = ctx->input(1);
    OP_REQUIRES(ctx, keys.shape() == values.shape(),
                errors::InvalidArgument("keys and values must have the same shape, got ",
                                        keys.shape().DebugString(), " and ",
                                        values.shape().DebugString()));
    OP_REQUIRES(ctx, keys.dims() >= 1 && keys.dim_size(keys.dims() - 1) % 2 == 0,
                errors::InvalidArgument("the last axis must have an even size, got shape ",
                                        keys.shape().DebugString()));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, keys.shape(), &output));
    const int64_t channels = keys.dim_size(keys.dims() - 1);
    if (channels == 0 || keys.NumElements() == 0) return;
    const int64_t rows = keys.NumElements() / channels;
    const int64_t half = channels / 2;
    // Partner offset and the stride between first members.
    const int64_t offset = interleaved_ ? 1 : half;
    const int64_t stride = interleaved_ ? 2 : 1;
    const float* k = keys.flat<float>().data();
    const float* v = values.flat<float>().data();
    float* out = output->flat<float>().data();
    ParallelFor(ctx, rows, 4 * channels, [=](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* kr = k + r * channels;
        const float* vr = v + r * channels;
        float* orow = out + r * channels;
        for (int64_t i = 0; i < half; ++i) {
          const int64_t a = i * stride, b = a + offset;
          const bool swap = kr[a] >= kr[b];
          const float va = vr[a], vb = vr[b];
          orow[a] = swap ? vb : va;
          orow[b] = swap ? va : vb;
        }
      }
    });
  }

 private:
  bool interleaved_;
};

REGISTER_KERNEL_BUILDER(Name("LipdpPairPermute").Device(DEVICE_CPU), PairPermuteOp);

Status PooledShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle input;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &input));
  int pool_h, pool_w;
  TF_RETURN_IF_ERROR(c->GetAttr("pool_h", &pool_h));
  TF_RETURN_IF_ERROR(c->GetAttr("pool_w", &pool_w));
  if (pool_h < 1 || pool_w < 1) return errors::InvalidArgument("pool sizes must be positive");
  auto pooled = [&](int axis, int pool) -> shape_inference::DimensionHandle {
    auto dim = c->Dim(input, axis);
    return c->ValueKnown(dim) ? c->MakeDim(c->Value(dim) / pool) : c->UnknownDim();
  };
  c->set_output(0, c->MakeShape({c->Dim(input, 0), pooled(1, pool_h), pooled(2, pool_w),
                                 c->Dim(input, 3)}));
  return OkStatus();
}

// A pooling gradient: the shape of the rank-4 input.
Status InputShape(shape_inference::InferenceContext* c) {
  shape_inference::ShapeHandle input;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &input));
  c->set_output(0, input);
  return OkStatus();
}

// `eps` is not used forward: it is the gradient's (and keeps the two ops' attributes alike).
REGISTER_OP("LipdpL2NormPool")
    .Input("x: float")
    .Output("y: float")
    .Attr("pool_h: int")
    .Attr("pool_w: int")
    .Attr("coef: float")
    .Attr("eps: float")
    .SetShapeFn(PooledShape);

REGISTER_OP("LipdpL2NormPoolGrad")
    .Input("x: float")
    .Input("dy: float")
    .Output("dx: float")
    .Attr("pool_h: int")
    .Attr("pool_w: int")
    .Attr("coef: float")
    .Attr("eps: float")
    .SetShapeFn(InputShape);

REGISTER_OP("LipdpSortPool")
    .Input("x: float")
    .Output("y: float")
    .Attr("pool_h: int")
    .Attr("pool_w: int")
    .Attr("coef: float")
    .Attr("eps: float")
    .Attr("interleaved: bool = false")
    .SetShapeFn(PooledShape);

REGISTER_OP("LipdpSortPoolGrad")
    .Input("x: float")
    .Input("dy: float")
    .Output("dx: float")
    .Attr("pool_h: int")
    .Attr("pool_w: int")
    .Attr("coef: float")
    .Attr("eps: float")
    .Attr("interleaved: bool = false")
    .SetShapeFn(InputShape);

// The window walk of the pooling kernels, written once: the checks of the inputs, the output,
// the pixels no window covers in the backward pass (dropped by 'valid' pooling: a zero
// cotangent times 2 x, as the reference computes it: signed zeros, NaN for a NaN input),
// and for each window deel-lip's order of operations (square, average, square root, scale;
// backward, ((dy * coef) / (2 (sqrt(s / area) + eps)) / area) times 2 v). `Pixels` says what
// a window's pixels contribute (CRTP, so that its loops inline and vectorise):
// `Pixels::CheckChannels(x)`, `Pixels::kCost` (operations per element one way),
// `pixels.Accumulate(p, s, channels)` adds the squares of the values v pooled at pixel p to
// the sums s, and `pixels.Scatter(p, s, d, channels)` writes the input cotangent d of pixel
// p from the scales s (the cotangent of v is s * (2 v)).
template <typename Pixels, bool kGrad>
class WindowPoolOp : public OpKernel {
 public:
  explicit WindowPoolOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pool_h", &pool_h_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("pool_w", &pool_w_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("coef", &coef_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("eps", &eps_));
    OP_REQUIRES(ctx, pool_h_ >= 1 && pool_w_ >= 1,
                errors::InvalidArgument("pool sizes must be positive"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES(ctx, x.dims() == 4,
                errors::InvalidArgument("expected NHWC input of rank 4, got shape ",
                                        x.shape().DebugString()));
    OP_REQUIRES_OK(ctx, Pixels::CheckChannels(x));
    const int64_t batch = x.dim_size(0), height = x.dim_size(1), width = x.dim_size(2),
                  channels = x.dim_size(3);
    const int64_t out_h = height / pool_h_, out_w = width / pool_w_;
    const TensorShape pooled({batch, out_h, out_w, channels});
    const float* dy = nullptr;
    if (kGrad) {
      const Tensor& grad = ctx->input(1);
      OP_REQUIRES(ctx, grad.shape() == pooled,
                  errors::InvalidArgument("dy has shape ", grad.shape().DebugString(),
                                          ", expected the pooled shape of ",
                                          x.shape().DebugString()));
      dy = grad.flat<float>().data();
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, kGrad ? x.shape() : pooled, &output));
    if (output->NumElements() == 0) return;
    float* out = output->flat<float>().data();
    const float* xs = x.flat<float>().data();
    if (kGrad && (out_h * pool_h_ != height || out_w * pool_w_ != width)) {
      // Covered pixels are overwritten below.
      ParallelFor(ctx, x.NumElements(), 2, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) out[i] = 0.0f * (2.0f * xs[i]);
      });
    }
    if (out_h == 0 || out_w == 0 || channels == 0) return;
    const Pixels& pixels = static_cast<const Pixels&>(*this);
    const int64_t ph = pool_h_, pw = pool_w_;
    const float area = static_cast<float>(ph * pw);
    const float coef = coef_, eps = eps_;
    ParallelFor(ctx, batch * out_h, out_w * channels * ph * pw * Pixels::kCost * (kGrad ? 2 : 1),
                [=, &pixels](int64_t begin, int64_t end) {
      std::vector<float> sums(channels);
      float* __restrict s = sums.data();
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / out_h, oi = row % out_h;
        for (int64_t oj = 0; oj < out_w; ++oj) {
          const int64_t corner = ((b * height + oi * ph) * width + oj * pw) * channels;
          for (int64_t c = 0; c < channels; ++c) s[c] = 0.0f;
          for (int64_t di = 0; di < ph; ++di) {
            for (int64_t dj = 0; dj < pw; ++dj) {
              pixels.Accumulate(xs + corner + (di * width + dj) * channels, s, channels);
            }
          }
          const int64_t o = (row * out_w + oj) * channels;
          if (!kGrad) {
            float* __restrict y = out + o;
            for (int64_t c = 0; c < channels; ++c) y[c] = std::sqrt(s[c] / area) * coef;
            continue;
          }
          for (int64_t c = 0; c < channels; ++c) {
            s[c] = (dy[o + c] * coef) / (2.0f * (std::sqrt(s[c] / area) + eps)) / area;
          }
          for (int64_t di = 0; di < ph; ++di) {
            for (int64_t dj = 0; dj < pw; ++dj) {
              const int64_t at = corner + (di * width + dj) * channels;
              pixels.Scatter(xs + at, s, out + at, channels);
            }
          }
        }
      }
    });
  }

 private:
  int pool_h_, pool_w_;
  float coef_, eps_;
};

// L2-norm pooling: a pixel's values are its own.
template <bool kGrad>
class L2NormPoolOp : public WindowPoolOp<L2NormPoolOp<kGrad>, kGrad> {
 public:
  static constexpr int kCost = 2;
  explicit L2NormPoolOp(OpKernelConstruction* ctx)
      : WindowPoolOp<L2NormPoolOp<kGrad>, kGrad>(ctx) {}

  static Status CheckChannels(const Tensor&) { return OkStatus(); }

  void Accumulate(const float* __restrict p, float* __restrict s, int64_t channels) const {
    for (int64_t c = 0; c < channels; ++c) s[c] += p[c] * p[c];
  }

  void Scatter(const float* __restrict p, const float* __restrict s, float* __restrict d,
               int64_t channels) const {
    for (int64_t c = 0; c < channels; ++c) d[c] = s[c] * (2.0f * p[c]);
  }
};

// One pair (a, b) at one pixel: the GroupSort2 outputs (min to a, max to b; a tie swaps, as
// LipdpPairPermute does) and whether the pair was swapped.
inline bool SortPair(const float* p, int64_t a, int64_t b, float* low, float* high) {
  const float va = p[a], vb = p[b];
  const bool swap = va >= vb;
  *low = swap ? vb : va;
  *high = swap ? va : vb;
  return swap;
}

// GroupSort2 then L2-norm pooling: a pixel's values are its sorted pairs, formed on the fly,
// and a sorted value's cotangent goes back through the pair's permutation. Uncovered pixels
// (the walk's zero cotangent times 2 x) are what the composition computes too: x's own
// sorted value is sent back to x's position.
template <bool kGrad>
class SortPoolOp : public WindowPoolOp<SortPoolOp<kGrad>, kGrad> {
 public:
  static constexpr int kCost = 3;
  explicit SortPoolOp(OpKernelConstruction* ctx) : WindowPoolOp<SortPoolOp<kGrad>, kGrad>(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("interleaved", &interleaved_));
  }

  static Status CheckChannels(const Tensor& x) {
    if (x.dim_size(3) % 2 == 0) return OkStatus();
    return errors::InvalidArgument("the last axis must have an even size, got shape ",
                                   x.shape().DebugString());
  }

  void Accumulate(const float* __restrict p, float* __restrict s, int64_t channels) const {
    const int64_t half = channels / 2;
    if (interleaved_) {
      for (int64_t i = 0; i < half; ++i) {
        float low, high;
        SortPair(p, 2 * i, 2 * i + 1, &low, &high);
        s[2 * i] += low * low;
        s[2 * i + 1] += high * high;
      }
      return;
    }
    // Halves: unit strides, so the loop vectorises.
    const float* __restrict pa = p;
    const float* __restrict pb = p + half;
    float* __restrict sa = s;
    float* __restrict sb = s + half;
    for (int64_t i = 0; i < half; ++i) {
      const float va = pa[i], vb = pb[i];
      const bool swap = va >= vb;
      const float low = swap ? vb : va, high = swap ? va : vb;
      sa[i] += low * low;
      sb[i] += high * high;
    }
  }

  void Scatter(const float* __restrict p, const float* __restrict s, float* __restrict d,
               int64_t channels) const {
    const int64_t half = channels / 2;
    if (interleaved_) {
      for (int64_t i = 0; i < half; ++i) {
        const int64_t a = 2 * i, c = a + 1;
        float low, high;
        const bool swap = SortPair(p, a, c, &low, &high);
        const float d_low = s[a] * (2.0f * low), d_high = s[c] * (2.0f * high);
        d[a] = swap ? d_high : d_low;
        d[c] = swap ? d_low : d_high;
      }
      return;
    }
    const float* __restrict pa = p;
    const float* __restrict pb = p + half;
    const float* __restrict sa = s;
    const float* __restrict sb = s + half;
    float* __restrict da = d;
    float* __restrict db = d + half;
    // Swapped, a's cotangent is the maximum's, sb * (2 high) with high = va, else the
    // minimum's, sa * (2 low) with low = va: (swap ? sb : sa) * (2 va), the same operations
    // on the same values.
    for (int64_t i = 0; i < half; ++i) {
      const float va = pa[i], vb = pb[i], ga = sa[i], gb = sb[i];
      const bool swap = va >= vb;
      da[i] = (swap ? gb : ga) * (2.0f * va);
      db[i] = (swap ? ga : gb) * (2.0f * vb);
    }
  }

 private:
  bool interleaved_;
};

REGISTER_KERNEL_BUILDER(Name("LipdpL2NormPool").Device(DEVICE_CPU), L2NormPoolOp<false>);
REGISTER_KERNEL_BUILDER(Name("LipdpL2NormPoolGrad").Device(DEVICE_CPU), L2NormPoolOp<true>);
REGISTER_KERNEL_BUILDER(Name("LipdpSortPool").Device(DEVICE_CPU), SortPoolOp<false>);
REGISTER_KERNEL_BUILDER(Name("LipdpSortPoolGrad").Device(DEVICE_CPU), SortPoolOp<true>);

}  // namespace lipdp
