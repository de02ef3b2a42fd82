// libFuzzer target for the .npy reader (cli/npy.h): arbitrary bytes as a file.
//
// cli/npy.h reads only from a path, so the bytes go to a per-process temporary file under
// /tmp first. Checks:
//   - no sanitizer report, no hang, no huge allocation (run with -rss_limit_mb=2048
//     -malloc_limit_mb=2048: the reader must refuse a header that promises more data than the
//     file holds before allocating it);
//   - read_npy either returns or throws std::runtime_error (nothing else);
//   - a parsed array is consistent (rank <= 4, data size = numel * itemsize), and writing it
//     back with write_npy and reading that again gives the same dtype, shape and bytes;
//   - the file write_npy produced is a valid version 1.0 file whose data starts at a multiple
//     of 64 bytes, as NumPy writes them.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "npy.h"

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "npy_fuzz: CHECK FAILED: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

const fs::path& scratch(int which) {
  static const fs::path paths[2] = {
      fs::temp_directory_path() / ("sdpa_npy_fuzz_in." + std::to_string(getpid()) + ".npy"),
      fs::temp_directory_path() / ("sdpa_npy_fuzz_out." + std::to_string(getpid()) + ".npy")};
  return paths[which];
}

void remove_scratch() {
  std::error_code ec;
  fs::remove(scratch(0), ec);
  fs::remove(scratch(1), ec);
}

void write_bytes(const fs::path& path, const uint8_t* data, size_t size) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  f.close();
  if (!f) fail("cannot write the scratch file " + path.string());
}

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::atexit(remove_scratch);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using sdpa_cli::NpyArray;
  write_bytes(scratch(0), data, size);
  NpyArray a;
  try {
    a = sdpa_cli::read_npy(scratch(0));
  } catch (const std::runtime_error& e) {
    // Every message starts with the file name.
    if (std::string(e.what()).rfind(scratch(0).string(), 0) != 0) {
      fail(std::string("read_npy's message does not start with the path: ") + e.what());
    }
    return 0;
  }
  // Parsed: it must describe itself consistently.
  if (a.shape.size() > 4) fail("rank " + std::to_string(a.shape.size()) + " accepted");
  // int32 / int64 ('<i4', '<i8') since the reader takes seqlens_k files (commit b4401bb); int8 /
  // uint8 ('|i1', '|u1') since the dtype table has the 8-bit KV cache's rows (issue 30).
  if (a.dtype != sdpa::DType::kFloat32 && a.dtype != sdpa::DType::kFloat64 && a.dtype != sdpa::DType::kBool &&
      a.dtype != sdpa::DType::kFloat16 && a.dtype != sdpa::DType::kBFloat16 && a.dtype != sdpa::DType::kInt32 &&
      a.dtype != sdpa::DType::kInt64 && a.dtype != sdpa::DType::kInt8 && a.dtype != sdpa::DType::kUInt8) {
    fail("unknown dtype accepted");
  }
  const int64_t numel = sdpa_cli::checked_numel("parsed", a.shape);
  if (static_cast<uint64_t>(numel) * static_cast<uint64_t>(sdpa::dtype_size(a.dtype)) != a.data.size()) {
    fail("data size " + std::to_string(a.data.size()) + " does not match shape " + a.shape_string());
  }
  if (a.data.size() > size) fail("more data bytes than the file has");
  // Round trip: write, read again, compare bit for bit.
  try {
    sdpa_cli::write_npy(scratch(1), a);
  } catch (const std::exception& e) {
    fail(std::string("write_npy of a parsed array failed: ") + e.what());
  }
  const std::vector<char> file = read_bytes(scratch(1));
  if (file.size() < 10 || std::memcmp(file.data(), "\x93NUMPY\x01\x00", 8) != 0) fail("written file has a bad prelude");
  const size_t header = static_cast<unsigned char>(file[8]) | (static_cast<size_t>(static_cast<unsigned char>(file[9])) << 8);
  if ((10 + header) % 64 != 0) fail("written data does not start at a multiple of 64 bytes");
  if (file.size() != 10 + header + a.data.size()) fail("written file has the wrong size");
  NpyArray b;
  try {
    b = sdpa_cli::read_npy(scratch(1));
  } catch (const std::exception& e) {
    fail(std::string("reading back what write_npy wrote failed: ") + e.what());
  }
  if (b.dtype != a.dtype) fail("round trip changed the dtype");
  if (b.shape != a.shape) fail("round trip changed the shape " + a.shape_string() + " to " + b.shape_string());
  if (b.data != a.data) fail("round trip changed the data bytes");
  // view() of a parsed array is always possible (rank <= 4) and matches the shape.
  const sdpa::TensorView v = a.view();
  if (v.rank != static_cast<int>(a.shape.size())) fail("view() rank differs");
  if (a.data.empty() != (v.data == nullptr)) fail("view() data pointer inconsistent with emptiness");
  return 0;
}
