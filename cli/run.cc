// `sdpa run`: reads q, k, v (and a mask) from .npy files, calls sdpa::attention, writes the
// results. Everything the library would refuse is checked first, naming the files, before the
// outputs (which can be far larger than the input files) are allocated; the outputs are
// written all or nothing (write_npy_files), so a failed run leaves every existing file as it was.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "commands.h"
#include "front_options.h"
#include "npy.h"
#include "sdpa/attention.h"
#include "storage.h"

namespace sdpa_cli {
namespace {

namespace fs = std::filesystem;

// --causal as sdpa's name for it, checked here, before any file is read: true and false are
// accepted too, because scripts often pass a boolean through.
std::string_view causal_name(const std::string& text) {
  const std::string_view name = text == "true" ? "bottom_right" : text == "false" ? "none" : std::string_view(text);
  sdpa::front::parse_name("--causal", sdpa::front::kCausalNames, name, " (or true, false)");
  return name;
}

sdpa::Window parse_window(const std::string& text) {
  sdpa::Window w;
  const auto fail = [&] {
    throw std::runtime_error("--window must be two integers L,R (-1 = unbounded), got '" + text + "'");
  };
  const size_t comma = text.find(',');
  if (comma == std::string::npos) fail();
  const auto parse = [&](std::string_view part, int64_t& value) {
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (ec != std::errc() || end != part.data() + part.size() || part.empty()) fail();
  };
  const std::string_view all(text);
  parse(all.substr(0, comma), w.left);
  parse(all.substr(comma + 1), w.right);
  return w;
}

// --block-size: "B" (both) or "BQ,BK", positive integers (the library checks the range too).
std::pair<int64_t, int64_t> parse_block_size(const std::string& text) {
  const auto fail = [&] {
    throw std::runtime_error("--block-size must be one positive integer B or two BQ,BK, got '" + text + "'");
  };
  const auto parse = [&](std::string_view part) {
    int64_t value = 0;
    const auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), value);
    if (ec != std::errc() || end != part.data() + part.size() || part.empty() || value < 1) fail();
    return value;
  };
  const std::string_view all(text);
  const size_t comma = all.find(',');
  if (comma == std::string_view::npos) {
    const int64_t b = parse(all);
    return {b, b};
  }
  return {parse(all.substr(0, comma)), parse(all.substr(comma + 1))};
}

// The shortest text that reads back as x: "1e+300", "0.1".
std::string number_string(double x) {
  char text[32];
  const auto [end, ec] = std::to_chars(text, text + sizeof(text), x);
  return ec == std::errc() ? std::string(text, end) : std::to_string(x);
}

// --scale is parsed here, not by CLI11, which takes '' for "not given" (so silently the default
// scale) and accepts nan and inf. Thrown while parsing, the error exits with status 2.
double parse_scale(const std::string& text) {
  char* end = nullptr;
  const double scale = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size()) {
    throw CLI::ValidationError("--scale", "must be a number, got '" + text + "'");
  }
  if (!std::isfinite(scale)) throw CLI::ValidationError("--scale", "must be a finite number, got '" + text + "'");
  return scale;
}

[[noreturn]] void refuse(const std::string& message) { throw std::runtime_error(message); }

Input read_input(const char* name, const std::string& path) { return {name, path, read_npy(path)}; }

// The index of the flat'th element of a C-order array of this shape, as "(0, 1)".
std::string index_string(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  return shape_string(index);
}

bool is_16_bit(sdpa::DType dtype) { return sdpa::internal::is_float_dtype(dtype) && sdpa::internal::storage_bytes(dtype) == 2; }

// The type the library computes in for queries of this dtype, and so the dtype of weights and lse.
using sdpa::internal::compute_dtype;

// A float64 mask beside float32 compute is narrowed to float32, where a finite bias beyond
// float32's range would become ±inf: +inf, which the library would then report as if it were
// in the file, or -inf, silently blocking a key that the bias (huge, but finite) left in the
// softmax. (NaN and +inf in the file itself are the library's to refuse, by index.) `why` says
// why float32: "q, k and v are float32".
void check_mask_narrowing(const Input& mask, sdpa::DType to, const std::string& why) {
  if (mask.array.dtype != sdpa::DType::kFloat64 || to != sdpa::DType::kFloat32) return;
  const double* values = mask.array.values<double>();
  const int64_t n = mask.array.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(values[i]) && std::isinf(static_cast<float>(values[i]))) {
      refuse(mask.label() + " has " + number_string(values[i]) + " at index " + index_string(mask.shape(), i) +
             ", which float32 cannot hold (" + why + ")");
    }
  }
}

// Element i of a float array, widened (exactly) to T.
template <class T>
T float_at(const NpyArray& a, int64_t i) {
  return sdpa::internal::load_as<T>(a.dtype, a.values<std::byte>() + i * sdpa::internal::storage_bytes(a.dtype));
}

// A float array is converted to `to`, float32 or float64: float32 inputs beside a float64 one
// compute in float64 (the Python package's rule), and a float mask of another dtype than q's
// becomes the compute type (q's own for float32 and float64). Only float64 to float32 can round (and
// check_mask_narrowing has made that safe for masks); float16 and bfloat16 widen exactly.
void convert_float(Input& t, sdpa::DType to) {
  using sdpa::DType;
  NpyArray& a = t.array;
  if (!t.is_float() || a.dtype == to) return;
  if (to != DType::kFloat32 && to != DType::kFloat64) throw std::logic_error("convert_float: to a 16-bit type");
  NpyArray converted = NpyArray::zeros(to, a.shape, t.label() + " converted to " + sdpa::dtype_name(to));
  const int64_t n = a.numel();
  for (int64_t i = 0; i < n; ++i) {
    if (to == DType::kFloat32) {
      converted.values<float>()[i] = float_at<float>(a, i);
    } else {
      converted.values<double>()[i] = float_at<double>(a, i);
    }
  }
  a = std::move(converted);
}

// Shape of q with its last dim replaced (or dropped, for lse).
std::vector<int64_t> q_shape_with_last(const NpyArray& q, std::optional<int64_t> last) {
  std::vector<int64_t> shape(q.shape.begin(), q.shape.end() - 1);
  if (last) shape.push_back(*last);
  return shape;
}

// Where an output really goes, symlinks resolved, so that two names for one file compare equal.
fs::path resolve_output(const std::string& path) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec);  // weakly_canonical keeps a lone "x.npy" relative
  if (ec) return fs::path(path).lexically_normal();
  const fs::path resolved = fs::weakly_canonical(absolute, ec);
  return ec ? absolute.lexically_normal() : resolved;
}

}  // namespace

const char* const kDtypesFooter =
      "Dtypes (.npy descr):\n"
      "  float32 '<f4', float64 '<f8', float16 '<f2', bfloat16 '<V2', bool '|b1' (masks only).\n"
      "  float32 and float64 inputs meet in float64: any float64 among q, k, v makes all three float64.\n"
      "  float16 and bfloat16 are never converted: q, k and v then share one dtype, or q is float32 over\n"
      "  float16 or bfloat16 k and v (a KV cache). They compute in float32, and out is rounded once.\n"
      "  out has q's dtype; weights and lse have the compute type: float64 for float64 q, else float32.\n"
      "  A float mask of another dtype than q's is converted to the compute type (exactly, or float64 to\n"
      "  float32 when every value fits).\n"
      "bfloat16: NumPy has no such type. np.save of an ml_dtypes.bfloat16 array writes descr '<V2', read\n"
      "  here as bfloat16; bfloat16 outputs are written the same way. np.load gives them back as raw\n"
      "  '|V2' bytes: np.load(f).view(ml_dtypes.bfloat16). A '|V2' file is refused (no type is known).\n"
      "seqlens_k: int32 '<i4' or int64 '<i8', shape (B,) ((1,) for q without a batch dim), each in [0, Nk].\n"
      "alibi_slopes, sinks: float32 or float64 (converted to float64 to be read; the compute type holds them).";

void add_call_options(CLI::App* run, CallOptions& o, bool required) {
  run->add_option("--q", o.q, "Queries (..., Hq, Nq, Dk), rank 2..4: float32, float64, float16 or bfloat16 (see below)")
      ->type_name("FILE")
      ->required(required);
  run->add_option("--k", o.k, "Keys (..., Hkv, Nk, Dk); Hq must be a multiple of Hkv")
      ->type_name("FILE")
      ->required(required);
  run->add_option("--v", o.v, "Values (..., Hkv, Nk, Dv)")->type_name("FILE")->required(required);
  run->add_option("--mask", o.mask,
                  "Bool mask (true = attend) or float bias of any float dtype, broadcast to (..., Hq, Nq, Nk)")
      ->type_name("FILE");
  run->add_option("--seqlens-k", o.seqlens_k,
                  "Key length of each sequence (B,), int32 or int64: keys past it are not read, causal and window "
                  "align to it")
      ->type_name("FILE");
  run->add_option("--causal", o.causal,
                  "Causal masking: none, bottom_right, top_left (true = bottom_right, false = none)")
      ->type_name("MODE")
      ->capture_default_str();
  run->add_option("--window", o.window, "Sliding window L,R: keys i'-L..i'+R where i' = i + Nk - Nq; -1 = unbounded")
      ->type_name("L,R");
  run->add_option_function<std::string>(
         "--scale", [&o](const std::string& text) { o.scale = parse_scale(text); }, "Score scale (default 1/sqrt(Dk))")
      ->type_name("S");
  run->add_option("--softcap", o.softcap, "Cap the scores: s = C * tanh(s / C) (Gemma's logit softcapping); 0 = off")
      ->type_name("C")
      ->check(CLI::NonNegativeNumber);
  run->add_option("--softcap-order", o.softcap_order,
                  "before_bias: cap, then ALiBi and mask are added (FlashAttention, Gemma, ONNX); after_bias: "
                  "the cap of the biased score (blocked keys stay blocked in either)")
      ->type_name("ORDER")
      ->check(CLI::IsMember(names_of(sdpa::front::kSoftcapOrderNames)))
      ->capture_default_str();
  run->add_option("--precision", o.precision,
                  "exact: 16-bit inputs computed in float32, out rounded once; fast: the weights rounded to the "
                  "inputs' type before p.V, as every peer does (each row still sums to 1; float32 and float64 "
                  "inputs ignore it)")
      ->type_name("MODE")
      ->check(CLI::IsMember(names_of(sdpa::front::kPrecisionNames)))
      ->capture_default_str();
  run->add_option("--alibi-slopes", o.alibi_slopes,
                  "ALiBi slopes (Hq,) or (B, Hq): score -= slope * |i + Nk - Nq - j|")
      ->type_name("FILE");
  run->add_option("--sinks", o.sinks, "Attention-sink logits (Hq,): one more term in each row's softmax sum")
      ->type_name("FILE");
  run->add_option("--block-mask", o.block_mask,
                  "Block-sparse attention: bool (..., ceil(Nq/BQ), ceil(Nk/BK)); a false block's keys are blocked "
                  "for its queries, and the kernels skip the tiles it empties")
      ->type_name("FILE");
  run->add_option("--block-size", o.block_size, "Rows and keys per block of --block-mask: B, or BQ,BK")
      ->type_name("B|BQ,BK")
      ->capture_default_str();
}

CLI::App* add_run_command(CLI::App& app, RunOptions& o) {
  CLI::App* run = app.add_subcommand("run", "Compute attention on .npy files: out = softmax(q k^T * scale + mask) v");
  add_call_options(run, o, /*required=*/true);
  run->add_option("-o,--out", o.out, "Output .npy for out (..., Hq, Nq, Dv), in q's dtype")
      ->type_name("FILE")
      ->required();
  run->add_option("--weights", o.weights, "Also write the softmax weights (..., Hq, Nq, Nk), in the compute type")
      ->type_name("FILE");
  run->add_option("--lse", o.lse, "Also write each row's log-sum-exp of the scores (..., Hq, Nq), in the compute type")
      ->type_name("FILE");
  run->footer(kDtypesFooter);
  return run;
}


LoadedCall load_call(const CallOptions& o) {
  LoadedCall call;
  sdpa::front::Call c{.scale = o.scale, .causal = causal_name(o.causal), .precision = o.precision,
                      .softcap = o.softcap, .softcap_order = o.softcap_order};
  if (!o.window.empty()) c.window = parse_window(o.window);

  call.q = read_input("q", o.q), call.k = read_input("k", o.k), call.v = read_input("v", o.v);
  Input &q = call.q, &k = call.k, &v = call.v;
  std::optional<Input>& mask = call.mask;
  if (!o.mask.empty()) mask = read_input("mask", o.mask);
  std::optional<Input>& seqlens = call.seqlens;
  if (!o.seqlens_k.empty()) seqlens = read_input("seqlens_k", o.seqlens_k);
  std::optional<Input>&slopes = call.slopes, &sinks = call.sinks;  // float32 or float64 as the library takes them
  if (!o.alibi_slopes.empty()) {
    slopes = read_input("alibi_slopes", o.alibi_slopes);
    if (slopes->is_float()) convert_float(*slopes, sdpa::DType::kFloat64);
    c.alibi_slopes = slopes->array.view();
  }
  if (!o.sinks.empty()) {
    sinks = read_input("sinks", o.sinks);
    if (sinks->is_float()) convert_float(*sinks, sdpa::DType::kFloat64);
    c.sinks = sinks->array.view();
  }
  std::optional<Input>& block_mask = call.block_mask;
  if (!o.block_mask.empty()) {
    block_mask = read_input("block_mask", o.block_mask);
    std::tie(c.block_q, c.block_k) = parse_block_size(o.block_size);
    c.block_mask = block_mask->array.view();
  }
  // float32 and float64 inputs meet in float64. float16 and bfloat16 are never converted (that
  // would change what is computed): beside them the library's rule holds as it is, q, k and v
  // one dtype or float32 q over float16 or bfloat16 k and v, and its error names the files.
  const auto dtype_of = [](const Input& t) { return t.array.dtype; };
  if (!is_16_bit(dtype_of(q)) && !is_16_bit(dtype_of(k)) && !is_16_bit(dtype_of(v))) {
    const bool any_f64 = dtype_of(q) == sdpa::DType::kFloat64 || dtype_of(k) == sdpa::DType::kFloat64 ||
                         dtype_of(v) == sdpa::DType::kFloat64;
    for (Input* t : {&q, &k, &v}) convert_float(*t, any_f64 ? sdpa::DType::kFloat64 : sdpa::DType::kFloat32);
  }
  const sdpa::DType dtype = q.array.dtype;  // out's (a bool q is the library's to refuse)
  const sdpa::DType compute = compute_dtype(dtype);  // weights' and lse's
  // A float mask of q's dtype is used as it is; any other becomes the compute type, as the
  // library requires (float32 or q's dtype): widened exactly, or float64 narrowed to float32
  // where every value fits.
  if (mask && mask->is_float() && mask->array.dtype != dtype) {
    const bool all_f32 = dtype_of(q) == sdpa::DType::kFloat32 && dtype_of(k) == sdpa::DType::kFloat32;
    check_mask_narrowing(*mask, compute,
                         all_f32 ? std::string("q, k and v are float32")
                                 : std::string("the compute type of ") + sdpa::dtype_name(dtype) + " q");
    convert_float(*mask, compute);
  }
  // The library's own checks of the inputs and options (sdpa::validate), before any output is
  // allocated: q (N, 1) and k (N, 2) would otherwise cost weights (N, N) before it said that Dk
  // differs. Its messages name arguments, not files: the files are added.
  call.files = "q = " + o.q + ", k = " + o.k + ", v = " + o.v;
  if (mask) call.files += ", mask = " + o.mask;
  if (seqlens) call.files += ", seqlens_k = " + o.seqlens_k;
  if (slopes) call.files += ", alibi_slopes = " + o.alibi_slopes;
  if (sinks) call.files += ", sinks = " + o.sinks;
  if (block_mask) call.files += ", block_mask = " + o.block_mask;
  call.options = sdpa::front::options(c);
  call.inputs = {q.array.view(), k.array.view(), v.array.view(), std::nullopt};
  if (mask) call.inputs.mask = mask->array.view();
  if (seqlens) call.inputs.seqlens_k = seqlens->array.view();
  try {
    sdpa::validate(call.inputs, call.options);
  } catch (const sdpa::Error& e) {
    throw call.with_files(e);
  }
  return call;
}

std::runtime_error LoadedCall::with_files(const sdpa::Error& e) const {
  return std::runtime_error(std::string(e.what()) + " (" + files + ")");
}

void run_command(const RunOptions& o) {
  // Two outputs at one path would overwrite each other: refuse before any work.
  std::vector<std::string> paths = {o.out};
  if (!o.weights.empty()) paths.push_back(o.weights);
  if (!o.lse.empty()) paths.push_back(o.lse);
  for (size_t i = 0; i < paths.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (resolve_output(paths[i]) == resolve_output(paths[j])) {
        throw std::runtime_error("two outputs would be written to " + paths[i]);
      }
    }
  }
  // Nor should an output that cannot be written (its folder missing, say) cost the reading and
  // the computing first.
  check_npy_destinations(std::vector<fs::path>(paths.begin(), paths.end()));

  const LoadedCall call = load_call(o);
  const Input &q = call.q, &k = call.k, &v = call.v;
  const sdpa::Inputs& inputs = call.inputs;
  const sdpa::Options& options = call.options;
  const auto with_files = [&](const sdpa::Error& e) { return call.with_files(e); };
  const sdpa::DType dtype = q.array.dtype;
  const sdpa::DType compute = compute_dtype(dtype);

  // The outputs' shapes follow from q, k and v, whose files may be tiny while the outputs are
  // not (q (N, 0) and k (N, 0) make weights (N, N)). Every size is counted with overflow
  // checks before anything is allocated, and a failure names the output and its shape.
  struct Planned {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<Planned> planned = {{"out (" + o.out + ")", q_shape_with_last(q.array, v.shape().back())}};
  if (!o.weights.empty()) {
    planned.push_back({"weights (" + o.weights + ")", q_shape_with_last(q.array, k.shape()[k.shape().size() - 2])});
  }
  if (!o.lse.empty()) planned.push_back({"lse (" + o.lse + ")", q_shape_with_last(q.array, std::nullopt)});
  for (size_t i = 0; i < planned.size(); ++i) {
    checked_nbytes(planned[i].name, i == 0 ? dtype : compute, planned[i].shape);  // out, then weights and lse
  }

  NpyArray out = NpyArray::zeros(dtype, planned.front().shape, planned.front().name);
  NpyArray weights, lse;
  sdpa::Outputs outputs{out.view(), std::nullopt, std::nullopt};
  if (!o.weights.empty()) {
    weights = NpyArray::zeros(compute, planned[1].shape, planned[1].name);  // right after out
    outputs.weights = weights.view();
  }
  if (!o.lse.empty()) {
    lse = NpyArray::zeros(compute, planned.back().shape, planned.back().name);  // always last
    outputs.lse = lse.view();
  }

  // The library throws sdpa::Error before writing anything (here only for the outputs, which
  // the CLI shaped itself).
  try {
    sdpa::attention(inputs, outputs, options);
  } catch (const sdpa::Error& e) {
    throw with_files(e);
  } catch (const std::bad_alloc&) {
    throw std::runtime_error("out of memory while computing attention on " + q.label() + ", " + k.label() + " and " +
                             v.label());
  }

  std::vector<std::pair<fs::path, const NpyArray*>> files = {{o.out, &out}};
  if (!o.weights.empty()) files.emplace_back(o.weights, &weights);
  if (!o.lse.empty()) files.emplace_back(o.lse, &lse);
  write_npy_files(files);  // silent on success: an output may be /dev/stdout
}

}  // namespace sdpa_cli
