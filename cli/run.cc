// `sdpa run`: reads q, k, v (and a mask) from .npy files, calls sdpa::attention, writes the
// results. Nothing is written unless attention succeeded, and a failed write removes the rest.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "commands.h"
#include "npy.h"
#include "sdpa/attention.h"

namespace sdpa_cli {
namespace {

namespace fs = std::filesystem;

sdpa::Causal parse_causal(const std::string& text) {
  // `true`/`false` are accepted because scripts often pass a boolean through.
  if (text == "none" || text == "false") return sdpa::Causal::kNone;
  if (text == "bottom_right" || text == "true") return sdpa::Causal::kBottomRight;
  if (text == "top_left") return sdpa::Causal::kTopLeft;
  throw std::runtime_error("--causal must be none, bottom_right, top_left, true or false, got '" + text + "'");
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

// The output shapes are taken from q, k and v, so their ranks are checked before that; the
// library checks everything else.
void check_rank(const char* name, const std::string& path, const NpyArray& a) {
  if (a.shape.size() < 2 || a.shape.size() > 4) {
    throw std::runtime_error(std::string(name) + " (" + path + ") has shape " + a.shape_string() +
                             " but must have rank 2..4");
  }
}

// A float array of the other float dtype is converted to `to`: float32 inputs beside a
// float64 one compute in float64 (the Python package's rule), and a float mask takes the
// inputs' dtype, as the library requires. Bool (and any other dtype) is left for it to judge.
void convert_float(NpyArray& a, sdpa::DType to) {
  using sdpa::DType;
  const bool is_float = a.dtype == DType::kFloat32 || a.dtype == DType::kFloat64;
  if (!is_float || a.dtype == to || to == DType::kBool) return;
  NpyArray converted = NpyArray::zeros(to, a.shape);
  const int64_t n = a.numel();
  if (to == DType::kFloat32) {
    std::copy_n(a.values<double>(), n, converted.values<float>());  // narrowing is intended
  } else {
    std::copy_n(a.values<float>(), n, converted.values<double>());
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

// Writes the outputs one after the other. If one fails, the regular files already written are
// removed as well, so a failed run leaves no output behind. (Not temporary files renamed into
// place: an output may be /dev/stdout, which a rename would not write through.)
void write_all(const std::vector<std::pair<std::string, const NpyArray*>>& outputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    try {
      write_npy(outputs[i].first, *outputs[i].second);
    } catch (...) {
      std::error_code ignored;
      for (size_t j = 0; j < i; ++j) {
        if (fs::is_regular_file(outputs[j].first, ignored)) fs::remove(outputs[j].first, ignored);
      }
      throw;
    }
  }
}

}  // namespace

CLI::App* add_run_command(CLI::App& app, RunOptions& o) {
  CLI::App* run = app.add_subcommand("run", "Compute attention on .npy files: out = softmax(q k^T * scale + mask) v");
  run->add_option("--q", o.q, "Queries (..., Hq, Nq, Dk), float32 or float64 (any float64 input makes all float64), rank 2..4")
      ->type_name("FILE")
      ->required();
  run->add_option("--k", o.k, "Keys (..., Hkv, Nk, Dk); Hq must be a multiple of Hkv")
      ->type_name("FILE")
      ->required();
  run->add_option("--v", o.v, "Values (..., Hkv, Nk, Dv)")->type_name("FILE")->required();
  run->add_option("--mask", o.mask, "Bool mask (true = attend) or float bias, broadcast to (..., Hq, Nq, Nk)")
      ->type_name("FILE");
  run->add_option("--causal", o.causal,
                  "Causal masking: none, bottom_right, top_left (true = bottom_right, false = none)")
      ->type_name("MODE")
      ->capture_default_str();
  run->add_option("--window", o.window, "Sliding window L,R: keys i'-L..i'+R where i' = i + Nk - Nq; -1 = unbounded")
      ->type_name("L,R");
  run->add_option("--scale", o.scale, "Score scale (default 1/sqrt(Dk))")->type_name("S");
  run->add_option("-o,--out", o.out, "Output .npy for out (..., Hq, Nq, Dv), in the inputs' dtype")
      ->type_name("FILE")
      ->required();
  run->add_option("--weights", o.weights, "Also write the softmax weights (..., Hq, Nq, Nk)")->type_name("FILE");
  run->add_option("--lse", o.lse, "Also write each row's log-sum-exp of the scores (..., Hq, Nq)")->type_name("FILE");
  return run;
}

void run_command(const RunOptions& o) {
  sdpa::Options options;
  options.causal = parse_causal(o.causal);
  if (!o.window.empty()) options.window = parse_window(o.window);
  options.scale = o.scale;

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

  NpyArray q = read_npy(o.q), k = read_npy(o.k), v = read_npy(o.v);
  check_rank("q", o.q, q);
  check_rank("k", o.k, k);
  check_rank("v", o.v, v);
  const bool any_f64 = q.dtype == sdpa::DType::kFloat64 || k.dtype == sdpa::DType::kFloat64 ||
                      v.dtype == sdpa::DType::kFloat64;
  if (any_f64) {
    for (NpyArray* a : {&q, &k, &v}) convert_float(*a, sdpa::DType::kFloat64);
  }
  std::optional<NpyArray> mask;
  if (!o.mask.empty()) {
    mask = read_npy(o.mask);
    convert_float(*mask, q.dtype);
  }

  // The outputs' shapes follow from q, k and v, whose files may be tiny while the outputs are
  // not (q (N, 0) and k (N, 0) make weights (N, N)). Every size is counted with overflow
  // checks before anything is allocated, and a failure names the output and its shape.
  struct Planned {
    std::string name;
    std::vector<int64_t> shape;
  };
  std::vector<Planned> planned = {{"out (" + o.out + ")", q_shape_with_last(q, v.shape.back())}};
  if (!o.weights.empty()) {
    planned.push_back({"weights (" + o.weights + ")", q_shape_with_last(q, k.shape[k.shape.size() - 2])});
  }
  if (!o.lse.empty()) planned.push_back({"lse (" + o.lse + ")", q_shape_with_last(q, std::nullopt)});
  for (const Planned& p : planned) checked_nbytes(p.name, q.dtype, p.shape);

  NpyArray out = NpyArray::zeros(q.dtype, planned.front().shape, planned.front().name);
  NpyArray weights, lse;
  sdpa::Inputs inputs{q.view(), k.view(), v.view(), std::nullopt};
  if (mask) inputs.mask = mask->view();
  sdpa::Outputs outputs{out.view(), std::nullopt, std::nullopt};
  if (!o.weights.empty()) {
    weights = NpyArray::zeros(q.dtype, planned[1].shape, planned[1].name);  // right after out
    outputs.weights = weights.view();
  }
  if (!o.lse.empty()) {
    lse = NpyArray::zeros(q.dtype, planned.back().shape, planned.back().name);  // always last
    outputs.lse = lse.view();
  }

  sdpa::attention(inputs, outputs, options);  // throws sdpa::Error before writing anything

  std::vector<std::pair<std::string, const NpyArray*>> files = {{o.out, &out}};
  if (!o.weights.empty()) files.emplace_back(o.weights, &weights);
  if (!o.lse.empty()) files.emplace_back(o.lse, &lse);
  write_all(files);  // silent on success: an output may be /dev/stdout
}

}  // namespace sdpa_cli
