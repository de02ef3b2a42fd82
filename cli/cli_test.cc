// End-to-end tests of the `sdpa` binary (its path comes from CMake as SDPA_EXE): write .npy
// inputs, run the tool through the shell, read back what it wrote and what it printed.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

  // A failure must be exactly one "sdpa: error: ..." line on stderr, with exit status 1.
  static void expect_one_line_error(const Result& r, const std::string& fragment) {
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err.rfind("sdpa: error: ", 0), 0u) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << "expected \"" << fragment << "\" in: " << r.err;
  }

  fs::path dir_;
};

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
  expect_one_line_error(r, "v has Nk=3 but k has Nk=2");
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
  expect_one_line_error(sdpa("run " + qkv + "--scale inf"), "scale must be finite");
  expect_one_line_error(sdpa("run " + qkv + "--weights ./out.npy"), "two outputs");
  // A later output that cannot be written must not leave the earlier ones behind.
  expect_one_line_error(sdpa("run " + qkv + "--weights no/such/dir/w.npy"), "no/such/dir/w.npy");
  EXPECT_EQ(files(), before);
}

TEST_F(CliTest, ParseErrorsUseCli11Reporting) {
  const Result missing = sdpa("run --q q.npy");
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.status, -1);
  EXPECT_NE(missing.err.find("required"), std::string::npos) << missing.err;
  const Result unknown = sdpa("frobnicate");
  EXPECT_NE(unknown.status, 0);
  EXPECT_NE(unknown.status, -1);
}

TEST_F(CliTest, HelpDescribesEveryOption) {
  const Result app = sdpa("--help");
  EXPECT_EQ(app.status, 0);
  EXPECT_NE(app.out.find("demo"), std::string::npos);
  EXPECT_NE(app.out.find("run"), std::string::npos);
  const Result run = sdpa("run --help");
  EXPECT_EQ(run.status, 0);
  for (const char* option :
       {"--q", "--k", "--v", "--mask", "--causal", "--window", "--scale", "--out", "--weights", "--lse"}) {
    EXPECT_NE(run.out.find(option), std::string::npos) << option;
  }
  EXPECT_EQ(sdpa("demo --help").status, 0);
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

}  // namespace
}  // namespace sdpa_cli
