// The fused CPU kernel as a PyTorch operator with a C++ autograd kernel (normswap/backends/cpu_build.py
// compiles this file after csrc/rmsnorm.cpp, into one library, with PyTorch's headers; optional).
//
// Why: a module call with gradients through a Python ``torch.autograd.Function`` costs ~2x
// ``nn.LayerNorm``'s host time on CPU (the Function's Python forward, its Python backward and the
// autograd bookkeeping around them measured ~100 us of ~300, RESULTS.md "Host cost per call"). Here
// the whole call is one dispatcher call into C++: the Autograd kernel records a C++ node and runs the
// forward kernel; the backward kernel and the dW/dB reduction run in C++ when the graph is walked.
//
// Scope (checked on the Python side when it binds a module, cpu.bind): 1-D weight/bias of x's dtype
// and size N, x float32/bfloat16/float16 whose last dim is N. A non-contiguous x is made contiguous
// here. float64, per-head parameters, large outputs (the Python path reuses pooled output storage)
// and torch.compile keep their existing paths.
//
// NS_OP_NAMESPACE is set per build (it contains the build's cache key): TORCH_LIBRARY may define a
// namespace once per process, and tests load several builds (ISA levels) into one process.
#include <torch/library.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros_like.h>
#include <cmath>

namespace {

constexpr int64_t kParallelMinElements = int64_t(1) << 15;  // as cpu._PARALLEL_MIN_ELEMENTS
int64_t g_stream_min_bytes = int64_t(1) << 62;              // set by configure() from the cache size

int code_of(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return 0;
    case c10::ScalarType::BFloat16: return 1;
    case c10::ScalarType::Half: return 2;
    default: return -1;
  }
}

const void* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr() : nullptr;
}

int threads_for(int64_t numel) { return numel >= kParallelMinElements ? at::get_num_threads() : 1; }

// y (and rstd when wanted) for x viewed as (M, N) rows.
std::pair<at::Tensor, at::Tensor> run_forward(const at::Tensor& x_in, const std::optional<at::Tensor>& w,
                                          const std::optional<at::Tensor>& b, double eps, bool want_rstd) {
  const at::Tensor x = x_in.contiguous();
  const int code = code_of(x.scalar_type());
  TORCH_CHECK(code >= 0 && x.dim() >= 1, "normswap cpu op: unsupported input");
  const int64_t N = x.size(-1), numel = x.numel(), M = N ? numel / N : 0;
  for (const auto* p : {&w, &b})  // the kernel reads N contiguous values of x's dtype from each
    TORCH_CHECK(!p->has_value() || !(*p)->defined() || ((*p)->dim() == 1 && (*p)->size(0) == N &&
                (*p)->scalar_type() == x.scalar_type() && (*p)->is_contiguous()),
                "normswap cpu op: weight and bias must be contiguous 1-D tensors of x's dtype and last dim");
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = want_rstd ? at::empty({M}, x.options().dtype(at::kFloat)) : at::Tensor();
  if (M == 0 || N == 0) {
    if (want_rstd) rstd.fill_(eps > 0 ? 1.0 / std::sqrt(eps) : INFINITY);
    return {y, rstd};
  }
  const int64_t nbytes = numel * int64_t(x.element_size());
  const int flags = nbytes >= g_stream_min_bytes ? 1 : 0;
  const int status = ns_rms_norm_fwd(code, x.data_ptr(), M, N, N, ptr_or_null(w), 1, ptr_or_null(b), 1,
                                     y.data_ptr(), want_rstd ? rstd.data_ptr<float>() : nullptr, eps,
                                     threads_for(numel), flags);
  TORCH_CHECK(status == 0, "normswap cpu op: the kernel does not handle ", x.scalar_type());
  return {y, rstd};
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& w,
                        const std::optional<at::Tensor>& b, double eps) {
  return run_forward(x, w, b, eps, false).first;
}

// An absent weight or bias (nullopt) is not an autograd input: the backward returns one gradient per
// forward argument (undefined where there is none), while needs_input_grad counts the tensor inputs
// only (x, then the weight if there is one, then the bias).
struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b, double eps) {
    auto [y, rstd] = run_forward(x, w, b, eps, true);
    const at::Tensor wt = w.has_value() ? *w : at::Tensor(), bt = b.has_value() ? *b : at::Tensor();
    ctx->save_for_backward({x, rstd, wt, bt});
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor x = saved[0].contiguous(), rstd = saved[1], w = saved[2], b = saved[3];
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    const int64_t N = x.size(-1), numel = x.numel(), M = N ? numel / N : 0;
    const size_t w_edge = 1, b_edge = w.defined() ? 2 : 1;
    const bool want_dx = ctx->needs_input_grad(0), want_dw = w.defined() && ctx->needs_input_grad(w_edge),
               want_db = b.defined() && ctx->needs_input_grad(b_edge);
    at::Tensor dx = at::empty_like(x), dw, db;
    if (M == 0 || N == 0) {
      if (want_dw) dw = at::zeros_like(w);
      if (want_db) db = at::zeros_like(b);
      return {want_dx ? dx : at::Tensor(), dw, db, at::Tensor()};
    }
    const int threads = int(std::min<int64_t>(threads_for(numel), M));
    // The fp32 partials of dW and dB, one row of N per thread each (separate storages: each becomes a
    // parameter's .grad as it is, for float32 parameters and one thread).
    const auto f32 = x.options().dtype(at::kFloat);
    at::Tensor dw_part = want_dw ? at::empty({threads, N}, f32) : at::Tensor();
    at::Tensor db_part = want_db ? at::empty({threads, N}, f32) : at::Tensor();
    const int status = ns_rms_norm_bwd(code_of(x.scalar_type()), x.data_ptr(), dy.data_ptr(), M, N, N, N,
                                       w.defined() ? w.data_ptr() : nullptr, 1, rstd.data_ptr<float>(),
                                       dx.data_ptr(), want_dw ? dw_part.data_ptr<float>() : nullptr,
                                       want_db ? db_part.data_ptr<float>() : nullptr, threads, 0);
    TORCH_CHECK(status == 0, "normswap cpu op: the backward kernel does not handle ", x.scalar_type());
    // Partials summed over threads in thread order (deterministic for a thread count), then cast to the
    // parameter's dtype; with one thread the row is the sum, and the cast needs no dispatcher call.
    auto reduce = [&](const at::Tensor& part, const at::Tensor& p) {
      if (threads == 1) {
        if (p.scalar_type() == at::kFloat) return part.view(p.sizes());
        at::Tensor out = at::empty(p.sizes(), p.options());
        TORCH_CHECK(ns_f32_to(code_of(p.scalar_type()), part.data_ptr<float>(), out.data_ptr(), N) == 0,
                    "normswap cpu op: cannot store a ", p.scalar_type(), " gradient");
        return out;
      }
      return at::sum(part, {0}).to(p.scalar_type()).view(p.sizes());
    };
    if (want_dw) dw = reduce(dw_part, w);
    if (want_db) db = reduce(db_part, b);
    return {want_dx ? dx : at::Tensor(), dw, db, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const std::optional<at::Tensor>& w,
                             const std::optional<at::Tensor>& b, double eps) {
  return RMSNormFunction::apply(x, w, b, eps);
}

void configure(int64_t stream_min_bytes) { g_stream_min_bytes = stream_min_bytes; }

}  // namespace

TORCH_LIBRARY(NS_OP_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def("configure(int stream_min_bytes) -> ()", &configure);
}

TORCH_LIBRARY_IMPL(NS_OP_NAMESPACE, CPU, m) { m.impl("rms_norm", &rms_norm_cpu); }

TORCH_LIBRARY_IMPL(NS_OP_NAMESPACE, Autograd, m) { m.impl("rms_norm", &rms_norm_autograd); }
