// .npy reading and writing; see npy.h for what is supported and why.
#include "npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/sysinfo.h>
#endif

#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <new>
#include <stdexcept>
#include <string_view>
#include <system_error>

// The dtype table (descriptors, sizes) and the 16-bit conversions: by path, as npy_fuzz also
// compiles this file, outside the library's include path.
#include "../src/storage.h"

namespace sdpa_cli {

// Elements are copied as raw bytes, and the files we accept are little-endian.
static_assert(std::endian::native == std::endian::little, "npy.cc assumes a little-endian host");

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};
constexpr size_t kPreludeSize = sizeof(kMagic) + 2;  // magic + major + minor version bytes
// A real header for rank <= 4 is under 200 bytes; the cap keeps a corrupt length from
// making us allocate gigabytes. (NumPy itself refuses headers over 10000 bytes by default.)
constexpr uint32_t kMaxHeaderSize = 1 << 16;
constexpr int kMaxRank = 4;
[[noreturn]] void fail(const fs::path& path, const std::string& what) {
  throw std::runtime_error(path.string() + ": " + what);
}

// numpy.save writes dtype.str as the descr: the dtype table's npy_descr (bfloat16's is '<V2',
// what numpy.save writes for an ml_dtypes.bfloat16 array; see storage.h).
const char* descr_of(sdpa::DType dtype) {
  const char* descr = sdpa::internal::dtype_traits(dtype).npy_descr;
  if (*descr == '\0') throw std::logic_error("npy: unknown dtype");
  return descr;
}

// What the header dict says.
struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

// Parses the header dict: a Python literal with the keys 'descr' (a string), 'fortran_order'
// (True/False) and 'shape' (a tuple of ints), in any order, each exactly once. Only that much
// of Python's syntax is understood. Throws std::runtime_error with a short reason.
class HeaderParser {
 public:
  explicit HeaderParser(std::string_view text) : s_(text) {}

  Header parse() {
    Header h;
    bool seen_descr = false, seen_order = false, seen_shape = false;
    expect('{');
    while (peek() != '}') {
      const std::string key = parse_string();
      expect(':');
      if (key == "descr" && !seen_descr) {
        h.descr = parse_string();
        seen_descr = true;
      } else if (key == "fortran_order" && !seen_order) {
        h.fortran_order = parse_bool();
        seen_order = true;
      } else if (key == "shape" && !seen_shape) {
        h.shape = parse_shape();
        seen_shape = true;
      } else {
        throw std::runtime_error("unexpected or repeated key '" + key + "'");
      }
      if (peek() != ',') break;  // a trailing comma before '}' is allowed, as in Python
      ++pos_;
    }
    expect('}');
    if (peek() != '\0') throw std::runtime_error("text after the closing '}'");
    if (!seen_descr) throw std::runtime_error("no 'descr' key");
    if (!seen_order) throw std::runtime_error("no 'fortran_order' key");
    if (!seen_shape) throw std::runtime_error("no 'shape' key");
    return h;
  }

 private:
  // The next non-blank character, or '\0' at the end (NUL never occurs in a valid header).
  char peek() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
    return pos_ < s_.size() ? s_[pos_] : '\0';
  }

  void expect(char c) {
    if (peek() != c) throw std::runtime_error(std::string("expected '") + c + "' at offset " + std::to_string(pos_));
    ++pos_;
  }

  std::string parse_string() {
    const char quote = peek();
    if (quote != '\'' && quote != '"')
      throw std::runtime_error("expected a quoted string at offset " + std::to_string(pos_));
    const size_t end = s_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) throw std::runtime_error("unterminated string");
    std::string value(s_.substr(pos_ + 1, end - pos_ - 1));
    if (value.find('\\') != std::string::npos) throw std::runtime_error("escapes in strings are not supported");
    pos_ = end + 1;
    return value;
  }

  bool parse_bool() {
    peek();
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    throw std::runtime_error("'fortran_order' must be True or False");
  }

  // "()" , "(3,)", "(2, 3)" or "(2, 3,)". "(3)" is the int 3 in Python, not a tuple: refused.
  std::vector<int64_t> parse_shape() {
    std::vector<int64_t> shape;
    bool trailing_comma = false;
    expect('(');
    while (peek() != ')') {
      shape.push_back(parse_dim());
      trailing_comma = false;
      if (peek() != ',') break;
      ++pos_;
      trailing_comma = true;
    }
    expect(')');
    if (shape.size() == 1 && !trailing_comma) throw std::runtime_error("'shape' must be a tuple, like (3,)");
    return shape;
  }

  int64_t parse_dim() {
    if (peek() < '0' || peek() > '9') throw std::runtime_error("expected a non-negative integer in 'shape'");
    int64_t value = 0;
    for (; pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; ++pos_) {
      if (value > (std::numeric_limits<int64_t>::max() - 9) / 10) throw std::runtime_error("a dimension is too large");
      value = value * 10 + (s_[pos_] - '0');
    }
    if (pos_ < s_.size() && s_[pos_] == 'L') ++pos_;  // files written under Python 2 say "3L"
    return value;
  }

  std::string_view s_;
  size_t pos_ = 0;
};

// The header text as it may appear in a message: printable ASCII only, and not too long.
std::string quoted_excerpt(std::string_view text) {
  std::string out = "\"";
  for (size_t i = 0; i < text.size() && i < 100; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    out += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  return out + (text.size() > 100 ? "...\"" : "\"");
}

sdpa::DType dtype_from_descr(const fs::path& path, const std::string& descr) {
  for (const sdpa::internal::DTypeTraits& t : sdpa::internal::kDTypeTable)
    if (descr == t.npy_descr) return t.dtype;
  if (!descr.empty() && descr[0] == '>') {
    fail(path,
         "big-endian data ('" + descr + "') is not supported; convert with arr.astype(arr.dtype.newbyteorder('<'))");
  }
  if (descr == "|V2") {
    // What np.load makes of a bfloat16 file (the type is lost, the bytes kept), saved again.
    fail(path,
         "unsupported dtype '|V2' (2 raw bytes, no number type); if they are bfloat16, save "
         "arr.view(ml_dtypes.bfloat16), which NumPy writes as '<V2'");
  }
  fail(path,
       "unsupported dtype '" + descr +
           "' (supported: '<f4' float32, '<f8' float64, '<f2' float16, '<V2' bfloat16 as ml_dtypes saves it, "
           "'|b1' bool)");
}

// Reads exactly n bytes or fails: the size checks before the reads make a failure here rare
// (the file changed under us, or an I/O error).
void read_exactly(std::ifstream& in, const fs::path& path, void* dst, size_t n) {
  if (n > 0 && !in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n))) fail(path, "read error");
}

// RAM plus swap in bytes, or 0 when unknown.
uint64_t memory_bytes() {
#if defined(__linux__)
  struct sysinfo info {};
  if (sysinfo(&info) == 0) {
    return (static_cast<uint64_t>(info.totalram) + static_cast<uint64_t>(info.totalswap)) * info.mem_unit;
  }
#endif
  return 0;
}

// Sizes `data` to `bytes` zero bytes, or throws std::runtime_error("<what>: <bytes> bytes, ...")
// saying why not. More than RAM and swap together cannot be allocated (Linux refuses it, or,
// overcommitting, lets the zero fill run into the OOM killer): said before trying. (Sanitizers
// abort on such requests instead of throwing std::bad_alloc, so this is also what keeps the
// error one line under them.)
void allocate(std::vector<std::byte>& data, int64_t bytes, const std::string& what) {
  const uint64_t memory = memory_bytes();
  if (memory > 0 && static_cast<uint64_t>(bytes) > memory) {
    throw std::runtime_error(what + ": " + std::to_string(bytes) + " bytes, more than this machine's memory (" +
                             std::to_string(memory) + " bytes)");
  }
  try {
    data.assign(static_cast<size_t>(bytes), std::byte{0});
  } catch (const std::bad_alloc&) {
    throw std::runtime_error(what + ": " + std::to_string(bytes) + " bytes cannot be allocated");
  } catch (const std::length_error&) {
    throw std::runtime_error(what + ": " + std::to_string(bytes) + " bytes cannot be allocated");
  }
}

}  // namespace

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

int64_t checked_numel(const std::string& name, const std::vector<int64_t>& shape) {
  int64_t nonzero = 1;  // the product of the nonzero dims
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) throw std::runtime_error(name + " has a negative dim: " + shape_string(shape));
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(nonzero, d, &nonzero)) {
      throw std::runtime_error(name + " has shape " + shape_string(shape) + ", more elements than int64_t counts");
    }
  }
  return empty ? 0 : nonzero;
}

int64_t checked_nbytes(const std::string& name, sdpa::DType dtype, const std::vector<int64_t>& shape) {
  int64_t bytes = 0;
  if (__builtin_mul_overflow(checked_numel(name, shape), sdpa::dtype_size(dtype), &bytes)) {
    throw std::runtime_error(name + " has shape " + shape_string(shape) + ", more bytes than int64_t counts");
  }
  return bytes;
}

NpyArray NpyArray::zeros(sdpa::DType dtype, std::vector<int64_t> shape, const std::string& name) {
  NpyArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  allocate(a.data, checked_nbytes(name, dtype, a.shape), name + " has shape " + a.shape_string());
  return a;
}

int64_t NpyArray::numel() const { return checked_numel("array", shape); }

std::string NpyArray::shape_string() const { return sdpa_cli::shape_string(shape); }

sdpa::TensorView NpyArray::view() {
  if (shape.size() > static_cast<size_t>(kMaxRank)) throw std::logic_error("NpyArray::view: rank > 4");
  sdpa::TensorView t;
  t.data = data.empty() ? nullptr : data.data();
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.shape[d] = shape[static_cast<size_t>(d)];
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

NpyArray read_npy(const fs::path& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) fail(path, "no such file");
  if (ec) fail(path, "cannot access: " + ec.message());
  if (!fs::is_regular_file(status)) fail(path, "not a regular file");
  const uintmax_t file_size = fs::file_size(path, ec);
  if (ec) fail(path, "cannot get its size: " + ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "cannot open: " + std::generic_category().message(errno));

  // Prelude: magic and version.
  unsigned char prelude[kPreludeSize];
  if (file_size < kPreludeSize) fail(path, "not a .npy file (only " + std::to_string(file_size) + " bytes)");
  read_exactly(in, path, prelude, kPreludeSize);
  if (std::memcmp(prelude, kMagic, sizeof(kMagic)) != 0) fail(path, "not a .npy file (bad magic bytes)");
  const int major = prelude[6], minor = prelude[7];
  size_t len_bytes = 0;
  if (major == 1 && minor == 0) len_bytes = 2;
  if (major == 2 && minor == 0) len_bytes = 4;
  if (len_bytes == 0) {
    fail(path, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                   " (1.0 and 2.0 are read)");
  }

  // Header length (little-endian) and text.
  if (file_size < kPreludeSize + len_bytes) fail(path, "truncated header length");
  unsigned char len_le[4] = {0, 0, 0, 0};
  read_exactly(in, path, len_le, len_bytes);
  const uint32_t header_size = len_le[0] | (len_le[1] << 8) | (len_le[2] << 16) | (uint32_t{len_le[3]} << 24);
  if (header_size > kMaxHeaderSize) fail(path, "implausible header length " + std::to_string(header_size));
  const uintmax_t data_offset = kPreludeSize + len_bytes + header_size;
  if (file_size < data_offset) {
    fail(path, "truncated header: it should be " + std::to_string(header_size) + " bytes but the file ends first");
  }
  std::string text(header_size, '\0');
  read_exactly(in, path, text.data(), header_size);
  if (text.find('\0') != std::string::npos) fail(path, "malformed header (NUL byte): " + quoted_excerpt(text));
  Header header;
  try {
    header = HeaderParser(text).parse();
  } catch (const std::runtime_error& e) {
    fail(path, std::string("malformed header (") + e.what() + "): " + quoted_excerpt(text));
  }

  // What the header describes.
  NpyArray a;
  a.dtype = dtype_from_descr(path, header.descr);
  if (header.fortran_order) fail(path, "Fortran-order arrays are not supported; save np.ascontiguousarray(arr)");
  if (header.shape.size() > static_cast<size_t>(kMaxRank)) {
    fail(path, "rank " + std::to_string(header.shape.size()) + " is not supported (at most 4)");
  }
  a.shape = header.shape;

  // The data must be exactly numel * itemsize bytes. Both must fit int64_t (so every offset and
  // stride of the array does too), even when a zero dim makes the array empty.
  uintmax_t expected = 0;
  try {
    expected = static_cast<uintmax_t>(checked_nbytes("shape", a.dtype, a.shape));
  } catch (const std::runtime_error&) {
    fail(path, "shape " + a.shape_string() + " of " + header.descr + " is too large: its size does not fit int64_t");
  }
  const uintmax_t available = file_size - data_offset;
  if (available < expected) {
    fail(path, "truncated data: shape " + a.shape_string() + " of " + header.descr + " needs " +
                   std::to_string(expected) + " bytes but only " + std::to_string(available) + " follow the header");
  }
  if (available > expected) {
    fail(path, std::to_string(available - expected) + " unexpected bytes after the data of shape " + a.shape_string());
  }
  // Only now, with the file known to hold all of it, is the memory for the data allocated.
  allocate(a.data, static_cast<int64_t>(expected),
           path.string() + ": shape " + a.shape_string() + " of " + header.descr);
  read_exactly(in, path, a.data.data(), a.data.size());
  return a;
}

float float16_to_float(uint16_t bits) { return sdpa::internal::f16_to_f32(bits); }
float bfloat16_to_float(uint16_t bits) { return sdpa::internal::bf16_to_f32(bits); }

std::string npy_header_dict(sdpa::DType dtype, const std::vector<int64_t>& shape) {
  // Key order and spacing as NumPy writes them, so our files look like NumPy's.
  std::string dict = std::string("{'descr': '") + descr_of(dtype) + "', 'fortran_order': False, 'shape': (";
  for (size_t d = 0; d < shape.size(); ++d) dict += (d ? ", " : "") + std::to_string(shape[d]);
  return dict + (shape.size() == 1 ? ",), }" : "), }");
}

namespace {

// Writes `array` to `file`, created or truncated; errors name `shown`, the destination the
// caller asked for (`file` may be its temporary). Nothing is removed on failure: a temporary
// is the caller's to remove, and a destination written in place is never removed.
void write_to(const fs::path& file, const fs::path& shown, const NpyArray& array) {
  if (array.data.size() != static_cast<size_t>(array.numel()) * static_cast<size_t>(sdpa::dtype_size(array.dtype))) {
    throw std::logic_error("write_npy: data size does not match shape " + array.shape_string());
  }
  // Pad with spaces so that the data starts at a multiple of 64 bytes, as NumPy does.
  std::string header = npy_header_dict(array.dtype, array.shape);
  const size_t unpadded = kPreludeSize + 2 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  if (header.size() > 0xffff) fail(shown, "header too long for format version 1.0");
  const unsigned char len_le[2] = {static_cast<unsigned char>(header.size() & 0xff),
                                   static_cast<unsigned char>(header.size() >> 8)};

  errno = 0;
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  if (!out) fail(shown, "cannot open for writing: " + std::generic_category().message(errno));
  out.write(kMagic, sizeof(kMagic));
  out.put('\x01').put('\x00');
  out.write(reinterpret_cast<const char*>(len_le), 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(array.data.data()), static_cast<std::streamsize>(array.data.size()));
  out.close();
  if (!out) fail(shown, errno != 0 ? "write error: " + std::generic_category().message(errno) : "write error");
}

// Where one output goes, and how.
struct Destination {
  fs::path path;          // as the caller named it: what messages say
  bool in_place = false;  // written directly, never renamed over (see destination())
  fs::path target;        // otherwise: the file the rename replaces (absolute, symlinks resolved)
  fs::path temporary;     // once created; empty again once renamed or removed
};

// /dev/stdout names a regular file when the shell redirects to one: renaming over that file
// would not write to the descriptor, so whatever is under /dev or /proc is written in place.
bool under_dev_or_proc(const fs::path& path) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(path, ec).lexically_normal();
  if (ec) return false;
  auto part = absolute.begin();  // the root "/", then the first folder
  if (part == absolute.end() || ++part == absolute.end()) return false;
  return *part == "dev" || *part == "proc";
}

// Decides how `path` is written: in place for a device, a pipe or anything under /dev or /proc,
// else through a temporary. Refuses what can never be written: a directory, a read-only file
// (replacing it by a rename would get round its protection, which writing in place respects).
Destination destination(const fs::path& path) {
  if (path.empty()) throw std::runtime_error("an output file name is empty");
  Destination d;
  d.path = path;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);  // follows symlinks
  if (fs::is_directory(status)) fail(path, "cannot open for writing: " + std::generic_category().message(EISDIR));
  d.in_place = under_dev_or_proc(path) || (fs::exists(status) && !fs::is_regular_file(status));
  if (d.in_place) return d;
  if (fs::exists(status) && ::access(path.c_str(), W_OK) != 0) {
    fail(path, "cannot open for writing: " + std::generic_category().message(errno));
  }
  const fs::path absolute = fs::absolute(path, ec);
  if (ec) fail(path, "cannot open for writing: " + ec.message());
  d.target = fs::weakly_canonical(absolute, ec);
  if (ec) d.target = absolute.lexically_normal();
  if (d.target.filename().empty()) fail(path, "cannot open for writing: not a file name");
  // A writable file in a folder where no file can be created has no room for a temporary:
  // written in place, as before there were temporaries (not atomic, but not refused).
  d.in_place = fs::exists(status) && ::access(d.target.parent_path().c_str(), W_OK | X_OK) != 0;
  return d;
}

// Creates an empty temporary for `d` in its target's folder (so the rename stays on one file
// system and is atomic) under a hidden name no other file has (O_EXCL), with the mode the
// target has, or else the one a new file gets (0666 less the umask).
fs::path create_temporary(const Destination& d) {
  static std::atomic<unsigned> counter = 0;  // with the pid, unique among live processes
  std::string name = d.target.filename().string();
  if (name.size() > 200) name.resize(200);  // the suffix must fit NAME_MAX (255) too
  for (int attempt = 0;; ++attempt) {
    const fs::path temporary = d.target.parent_path() / ("." + name + ".tmp." + std::to_string(::getpid()) + "." +
                                                         std::to_string(counter++));
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0 && errno == EEXIST && attempt < 100) continue;  // left by a dead process with our pid
    if (fd < 0) fail(d.path, "cannot open for writing: " + std::generic_category().message(errno));
    std::error_code ec;
    const fs::file_status existing = fs::status(d.target, ec);
    if (fs::is_regular_file(existing)) {
      ::fchmod(fd, static_cast<mode_t>(existing.permissions() & fs::perms::all));  // on failure: 0666 - umask
    }
    ::close(fd);
    return temporary;
  }
}

}  // namespace

void write_npy_files(const std::vector<std::pair<fs::path, const NpyArray*>>& files) {
  std::vector<Destination> ds;
  for (const auto& file : files) ds.push_back(destination(file.first));
  // Whatever happens below, no temporary outlives this call.
  struct Cleanup {
    std::vector<Destination>& ds;
    ~Cleanup() {
      std::error_code ignored;
      for (const Destination& d : ds) {
        if (!d.temporary.empty()) fs::remove(d.temporary, ignored);
      }
    }
  } cleanup{ds};

  // Everything that can fail for lack of space or rights fails here, before any destination
  // is touched: the temporaries first, then what is written in place (which cannot be undone).
  for (size_t i = 0; i < ds.size(); ++i) {
    if (ds[i].in_place) continue;
    ds[i].temporary = create_temporary(ds[i]);
    write_to(ds[i].temporary, ds[i].path, *files[i].second);
  }
  std::string written;  // for the message of a rename that fails after others were done
  for (size_t i = 0; i < ds.size(); ++i) {
    if (!ds[i].in_place) continue;
    write_to(ds[i].path, ds[i].path, *files[i].second);
    written += (written.empty() ? "" : ", ") + ds[i].path.string();
  }
  for (Destination& d : ds) {
    if (d.in_place) continue;
    std::error_code ec;
    fs::rename(d.temporary, d.target, ec);
    if (ec) {
      fail(d.path, "cannot move the written file into place: " + ec.message() +
                       (written.empty() ? "" : " (already written: " + written + ")"));
    }
    d.temporary.clear();
    written += (written.empty() ? "" : ", ") + d.path.string();
  }
}

void write_npy(const fs::path& path, const NpyArray& array) { write_npy_files({{path, &array}}); }

void check_npy_destinations(const std::vector<fs::path>& paths) {
  for (const fs::path& path : paths) {
    const Destination d = destination(path);
    if (d.in_place) continue;
    std::error_code ignored;
    fs::remove(create_temporary(d), ignored);
  }
}

}  // namespace sdpa_cli
