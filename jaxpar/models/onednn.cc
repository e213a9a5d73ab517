// 2-D convolutions (NHWC input, HWIO kernel) and their two gradients by oneDNN, as XLA:CPU FFI
// custom calls (jaxpar/models/onednn.py builds, registers and calls them).
//
// Each call splits its batch into one chunk per thread of XLA's intra-op pool and runs every
// chunk as a one-threaded oneDNN primitive on that pool (the calling thread takes chunks too):
// the convolution shares XLA's threads instead of starting an OpenMP team beside them. The
// kernel gradient sums the chunks' partial gradients.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include <omp.h>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

namespace {

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

enum Kind { kForward, kInputGrad, kKernelGrad };

struct Geometry {  // n, h, w, c: the input; kh, kw, o: the kernel; strides; padding
  int64_t n, h, w, c, kh, kw, o, sh, sw, pt, pb, pl, pr;
  int64_t oh() const { return (h + pt + pb - kh) / sh + 1; }
  int64_t ow() const { return (w + pl + pr - kw) / sw + 1; }
  auto key() const { return std::make_tuple(n, h, w, c, kh, kw, o, sh, sw, pt, pb, pl, pr); }
  memory::desc input() const { return memory::desc({n, c, h, w}, dt::f32, tag::nhwc); }
  memory::desc output() const { return memory::desc({n, o, oh(), ow()}, dt::f32, tag::nhwc); }
  memory::desc kernel(tag t) const { return memory::desc({o, c, kh, kw}, dt::f32, t); }
  memory::dims strides() const { return {sh, sw}; }
  memory::dims before() const { return {pt, pl}; }
  memory::dims after() const { return {pb, pr}; }
};

struct Plan {
  dnnl::primitive primitive;
  memory::desc kernel;  // the layout the primitive wants its kernel (gradient) in
  size_t scratch_bytes;
};

std::mutex plans_mutex;
std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int64_t, int64_t>,
         std::shared_ptr<const Plan>>
    plans;

template <typename Primitive>
void Fill(Plan& plan, const typename Primitive::primitive_desc& pd, const memory::desc& kernel) {
  plan.primitive = Primitive(pd);
  plan.kernel = kernel;
  plan.scratch_bytes = pd.scratchpad_desc().get_size();
}

// A gradient's primitive descriptor: both take the same arguments (the kernel's layout: any).
template <typename Primitive>
typename Primitive::primitive_desc BackwardDesc(
    const Geometry& g, const dnnl::convolution_forward::primitive_desc& forward,
    const dnnl::primitive_attr& attr) {
  return typename Primitive::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, g.input(), g.kernel(tag::any), g.output(),
      g.strides(), g.before(), g.after(), forward, attr);
}

// The primitive for one chunk's shape, made once (oneDNN generates its kernels then).
std::shared_ptr<const Plan> GetPlan(Kind kind, const Geometry& g) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  auto key = std::tuple_cat(std::make_tuple(int(kind)), g.key());
  if (auto it = plans.find(key); it != plans.end()) return it->second;
  omp_set_num_threads(1);  // made for, and run on, one thread
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // chunks run at once: one each
  auto forward = dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct,
      g.input(), g.kernel(tag::any), g.output(), g.strides(), g.before(), g.after(), attr);
  auto plan = std::make_shared<Plan>();
  if (kind == kForward) {
    Fill<dnnl::convolution_forward>(*plan, forward, forward.weights_desc());
  } else if (kind == kInputGrad) {
    auto pd = BackwardDesc<dnnl::convolution_backward_data>(g, forward, attr);
    Fill<dnnl::convolution_backward_data>(*plan, pd, pd.weights_desc());
  } else {
    auto pd = BackwardDesc<dnnl::convolution_backward_weights>(g, forward, attr);
    Fill<dnnl::convolution_backward_weights>(*plan, pd, pd.diff_weights_desc());
  }
  plans[key] = plan;
  return plan;
}

// body(i) for i in [0, chunks), on XLA's intra-op pool and the calling thread. The caller takes
// chunks as the pool's threads do and then waits only for chunks already running, never for a
// task a busy pool has not started (the caller may itself be one of the pool's threads).
template <typename Body>
void ForEachChunk(ffi::ThreadPool& pool, int chunks, const Body& body) {
  struct Shared {
    std::atomic<int> next{0}, running{0};
    std::mutex mutex;
    std::condition_variable idle;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, chunks, &body] {
    for (;;) {
      shared->running.fetch_add(1);
      int i = shared->next.fetch_add(1);
      if (i < chunks) body(i);  // `body` outlives this: the caller waits while any chunk runs
      if (shared->running.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(shared->mutex);
        shared->idle.notify_all();
      }
      if (i >= chunks) return;
    }
  };
  for (int t = 1; t < chunks; ++t) pool.Schedule(decltype(work)(work));  // a copy each
  work();
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->idle.wait(lock, [&] { return shared->running.load() == 0; });
}

// One chunk per thread of XLA's pool (`threads` > 0: at most that many), at least one image each.
int ChunkCount(ffi::ThreadPool& pool, int64_t n, int64_t threads) {
  int64_t pool_threads = pool.num_threads();
  if (threads > 0) pool_threads = std::min(pool_threads, threads);
  return int(std::clamp<int64_t>(pool_threads, 1, n));
}

Geometry Chunk(const Geometry& whole, int chunks, int i, int64_t* first) {
  int64_t base = whole.n / chunks, extra = whole.n % chunks;
  *first = i * base + std::min<int64_t>(i, extra);
  Geometry g = whole;
  g.n = base + (i < extra ? 1 : 0);
  return g;
}

thread_local std::vector<char> scratch;

// One chunk of images [first, first + g.n): `input` and `output` point at whole NHWC arrays
// (for kInputGrad, `input` is the input gradient written and `output` the output gradient
// read); `kernel` is HWIO, read or (kKernelGrad) written.
void RunChunk(Kind kind, const Geometry& g, int64_t first, float* input, float* kernel,
              float* output) {
  omp_set_num_threads(1);
  auto plan = GetPlan(kind, g);
  dnnl::stream stream(Engine());
  if (scratch.size() < plan->scratch_bytes + 1) scratch.resize(plan->scratch_bytes + 1);
  memory x(g.input(), Engine(), input + first * g.h * g.w * g.c);
  memory y(g.output(), Engine(), output + first * g.oh() * g.ow() * g.o);
  memory hwio(g.kernel(tag::hwio), Engine(), kernel);
  memory k = plan->kernel == hwio.get_desc() ? hwio : memory(plan->kernel, Engine());
  memory pad(memory::desc({int64_t(scratch.size())}, dt::u8, tag::a), Engine(), scratch.data());
  if (kind != kKernelGrad && k != hwio) dnnl::reorder(hwio, k).execute(stream, hwio, k);
  if (kind == kForward) {
    plan->primitive.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_WEIGHTS, k},
                                     {DNNL_ARG_DST, y}, {DNNL_ARG_SCRATCHPAD, pad}});
  } else if (kind == kInputGrad) {
    plan->primitive.execute(stream, {{DNNL_ARG_DIFF_SRC, x}, {DNNL_ARG_WEIGHTS, k},
                                     {DNNL_ARG_DIFF_DST, y}, {DNNL_ARG_SCRATCHPAD, pad}});
  } else {
    plan->primitive.execute(stream, {{DNNL_ARG_SRC, x}, {DNNL_ARG_DIFF_WEIGHTS, k},
                                     {DNNL_ARG_DIFF_DST, y}, {DNNL_ARG_SCRATCHPAD, pad}});
    if (k != hwio) dnnl::reorder(k, hwio).execute(stream, k, hwio);
  }
  stream.wait();
}

Geometry Make(ffi::Span<const int64_t> input, ffi::Span<const int64_t> kernel, int64_t sh,
              int64_t sw, int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  return Geometry{input[0], input[1], input[2], input[3], kernel[0], kernel[1], kernel[3],
                  sh, sw, pt, pb, pl, pr};
}

// Catches oneDNN's errors (an unsupported shape, out of memory) as the call's error.
template <typename F>
ffi::Error Guarded(F f) {
  try {
    f();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string("jaxpar onednn: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jaxpar onednn: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y, int64_t sh, int64_t sw, int64_t pt,
                   int64_t pb, int64_t pl, int64_t pr, int64_t threads) {
  return Guarded([&] {
    Geometry g = Make(x.dimensions(), w.dimensions(), sh, sw, pt, pb, pl, pr);
    int chunks = ChunkCount(pool, g.n, threads);
    ForEachChunk(pool, chunks, [&](int i) {
      int64_t first;
      Geometry part = Chunk(g, chunks, i, &first);
      RunChunk(kForward, part, first, x.typed_data(), w.typed_data(), y->typed_data());
    });
  });
}

ffi::Error InputGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> dx, int64_t sh, int64_t sw, int64_t pt,
                     int64_t pb, int64_t pl, int64_t pr, int64_t threads) {
  return Guarded([&] {
    Geometry g = Make(dx->dimensions(), w.dimensions(), sh, sw, pt, pb, pl, pr);
    int chunks = ChunkCount(pool, g.n, threads);
    ForEachChunk(pool, chunks, [&](int i) {
      int64_t first;
      Geometry part = Chunk(g, chunks, i, &first);
      RunChunk(kInputGrad, part, first, dx->typed_data(), w.typed_data(), dy.typed_data());
    });
  });
}

ffi::Error KernelGrad(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                      ffi::ResultBuffer<ffi::F32> dw, int64_t sh, int64_t sw, int64_t pt,
                      int64_t pb, int64_t pl, int64_t pr, int64_t threads) {
  return Guarded([&] {
    Geometry g = Make(x.dimensions(), dw->dimensions(), sh, sw, pt, pb, pl, pr);
    int chunks = ChunkCount(pool, g.n, threads);
    size_t size = dw->element_count();
    thread_local std::vector<float> kept;  // the calling thread's, reused by its next calls
    kept.resize(size * (chunks - 1));
    float* parts = kept.data();  // chunk 0 writes dw itself
    ForEachChunk(pool, chunks, [&](int i) {
      int64_t first;
      Geometry part = Chunk(g, chunks, i, &first);
      float* out = i == 0 ? dw->typed_data() : parts + (i - 1) * size;
      RunChunk(kKernelGrad, part, first, x.typed_data(), out, dy.typed_data());
    });
    float* sum = dw->typed_data();
    for (int i = 1; i < chunks; ++i)
      for (size_t j = 0; j < size; ++j) sum[j] += parts[(i - 1) * size + j];
  });
}

}  // namespace

#define JAXPAR_CONV_BINDING                                                           \
  ffi::Ffi::Bind()                                                                    \
      .Ctx<ffi::ThreadPool>()                                                         \
      .Arg<ffi::Buffer<ffi::F32>>()                                                   \
      .Arg<ffi::Buffer<ffi::F32>>()                                                   \
      .Ret<ffi::Buffer<ffi::F32>>()                                                   \
      .Attr<int64_t>("sh").Attr<int64_t>("sw").Attr<int64_t>("pt").Attr<int64_t>("pb") \
      .Attr<int64_t>("pl").Attr<int64_t>("pr").Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparConvForward, Forward, JAXPAR_CONV_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparConvInputGrad, InputGrad, JAXPAR_CONV_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxparConvKernelGrad, KernelGrad, JAXPAR_CONV_BINDING);
