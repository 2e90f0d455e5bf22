// The safetensors header (model/safetensors): any bytes either index into tensors that lie
// inside the input, or are refused. Each accepted tensor of modest size is also read (upcast
// to fp32), so a view that points outside the bytes is an ASan report.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<std::unique_ptr<kvrelay::model::SafetensorsFile>> file =
      kvrelay::model::SafetensorsFile::FromBytes(bytes, "fuzz.safetensors");
  if (!file.ok()) return 0;
  for (const auto& [name, view] : (*file)->tensors()) {
    const int64_t n = view.num_elements();
    if (n < 0 || static_cast<uint64_t>(n) * kvrelay::model::TensorDTypeBytes(view.dtype) !=
                     view.size_bytes) {
      __builtin_trap();
    }
    if (view.size_bytes > 0 && (view.data < data || view.data + view.size_bytes > data + size)) {
      __builtin_trap();
    }
    if (n <= (1 << 16)) (void)view.ToFloat();
  }
  return 0;
}
