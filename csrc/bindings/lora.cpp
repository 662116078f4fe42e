// Host binding of the LoRA ops: every step is a GEMM whose epilogue carries the scaling, the
// bias, the activation and the accumulation of the low-rank term (no separate add or scale
// kernels); only dropout of the LoRA input is an elementwise pass, and only when p > 0.
//
// Shapes: x [..., in] (as [M, in]); weight [out, in]; lora_A [r, in]; lora_B [out, r].
//   forward   t^T = A drop(x)^T                      [r, M]
//             y  = act([x | s t] [W | B]^T + bias)    (one GEMM whose K loop runs over both
//                                                      pairs, gemm/sm90_extk.cuh; where no
//                                                      such kernel serves the shape, s t B^T
//                                                      first and the main GEMM adds onto it
//                                                      in place through its C operand)
//   backward  dz = dy * act'(.), dbias = sum dz       (one fused pass)
//             U^T = B^T dz^T                          [r, M]
//             dx = [dz | s U] [W ; A]                  (likewise; with dropout the LoRA term
//                                                      is computed first and masked in place,
//                                                      then the main GEMM adds onto it)
//             dA = s * U^T drop(x),  dB = (s * t^T dz)^T,  dW = dz^T x   (only those requested;
//                                                      dA beside the dx GEMM on a second stream
//                                                      from 2^23 elements of x)
//   merge     W += s * B A                            (one pass reading and writing W in place,
//                                                      gemm/rank_update.h; a GEMM with W as its C
//                                                      operand where that pass does not apply)
// The rank-r activations t and U are kept as contiguous [r, M] (t is the op's second output in
// that form). For 16-bit types and r <= 32, t, U and dB come from the rank-r pass
// (gemm/rank_pass.h): t^T and s t from one read of drop(x); U^T, s U and dB from one read of
// dz. Elsewhere they are GEMMs with r rows, which the transposed small-M kernels stream over M
// in 64-row tiles (computed as [M, r], the same products ran on 128-wide tiles of which r
// columns are used, 1.4-1.55x slower: bench/NOTES.md, section 7).
// CUTLASS_EXT_LORA_RANK_PASS=0 turns the pass off (every rank-r product a GEMM), and
// CUTLASS_EXT_LORA_MERGE_PASS=0 runs every merge as the GEMM.
#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "bindings/common.h"
#include "bindings/gemm_op.h"
#include "elementwise/dropout_kernels.h"
#include "gemm/rank_pass.h"
#include "gemm/rank_update.h"

namespace cutlass_ext {
namespace {

// weight [out, in], lora_A [r, in], lora_B [out, r]: one dtype, on weight's CUDA device.
void check_adapter(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B, const char* op) {
  CE_CHECK(weight.is_cuda() && weight.dim() == 2, op, ": weight must be a 2-D CUDA tensor, got ",
           shape_str(weight));
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{lora_A, "lora_A"}, {lora_B, "lora_B"}}) {
    CE_CHECK(t.device() == weight.device() && t.scalar_type() == weight.scalar_type(), op, ": ", name,
             " must be a ", weight.scalar_type(), " tensor on ", weight.device());
    CE_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", shape_str(t));
  }
  const int64_t in = weight.size(1), out = weight.size(0), r = lora_A.size(0);
  CE_CHECK(lora_A.size(1) == in, op, ": lora_A must be [r, ", in, "], got ", shape_str(lora_A));
  CE_CHECK(lora_B.size(0) == out && lora_B.size(1) == r, op, ": lora_B must be [", out, ", ", r, "], got ",
           shape_str(lora_B));
}

void check_lora_operands(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
                         const at::Tensor& lora_B, const char* op) {
  check_adapter(weight, lora_A, lora_B, op);
  CE_CHECK(x.device() == weight.device() && x.scalar_type() == weight.scalar_type(), op, ": x must be a ",
           weight.scalar_type(), " tensor on ", weight.device());
  CE_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), op, ": x must be [..., ", weight.size(1), "], got ",
           shape_str(x));
}

// drop(x) for a contiguous [M, in] x, or the masked scaling of a tensor shaped like x in place.
void run_dropout(const at::Tensor& input, const at::Tensor& output, double p, const at::Tensor& seed,
                 const char* op) {
  CE_CHECK(seed.defined() && seed.is_cuda() && seed.scalar_type() == at::kLong && seed.numel() == 1 &&
               seed.device() == input.device(),
           op, ": dropout needs a seed: pass seed, a one-element int64 tensor on ", input.device());
  DropoutTensorParams p_;
  p_.numel = input.numel();
  p_.dtype = dtype_of(input, op, "x");
  p_.input = input.data_ptr();
  p_.output = output.data_ptr();
  p_.seed = seed.data_ptr<int64_t>();
  p_.p = p;
  p_.sm_count = sm_count(input.device().index());
  check_launch(dropout_forward(p_, current_stream(input.device())), op, "dropout");
}

at::Tensor dropped(const at::Tensor& x2, double p, const c10::optional<at::Tensor>& seed, const char* op) {
  if (p <= 0.0) return x2;
  at::Tensor in = x2.contiguous();
  at::Tensor out = new_output(in.sizes(), in.options());
  run_dropout(in, out, p, seed.has_value() ? *seed : at::Tensor(), op);
  return out;
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b, const GemmOptions& opts, float alpha = 1.f) {
  return std::get<0>(gemm_op(a, b, c10::nullopt, 0, false, opts, GemmExtra{alpha}));
}

// s * v^T as a contiguous [M, r] tensor from a [r, M] one: the rank-r operand of the extended-K
// GEMMs, which read it K-major like their first operand (r * M elements, a few hundred KB).
at::Tensor scaled_rows(const at::Tensor& v_t, double scaling) {
  at::Tensor out = at::empty({v_t.size(1), v_t.size(0)}, v_t.options());
  return at::mul_out(out, v_t.t(), at::Scalar(scaling));
}

// A comparison switch of this file: on unless the environment variable is "0" (read per call).
bool switch_on(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string(v) != "0";
}

// dA = s U^T drop(x) needs only U and x, both ready before the dx GEMM, which runs a persistent
// grid of one CTA per SM whose last round of tiles leaves SMs idle (8192 x 4096 -> 4096 on 128x256
// tiles: 1024 tiles, 7.76 rounds, 32 SMs idle for the last one). Enqueued on a second stream right
// after the dx GEMM, dA's blocks take those SMs as the GEMM's CTAs finish (they cannot share an SM
// with a GEMM CTA, which holds the register file) instead of running after the GEMM. The second
// stream waits for the work before the dx GEMM and the caller's stream waits for dA: the op stays
// ordered on the current stream, also when captured into a CUDA graph. dA's output comes from the
// caller's stream; what dA allocates on the second stream is freed there (stream-ordered).
// The two launches are not ordered on the GPU: where dA's blocks start first (seen in eager runs),
// the GEMM's CTAs on those SMs start after them and the step takes as long as with dA after the
// GEMM. CUTLASS_EXT_LORA_OVERLAP=0 runs dA after the dx GEMM on the current stream.
bool lora_overlap_enabled() { return switch_on("CUTLASS_EXT_LORA_OVERLAP"); }

// Below this many elements of x, dA is a few microseconds and the second stream's events and
// launch cost more than the idle SMs give.
constexpr int64_t kOverlapMinElements = int64_t(1) << 23;

bool rank_pass_enabled() { return switch_on("CUTLASS_EXT_LORA_RANK_PASS"); }

// CUTLASS_EXT_LORA_MERGE_PASS: unset or 1, the rank-r update pass on the tile its rule picks; 0,
// the GEMM with W as C; 128x64 or 256x256, the pass on that tile (comparison runs).
enum class MergePath { kGemm, kPass };
MergePath merge_path(RankUpdateTile* tile) {
  *tile = RankUpdateTile::kAuto;
  const char* v = std::getenv("CUTLASS_EXT_LORA_MERGE_PASS");
  if (v == nullptr) return MergePath::kPass;
  const std::string s(v);
  if (s == "0") return MergePath::kGemm;
  if (s == "128x64") *tile = RankUpdateTile::k128x64;
  if (s == "256x256") *tile = RankUpdateTile::k256x256;
  CE_CHECK(s == "1" || *tile != RankUpdateTile::kAuto, "lora_merge: CUTLASS_EXT_LORA_MERGE_PASS=", s,
           " is not one of 0 (the GEMM), 1 (the rank-r update pass, the default), 128x64 or 256x256 (the pass on ",
           "that tile); unset it or set one of those");
  return MergePath::kPass;
}

// Rank-r pass parameters over x [M, N] (unit column stride); the caller adds the products.
RankPassParams rank_pass_over(const at::Tensor& x, int64_t r, const char* op) {
  RankPassParams p;
  p.dtype = dtype_of(x, op, "x");
  p.M = x.size(0);
  p.N = x.size(1);
  p.r = int(r);
  p.x = x.data_ptr();
  p.ldx = x.size(0) > 1 ? x.stride(0) : x.size(1);
  p.sm_count = sm_count(x.device().index());
  return p;
}

// Runs the pass with a workspace from the caching allocator.
void run_rank_pass(RankPassParams& p, const at::Tensor& like, const char* op) {
  const at::Tensor workspace = at::empty({rank_pass_workspace_floats(p)}, like.options().dtype(at::kFloat));
  p.workspace = workspace.data_ptr<float>();
  check_launch(rank_pass(p, current_stream(like.device())), op, "rank_pass");
}

// Whether x can be the pass's X: rows of unit column stride.
bool rank_pass_input(const at::Tensor& x) { return x.dim() == 2 && (x.stride(1) == 1 || x.size(1) == 1); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> lora_linear_cuda(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
    const c10::optional<at::Tensor>& bias, double scaling, c10::string_view activation_name, double dropout_p,
    const c10::optional<at::Tensor>& seed, bool save_preact) {
  const char* op = "lora_linear";
  check_lora_operands(x, weight, lora_A, lora_B, op);
  const int64_t activation = activation_code(activation_name, op);
  const c10::DeviceGuard guard(x.device());
  const int64_t in = weight.size(1), out = weight.size(0);
  const at::IntArrayRef lead = x.sizes().slice(0, x.dim() - 1);
  const at::Tensor x2 = x.reshape({-1, in});
  const GemmOptions opts = gemm_options();

  const at::Tensor x_in = dropped(x2, dropout_p, seed, op);
  const int64_t M = x2.size(0), r = lora_A.size(0);
  GemmExtra low_rank;
  at::Tensor t_t;  // [r, M]
  RankPassParams pass = rank_pass_over(x_in, r, op);
  pass.p = lora_A.data_ptr();  // P = A^T
  pass.p_stride_n = lora_A.stride(1);
  pass.p_stride_r = lora_A.stride(0);
  if (rank_pass_enabled() && rank_pass_input(x_in) && M > 0) {
    t_t = new_output({r, M}, x.options());
    low_rank.a2 = new_output({M, r}, x.options());
    pass.rows_t = t_t.data_ptr();
    pass.rows_s = low_rank.a2.data_ptr();
    pass.rows_s_scale = float(scaling);
  }
  if (pass.rows_t != nullptr && rank_pass_supported(pass)) {
    run_rank_pass(pass, x_in, op);
  } else {
    t_t = mm(lora_A, x_in.t(), opts);
    low_rank.a2 = scaled_rows(t_t, scaling);
  }
  low_rank.b2 = lora_B.t();
  low_rank.dependent = true;  // its launch overlaps the rank-r pass finish (GemmExtra::dependent)
  auto [y, z] = gemm_op(x2, weight.t(), bias, activation, save_preact, opts, low_rank);
  y = y.view(with_last(lead, {out}));
  z = z.defined() ? z.view(with_last(lead, {out})) : at::empty({0}, x.options());
  return {y, t_t, z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lora_linear_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& lora_A,
    const at::Tensor& lora_B, const at::Tensor& t, const c10::optional<at::Tensor>& saved,
    c10::string_view activation_name, double scaling, double dropout_p, const c10::optional<at::Tensor>& seed,
    bool need_x, bool need_weight, bool need_A, bool need_B, bool need_bias) {
  const char* op = "_lora_linear_backward";
  check_lora_operands(x, weight, lora_A, lora_B, op);
  const int64_t activation = activation_code(activation_name, op);
  const c10::DeviceGuard guard(x.device());
  const int64_t in = weight.size(1), out = weight.size(0), r = lora_A.size(0);
  const at::TensorOptions options = x.options();
  const at::Tensor grad2 = grad.reshape({-1, out});
  const at::Tensor x2 = x.reshape({-1, in});
  CE_CHECK(t.dim() == 2 && t.size(0) == r && t.size(1) == x2.size(0), op, ": t must be lora_linear's [", r, ", ",
           x2.size(0), "] second output, got ", shape_str(t));
  const GemmOptions opts = gemm_options();

  at::Tensor dz = grad2;
  at::Tensor dbias;
  if (activation != int64_t(Activation::kNone) || need_bias) {
    c10::optional<at::Tensor> saved2;
    if (saved.has_value()) saved2 = saved->reshape({-1, out});
    auto [gz, gb] = act_grad_cuda(grad2, saved2, activation_name, need_x || need_weight || need_A || need_B,
                                  need_bias);
    if (activation != int64_t(Activation::kNone)) dz = gz;
    dbias = gb;
  }
  const int64_t M = x2.size(0);
  const bool need_u = need_x || need_A;
  at::Tensor u_t;  // [r, M]
  at::Tensor su;   // s U as [M, r]: the extended-K dx GEMM's rank-r operand (no dropout)
  at::Tensor dB;
  // U^T, s U and dB from one read of dz where the rank-r pass takes it (dB alone where Q's rows
  // are not 16-byte pieces, i.e. M not a multiple of 8, is left to the GEMM below).
  RankPassParams pass = rank_pass_over(dz, r, op);
  if (rank_pass_enabled() && M > 0 && (need_u || need_B) && rank_pass_input(dz)) {
    if (need_u) {
      pass.p = lora_B.data_ptr();
      pass.p_stride_n = lora_B.stride(0);
      pass.p_stride_r = lora_B.stride(1);
      u_t = new_output({r, M}, options);
      pass.rows_t = u_t.data_ptr();
      if (need_x && dropout_p == 0.0) {
        su = new_output({M, r}, options);
        pass.rows_s = su.data_ptr();
        pass.rows_s_scale = float(scaling);
      }
    }
    if (need_B && t.is_contiguous()) {
      dB = new_output({out, r}, options);
      pass.q = t.data_ptr();
      pass.cols = dB.data_ptr();
      pass.cols_stride_n = r;
      pass.cols_stride_r = 1;
      pass.cols_scale = float(scaling);
      if (need_u && !rank_pass_supported(pass)) {  // Q's rows not in 16-byte pieces: dB by the GEMM
        pass.q = nullptr;
        pass.cols = nullptr;
        dB = at::Tensor();
      }
    }
    if (rank_pass_supported(pass)) {
      run_rank_pass(pass, dz, op);
    } else {
      u_t = su = dB = at::Tensor();
    }
  }
  if (need_u && !u_t.defined()) u_t = mm(lora_B.t().contiguous(), dz.t(), opts);
  // dB reads dz right after U does, while more of dz is still in L2 than after the dx GEMM (which
  // streams the weight through it): on an H200 the four rank-r products took 49.4 -> 45.7 us at
  // 4096 x 4096 -> 4096 and 82.6 -> 78.6 at 8192 tokens (bench/NOTES.md section 30).
  if (need_B && !dB.defined()) dB = mm(t, dz, opts, float(scaling)).t().contiguous();
  if (!need_B) dB = at::empty({0}, options);

  const bool overlap_dA = need_x && need_A && lora_overlap_enabled() && M * in >= kOverlapMinElements;
  const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  const c10::Stream stream = cuda->getStream(x.device());
  c10::Event before_dx(c10::DeviceType::CUDA);
  at::Tensor dA;
  if (overlap_dA) {
    dA = new_output({r, in}, options);
    before_dx.record(stream);
  }
  at::Tensor dx;
  if (need_x) {
    GemmExtra low_rank;
    if (dropout_p > 0.0) {
      at::Tensor term = mm(u_t.t(), lora_A, opts, float(scaling));
      run_dropout(term, term, dropout_p, seed.has_value() ? *seed : at::Tensor(), op);
      low_rank.c = low_rank.out = term;
    } else {
      low_rank.a2 = su.defined() ? su : scaled_rows(u_t, scaling);
      low_rank.b2 = lora_A;
      low_rank.dependent = true;
    }
    dx = std::get<0>(gemm_op(dz, weight, c10::nullopt, 0, false, opts, low_rank));
    dx = dx.view(x.sizes());
  }
  if (overlap_dA) {
    const c10::Stream side = cuda->getStreamFromGlobalPool(x.device(), /*isHighPriority=*/false);
    before_dx.block(side);
    {
      const c10::StreamGuard on_side(side);
      gemm_op(u_t, dropped(x2, dropout_p, seed, op), c10::nullopt, 0, false, opts,
              GemmExtra{float(scaling), at::Tensor(), dA});
    }
    c10::Event dA_done(c10::DeviceType::CUDA);
    dA_done.record(side);
    dA_done.block(stream);
  } else if (need_A) {
    dA = mm(u_t, dropped(x2, dropout_p, seed, op), opts, float(scaling));
  } else {
    dA = at::empty({0}, options);
  }
  at::Tensor dW = need_weight ? mm(dz.t(), x2, opts) : at::empty({0}, options);
  return {or_empty(dx, options), dW, dA, dB, or_empty(dbias, options)};
}

void lora_merge_cuda(const at::Tensor& weight, const at::Tensor& lora_A, const at::Tensor& lora_B,
                     double scaling) {
  const char* op = "lora_merge";
  check_adapter(weight, lora_A, lora_B, op);
  const c10::DeviceGuard guard(weight.device());
  RankUpdateParams u;
  u.dtype = dtype_of(weight, op, "weight");
  u.M = weight.size(0);
  u.N = weight.size(1);
  u.r = int(std::min<int64_t>(lora_A.size(0), INT32_MAX));
  u.w = weight.data_ptr();
  u.ldw = weight.stride(1) == 1 ? weight.stride(0) : 0;  // 0: not unit column stride, which the pass refuses
  u.a = lora_A.data_ptr();
  u.a_stride_r = lora_A.stride(0);
  u.a_stride_n = lora_A.stride(1);
  u.b = lora_B.data_ptr();
  u.b_stride_m = lora_B.stride(0);
  u.b_stride_r = lora_B.stride(1);
  u.alpha = float(scaling);
  u.sm_count = sm_count(weight.device().index());
  if (merge_path(&u.tile) == MergePath::kPass && rank_update_supported(u)) {
    check_launch(rank_update(u, current_stream(weight.device())), op, "rank-r update");
    return;
  }
  gemm_op(lora_B, lora_A, c10::nullopt, 0, false, gemm_options(), GemmExtra{float(scaling), weight, weight});
}

}  // namespace
}  // namespace cutlass_ext

TORCH_LIBRARY_IMPL(cutlass_ext, CUDA, m) {
  m.impl("lora_linear", &cutlass_ext::lora_linear_cuda);
  m.impl("_lora_linear_backward", &cutlass_ext::lora_linear_backward_cuda);
  m.impl("lora_merge", &cutlass_ext::lora_merge_cuda);
}
