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
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle input;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &input));
      c->set_output(0, input);
      return OkStatus();
    });

// The NHWC geometry and buffers of one call of a window-pooling kernel.
struct Windows {
  int64_t batch, height, width, channels, out_h, out_w;
  const float* x;
  const float* dy;  // the pooled cotangent (backward kernels), else nullptr
  float* out;
};

// What the pooling kernels share: their attributes, the checks of their inputs, the output,
// and in the backward pass the pixels no window covers (dropped by 'valid' pooling): a zero
// cotangent times 2 x, as the reference computes it (signed zeros, NaN for a NaN input); a
// subclass computes the covered ones (`Pool`).
template <bool kGrad>
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
    OP_REQUIRES_OK(ctx, CheckChannels(x));
    Windows w;
    w.batch = x.dim_size(0), w.height = x.dim_size(1), w.width = x.dim_size(2);
    w.channels = x.dim_size(3);
    w.out_h = w.height / pool_h_, w.out_w = w.width / pool_w_;
    w.dy = nullptr;
    const TensorShape pooled({w.batch, w.out_h, w.out_w, w.channels});
    if (kGrad) {
      const Tensor& grad = ctx->input(1);
      OP_REQUIRES(ctx, grad.shape() == pooled,
                  errors::InvalidArgument("dy has shape ", grad.shape().DebugString(),
                                          ", expected the pooled shape of ",
                                          x.shape().DebugString()));
      w.dy = grad.flat<float>().data();
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, kGrad ? x.shape() : pooled, &output));
    if (output->NumElements() == 0) return;
    w.out = output->flat<float>().data();
    w.x = x.flat<float>().data();
    if (kGrad && (w.out_h * pool_h_ != w.height || w.out_w * pool_w_ != w.width)) {
      // Covered pixels are overwritten by `Pool`.
      float* out = w.out;
      const float* xs = w.x;
      ParallelFor(ctx, x.NumElements(), 2, [=](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) out[i] = 0.0f * (2.0f * xs[i]);
      });
    }
    if (w.out_h == 0 || w.out_w == 0 || w.channels == 0) return;
    Pool(ctx, w);
  }

 protected:
  virtual Status CheckChannels(const Tensor& x) const { return OkStatus(); }
  virtual void Pool(OpKernelContext* ctx, const Windows& w) const = 0;

  int pool_h_, pool_w_;
  float coef_, eps_;
};

template <bool kGrad>
class L2NormPoolOp : public WindowPoolOp<kGrad> {
 public:
  explicit L2NormPoolOp(OpKernelConstruction* ctx) : WindowPoolOp<kGrad>(ctx) {}

 protected:
  void Pool(OpKernelContext* ctx, const Windows& w) const override {
    const int64_t batch = w.batch, height = w.height, width = w.width, channels = w.channels,
                  out_h = w.out_h, out_w = w.out_w;
    const float* xs = w.x;
    const float* dy = w.dy;
    float* out = w.out;
    const int64_t ph = this->pool_h_, pw = this->pool_w_;
    const float area = static_cast<float>(ph * pw);
    const float coef = this->coef_, eps = this->eps_;
    ParallelFor(ctx, batch * out_h, out_w * channels * ph * pw * (kGrad ? 4 : 2),
                [=](int64_t begin, int64_t end) {
      std::vector<float> sums(channels);
      float* __restrict s = sums.data();
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / out_h, oi = row % out_h;
        for (int64_t oj = 0; oj < out_w; ++oj) {
          const int64_t corner = ((b * height + oi * ph) * width + oj * pw) * channels;
          for (int64_t c = 0; c < channels; ++c) s[c] = 0.0f;
          for (int64_t di = 0; di < ph; ++di) {
            for (int64_t dj = 0; dj < pw; ++dj) {
              const float* __restrict p = xs + corner + (di * width + dj) * channels;
              for (int64_t c = 0; c < channels; ++c) s[c] += p[c] * p[c];
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
              const float* __restrict p = xs + at;
              float* __restrict d = out + at;
              for (int64_t c = 0; c < channels; ++c) d[c] = s[c] * (2.0f * p[c]);
            }
          }
        }
      }
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("LipdpL2NormPool").Device(DEVICE_CPU), L2NormPoolOp<false>);
REGISTER_KERNEL_BUILDER(Name("LipdpL2NormPoolGrad").Device(DEVICE_CPU), L2NormPoolOp<true>);

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
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle input;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 4, &input));
      c->set_output(0, input);
      return OkStatus();
    });

// One pair (a, b) at one pixel: the GroupSort2 outputs (min to a, max to b; a tie swaps, as
// LipdpPairPermute does) and whether the pair was swapped.
inline bool SortPair(const float* p, int64_t a, int64_t b, float* low, float* high) {
  const float va = p[a], vb = p[b];
  const bool swap = va >= vb;
  *low = swap ? vb : va;
  *high = swap ? va : vb;
  return swap;
}

template <bool kGrad>
class SortPoolOp : public WindowPoolOp<kGrad> {
 public:
  explicit SortPoolOp(OpKernelConstruction* ctx) : WindowPoolOp<kGrad>(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("interleaved", &interleaved_));
  }

 protected:
  Status CheckChannels(const Tensor& x) const override {
    if (x.dim_size(3) % 2 == 0) return OkStatus();
    return errors::InvalidArgument("the last axis must have an even size, got shape ",
                                   x.shape().DebugString());
  }

  // Uncovered pixels (the base class): the pooling's zero cotangent times 2 x, x's own
  // sorted value sent back to x's position, as the composition computes it.
  void Pool(OpKernelContext* ctx, const Windows& w) const override {
    const int64_t batch = w.batch, height = w.height, width = w.width, channels = w.channels,
                  out_h = w.out_h, out_w = w.out_w;
    const float* xs = w.x;
    const float* dy = w.dy;
    float* out = w.out;
    const int64_t half = channels / 2;
    const bool interleaved = interleaved_;
    const int64_t ph = this->pool_h_, pw = this->pool_w_;
    const float area = static_cast<float>(ph * pw);
    const float coef = this->coef_, eps = this->eps_;
    ParallelFor(ctx, batch * out_h, out_w * channels * ph * pw * (kGrad ? 6 : 3),
                [=](int64_t begin, int64_t end) {
      std::vector<float> sums(channels);
      float* __restrict s = sums.data();
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / out_h, oi = row % out_h;
        for (int64_t oj = 0; oj < out_w; ++oj) {
          const int64_t corner = ((b * height + oi * ph) * width + oj * pw) * channels;
          for (int64_t c = 0; c < channels; ++c) s[c] = 0.0f;
          for (int64_t di = 0; di < ph; ++di) {
            for (int64_t dj = 0; dj < pw; ++dj) {
              const float* __restrict p = xs + corner + (di * width + dj) * channels;
              if (interleaved) {
                for (int64_t i = 0; i < half; ++i) {
                  float low, high;
                  SortPair(p, 2 * i, 2 * i + 1, &low, &high);
                  s[2 * i] += low * low;
                  s[2 * i + 1] += high * high;
                }
                continue;
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
              const float* __restrict p = xs + at;
              float* __restrict d = out + at;
              // The pooling's cotangents of the sorted pair, sent back through the pair's
              // permutation.
              if (interleaved) {
                for (int64_t i = 0; i < half; ++i) {
                  const int64_t a = 2 * i, c = a + 1;
                  float low, high;
                  const bool swap = SortPair(p, a, c, &low, &high);
                  const float d_low = s[a] * (2.0f * low), d_high = s[c] * (2.0f * high);
                  d[a] = swap ? d_high : d_low;
                  d[c] = swap ? d_low : d_high;
                }
                continue;
              }
              const float* __restrict pa = p;
              const float* __restrict pb = p + half;
              const float* __restrict sa = s;
              const float* __restrict sb = s + half;
              float* __restrict da = d;
              float* __restrict db = d + half;
              // Swapped, a's cotangent is the maximum's, sb * (2 high) with high = va, else the
              // minimum's, sa * (2 low) with low = va: (swap ? sb : sa) * (2 va), the same
              // operations on the same values.
              for (int64_t i = 0; i < half; ++i) {
                const float va = pa[i], vb = pb[i], ga = sa[i], gb = sb[i];
                const bool swap = va >= vb;
                da[i] = (swap ? gb : ga) * (2.0f * va);
                db[i] = (swap ? ga : gb) * (2.0f * vb);
              }
            }
          }
        }
      }
    });
  }

 private:
  bool interleaved_;
};

REGISTER_KERNEL_BUILDER(Name("LipdpSortPool").Device(DEVICE_CPU), SortPoolOp<false>);
REGISTER_KERNEL_BUILDER(Name("LipdpSortPoolGrad").Device(DEVICE_CPU), SortPoolOp<true>);

}  // namespace lipdp
