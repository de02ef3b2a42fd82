// End-to-end tests of the `sdpa` binary (its path comes from CMake as SDPA_EXE): write .npy
// inputs, run the tool through the shell, read back what it wrote and what it printed.
#include <gtest/gtest.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "npy.h"

namespace sdpa_cli {
namespace {

namespace fs = std::filesystem;
using sdpa::DType;

struct Result {
  int status = -1;  // exit status, or -1 if it did not exit normally (a crash)
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

template <class T>
NpyArray array(DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  NpyArray a = NpyArray::zeros(dtype, std::move(shape));
  std::copy(values.begin(), values.end(), a.values<T>());
  return a;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / (std::string("sdpa_cli_test_") + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::string save(const std::string& name, const NpyArray& a) const {
    write_npy(path(name), a);
    return path(name);
  }

  // Seed 001, example 2: two queries and keys of zeros, values 10 and 20.
  void save_seed_001(DType dtype) const {
    if (dtype == DType::kFloat64) {
      save("q.npy", array<double>(dtype, {2, 1}, {0, 0}));
      save("k.npy", array<double>(dtype, {2, 1}, {0, 0}));
      save("v.npy", array<double>(dtype, {2, 1}, {10, 20}));
    } else {
      save("q.npy", array<float>(dtype, {2, 1}, {0, 0}));
      save("k.npy", array<float>(dtype, {2, 1}, {0, 0}));
      save("v.npy", array<float>(dtype, {2, 1}, {10, 20}));
    }
  }

  // Runs `sdpa <args>` in the test's directory (args are passed to the shell as they are).
  Result sdpa(const std::string& args) const {
    const std::string out = path("stdout.txt"), err = path("stderr.txt");
    const std::string command =
        "cd '" + dir_.string() + "' && '" SDPA_EXE "' " + args + " >'" + out + "' 2>'" + err + "'";
    const int raw = std::system(command.c_str());
    Result r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    fs::remove(out);
    fs::remove(err);
    return r;
  }

  // The names of the files in the test's directory, sorted.
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  // A failure must be exactly one "sdpa: error: ..." line on stderr, with exit status 1, holding
  // the fragment (and the file it names, for the library's messages, which name arguments).
  static void expect_one_line_error(const Result& r, const std::string& fragment, const std::string& file = "") {
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err.rfind("sdpa: error: ", 0), 0u) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << "expected \"" << fragment << "\" in: " << r.err;
    EXPECT_NE(r.err.find(file), std::string::npos) << "expected \"" << file << "\" in: " << r.err;
  }

  fs::path dir_;
};

// --seqlens-k: each sequence attends to its own keys only (ONNX's nonpad_kv_seqlen). One head,
// D = 1, zero scores: the output is the mean of the values of the keys a row sees.
TEST_F(CliTest, SeqlensKLimitsEachSequencesKeys) {
  save("q.npy", array<float>(DType::kFloat32, {2, 1, 2, 1}, {0, 0, 0, 0}));
  save("k.npy", array<float>(DType::kFloat32, {2, 1, 3, 1}, {0, 0, 0, 0, 0, 0}));
  save("v.npy", array<float>(DType::kFloat32, {2, 1, 3, 1}, {1, 2, 4, 8, 16, 32}));
  save("len.npy", array<int32_t>(DType::kInt32, {2}, {2, 3}));
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy --seqlens-k len.npy --causal bottom_right -o out.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  // Sequence 0 (L = 2): row 0 sees key 0, row 1 keys 0..1. Sequence 1 (L = 3): keys 0..1, 0..2.
  const NpyArray out = read_npy(path("out.npy"));
  const std::vector<float> want = {1, 1.5f, 12, 56.0f / 3};
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(out.values<float>()[i], want[i]) << i;
  save("bad.npy", array<int64_t>(DType::kInt64, {2}, {2, 4}));
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy --seqlens-k bad.npy -o out2.npy"),
                        "seqlens_k[1] = 4 is outside [0, Nk] = [0, 3]", "bad.npy");
  EXPECT_FALSE(fs::exists(path("out2.npy")));
}

// --softcap, --alibi-slopes and --sinks: one query, keys with q·k = {2, 0, -3} (scale 1), by hand.
TEST_F(CliTest, ScoreModifiersByHand) {
  save("q.npy", array<double>(DType::kFloat64, {1, 1}, {1}));
  save("k.npy", array<double>(DType::kFloat64, {3, 1}, {2, 0, -3}));
  save("v.npy", array<double>(DType::kFloat64, {3, 1}, {1, 10, 100}));
  save("slopes.npy", array<float>(DType::kFloat32, {1}, {0.5f}));
  save("sinks.npy", array<double>(DType::kFloat64, {1}, {0.25}));
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy --scale 1 --softcap 2 --alibi-slopes slopes.npy "
                        "--sinks sinks.npy -o out.npy --lse lse.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  // s_j = 2 tanh(x_j / 2) - 0.5 |2 - j|; the sink adds exp(0.25) to the sum.
  const double x[3] = {2, 0, -3}, value[3] = {1, 10, 100};
  double sum = std::exp(0.25), weighted = 0;
  for (int j = 0; j < 3; ++j) {
    const double e = std::exp(2 * std::tanh(x[j] / 2) - 0.5 * std::abs(2 - j));
    sum += e;
    weighted += e * value[j];
  }
  EXPECT_NEAR(read_npy(path("out.npy")).values<double>()[0], weighted / sum, 1e-12);
  EXPECT_NEAR(read_npy(path("lse.npy")).values<double>()[0], std::log(sum), 1e-12);
  save("bad.npy", array<double>(DType::kFloat64, {2}, {1, 2}));
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy --sinks bad.npy -o out2.npy"),
                        "sinks has shape (2,)", "bad.npy");
  EXPECT_FALSE(fs::exists(path("out2.npy")));
}

// --block-mask and --block-size: query 0 sees keys 0, 1 and query 1 keys 2, 3 (blocks of 1 x 2).
TEST_F(CliTest, BlockMaskByHand) {
  save("q.npy", array<double>(DType::kFloat64, {2, 1}, {1, 2}));
  save("k.npy", array<double>(DType::kFloat64, {4, 1}, {1, -1, 0.5, 2}));
  save("v.npy", array<double>(DType::kFloat64, {4, 1}, {1, 10, 100, 1000}));
  save("blocks.npy", array<uint8_t>(DType::kBool, {2, 2}, {1, 0, 0, 1}));
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy --scale 1 --block-mask blocks.npy --block-size 1,2 -o out.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  const double q[2] = {1, 2}, k[4] = {1, -1, 0.5, 2}, value[4] = {1, 10, 100, 1000};
  for (int i = 0; i < 2; ++i) {
    double sum = 0, weighted = 0;
    for (int j = 2 * i; j < 2 * i + 2; ++j) {
      sum += std::exp(q[i] * k[j]);
      weighted += std::exp(q[i] * k[j]) * value[j];
    }
    EXPECT_NEAR(read_npy(path("out.npy")).values<double>()[static_cast<size_t>(i)], weighted / sum, 1e-9);
  }
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy --block-mask blocks.npy -o out2.npy"),
                        "block_mask has shape (2, 2)", "blocks.npy");
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy --block-mask blocks.npy --block-size 0 -o out2.npy"),
                        "--block-size must be", "'0'");
  EXPECT_FALSE(fs::exists(path("out2.npy")));
}

TEST_F(CliTest, Seed001CausalMaskExample) {
  save_seed_001(DType::kFloat64);
  save("mask.npy", array<uint8_t>(DType::kBool, {2, 2}, {1, 0, 1, 1}));
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy --mask mask.npy -o out.npy --weights w.npy --lse lse.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");

  const NpyArray out = read_npy(path("out.npy"));
  EXPECT_EQ(out.dtype, DType::kFloat64);
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 1}));
  EXPECT_NEAR(out.values<double>()[0], 10.0, 1e-12);
  EXPECT_NEAR(out.values<double>()[1], 15.0, 1e-12);

  const NpyArray w = read_npy(path("w.npy"));
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 2}));
  const std::vector<double> expected_w = {1, 0, 0.5, 0.5};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(w.values<double>()[i], expected_w[i], 1e-12) << i;

  const NpyArray lse = read_npy(path("lse.npy"));
  EXPECT_EQ(lse.shape, (std::vector<int64_t>{2}));
  EXPECT_NEAR(lse.values<double>()[0], 0.0, 1e-12);  // log(e^0)
  EXPECT_NEAR(lse.values<double>()[1], std::log(2.0), 1e-12);
}

TEST_F(CliTest, CausalAndWindowOptionsGiveTheSameMasking) {
  save_seed_001(DType::kFloat32);
  for (const std::string option :
       {"--causal top_left", "--causal bottom_right", "--causal true", "--window -1,0", "--window=-1,0"}) {
    SCOPED_TRACE(option);
    const Result r = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy " + option);
    ASSERT_EQ(r.status, 0) << r.err;
    const NpyArray out = read_npy(path("out.npy"));
    EXPECT_EQ(out.dtype, DType::kFloat32);
    EXPECT_NEAR(out.values<float>()[0], 10.0f, 1e-5f);
    EXPECT_NEAR(out.values<float>()[1], 15.0f, 1e-5f);
  }
  const Result none = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --causal false");
  ASSERT_EQ(none.status, 0) << none.err;
  EXPECT_NEAR(read_npy(path("out.npy")).values<float>()[0], 15.0f, 1e-5f);  // no masking: the mean
}

TEST_F(CliTest, FloatMaskOfTheOtherDtypeIsConverted) {
  save_seed_001(DType::kFloat32);
  save("bias.npy", array<double>(DType::kFloat64, {2, 2}, {0, -INFINITY, 0, 0}));
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy --mask bias.npy -o out.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  const NpyArray out = read_npy(path("out.npy"));
  EXPECT_EQ(out.dtype, DType::kFloat32);
  EXPECT_NEAR(out.values<float>()[0], 10.0f, 1e-5f);
  EXPECT_NEAR(out.values<float>()[1], 15.0f, 1e-5f);
}

TEST_F(CliTest, Float32BesideFloat64ComputesInFloat64) {
  save_seed_001(DType::kFloat64);
  save("q_f32.npy", array<float>(DType::kFloat32, {2, 1}, {0, 0}));
  const Result r = sdpa("run --q q_f32.npy --k k.npy --v v.npy --causal top_left -o out.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  const NpyArray out = read_npy(path("out.npy"));
  EXPECT_EQ(out.dtype, DType::kFloat64);
  EXPECT_NEAR(out.values<double>()[1], 15.0, 1e-12);
}

TEST_F(CliTest, WritesToStdoutAndSaysNothingElse) {
  save_seed_001(DType::kFloat64);
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy --causal top_left -o /dev/stdout");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  std::ofstream(path("piped.npy"), std::ios::binary) << r.out;
  const NpyArray out = read_npy(path("piped.npy"));  // fails if anything else went to stdout
  EXPECT_NEAR(out.values<double>()[1], 15.0, 1e-12);
}

TEST_F(CliTest, ShapeMismatchFailsWithOneLineAndNoOutput) {
  save_seed_001(DType::kFloat64);
  save("v3.npy", array<double>(DType::kFloat64, {3, 1}, {10, 20, 30}));  // Nk = 3, but k has 2
  const auto before = files();
  const Result r = sdpa("run --q q.npy --k k.npy --v v3.npy -o out.npy --weights w.npy");
  expect_one_line_error(r, "v has Nk=3 but k has Nk=2", "v = v3.npy");
  EXPECT_EQ(files(), before);  // no out.npy, no w.npy, no temporary left over
}

TEST_F(CliTest, BadInputsAndOptionsFailWithOneLine) {
  save_seed_001(DType::kFloat64);
  save("q_f32.npy", array<float>(DType::kFloat32, {2, 1}, {0, 0}));
  save("q_rank1.npy", array<double>(DType::kFloat64, {2}, {0, 0}));
  std::ofstream(path("garbage.npy")) << "not numpy";
  const auto before = files();
  const std::string qkv = "--q q.npy --k k.npy --v v.npy -o out.npy ";
  expect_one_line_error(sdpa("run --q missing.npy --k k.npy --v v.npy -o out.npy"), "missing.npy: no such file");
  expect_one_line_error(sdpa("run --q garbage.npy --k k.npy --v v.npy -o out.npy"), "garbage.npy: not a .npy file");
  expect_one_line_error(sdpa("run --q q_rank1.npy --k k.npy --v v.npy -o out.npy"), "must have rank 2..4");
  expect_one_line_error(sdpa("run " + qkv + "--window 1"), "--window must be two integers");
  expect_one_line_error(sdpa("run " + qkv + "--window 1,x"), "--window must be two integers");
  expect_one_line_error(sdpa("run " + qkv + "--causal sideways"), "--causal must be");
  expect_one_line_error(sdpa("run " + qkv + "--weights ./out.npy"), "two outputs");
  // A later output that cannot be written must not leave the earlier ones behind.
  expect_one_line_error(sdpa("run " + qkv + "--weights no/such/dir/w.npy"), "no/such/dir/w.npy");
  EXPECT_EQ(files(), before);
}

TEST_F(CliTest, ParseErrorsAreOneLineWithExitStatus2) {
  // What CLI11 rejects is one "sdpa: error: ..." line too (not CLI11's two, "... Run with
  // --help for more information."), with status 2 (a usage error) rather than CLI11's > 100.
  const auto expect_parse_error = [](const Result& r, const std::string& fragment) {
    EXPECT_EQ(r.status, 2) << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_EQ(r.err.rfind("sdpa: error: ", 0), 0u) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.find("Run with --help"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << "expected \"" << fragment << "\" in: " << r.err;
  };
  const Result missing = sdpa("run --q q.npy");
  expect_parse_error(missing, "required");
  expect_parse_error(missing, "(see sdpa run --help)");
  expect_parse_error(sdpa("frobnicate"), "frobnicate");
  expect_parse_error(sdpa(""), "subcommand");
  expect_parse_error(sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --scale x"), "--scale");
  // An empty --scale used to be the default scale, silently; nan and inf are no scale either.
  for (const std::string scale : {"''", "nan", "inf", "-inf", "1e400", "1,5", "' 0.5x'"}) {
    SCOPED_TRACE(scale);
    expect_parse_error(sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --scale " + scale), "--scale");
  }
  expect_parse_error(sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --frobnicate"), "--frobnicate");
  expect_parse_error(sdpa("bench --reps 0"), "--reps");
  expect_parse_error(sdpa("demo extra"), "extra");
  EXPECT_EQ(files(), std::vector<std::string>{});
}

TEST_F(CliTest, VersionExitsZero) {
  const Result r = sdpa("--version");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find('.'), std::string::npos) << r.out;  // "0.1.0"
}

// An array with a zero dim, so an empty file whatever its other dims: the shapes of crafted
// headers that make outputs huge.
void save_empty(const std::string& path, std::vector<int64_t> shape) {
  NpyArray a;
  a.dtype = DType::kFloat32;
  a.shape = std::move(shape);
  write_npy(path, a);
}

TEST_F(CliTest, HugeOutputShapesFailWithOneLineNamingTheOutput) {
  constexpr int64_t k2to62 = int64_t{1} << 62, k2to30 = int64_t{1} << 30, k2to40 = int64_t{1} << 40;
  save_empty(path("q62.npy"), {k2to62, 0});
  save_empty(path("q30.npy"), {k2to30, 0});
  save_empty(path("q40.npy"), {k2to40, 0});
  save_empty(path("k0.npy"), {0, 0});
  save_empty(path("v40.npy"), {0, k2to40});
  const auto before = files();
  // Weights (2^62, 2^62): more elements than int64_t counts (no signed overflow on the way).
  expect_one_line_error(sdpa("run --q q62.npy --k q62.npy --v q62.npy -o out.npy --weights w.npy"),
                        "weights (w.npy) has shape (4611686018427387904, 4611686018427387904), more elements than "
                        "int64_t counts");
  // lse (2^62,) of float32: 2^64 bytes.
  expect_one_line_error(sdpa("run --q q62.npy --k q62.npy --v q62.npy -o out.npy --lse l.npy"),
                        "lse (l.npy) has shape (4611686018427387904,), more bytes than int64_t counts");
  // out (2^40, 2^40) from q (2^40, 0) and v (0, 2^40).
  expect_one_line_error(sdpa("run --q q40.npy --k k0.npy --v v40.npy -o out.npy"),
                        "out (out.npy) has shape (1099511627776, 1099511627776), more elements than int64_t counts");
  // Weights (2^30, 2^30): countable, 2^62 bytes, but no machine has that memory (not
  // std::bad_alloc, which sanitizers would turn into an abort anyway).
  expect_one_line_error(sdpa("run --q q30.npy --k q30.npy --v q30.npy -o out.npy --weights w.npy"),
                        "weights (w.npy) has shape (1073741824, 1073741824): 4611686018427387904 bytes, more than "
                        "this machine's memory");
  EXPECT_EQ(files(), before);
  // With only -o, every output is empty: a valid call that returns at once (it used to loop
  // over the 2^62 empty rows) and writes out.npy of shape (2^62, 0).
  const Result empty = sdpa("run --q q62.npy --k q62.npy --v q62.npy -o out.npy");
  EXPECT_EQ(empty.status, 0) << empty.err;
  EXPECT_TRUE(std::filesystem::exists(path("out.npy")));
}

TEST_F(CliTest, HelpDescribesEveryOption) {
  const Result app = sdpa("--help");
  EXPECT_EQ(app.status, 0);
  EXPECT_NE(app.out.find("demo"), std::string::npos);
  EXPECT_NE(app.out.find("run"), std::string::npos);
  const Result run = sdpa("run --help");
  EXPECT_EQ(run.status, 0);
  for (const char* option :
       {"--q", "--k", "--v", "--mask", "--seqlens-k", "--causal", "--window", "--scale", "--out", "--weights", "--lse"}) {
    EXPECT_NE(run.out.find(option), std::string::npos) << option;
  }
  EXPECT_EQ(sdpa("demo --help").status, 0);
  const Result bench = sdpa("bench --help");
  EXPECT_EQ(bench.status, 0) << bench.err;
  EXPECT_EQ(bench.err, "");
  for (const char* option : {"--threads", "--reps", "--filter", "--dtype", "bf16", "f16", "--json", "--no-avx512", "--no-amx",
                             "--no-bf16-dot"}) {
    EXPECT_NE(bench.out.find(option), std::string::npos) << option;
  }
  // The dtypes and their .npy descrs, and what NumPy does with bfloat16.
  for (const char* text : {"float16 '<f2'", "bfloat16 '<V2'", "ml_dtypes.bfloat16", "view(ml_dtypes.bfloat16)",
                           "out has q's dtype", "weights and lse have the compute type"}) {
    EXPECT_NE(run.out.find(text), std::string::npos) << text << " in: " << run.out;
  }
}

TEST_F(CliTest, ScaleIsUsedAndCheckedAgainstFloat32) {
  // Scores (0, 1) of one query: softmax weights 1/(1 + e^s) and e^s/(1 + e^s) for scale s.
  save("q.npy", array<float>(DType::kFloat32, {1, 1}, {1}));
  save("k.npy", array<float>(DType::kFloat32, {2, 1}, {0, 1}));
  save("v.npy", array<float>(DType::kFloat32, {2, 1}, {0, 1}));
  for (const double scale : {0.0, 2.0, -3.5}) {
    SCOPED_TRACE(scale);
    const Result r = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --scale " + std::to_string(scale));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NEAR(read_npy(path("out.npy")).values<float>()[0], 1 / (1 + std::exp(-scale)), 1e-6);
  }
  // 1e39 is a finite double, but float32, the compute type of float32 inputs, cannot hold it.
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --scale 1e39"),
                        "scale=1e+39 cannot be held by float32");
}

// A .npy header (version 1.0, padded as NumPy pads it) claiming `shape`, without data.
std::string npy_header(DType dtype, const std::vector<int64_t>& shape) {
  std::string dict = npy_header_dict(dtype, shape);
  dict.append((64 - (10 + dict.size() + 1) % 64) % 64, ' ');
  dict += '\n';
  return std::string("\x93NUMPY\x01\x00", 8) + static_cast<char>(dict.size() & 0xff) +
         static_cast<char>(dict.size() >> 8) + dict;
}

// RAM plus swap, in bytes.
uint64_t memory_bytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return UINT64_MAX;
  return (static_cast<uint64_t>(info.totalram) + info.totalswap) * info.mem_unit;
}

TEST_F(CliTest, FailedRunLeavesExistingOutputsAsTheyWere) {
  save_seed_001(DType::kFloat64);
  const std::string old_out = "the user's out.npy, from an earlier run", old_w = "the user's w.npy";
  std::ofstream(path("out.npy"), std::ios::binary) << old_out;
  std::ofstream(path("w.npy"), std::ios::binary) << old_w;
  const auto before = files();
  const std::string qkv = "run --q q.npy --k k.npy --v v.npy -o out.npy --weights w.npy ";
  // A folder that does not exist: found before anything is computed.
  expect_one_line_error(sdpa(qkv + "--lse no/such/dir/lse.npy"), "no/such/dir/lse.npy");
  ASSERT_EQ(slurp(path("out.npy")), old_out);
  EXPECT_EQ(slurp(path("w.npy")), old_w);
  EXPECT_EQ(files(), before);  // and no temporary left over
  // A device that fails only when written: out and weights are complete by then, but not in place.
  if (fs::exists("/dev/full")) {
    expect_one_line_error(sdpa(qkv + "--lse /dev/full"), "/dev/full: write error");
    EXPECT_EQ(slurp(path("out.npy")), old_out);
    EXPECT_EQ(slurp(path("w.npy")), old_w);
    EXPECT_EQ(files(), before);
  }
  // A run that succeeds replaces them, through a symlink if out.npy is one.
  fs::rename(path("out.npy"), path("real_out.npy"));
  fs::create_symlink("real_out.npy", path("out.npy"));
  const Result ok = sdpa(qkv + "--causal top_left");
  ASSERT_EQ(ok.status, 0) << ok.err;
  EXPECT_TRUE(fs::is_symlink(path("out.npy")));
  EXPECT_NEAR(read_npy(path("real_out.npy")).values<double>()[1], 15.0, 1e-12);
  EXPECT_EQ(read_npy(path("w.npy")).shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(files().size(), before.size() + 1);  // real_out.npy beside the link
}

TEST_F(CliTest, ShapeMismatchIsFoundBeforeAllocatingOutputs) {
  // Each call asks for weights (2^20, 2^20) of float32, 4 TiB, from input files of at most
  // 4 MiB: the mismatch must be reported, not the weights' size (and nothing allocated).
  constexpr int64_t n = int64_t{1} << 20;
  save_empty(path("q.npy"), {n, 0});
  save_empty(path("k.npy"), {n, 0});
  save_empty(path("v.npy"), {n, 0});
  save_empty(path("v1.npy"), {1, 0});
  save("k1.npy", NpyArray::zeros(DType::kFloat32, {n, 1}));
  save("mask3.npy", array<uint8_t>(DType::kBool, {3}, {1, 1, 1}));
  save("b.npy", array<float>(DType::kFloat32, {1, 2, 1, 1}, {0, 0}));
  const auto before = files();
  const std::string w = " -o out.npy --weights w.npy";
  expect_one_line_error(sdpa("run --q q.npy --k k1.npy --v v.npy" + w),
                        "k has Dk=1 but q has Dk=0 (q (1048576, 0), k (1048576, 1))", "k = k1.npy");
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v1.npy" + w),
                        "v has Nk=1 but k has Nk=1048576", "v = v1.npy");
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy --mask mask3.npy" + w),
                        "mask has shape (3,), which does not broadcast to the scores (1048576, 1048576) = (Nq, Nk)",
                        "mask = mask3.npy");
  expect_one_line_error(sdpa("run --q q.npy --k k.npy --v v.npy --mask b.npy" + w),
                        "mask has shape (1, 2, 1, 1), more dims than the scores", "mask = b.npy");
  expect_one_line_error(sdpa("run --q b.npy --k k.npy --v v.npy" + w), "k has rank 2 but q has rank 4", "q = b.npy");
  EXPECT_EQ(files(), before);
}

TEST_F(CliTest, InputLargerThanMemoryNamesTheFile) {
  // A header claiming (2^40, 2^10) float32, 4 PiB, with 16 bytes of data: found truncated from
  // the file's size, before anything is allocated.
  std::ofstream(path("short.npy"), std::ios::binary)
      << npy_header(DType::kFloat32, {int64_t{1} << 40, 1024}) << std::string(16, '\0');
  save_seed_001(DType::kFloat32);
  const Result r = sdpa("run --q short.npy --k k.npy --v v.npy -o out.npy");
  expect_one_line_error(r,
                        "short.npy: truncated data: shape (1099511627776, 1024) of <f4 needs 4503599627370496 bytes");
  // A complete file of 8 TiB (sparse: no disk used) cannot be read into memory either: said by
  // name, not as a bare std::bad_alloc.
  constexpr uint64_t bytes = uint64_t{1} << 43;
  const std::string header = npy_header(DType::kFloat32, {int64_t{1} << 39, 4});
  std::ofstream(path("huge.npy"), std::ios::binary) << header;
  std::error_code ec;
  fs::resize_file(path("huge.npy"), header.size() + bytes, ec);
  if (ec || memory_bytes() >= bytes) GTEST_SKIP() << "no sparse 8 TiB file here, or as much memory";
  const Result huge = sdpa("run --q huge.npy --k k.npy --v v.npy -o out.npy");
  expect_one_line_error(huge,
                        "huge.npy: shape (549755813888, 4) of <f4: 8796093022208 bytes, more than this machine's "
                        "memory");
  EXPECT_EQ(huge.err.find("bad_alloc"), std::string::npos) << huge.err;
  EXPECT_FALSE(fs::exists(path("out.npy")));
}

TEST_F(CliTest, FloatMaskValuesAreCheckedByName) {
  save_seed_001(DType::kFloat32);
  // float64 biases that float32, the inputs' dtype, cannot hold: not "+inf", and not -inf either
  // (which would block a key that the finite bias left in).
  save("big.npy", array<double>(DType::kFloat64, {2, 2}, {0, 1e300, 0, 0}));
  save("small.npy", array<double>(DType::kFloat64, {2, 2}, {0, 0, -1e300, 0}));
  save("nan.npy", array<float>(DType::kFloat32, {2, 2}, {0, 0, 0, NAN}));
  save("inf.npy", array<double>(DType::kFloat64, {1, 2}, {0, INFINITY}));  // broadcast over the rows
  const std::string qkv = "run --q q.npy --k k.npy --v v.npy -o out.npy --mask ";
  expect_one_line_error(sdpa(qkv + "big.npy"), "mask (big.npy) has 1e+300 at index (0, 1), which float32 cannot hold");
  expect_one_line_error(sdpa(qkv + "small.npy"),
                        "mask (small.npy) has -1e+300 at index (1, 0), which float32 cannot hold");
  expect_one_line_error(sdpa(qkv + "nan.npy"), "mask has NaN at index (1, 1)", "mask = nan.npy");
  expect_one_line_error(sdpa(qkv + "inf.npy"), "mask has +inf at index (0, 1)", "mask = inf.npy");
  EXPECT_FALSE(fs::exists(path("out.npy")));
  // Beside float64 inputs the same values are fine: large finite biases.
  save("q64.npy", array<double>(DType::kFloat64, {2, 1}, {0, 0}));
  const Result r = sdpa("run --q q64.npy --k k.npy --v v.npy -o out.npy --mask small.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NEAR(read_npy(path("out.npy")).values<double>()[1], 20.0, 1e-12);  // row 1 sees key 1 only
}

// A small JSON syntax check (RFC 8259 values; no \u escapes needed here): true if `text` is
// exactly one JSON value, surrounding whitespace allowed.
class JsonChecker {
 public:
  explicit JsonChecker(const std::string& text) : s_(text) {}
  bool valid() {
    const bool ok = value();
    skip();
    return ok && pos_ == s_.size();
  }

 private:
  void skip() {
    while (pos_ < s_.size() && std::string(" \t\r\n").find(s_[pos_]) != std::string::npos) ++pos_;
  }
  bool eat(char c) {
    skip();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool string() {
    if (!eat('"')) return false;
    for (; pos_ < s_.size(); ++pos_) {
      if (s_[pos_] == '\\') ++pos_;
      else if (s_[pos_] == '"') return ++pos_, true;
      else if (static_cast<unsigned char>(s_[pos_]) < 0x20) return false;
    }
    return false;
  }
  bool value() {
    skip();
    if (pos_ >= s_.size()) return false;
    const char c = s_[pos_];
    if (c == '"') return string();
    if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++pos_;
      if (eat(close)) return true;
      do {
        if (c == '{' && !(string() && eat(':'))) return false;
        if (!value()) return false;
      } while (eat(','));
      return eat(close);
    }
    for (const char* word : {"true", "false", "null"}) {
      if (s_.compare(pos_, std::strlen(word), word) == 0) return pos_ += std::strlen(word), true;
    }
    const size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    while (pos_ < s_.size() && std::string("0123456789.eE+-").find(s_[pos_]) != std::string::npos) ++pos_;
    return pos_ > start && std::isdigit(static_cast<unsigned char>(s_[pos_ - 1]));
  }

  const std::string& s_;
  size_t pos_ = 0;
};

TEST_F(CliTest, BenchJsonSmoke) {
  // One small decode case, one run, one thread: a few seconds, most of it the machine probe.
  const Result r = sdpa("bench --filter 'decode mha 8 d64' --reps 1 --threads 1 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(JsonChecker(r.out).valid()) << r.out;
  for (const char* key : {"\"threads\": 1", "\"simd_target\":", "\"fma_peak_gflops\":", "\"read_bandwidth_gbs\":",
                          "\"flops_formula\":", "\"cases\": [", "\"name\": \"decode mha 8 d64 (4 tokens)\"",
                          "\"Nk\": 16384", "\"median_ms\":", "\"gflops\":", "\"peak_share\":", "\"kv_gbs\":",
                          "\"bandwidth_share\":", "\"dtype\": \"f32\""}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << key << " in: " << r.out;
  }
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '{'), 2) << "the run and exactly one case: " << r.out;
  EXPECT_FALSE(JsonChecker("{\"a\": 1,}").valid());  // the checker does reject things
  EXPECT_FALSE(JsonChecker("{\"a\": 1} {}").valid());
  expect_one_line_error(sdpa("bench --filter 'no such case' --reps 1"), "--filter 'no such case' matches no case");
}

TEST_F(CliTest, BenchHasTheEightBitCacheDecodeRows) {
  // float32 q against a uint8 K/V cache (values, scales and zero points; issue 30): its type
  // column says u8 and its bytes count 1 per value plus 8 per row (scale and zero point).
  const Result r = sdpa("bench --filter 'decode gqa 32:8 d128 u8' --reps 1 --threads 1 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(JsonChecker(r.out).valid()) << r.out;
  for (const char* key : {"\"name\": \"decode gqa 32:8 d128 u8\"", "\"dtype\": \"u8\"", "\"kv_gbs\":"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << key << " in: " << r.out;
  }
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '{'), 2) << "the run and exactly one case: " << r.out;
}

TEST_F(CliTest, BenchDtypeRunsTheTableInThatDtype) {
  const Result r = sdpa("bench --dtype f16 --filter 'decode mha 8 d64' --reps 1 --threads 1 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(JsonChecker(r.out).valid()) << r.out;
  EXPECT_NE(r.out.find("\"name\": \"decode mha 8 d64 (4 tokens) f16\", \"dtype\": \"f16\""), std::string::npos)
      << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '{'), 2) << "the run and exactly one case: " << r.out;
  // The table: its header names the dtype, and a row says it too.
  const Result table = sdpa("bench --dtype bf16 --filter 'decode mha 8 d64' --reps 1 --threads 1");
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find(", bfloat16, precision exact, median of 1 runs"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("decode mha 8 d64 (4 tokens) bf16 bf16"), std::string::npos) << table.out;
  // --precision: every case's Options::precision, in the header and the JSON.
  const Result fast = sdpa("bench --dtype bf16 --filter 'decode mha 8 d64' --reps 1 --threads 1 --precision fast --json");
  ASSERT_EQ(fast.status, 0) << fast.err;
  EXPECT_NE(fast.out.find("\"precision\": \"fast\""), std::string::npos) << fast.out;
  const Result bad_precision = sdpa("bench --precision quick");
  EXPECT_EQ(bad_precision.status, 2) << bad_precision.err;
  EXPECT_NE(bad_precision.err.find("--precision"), std::string::npos) << bad_precision.err;
  const Result bad = sdpa("bench --dtype bf32");
  EXPECT_EQ(bad.status, 2) << bad.err;
  EXPECT_NE(bad.err.find("--dtype"), std::string::npos) << bad.err;
  EXPECT_EQ(r.err.find("error"), std::string::npos) << r.err;
}

// The path caps: --no-amx leaves at most AVX512_BF16's dot products, --no-bf16-dot neither; the
// path column says what ran (the uncapped path depends on the CPU: test KernelPaths in lowp_test).
TEST_F(CliTest, BenchPathCapsShowInThePathColumn) {
  const std::string run = "bench --dtype bf16 --filter 'prefill d64 causal' --reps 1 --threads 1 --json";
  const Result simd = sdpa(run + " --no-bf16-dot");
  ASSERT_EQ(simd.status, 0) << simd.err;
  EXPECT_NE(simd.out.find("\"path\": \"simd\""), std::string::npos) << simd.out;
  const Result no_amx = sdpa(run + " --no-amx");
  ASSERT_EQ(no_amx.status, 0) << no_amx.err;
  EXPECT_EQ(no_amx.out.find("\"path\": \"amx\""), std::string::npos) << no_amx.out;
  EXPECT_TRUE(no_amx.out.find("\"path\": \"bf16dot\"") != std::string::npos ||
              no_amx.out.find("\"path\": \"simd\"") != std::string::npos)
      << no_amx.out;
}

// float16 bits of a random value in ±[0.25, 4): sign, exponent 13..16, any mantissa; bfloat16
// likewise (exponent 125..128). Random bits, not rounded floats: no conversion to trust.
uint16_t random_bits(DType dtype, uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  const uint32_t r = state >> 8;
  const uint32_t sign = (r & 1) << 15;
  if (dtype == DType::kFloat16) return static_cast<uint16_t>(sign | ((13 + ((r >> 1) & 3)) << 10) | ((r >> 3) & 0x3ff));
  return static_cast<uint16_t>(sign | ((125 + ((r >> 1) & 3)) << 7) | ((r >> 3) & 0x7f));
}

NpyArray random_16(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  NpyArray a = NpyArray::zeros(dtype, std::move(shape));
  for (int64_t i = 0; i < a.numel(); ++i) a.values<uint16_t>()[i] = random_bits(dtype, seed);
  return a;
}

// Element i of a float array, as a double.
double value_at(const NpyArray& a, int64_t i) {
  switch (a.dtype) {
    case DType::kFloat16: return float16_to_float(a.values<uint16_t>()[i]);
    case DType::kBFloat16: return bfloat16_to_float(a.values<uint16_t>()[i]);
    case DType::kFloat32: return a.values<float>()[i];
    case DType::kFloat64: return a.values<double>()[i];
    case DType::kBool:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kInt8:
    case DType::kUInt8: break;
  }
  ADD_FAILURE() << "not a float array";
  return 0;
}

// The array in float64 (exactly).
NpyArray to_float64(const NpyArray& a) {
  NpyArray b = NpyArray::zeros(DType::kFloat64, a.shape);
  for (int64_t i = 0; i < a.numel(); ++i) b.values<double>()[i] = value_at(a, i);
  return b;
}

// What sdpa::attention itself gives for these arrays (the .npy files the CLI read, read again),
// with out of `out_dtype` and weights and lse of `compute`.
struct Direct {
  NpyArray out, weights, lse;
};
Direct attention_of(NpyArray q, NpyArray k, NpyArray v, NpyArray* mask, DType out_dtype, DType compute,
                    sdpa::Options options, sdpa::Backend backend = sdpa::Backend::kAuto) {
  options.backend = backend;
  const size_t r = q.shape.size();
  std::vector<int64_t> out_shape = q.shape, w_shape = q.shape, lse_shape(q.shape.begin(), q.shape.end() - 1);
  out_shape[r - 1] = v.shape.back();
  w_shape[r - 1] = k.shape[r - 2];
  Direct d{NpyArray::zeros(out_dtype, out_shape), NpyArray::zeros(compute, w_shape),
           NpyArray::zeros(compute, lse_shape)};
  sdpa::Inputs in{q.view(), k.view(), v.view(), std::nullopt};
  if (mask) in.mask = mask->view();
  sdpa::attention(in, sdpa::Outputs{d.out.view(), d.weights.view(), d.lse.view()}, options);
  return d;
}

TEST_F(CliTest, Float16RunGivesFloat16OutAsTheLibraryDoes) {
  // GQA 4:2, a float16 additive mask broadcast over batch and heads (-inf blocks), causal.
  save("q.npy", random_16(DType::kFloat16, {2, 4, 5, 8}, 1));
  save("k.npy", random_16(DType::kFloat16, {2, 2, 7, 8}, 2));
  save("v.npy", random_16(DType::kFloat16, {2, 2, 7, 3}, 3));
  NpyArray mask = random_16(DType::kFloat16, {5, 7}, 4);
  mask.values<uint16_t>()[3] = mask.values<uint16_t>()[15] = 0xfc00;  // -inf
  save("mask.npy", mask);
  const Result r = sdpa(
      "run --q q.npy --k k.npy --v v.npy --mask mask.npy --causal top_left -o out.npy --weights w.npy --lse lse.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  const NpyArray out = read_npy(path("out.npy")), w = read_npy(path("w.npy")), lse = read_npy(path("lse.npy"));
  EXPECT_EQ(out.dtype, DType::kFloat16);  // q's
  EXPECT_EQ(w.dtype, DType::kFloat32);    // the compute type
  EXPECT_EQ(lse.dtype, DType::kFloat32);
  EXPECT_EQ(out.shape, (std::vector<int64_t>{2, 4, 5, 3}));
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 4, 5, 7}));
  EXPECT_EQ(lse.shape, (std::vector<int64_t>{2, 4, 5}));
  EXPECT_NE(slurp(path("out.npy")).find("'descr': '<f2'"), std::string::npos);

  sdpa::Options options;
  options.causal = sdpa::Causal::kTopLeft;
  NpyArray file_mask = read_npy(path("mask.npy"));
  const Direct direct = attention_of(read_npy(path("q.npy")), read_npy(path("k.npy")), read_npy(path("v.npy")),
                                     &file_mask, DType::kFloat16, DType::kFloat32, options);
  EXPECT_EQ(out.data, direct.out.data);  // bit for bit: the library's results are deterministic
  EXPECT_EQ(w.data, direct.weights.data);
  EXPECT_EQ(lse.data, direct.lse.data);

  // And near the float64 oracle on the same (widened) values: half an ulp of float16 and a bit.
  NpyArray mask64 = to_float64(file_mask);
  const Direct oracle = attention_of(to_float64(read_npy(path("q.npy"))), to_float64(read_npy(path("k.npy"))),
                                     to_float64(read_npy(path("v.npy"))), &mask64, DType::kFloat64, DType::kFloat64,
                                     options, sdpa::Backend::kReference);
  int nonzero = 0;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const double x = value_at(out, i), expected = oracle.out.values<double>()[i];
    EXPECT_NEAR(x, expected, 1e-3 * std::max(1.0, std::abs(expected))) << i;
    nonzero += x != 0;
  }
  EXPECT_GT(nonzero, out.numel() / 2);
  for (int64_t i = 0; i < lse.numel(); ++i) EXPECT_NEAR(value_at(lse, i), oracle.lse.values<double>()[i], 1e-5) << i;
}

TEST_F(CliTest, BFloat16RunReadsAndWritesMlDtypesFiles) {
  save("q.npy", random_16(DType::kBFloat16, {3, 6, 4}, 5));
  save("k.npy", random_16(DType::kBFloat16, {3, 9, 4}, 6));
  save("v.npy", random_16(DType::kBFloat16, {3, 9, 5}, 7));
  // A bfloat16 mask beside float16 inputs is not the library's to take: the CLI widens it
  // (exactly) to float32, so the result is the library's with that float32 mask.
  NpyArray mask = random_16(DType::kBFloat16, {6, 9}, 8);
  mask.values<uint16_t>()[10] = 0xff80;  // -inf
  save("bmask.npy", mask);
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --lse lse.npy --weights w.npy --scale 0.75");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string file = slurp(path("out.npy"));
  EXPECT_NE(file.find("{'descr': '<V2', 'fortran_order': False, 'shape': (3, 6, 5), }"), std::string::npos) << file;
  const NpyArray out = read_npy(path("out.npy")), lse = read_npy(path("lse.npy")), w = read_npy(path("w.npy"));
  EXPECT_EQ(out.dtype, DType::kBFloat16);
  EXPECT_EQ(lse.dtype, DType::kFloat32);
  EXPECT_EQ(w.dtype, DType::kFloat32);
  sdpa::Options options;
  options.scale = 0.75;
  const Direct direct = attention_of(read_npy(path("q.npy")), read_npy(path("k.npy")), read_npy(path("v.npy")), nullptr,
                                     DType::kBFloat16, DType::kFloat32, options);
  EXPECT_EQ(out.data, direct.out.data);
  EXPECT_EQ(lse.data, direct.lse.data);
  EXPECT_EQ(w.data, direct.weights.data);
  // --precision fast: the library's kFast call, bit for bit.
  const Result fast = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --lse lse.npy --scale 0.75 --precision fast");
  ASSERT_EQ(fast.status, 0) << fast.err;
  options.precision = sdpa::Precision::kFast;
  const Direct direct_fast = attention_of(read_npy(path("q.npy")), read_npy(path("k.npy")), read_npy(path("v.npy")),
                                          nullptr, DType::kBFloat16, DType::kFloat32, options);
  EXPECT_EQ(read_npy(path("out.npy")).data, direct_fast.out.data);
  EXPECT_EQ(read_npy(path("lse.npy")).data, direct_fast.lse.data);
  const Result quick = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --precision quick");
  EXPECT_EQ(quick.status, 2) << quick.err;
  EXPECT_NE(quick.err.find("--precision"), std::string::npos) << quick.err;

  save("q16.npy", random_16(DType::kFloat16, {3, 6, 4}, 9));
  save("k16.npy", random_16(DType::kFloat16, {3, 9, 4}, 10));
  save("v16.npy", random_16(DType::kFloat16, {3, 9, 5}, 11));
  const Result masked = sdpa("run --q q16.npy --k k16.npy --v v16.npy --mask bmask.npy -o out.npy");
  ASSERT_EQ(masked.status, 0) << masked.err;
  NpyArray mask32 = NpyArray::zeros(DType::kFloat32, {6, 9});
  for (int64_t i = 0; i < mask32.numel(); ++i) {
    mask32.values<float>()[i] = std::bit_cast<float>(uint32_t{mask.values<uint16_t>()[i]} << 16);
  }
  const Direct widened = attention_of(read_npy(path("q16.npy")), read_npy(path("k16.npy")), read_npy(path("v16.npy")),
                                      &mask32, DType::kFloat16, DType::kFloat32, {});
  const NpyArray masked_out = read_npy(path("out.npy"));
  EXPECT_EQ(masked_out.dtype, DType::kFloat16);
  EXPECT_EQ(masked_out.data, widened.out.data);
}

TEST_F(CliTest, Float32QueriesOverFloat16KeysAndValues) {
  // A float32 query against a float16 KV cache: out and lse float32.
  NpyArray q = NpyArray::zeros(DType::kFloat32, {2, 6});
  for (int64_t i = 0; i < q.numel(); ++i) q.values<float>()[i] = 0.3f * static_cast<float>(i % 5) - 0.55f;
  save("q.npy", q);
  save("k.npy", random_16(DType::kFloat16, {11, 6}, 12));
  save("v.npy", random_16(DType::kFloat16, {11, 2}, 13));
  const Result r = sdpa("run --q q.npy --k k.npy --v v.npy -o out.npy --lse lse.npy");
  ASSERT_EQ(r.status, 0) << r.err;
  const NpyArray out = read_npy(path("out.npy")), lse = read_npy(path("lse.npy"));
  EXPECT_EQ(out.dtype, DType::kFloat32);
  EXPECT_EQ(lse.dtype, DType::kFloat32);
  const Direct direct = attention_of(read_npy(path("q.npy")), read_npy(path("k.npy")), read_npy(path("v.npy")), nullptr,
                                     DType::kFloat32, DType::kFloat32, {});
  EXPECT_EQ(out.data, direct.out.data);
  EXPECT_EQ(lse.data, direct.lse.data);
}

TEST_F(CliTest, DtypeErrorsNameTheFiles) {
  save("q16.npy", random_16(DType::kFloat16, {2, 4}, 1));
  save("k16.npy", random_16(DType::kFloat16, {3, 4}, 2));
  save("v16.npy", random_16(DType::kFloat16, {3, 4}, 3));
  save("kb.npy", random_16(DType::kBFloat16, {3, 4}, 4));
  save("k32.npy", NpyArray::zeros(DType::kFloat32, {3, 4}));
  save("q64.npy", NpyArray::zeros(DType::kFloat64, {2, 4}));
  save("big.npy", array<double>(DType::kFloat64, {1, 3}, {0, 1e300, 0}));
  save("bool.npy", array<uint8_t>(DType::kBool, {2, 4}, {1, 1, 1, 1, 1, 1, 1, 1}));
  // np.load of a bfloat16 file, saved again without the view: '|V2'.
  std::ofstream(path("raw.npy"), std::ios::binary)
      << std::string("\x93NUMPY\x01\x00v\x00", 10) + "{'descr': '|V2', 'fortran_order': False, 'shape': (3, 4), }" +
             std::string(128 - 11 - 59, ' ') + "\n" + std::string(24, '\0');
  const auto before = files();
  const std::string o = " -o out.npy --lse lse.npy";
  // float16 and bfloat16 are not converted: the library's rule, and the files, are named.
  expect_one_line_error(sdpa("run --q q16.npy --k kb.npy --v v16.npy" + o),
                        "k has dtype bfloat16 but q has dtype float16", "k = kb.npy");
  expect_one_line_error(sdpa("run --q q16.npy --k k16.npy --v kb.npy" + o),
                        "v has dtype bfloat16 but k has dtype float16", "v = kb.npy");
  expect_one_line_error(sdpa("run --q q16.npy --k k32.npy --v v16.npy" + o),
                        "k has dtype float32 but q has dtype float16", "k = k32.npy");
  // float64 meets float32 in float64, but not float16.
  expect_one_line_error(sdpa("run --q q64.npy --k k16.npy --v v16.npy" + o),
                        "k has dtype float16 but q has dtype float64", "q = q64.npy, k = k16.npy");
  expect_one_line_error(sdpa("run --q bool.npy --k k16.npy --v v16.npy" + o), "q has dtype bool", "q = bool.npy");
  expect_one_line_error(sdpa("run --q raw.npy --k k16.npy --v v16.npy" + o), "raw.npy: unsupported dtype '|V2'");
  // A float64 bias that float32, the compute type of float16, cannot hold.
  expect_one_line_error(sdpa("run --q q16.npy --k k16.npy --v v16.npy --mask big.npy" + o),
                        "mask (big.npy) has 1e+300 at index (0, 1), which float32 cannot hold (the compute type of "
                        "float16 q)");
  EXPECT_EQ(files(), before);  // no output, no temporary
}

TEST_F(CliTest, DemoPrintsTheToyHead) {
  const Result r = sdpa("demo");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  // out = [[0.598888, 1.000000], [0.598888, 1.203336]] (weights 0.401112/0.197776, see seed 000).
  EXPECT_NE(r.out.find("[[0.598888 1.000000]\n [0.598888 1.203336]]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("row sum 1.000000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("lse"), std::string::npos) << r.out;
}

// `sdpa inspect --demo`: the toy head's page with its 2 x 3 weights and their values (seed 000's
// 0.401112 and 0.197776), written to -o and nothing on stdout; no progress bar off a terminal.
TEST_F(CliTest, InspectDemoWritesTheToyHeadsPage) {
  const Result r = sdpa("inspect --demo -o demo.html");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "");
  const std::string html = slurp(path("demo.html"));
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("<td>0.401112</td><td>0.401112</td><td>0.197776</td>"), std::string::npos) << html;
  EXPECT_NE(html.find("<td>0.197776</td><td>0.401112</td><td>0.401112</td>"), std::string::npos) << html;
  EXPECT_NE(html.find("width='144' height='96' src='data:image/png;base64,"), std::string::npos);
}

// From files, as `sdpa run` reads them (here a causal float32 call), and its errors.
TEST_F(CliTest, InspectReadsTheCallsFilesAndNamesThemInErrors) {
  save_seed_001(DType::kFloat32);
  const Result r = sdpa("inspect --q q.npy --k k.npy --v v.npy --causal top_left --topk 2 -o r.html");
  EXPECT_EQ(r.status, 0) << r.err;
  const std::string html = slurp(path("r.html"));
  EXPECT_NE(html.find("<tr><th>0</th><td>1</td><td class='zero'>0</td><td>1</td></tr>"), std::string::npos) << html;
  EXPECT_NE(html.find("causal</th><td>top_left"), std::string::npos);
  save("v3.npy", array<float>(DType::kFloat32, {3, 1}, {10, 20, 30}));
  expect_one_line_error(sdpa("inspect --q q.npy --k k.npy --v v3.npy -o r2.html"), "v has Nk=3 but k has Nk=2",
                        "v = v3.npy");
  expect_one_line_error(sdpa("inspect --q q.npy -o r2.html"), "--q, --k and --v are required (or --demo)");
  expect_one_line_error(sdpa("inspect --demo --q q.npy"), "--demo takes no --q");
  expect_one_line_error(sdpa("inspect --demo -o no/such/dir/r.html"), "cannot write no/such/dir/r.html");
  EXPECT_FALSE(fs::exists(path("r2.html")));
}

}  // namespace
}  // namespace sdpa_cli
