// A small reader and writer for NumPy's .npy files, enough for the sdpa command-line tool.
//
// The format (numpy.lib.format): the magic "\x93NUMPY", a major and a minor version byte, the
// header length (2 bytes little-endian in version 1.0, 4 bytes in 2.0), then an ASCII header
// that is a Python dict literal such as
//     {'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and ended by '\n', then the raw elements.
//
// Supported: versions 1.0 and 2.0 read, 1.0 written; dtypes '<f4' (float32), '<f8' (float64),
// '<f2' (float16), '<V2' (bfloat16) and '|b1' (bool); C order only; rank 0..4. Anything else is
// refused with a std::runtime_error whose message starts with the file name and says what is
// wrong.
//
// bfloat16: NumPy has no such type. numpy.save of an ml_dtypes.bfloat16 array writes its
// dtype.str, '<V2' (a 2-byte void with a byte order, which no NumPy type has: NumPy's own 2-byte
// void is '|V2'), and bfloat16 is ml_dtypes' only 2-byte type, so '<V2' is read as bfloat16 and
// bfloat16 is written as '<V2', byte for byte what numpy.save writes. np.load gives such a file
// back as '|V2' bytes: arr.view(ml_dtypes.bfloat16) makes them bfloat16 again. '|V2' itself (those
// bytes saved again without the view) says nothing about the type and is refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "sdpa/attention.h"

namespace sdpa_cli {

// An owning, C-order array. `data` holds numel() * dtype_size(dtype) bytes.
struct NpyArray {
  sdpa::DType dtype = sdpa::DType::kFloat64;
  std::vector<int64_t> shape;  // empty for a 0-d (scalar) array
  // Bytes from operator new, so aligned for double (16 bytes on the platforms we build for).
  std::vector<std::byte> data;

  // A zero-filled array of the given dtype and shape. `name` is what an error calls it: a
  // shape too large to count (checked_nbytes), or to allocate, is a std::runtime_error such as
  // "weights has shape (65536, 65536, 65536): 1125899906842624 bytes, more than this machine's
  // memory (...)"; never std::bad_alloc.
  static NpyArray zeros(sdpa::DType dtype, std::vector<int64_t> shape, const std::string& name = "array");

  int64_t numel() const;  // checked_numel("array", shape)
  std::string shape_string() const;  // "(2, 3)", "(4,)", "()" like NumPy

  // The array seen as T (float, double, uint16_t for the bits of float16 and bfloat16, uint8_t
  // for bool); T must match dtype's size.
  template <class T>
  T* values() {
    return reinterpret_cast<T*>(data.data());
  }
  template <class T>
  const T* values() const {
    return reinterpret_cast<const T*>(data.data());
  }

  // A C-order view for the sdpa API; rank must be at most 4 (which read_npy guarantees).
  sdpa::TensorView view();
};

// The number of elements of an array of this shape, checked: throws std::runtime_error
// ("<name> has shape (...), more elements than int64_t counts") when a dim is negative or the
// product of the nonzero dims overflows int64_t (NumPy's rule: so every C-order stride fits).
int64_t checked_numel(const std::string& name, const std::vector<int64_t>& shape);
// checked_numel times the dtype's size, checked the same way ("..., more bytes than int64_t
// counts"): the bytes NpyArray::zeros(dtype, shape, name) allocates.
int64_t checked_nbytes(const std::string& name, sdpa::DType dtype, const std::vector<int64_t>& shape);

// "(2, 3)", "(4,)", "()": a shape or an index as NumPy prints a tuple.
std::string shape_string(const std::vector<int64_t>& shape);

// Reads a .npy file. Throws std::runtime_error("<path>: <what is wrong>") on any problem, a
// file larger than memory included: the header's shape is checked against the file's size and
// this machine's memory before anything is allocated (never std::bad_alloc).
NpyArray read_npy(const std::filesystem::path& path);

// Writes .npy files (version 1.0) all or nothing. Each array goes to a new temporary file in
// its destination's folder; only when every one is complete are they renamed over their
// destinations, so a failure leaves every existing file as it was and no temporary behind.
// A symlinked destination is written through (its target is replaced, keeping its mode). A
// destination that cannot be replaced by a rename (a device or pipe, anything under /dev or
// /proc such as /dev/stdout, a writable file in a folder where no file can be created) is
// written in place, after the temporaries and before the renames, and is never removed.
// Throws std::runtime_error("<path>: <what is wrong>") naming the destination.
void write_npy_files(const std::vector<std::pair<std::filesystem::path, const NpyArray*>>& files);
// write_npy_files for one file.
void write_npy(const std::filesystem::path& path, const NpyArray& array);
// Fails now, as write_npy_files would later, for a destination that cannot be written: a
// directory, or a folder that does not exist or is not writable. Finds out by creating and
// removing a temporary; destinations written in place are not opened.
void check_npy_destinations(const std::vector<std::filesystem::path>& paths);

// The value of float16 / bfloat16 bits, exactly (every one is a float32; NaN payloads kept).
float float16_to_float(uint16_t bits);
float bfloat16_to_float(uint16_t bits);

// The header dict text for an array (without padding): exposed for tests.
std::string npy_header_dict(sdpa::DType dtype, const std::vector<int64_t>& shape);

}  // namespace sdpa_cli
