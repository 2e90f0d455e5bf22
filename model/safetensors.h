#pragma once

// safetensors files: a little-endian u64 header length, a JSON header
//   {"name": {"dtype": "BF16", "shape": [r, c], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {...}}
// and the raw tensor bytes. Reading memory-maps the file; tensors are views into the mapping.
//
// A model directory holds either model.safetensors or shards listed in
// model.safetensors.index.json ({"weight_map": {"tensor": "file", ...}}).
//
// Thread-safe after Open(): read-only views. Views stay valid while their file object lives.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvrelay::model {

enum class TensorDType { kBf16, kFp16, kFp32 };
std::string_view TensorDTypeName(TensorDType dtype);  // "BF16", "F16", "F32"
int32_t TensorDTypeBytes(TensorDType dtype);

// A read-only view of one stored tensor.
struct TensorView {
  std::string name;
  TensorDType dtype = TensorDType::kFp32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // not owned; valid while the owning file is open
  size_t size_bytes = 0;

  int64_t num_elements() const;
  // Upcasts to fp32. `out` must hold num_elements() floats.
  void ToFloat(float* out) const;
  std::vector<float> ToFloat() const;
};

// Largest header we accept (the format's own reference limit is 100 MB).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  // InvalidArgument (naming the path and what is wrong) for a short or truncated file, a header
  // that is not JSON, an unknown dtype, a tensor whose byte range does not match its shape or
  // lies outside the data; NotFound when the file does not exist.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // The same checks over bytes already in memory (`name` stands for the path in errors). The
  // tensors point into `bytes`, which must outlive the result.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(std::string_view bytes,
                                                                    const std::string& name);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors by name.
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* Find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  // Parses the header of the `bytes` at `base` and indexes the tensors (views into them).
  absl::Status Index(const uint8_t* base, uint64_t bytes);
  std::string path_;
  void* mapping_ = nullptr;  // owned: munmap in the destructor
  size_t mapping_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a model directory (single file or sharded).
class SafetensorsModel {
 public:
  // Opens <dir>/model.safetensors.index.json if present, else <dir>/model.safetensors.
  // A tensor named twice (in two shards) or an index entry whose shard lacks it ->
  // InvalidArgument.
  static absl::StatusOr<std::unique_ptr<SafetensorsModel>> Open(const std::string& dir);

  const TensorView* Find(std::string_view name) const;
  // All tensor names, sorted.
  std::vector<std::string> Names() const;
  size_t num_files() const { return files_.size(); }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*, std::less<>> index_;
};

// A tensor to write: fp32 values stored as `dtype`.
struct TensorToWrite {
  std::string name;
  TensorDType dtype = TensorDType::kBf16;
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major, size == product of shape
};

// Serialises tensors into safetensors bytes (header sorted by name, padded to 8 bytes).
absl::StatusOr<std::string> SerializeSafetensors(
    absl::Span<const TensorToWrite> tensors,
    const std::map<std::string, std::string>& metadata = {});
// Writes one file atomically.
absl::Status WriteSafetensors(const std::string& path, absl::Span<const TensorToWrite> tensors);
// Writes tensors as `num_shards` files model-0000i-of-0000n.safetensors plus
// model.safetensors.index.json, or as model.safetensors when num_shards == 1.
absl::Status WriteSafetensorsModel(const std::string& dir, absl::Span<const TensorToWrite> tensors,
                                   int num_shards);

}  // namespace kvrelay::model
