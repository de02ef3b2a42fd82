// Tests of the .npy reader and writer: round trips, the exact bytes written, headers as other
// writers (NumPy 2.0 format, Python 2) produce them, and one test per kind of bad file.
#include "npy.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace sdpa_cli {
namespace {

namespace fs = std::filesystem;
using sdpa::DType;

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / (std::string("npy_test_") + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path file(const std::string& name, const std::string& bytes) const {
    const fs::path p = dir_ / name;
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

  // The message of the error read_npy throws for `p`; it must start with the file name.
  static std::string read_error(const fs::path& p) {
    try {
      read_npy(p);
    } catch (const std::runtime_error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind(p.string() + ": ", 0), 0u) << message;
      return message;
    }
    ADD_FAILURE() << "reading " << p << " did not throw";
    return "";
  }

  fs::path dir_;
};

// A .npy file with the given header text (padding and '\n' added) and data bytes.
std::string npy_bytes(const std::string& dict, const std::string& data = "", int major = 1) {
  const std::string header = dict + "      \n";
  std::string s = std::string("\x93NUMPY", 6) + static_cast<char>(major) + '\0';
  const size_t n = header.size();
  s += static_cast<char>(n & 0xff);
  s += static_cast<char>((n >> 8) & 0xff);
  if (major == 2) s += std::string(2, '\0');  // 4-byte length in version 2.0
  return s + header + data;
}

std::string contents(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

template <class T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

// Fills an array with values that differ from element to element (and from zero).
NpyArray sample(DType dtype, std::vector<int64_t> shape) {
  NpyArray a = NpyArray::zeros(dtype, std::move(shape));
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (dtype == DType::kFloat32) a.values<float>()[i] = 0.5f + static_cast<float>(i) * 1.25f;
    if (dtype == DType::kFloat64) a.values<double>()[i] = -1.0 / (3.0 + static_cast<double>(i));
    if (dtype == DType::kBool) a.values<uint8_t>()[i] = (i % 3) != 1;
    if (dtype == DType::kInt32) a.values<int32_t>()[i] = static_cast<int32_t>(0x01020304 * (i + 1)) - 7;
    if (dtype == DType::kInt64) a.values<int64_t>()[i] = -(int64_t{0x0102030405060708} + i);
    if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {  // bits; both bytes vary
      a.values<uint16_t>()[i] = static_cast<uint16_t>(0x3c01 + i * 0x0101);
    }
  }
  return a;
}

TEST_F(NpyTest, RoundTripsEveryDtypeAndRank) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {5}, {2, 3}, {2, 1, 3}, {2, 3, 1, 2}, {0, 3}, {4, 0, 2, 1}};
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16, DType::kBool, DType::kInt32,
                      DType::kInt64}) {
    for (const auto& shape : shapes) {
      const NpyArray a = sample(dtype, shape);
      const fs::path p = dir_ / "a.npy";
      write_npy(p, a);
      const NpyArray b = read_npy(p);
      SCOPED_TRACE(std::string(sdpa::dtype_name(dtype)) + " " + a.shape_string());
      EXPECT_EQ(b.dtype, dtype);
      EXPECT_EQ(b.shape, shape);
      EXPECT_EQ(b.data, a.data);
    }
  }
}

TEST_F(NpyTest, WritesVersion1WithNumPyHeaderAndAlignedData) {
  const NpyArray a = sample(DType::kFloat64, {1, 2});
  const fs::path p = dir_ / "a.npy";
  write_npy(p, a);
  std::ifstream in(p, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(bytes.size(), 128u + 16u);  // 128 bytes of prelude and header, then 2 doubles
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
  EXPECT_EQ(static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8), 128 - 10);
  const std::string dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 2), }";
  EXPECT_EQ(bytes.substr(10, dict.size()), dict);
  EXPECT_EQ(bytes.substr(10 + dict.size(), 128 - 11 - dict.size()), std::string(128 - 11 - dict.size(), ' '));
  EXPECT_EQ(bytes[127], '\n');
  EXPECT_EQ(bytes.substr(128), std::string(reinterpret_cast<const char*>(a.data.data()), 16));
}

TEST_F(NpyTest, HeaderDictSpellsShapesLikePython) {
  EXPECT_EQ(npy_header_dict(DType::kBool, {}), "{'descr': '|b1', 'fortran_order': False, 'shape': (), }");
  EXPECT_EQ(npy_header_dict(DType::kFloat32, {7}), "{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }");
}

TEST_F(NpyTest, ReadsVersion2Header) {
  const std::vector<float> values = {1.5f, -2.0f, 3.25f};
  const fs::path p =
      file("v2.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 1), }", bytes_of(values), 2));
  const NpyArray a = read_npy(p);
  EXPECT_EQ(a.dtype, DType::kFloat32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(a.values<float>()[2], 3.25f);
}

TEST_F(NpyTest, ReadsOtherSpellingsOfTheHeader) {
  const std::string data = bytes_of(std::vector<double>{1, 2, 3, 4, 5, 6});
  // Keys in another order, double quotes, no trailing comma or spaces.
  NpyArray a = read_npy(file("a.npy", npy_bytes("{\"shape\":(2,3),\"fortran_order\":False,\"descr\":\"<f8\"}", data)));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  // Python 2's long integers.
  a = read_npy(file("b.npy", npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2L, 3L), }", data)));
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.values<double>()[5], 6.0);
}

TEST_F(NpyTest, ErrorNotAFile) {
  EXPECT_NE(read_error(dir_ / "missing.npy").find("no such file"), std::string::npos);
  EXPECT_NE(read_error(dir_).find("not a regular file"), std::string::npos);
}

TEST_F(NpyTest, ErrorBadMagic) {
  EXPECT_NE(read_error(file("a.npy", "PK\x03\x04 this is a zip file")).find("bad magic"), std::string::npos);
  EXPECT_NE(read_error(file("b.npy", "\x93NUM")).find("not a .npy file"), std::string::npos);
  EXPECT_NE(read_error(file("c.npy", "")).find("not a .npy file"), std::string::npos);
}

TEST_F(NpyTest, ErrorUnsupportedVersion) {
  std::string bytes = npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", std::string(8, '\0'), 2);
  bytes[6] = '\x03';
  EXPECT_NE(read_error(file("a.npy", bytes)).find("version 3.0"), std::string::npos);
  bytes[6] = '\x01';
  bytes[7] = '\x01';
  EXPECT_NE(read_error(file("b.npy", bytes)).find("version 1.1"), std::string::npos);
}

TEST_F(NpyTest, ErrorTruncatedHeader) {
  const std::string bytes = npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (), }");
  EXPECT_NE(read_error(file("a.npy", bytes.substr(0, 9))).find("truncated header length"), std::string::npos);
  EXPECT_NE(read_error(file("b.npy", bytes.substr(0, 40))).find("truncated header"), std::string::npos);
  std::string huge = bytes;
  huge[8] = huge[9] = '\xff';
  huge[6] = '\x02';
  huge.insert(10, "\xff\x7f");  // a version 2.0 length of about 2 GiB
  EXPECT_NE(read_error(file("c.npy", huge)).find("implausible header length"), std::string::npos);
}

TEST_F(NpyTest, ErrorTruncatedOrTrailingData) {
  const std::string dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (2, 2), }";
  const std::string data = bytes_of(std::vector<double>{1, 2, 3, 4});
  const std::string truncated = read_error(file("a.npy", npy_bytes(dict, data.substr(0, 31))));
  EXPECT_NE(truncated.find("truncated data"), std::string::npos) << truncated;
  EXPECT_NE(truncated.find("needs 32 bytes but only 31"), std::string::npos) << truncated;
  EXPECT_NE(read_error(file("b.npy", npy_bytes(dict, data + "x"))).find("1 unexpected bytes"), std::string::npos);
}

TEST_F(NpyTest, ErrorFortranOrder) {
  const std::string dict = "{'descr': '<f8', 'fortran_order': True, 'shape': (2, 2), }";
  const std::string message = read_error(file("a.npy", npy_bytes(dict, std::string(32, '\0'))));
  EXPECT_NE(message.find("Fortran-order"), std::string::npos) << message;
}

TEST_F(NpyTest, ErrorBigEndian) {
  const std::string dict = "{'descr': '>f8', 'fortran_order': False, 'shape': (2,), }";
  const std::string message = read_error(file("a.npy", npy_bytes(dict, std::string(16, '\0'))));
  EXPECT_NE(message.find("big-endian"), std::string::npos) << message;
}

TEST_F(NpyTest, ErrorUnsupportedDtype) {
  // '<V1' is what numpy.save writes for ml_dtypes' 1-byte types (float8_e4m3fn, int4, ...).
  for (const char* descr : {"<u4", "<u2", "<i2", "<c16", "<u8", "<U3", "<V1", "<V4", "|V2", "<e2"}) {
    const std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (1,), }";
    const std::string message = read_error(file("a.npy", npy_bytes(dict, std::string(16, '\0'))));
    EXPECT_NE(message.find(std::string("unsupported dtype '") + descr + "'"), std::string::npos) << message;
  }
}

TEST_F(NpyTest, ErrorRawTwoByteVoidSaysHowToSaveBFloat16) {
  // np.load of a bfloat16 file gives '|V2' bytes; saved again without .view(ml_dtypes.bfloat16)
  // they say nothing about their type: refused, with the way out.
  const std::string dict = "{'descr': '|V2', 'fortran_order': False, 'shape': (2,), }";
  const std::string message = read_error(file("a.npy", npy_bytes(dict, std::string(4, '\0'))));
  EXPECT_NE(message.find("arr.view(ml_dtypes.bfloat16)"), std::string::npos) << message;
  const std::string big_endian = "{'descr': '>f2', 'fortran_order': False, 'shape': (2,), }";
  const std::string big = read_error(file("b.npy", npy_bytes(big_endian, std::string(4, '\0'))));
  EXPECT_NE(big.find("big-endian"), std::string::npos) << big;
}

// What numpy.save (NumPy 2.4) writes, byte for byte, for
//   np.array([[1.0, 65504, -0.0], [2**-24, np.inf, -np.nan]], dtype=np.float16)
//   np.array([1.0, -2.5, np.inf, 2**-133, 3.0e38], dtype=ml_dtypes.bfloat16)   (ml_dtypes 0.6)
// and the bits they hold.
std::string numpy_file(const std::string& dict, const std::vector<uint16_t>& bits) {
  std::string header = dict;
  header.append(128 - 10 - 1 - dict.size(), ' ');
  header += '\n';
  return std::string("\x93NUMPY\x01\x00v\x00", 10) + header + bytes_of(bits);
}
const std::vector<uint16_t> kFloat16Bits = {0x3c00, 0x7bff, 0x8000, 0x0001, 0x7c00, 0xfe00};
const std::vector<uint16_t> kBFloat16Bits = {0x3f80, 0xc020, 0x7f80, 0x0001, 0x7f62};

TEST_F(NpyTest, Float16AndBFloat16FilesAreNumPysByteForByte) {
  const std::string f16 = numpy_file("{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3), }", kFloat16Bits);
  const std::string bf16 = numpy_file("{'descr': '<V2', 'fortran_order': False, 'shape': (5,), }", kBFloat16Bits);
  ASSERT_EQ(f16.size(), 140u);  // as NumPy's: 128 bytes of header, 6 elements of 2 bytes
  ASSERT_EQ(bf16.size(), 138u);
  // Read: NumPy's files give the bits, unchanged.
  const NpyArray a = read_npy(file("f16.npy", f16));
  EXPECT_EQ(a.dtype, DType::kFloat16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(std::vector<uint16_t>(a.values<uint16_t>(), a.values<uint16_t>() + 6), kFloat16Bits);
  const NpyArray b = read_npy(file("bf16.npy", bf16));
  EXPECT_EQ(b.dtype, DType::kBFloat16);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{5}));
  EXPECT_EQ(std::vector<uint16_t>(b.values<uint16_t>(), b.values<uint16_t>() + 5), kBFloat16Bits);
  // Written: the same bytes as NumPy's.
  write_npy(dir_ / "f16_out.npy", a);
  write_npy(dir_ / "bf16_out.npy", b);
  EXPECT_EQ(contents(dir_ / "f16_out.npy"), f16);
  EXPECT_EQ(contents(dir_ / "bf16_out.npy"), bf16);
  EXPECT_EQ(npy_header_dict(DType::kBFloat16, {}), "{'descr': '<V2', 'fortran_order': False, 'shape': (), }");
}

TEST_F(NpyTest, EveryFloat16AndBFloat16BitPatternRoundTrips) {
  // All 65536 patterns of each, NaN payloads and signalling NaNs included, bit for bit.
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    NpyArray a = NpyArray::zeros(dtype, {256, 256});
    for (int i = 0; i < 65536; ++i) a.values<uint16_t>()[i] = static_cast<uint16_t>(i);
    write_npy(dir_ / "all.npy", a);
    const NpyArray b = read_npy(dir_ / "all.npy");
    EXPECT_EQ(b.dtype, dtype);
    EXPECT_EQ(b.data, a.data) << sdpa::dtype_name(dtype);
  }
}

TEST(NpyWiden, Float16AndBFloat16ToFloatAreExact) {
  EXPECT_EQ(float16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(float16_to_float(0x7bff), 65504.0f);
  EXPECT_EQ(float16_to_float(0xc000), -2.0f);
  EXPECT_EQ(float16_to_float(0x0001), std::ldexp(1.0f, -24));  // the smallest subnormal
  EXPECT_EQ(float16_to_float(0x03ff), std::ldexp(1023.0f, -24));  // the largest
  EXPECT_EQ(float16_to_float(0x0400), std::ldexp(1.0f, -14));  // the smallest normal
  EXPECT_TRUE(std::signbit(float16_to_float(0x8000)) && float16_to_float(0x8000) == 0.0f);
  EXPECT_EQ(float16_to_float(0xfc00), -INFINITY);
  EXPECT_EQ(bfloat16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bfloat16_to_float(0xc020), -2.5f);
  EXPECT_EQ(bfloat16_to_float(0x0001), std::ldexp(1.0f, -133));
  // Every pattern against the definition: (-1)^s · 2^(e - bias) · (1 + m / 2^mbits), subnormals
  // 2^(1 - bias) · m / 2^mbits, e all ones inf or NaN (the NaN's payload kept in float32's top bits).
  for (int i = 0; i < 65536; ++i) {
    const uint16_t bits = static_cast<uint16_t>(i);
    const double sign = (bits & 0x8000) ? -1.0 : 1.0;
    const int h_exp = (bits >> 10) & 0x1f, h_man = bits & 0x3ff;
    const float h = float16_to_float(bits);
    if (h_exp == 0x1f) {
      EXPECT_TRUE(h_man ? std::isnan(h) : h == sign * INFINITY) << i;
      if (h_man) {
        EXPECT_EQ((std::bit_cast<uint32_t>(h) >> 13) & 0x3ff, static_cast<uint32_t>(h_man)) << i;
      }
    } else {
      const double expected = sign * (h_exp ? std::ldexp(1.0 + h_man / 1024.0, h_exp - 15) : std::ldexp(h_man, -24));
      EXPECT_EQ(static_cast<double>(h), expected) << i;
      EXPECT_EQ(std::signbit(h), (bits & 0x8000) != 0) << i;
    }
    const int b_exp = (bits >> 7) & 0xff, b_man = bits & 0x7f;
    const float b = bfloat16_to_float(bits);
    if (b_exp == 0xff) {
      EXPECT_TRUE(b_man ? std::isnan(b) : b == sign * INFINITY) << i;
    } else {
      const double expected = sign * (b_exp ? std::ldexp(1.0 + b_man / 128.0, b_exp - 127) : std::ldexp(b_man, -133));
      EXPECT_EQ(static_cast<double>(b), expected) << i;
    }
  }
}

TEST_F(NpyTest, ErrorRankAboveFour) {
  const std::string dict = "{'descr': '|b1', 'fortran_order': False, 'shape': (1, 1, 1, 1, 2), }";
  const std::string message = read_error(file("a.npy", npy_bytes(dict, "\x01\x00")));
  EXPECT_NE(message.find("rank 5"), std::string::npos) << message;
}

TEST_F(NpyTest, ErrorShapeTooLarge) {
  const std::string dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296), }";
  EXPECT_NE(read_error(file("a.npy", npy_bytes(dict))).find("too large"), std::string::npos);
  const std::string digits = "{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,), }";
  EXPECT_NE(read_error(file("b.npy", npy_bytes(digits))).find("too large"), std::string::npos);
}

TEST_F(NpyTest, ErrorShapeWhoseNonzeroDimsOverflowEvenWhenEmpty) {
  // (2^62, 2^62, 0) has no elements, but its C-order strides would overflow int64_t.
  const std::string dict =
      "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 4611686018427387904, 0), }";
  const std::string message = read_error(file("a.npy", npy_bytes(dict)));
  EXPECT_NE(message.find("shape (4611686018427387904, 4611686018427387904, 0) of <f4 is too large"), std::string::npos)
      << message;
  // (2^62, 0) is fine: empty, and every stride fits.
  const std::string empty = "{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 0), }";
  const NpyArray a = read_npy(file("b.npy", npy_bytes(empty)));
  EXPECT_EQ(a.numel(), 0);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{int64_t{1} << 62, 0}));
}

// The message of the std::runtime_error `f` throws ("" and a failure if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no std::runtime_error";
  return "";
}

TEST(NpyCounts, CheckedNumelAndBytes) {
  const int64_t big = int64_t{1} << 62;
  EXPECT_EQ(checked_numel("x", {}), 1);
  EXPECT_EQ(checked_numel("x", {2, 3, 4}), 24);
  EXPECT_EQ(checked_numel("x", {big, 0}), 0);
  EXPECT_EQ(checked_numel("x", {0, big, 1}), 0);
  EXPECT_EQ(checked_numel("x", {big, 1}), big);
  EXPECT_EQ(error_of([&] { checked_numel("weights", {big, 2}); }),
            "weights has shape (4611686018427387904, 2), more elements than int64_t counts");
  EXPECT_EQ(error_of([&] { checked_numel("weights", {0, big, big}); }),
            "weights has shape (0, 4611686018427387904, 4611686018427387904), more elements than int64_t counts");
  EXPECT_EQ(error_of([&] { checked_numel("q", {2, -1}); }), "q has a negative dim: (2, -1)");
  EXPECT_EQ(checked_nbytes("x", DType::kFloat64, {3, 5}), 120);
  EXPECT_EQ(checked_nbytes("x", DType::kFloat64, {big, 0}), 0);
  EXPECT_EQ(error_of([&] { checked_nbytes("lse", DType::kFloat32, {big}); }),
            "lse has shape (4611686018427387904,), more bytes than int64_t counts");
}

TEST(NpyCounts, ZerosThatCannotBeAllocatedSaySoByName) {
  const int64_t n = int64_t{1} << 30;  // 2^60 float32 elements: 2^62 bytes, fits int64_t
  const std::string message = error_of([&] { NpyArray::zeros(DType::kFloat32, {n, n}, "weights"); });
  EXPECT_EQ(message.rfind("weights has shape (1073741824, 1073741824): 4611686018427387904 bytes, more than this "
                          "machine's memory (", 0),
            0u)
      << message;
  EXPECT_NE(error_of([&] { NpyArray::zeros(DType::kFloat64, {int64_t{1} << 62}, "out"); }).find("out has shape"),
            std::string::npos);
  EXPECT_EQ(NpyArray::zeros(DType::kFloat32, {int64_t{1} << 62, 0}, "out").data.size(), 0u);
}

TEST_F(NpyTest, ErrorHeaderGarbage) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"not a dict at all", "expected '{'"},
      {"{'descr': '<f8', 'fortran_order': False}", "no 'shape' key"},
      {"{'descr': '<f8', 'shape': (1,)}", "no 'fortran_order' key"},
      {"{'fortran_order': False, 'shape': (1,)}", "no 'descr' key"},
      {"{'descr': '<f8', 'descr': '<f8', 'fortran_order': False, 'shape': (1,)}", "repeated key 'descr'"},
      {"{'descr': '<f8', 'fortran_order': False, 'shape': (1,), 'extra': 1}", "unexpected or repeated key 'extra'"},
      {"{'descr': '<f8', 'fortran_order': False, 'shape': (1)}", "must be a tuple"},
      {"{'descr': '<f8', 'fortran_order': False, 'shape': (-1,)}", "non-negative integer"},
      {"{'descr': '<f8', 'fortran_order': false, 'shape': (1,)}", "True or False"},
      {"{'descr': <f8, 'fortran_order': False, 'shape': (1,)}", "quoted string"},
      {"{'descr': '<f8, 'fortran_order': False, 'shape': (1,)}", "expected '}'"},
      {"{'descr' '<f8', 'fortran_order': False, 'shape': (1,)}", "expected ':'"},
      {"{'descr': '<f8', 'fortran_order': False, 'shape': (1,)} junk", "text after the closing"},
      {"{'descr': '<f8', 'fortran_order': False, 'shape': (1,)", "expected '}'"},
      {"{'descr': '<f\\x38', 'fortran_order': False, 'shape': (1,)}", "escapes"},
      {std::string("{'descr': '<f8',") + '\0' + " 'fortran_order': False, 'shape': (1,)}", "NUL byte"},
  };
  for (const auto& [dict, reason] : cases) {
    const std::string message = read_error(file("a.npy", npy_bytes(dict, std::string(8, '\0'))));
    EXPECT_NE(message.find("malformed header"), std::string::npos) << message;
    EXPECT_NE(message.find(reason), std::string::npos) << "expected \"" << reason << "\" in: " << message;
  }
}

TEST_F(NpyTest, WriteErrorNamesTheFile) {
  const fs::path p = dir_ / "no" / "such" / "dir.npy";
  try {
    write_npy(p, sample(DType::kFloat32, {2}));
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(p.string() + ": cannot open for writing", 0), 0u) << e.what();
  }
  EXPECT_FALSE(fs::exists(p));
}

TEST_F(NpyTest, ErrorDataLargerThanMemory) {
  // A complete file of 8 TiB (sparse, so no disk is used): read_npy must say that it does not
  // fit in memory, naming the file, rather than throw std::bad_alloc (or be OOM-killed).
  const std::string header = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (549755813888, 4), }");
  const fs::path p = file("huge.npy", header);
  constexpr uintmax_t bytes = uintmax_t{1} << 43;
  std::error_code ec;
  fs::resize_file(p, header.size() + bytes, ec);
  struct sysinfo info {};
  const bool big_memory = sysinfo(&info) == 0 && (uintmax_t{info.totalram} + info.totalswap) * info.mem_unit >= bytes;
  if (ec || big_memory) GTEST_SKIP() << "no sparse 8 TiB file here, or as much memory";
  const std::string message = read_error(p);
  EXPECT_NE(message.find("shape (549755813888, 4) of <f4: 8796093022208 bytes, more than this machine's memory"),
            std::string::npos)
      << message;
}

// The names in a folder, sorted.
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_F(NpyTest, WriteFilesIsAllOrNothing) {
  const fs::path a = file("a.npy", "the user's a.npy"), b = dir_ / "no" / "such" / "b.npy";
  const NpyArray x = sample(DType::kFloat32, {2, 3}), y = sample(DType::kFloat64, {4});
  try {
    write_npy_files({{a, &x}, {b, &y}});
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(b.string() + ": cannot open for writing", 0), 0u) << e.what();
  }
  EXPECT_EQ(contents(a), "the user's a.npy");  // a was written (to a temporary) but not put in place
  EXPECT_EQ(names_in(dir_), std::vector<std::string>{"a.npy"});  // no temporary left
  // The same check, made before any work: nothing is written.
  EXPECT_THROW(check_npy_destinations({a, b}), std::runtime_error);
  check_npy_destinations({a, dir_ / "c.npy"});
  EXPECT_EQ(names_in(dir_), std::vector<std::string>{"a.npy"});
  EXPECT_EQ(contents(a), "the user's a.npy");
  // Success replaces a and creates c, and leaves nothing else.
  write_npy_files({{a, &x}, {dir_ / "c.npy", &y}});
  EXPECT_EQ(read_npy(a).data, x.data);
  EXPECT_EQ(read_npy(dir_ / "c.npy").data, y.data);
  EXPECT_EQ(names_in(dir_), (std::vector<std::string>{"a.npy", "c.npy"}));
}

TEST_F(NpyTest, WriteKeepsTheModeAndWritesThroughSymlinks) {
  const fs::path a = file("a.npy", "old");
  fs::permissions(a, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  write_npy(a, sample(DType::kBool, {3}));
  EXPECT_EQ(fs::status(a).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  // A new file gets the mode any new file gets (0666 less the umask), not a temporary's 0600.
  const mode_t umask = ::umask(0);
  ::umask(umask);
  write_npy(dir_ / "new.npy", sample(DType::kBool, {3}));
  EXPECT_EQ(static_cast<mode_t>(fs::status(dir_ / "new.npy").permissions() & fs::perms::all), 0666 & ~umask);
  fs::create_symlink("a.npy", dir_ / "link.npy");
  const NpyArray x = sample(DType::kFloat64, {2});
  write_npy(dir_ / "link.npy", x);
  EXPECT_TRUE(fs::is_symlink(dir_ / "link.npy"));
  EXPECT_EQ(read_npy(a).data, x.data);
}

TEST_F(NpyTest, WriteRefusesADirectoryAndWritesDevicesInPlace) {
  const std::string message = [&] {
    try {
      write_npy(dir_, sample(DType::kBool, {1}));
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  }();
  EXPECT_EQ(message, dir_.string() + ": cannot open for writing: Is a directory");
  EXPECT_TRUE(fs::is_directory(dir_));
  write_npy("/dev/null", sample(DType::kFloat32, {2}));  // no temporary in /dev, no rename over it
  if (fs::exists("/dev/full")) {
    try {
      write_npy("/dev/full", sample(DType::kFloat32, {2}));
      ADD_FAILURE() << "no error";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("/dev/full: write error", 0), 0u) << e.what();
    }
    EXPECT_TRUE(fs::exists("/dev/full"));
  }
}

TEST_F(NpyTest, ViewIsCOrder) {
  NpyArray a = sample(DType::kFloat64, {2, 3, 4});
  const sdpa::TensorView v = a.view();
  EXPECT_EQ(v.rank, 3);
  EXPECT_EQ(v.shape_string(), "(2, 3, 4)");
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[1], 4);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_EQ(v.data, a.data.data());
}

}  // namespace
}  // namespace sdpa_cli
