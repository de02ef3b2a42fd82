// attention_fuzz: checks, the case's description.
#include "harness.h"

namespace sdpa_fuzz {

// The input's global state (harness.h says what each holds).
std::set<std::string> g_known, g_skip;
std::map<std::string, uint64_t> g_known_hits;
bool g_verbose = false;
bool g_avx2 = false;
sdpa::KernelPath g_path_cap = sdpa::KernelPath::kAmxBf16;
int g_storage = 0;
sdpa::Precision g_precision = sdpa::Precision::kExact;
bool g_seqlens = false;
uint8_t g_sk = 0, g_sk_seed = 0;
bool g_varlen = false;
bool g_mods = false;
uint8_t g_md = 0, g_md_seed = 0;
bool g_blocks = false;
uint8_t g_bm = 0, g_bm_seed = 0;
bool g_varlen_blocks = false;
std::string g_case;
const uint8_t* g_data = nullptr;
size_t g_size = 0;
const char* g_known_dir = nullptr;
std::map<std::string, uint64_t> g_evaluated;
bool g_stats = false;
bool g_print = false;
uint8_t g_mode = 0;

bool skipping(const char* what) { return g_skip.count(what) != 0; }

void check(bool ok, const char* name, const std::function<std::string()>& message) {
  if (g_stats) ++g_evaluated[name];
  if (ok) return;
  if (g_known.count(name)) {
    ++g_known_hits[name];
    if (g_verbose || g_known_hits[name] == 1) std::fprintf(stderr, "KNOWN %s: %s\n%s\n", name, message().c_str(), g_case.c_str());
    if (g_known_dir && g_known_hits[name] <= 5) {
      const std::string path = std::string(g_known_dir) + "/known-" + name + "-" + std::to_string(g_known_hits[name]);
      if (FILE* fp = std::fopen(path.c_str(), "wb")) {
        std::fwrite(g_data, 1, g_size, fp);
        std::fclose(fp);
      }
    }
    throw CheckFailed{};
  }
  std::fprintf(stderr, "\n==== attention_fuzz: CHECK FAILED: %s\n%s\n---- case:\n%s\n", name, message().c_str(),
               g_case.c_str());
  std::fflush(stderr);
  std::abort();
}

bool throws_sdpa_error(const char* call, const std::function<void()>& fn, std::string& what) {
  try {
    fn();
  } catch (const sdpa::Error& e) {
    what = e.what();
    return true;
  } catch (const std::exception& e) {
    check(false, "other_exception", [&] { return std::string(call) + " threw a non-sdpa::Error exception: " + e.what(); });
  }
  return false;
}

std::string num(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

bool same_bits(double a, double b) { return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b); }
// Equal for the poison checks: same bits, or both zero (+0 / -0), or both NaN.
bool same_value(double a, double b) {
  return same_bits(a, b) || (a == 0 && b == 0) || (std::isnan(a) && std::isnan(b));
}
BadBlocks bad_blocks_of(uint8_t bm_seed) {
  return (bm_seed >> 5) == 7 ? static_cast<BadBlocks>(1 + (bm_seed & 31) % (static_cast<int>(BadBlocks::kCount) - 1)) : BadBlocks::kNone;
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kAuto: return "kAuto";
    case Backend::kFlash: return "kFlash";
    case Backend::kReference: return "kReference";
    case Backend::kNaive: return "kNaive";
  }
  return "invalid";
}

const char* path_name(sdpa::KernelPath p) {
  return p == sdpa::KernelPath::kSimd ? "kSimd" : p == sdpa::KernelPath::kAvx512Bf16 ? "kAvx512Bf16" : p == sdpa::KernelPath::kAmxBf16 ? "kAmxBf16" : "invalid";
}

std::string dtype_long(DType t) {
  return t == DType::kFloat32 ? "float32" : t == DType::kFloat64 ? "float64" : t == DType::kBFloat16 ? "bfloat16" : t == DType::kFloat16 ? "float16" : "bool";
}

uint64_t input_seed() {
  uint64_t seed = 1469598103934665603ull;
  for (size_t n = 0; n < g_size; ++n) seed = (seed ^ g_data[n]) * 1099511628211ull;
  return seed;
}

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "dtype " << (c.kv == c.dtype ? dtype_long(c.dtype) : dtype_long(c.dtype) + " q over " + dtype_long(c.kv) + " k, v") << ", rank " << c.rank << ", B=" << c.d.B
    << " Hq=" << c.d.Hq << " Hkv=" << c.d.Hkv << " Nq=" << c.d.Nq << " Nk=" << c.d.Nk << " Dk=" << c.d.Dk
    << " Dv=" << c.d.Dv << "\n";
  s << "options: scale=" << (c.opt.scale ? num(*c.opt.scale) : std::string("default")) << " causal="
    << (c.opt.causal == Causal::kNone ? "kNone" : c.opt.causal == Causal::kBottomRight ? "kBottomRight" : c.opt.causal == Causal::kTopLeft ? "kTopLeft" : "invalid")
    << " window={" << c.opt.window.left << ", " << c.opt.window.right << "} backend=" << backend_name(c.opt.backend)
    << " dropout_p=" << num(c.opt.dropout_p) << " seed=" << (c.opt.seed ? std::to_string(*c.opt.seed) : "none")
    << " precision=" << (c.opt.precision == sdpa::Precision::kFast ? "kFast" : "kExact") << "\n";
  s << "weights " << (c.want_weights ? "yes" : "no") << ", lse " << (c.want_lse ? "yes" : "no") << ", threads "
    << c.threads << ", SIMD " << (c.avx2 ? "capped at AVX2" : "all targets") << ", kernel path cap " << path_name(c.path_cap) << ", " << (c.backward ? "forward+backward" : "forward")
    << ", " << (c.tame ? "tame" : "not tame") << (c.huge ? ", huge-empty" : "") << "\n";
  s << c.q.describe("q") << "\n" << c.k.describe("k") << "\n" << c.v.describe("v") << "\n";
  if (c.mask) s << c.mask->describe("mask") << "\n";
  if (c.sl) {
    s << c.sl->describe("seqlens_k");
    if (c.bad_sl != BadSeqlens::kNone) s << " (invalid: " << kBadSeqlensNames[static_cast<int>(c.bad_sl)] << ")";
    s << "\n";
  }
  if (c.mods) {
    s << "modifiers: softcap=" << num(c.opt.softcap) << " order="
      << (c.opt.softcap_order == sdpa::Options::SoftcapOrder::kBeforeBias ? "kBeforeBias" : c.opt.softcap_order == sdpa::Options::SoftcapOrder::kAfterBias ? "kAfterBias" : "invalid")
      << (c.want_dsinks() ? ", dsinks " + dtype_long(c.mods->dsinks_dtype) : std::string()) << "\n";
    if (c.opt.alibi_slopes && c.mods->slopes) s << c.mods->slopes->describe("alibi_slopes") << "\n";
    if (c.opt.sinks && c.mods->sinks) s << c.mods->sinks->describe("sinks") << "\n";
    if (c.mods->bad != BadMod::kNone) s << "invalid modifier: " << kBadModNames[static_cast<int>(c.mods->bad)] << "\n";
  }
  if (c.blocks) {
    s << "block mask (" << c.blocks->how << "): block_q=" << c.opt.block_q << " block_k=" << c.opt.block_k << "; "
      << c.blocks->mask.describe("block_mask") << "\n";
    if (c.blocks->bad != BadBlocks::kNone) s << "invalid block mask: " << kBadBlocksNames[static_cast<int>(c.blocks->bad)] << "\n";
  }
  return s.str();
}

}  // namespace sdpa_fuzz
