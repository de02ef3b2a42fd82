// The options layer of sdpa's three C++ front doors: python/bindings.cc (sdpa._core),
// python/torch_ops.cc (torch.ops.sdpa.*) and cli/run.cc (`sdpa run`, `sdpa inspect`). It holds
// the names by which they spell Options' enums (strings in Python, in the torch schema and on
// the command line) and builds sdpa::Options from a call's arguments as they arrive: enums by
// name, arrays already viewed (each door views its own arrays: NumPy, torch, .npy).
//
// Only names are checked here. Every value rule (scale finite and held by the compute type,
// dropout_p in [0, 1), the window, softcap >= 0, block sizes >= 1, ...) is make_problem's, which
// names the argument; a front door does not repeat it.
//
// Header-only: the front doors link different copies of the library (the CLI the static sdpa,
// the Python modules libsdpa.so), and this is no part of the library's API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sdpa/attention.h"
#include "storage.h"

namespace sdpa::front {

template <class E>
struct Name {
  std::string_view name;
  E value;
};

inline constexpr Name<Causal> kCausalNames[] = {
    {"none", Causal::kNone}, {"bottom_right", Causal::kBottomRight}, {"top_left", Causal::kTopLeft}};
inline constexpr Name<Backend> kBackendNames[] = {
    {"auto", Backend::kAuto}, {"flash", Backend::kFlash}, {"reference", Backend::kReference}, {"naive", Backend::kNaive}};
inline constexpr Name<Options::SoftcapOrder> kSoftcapOrderNames[] = {
    {"before_bias", Options::SoftcapOrder::kBeforeBias}, {"after_bias", Options::SoftcapOrder::kAfterBias}};
inline constexpr Name<Precision> kPrecisionNames[] = {{"exact", Precision::kExact}, {"fast", Precision::kFast}};
inline constexpr Name<ScoresStage> kScoresStageNames[] = {{"scaled", ScoresStage::kScaled},
                                                          {"softcapped", ScoresStage::kSoftcapped},
                                                          {"biased", ScoresStage::kBiased},
                                                          {"final", ScoresStage::kFinal}};
// The value that `names` spells `text`, else Error "<arg> must be 'a', 'b' or 'c'<also>, got
// '<text>'" (`also`: what a front door accepts besides, as " (or true, false)").
template <class E>
E parse_name(std::string_view arg, std::span<const Name<E>> names, std::string_view text, std::string_view also = {}) {
  std::string expected;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i].name == text) return names[i].value;
    expected += (i == 0 ? "'" : i + 1 == names.size() ? " or '" : ", '") + std::string(names[i].name) + "'";
  }
  throw Error(std::string(arg) + " must be " + expected + std::string(also) + ", got '" + std::string(text) + "'");
}
template <class E, size_t n>
E parse_name(std::string_view arg, const Name<E> (&names)[n], std::string_view text, std::string_view also = {}) {
  return parse_name<E>(arg, std::span<const Name<E>>(names), text, also);
}

// Every name in `names`, in order: a command-line option's allowed values.
template <class E, size_t n>
std::vector<std::string> names_of(const Name<E> (&names)[n]) {
  std::vector<std::string> out;
  for (const Name<E>& x : names) out.emplace_back(x.name);
  return out;
}

// The storage dtype named `text`, by the dtype table's names (storage.h: 'float32', 'float64',
// 'bfloat16' or 'float16'): a KV cache's pool dtype.
inline DType parse_storage_dtype(std::string_view arg, std::string_view text) {
  std::vector<Name<DType>> names;
  for (const internal::DTypeTraits& row : internal::kDTypeTable)
    if (row.storage) names.push_back({row.name, row.dtype});
  return parse_name<DType>(arg, names, text);
}

// The name of `value` in `names` ("?" for one it lacks); a literal's, so data() ends in '\0'.
template <class E, size_t n>
constexpr std::string_view name_of(const Name<E> (&names)[n], E value) {
  for (const Name<E>& x : names)
    if (x.value == value) return x.name;
  return "?";
}

// The arguments of a call that become Options, as a front door receives them (Options' fields
// and defaults, its enums by name).
struct Call {
  // (Each member has an initializer, so that a designated initializer may leave any out.)
  std::optional<double> scale = std::nullopt;
  std::string_view causal = "none";
  Window window = {};
  std::string_view backend = "auto";
  std::string_view precision = "exact";
  double dropout_p = 0.0;
  std::optional<uint64_t> seed = std::nullopt;
  double softcap = 0.0;
  std::string_view softcap_order = "before_bias";
  std::optional<TensorView> alibi_slopes = std::nullopt, sinks = std::nullopt, block_mask = std::nullopt;
  int64_t block_q = 128, block_k = 128;
  std::optional<int64_t> q_start = std::nullopt, k_start = std::nullopt;
  bool batch_invariant = false;
};

// Options for `c`; Error naming the argument for a name that is not one of its names.
inline Options options(const Call& c) {
  Options opt;
  opt.scale = c.scale;
  opt.causal = parse_name("causal", kCausalNames, c.causal);
  opt.window = c.window;
  opt.backend = parse_name("backend", kBackendNames, c.backend);
  opt.precision = parse_name("precision", kPrecisionNames, c.precision);
  opt.dropout_p = c.dropout_p;
  opt.seed = c.seed;
  opt.softcap = c.softcap;
  opt.softcap_order = parse_name("softcap_order", kSoftcapOrderNames, c.softcap_order);
  opt.alibi_slopes = c.alibi_slopes;
  opt.sinks = c.sinks;
  opt.block_mask = c.block_mask;
  opt.block_q = c.block_q;
  opt.block_k = c.block_k;
  opt.q_start = c.q_start;
  opt.k_start = c.k_start;
  opt.batch_invariant = c.batch_invariant;
  return opt;
}

}  // namespace sdpa::front
