// HF config.json parsing (kv/hf_config): any bytes either parse into a config whose layout has
// positive sizes, or are refused with a status. Never a crash, a hang or a sanitizer report.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kv/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<kvrelay::kv::ModelConfig> config = kvrelay::kv::ParseHfConfig(json);
  if (config.ok()) {
    // Everything derived from an accepted config is computable.
    const kvrelay::kv::ModelLayout& layout = config->layout;
    if (layout.num_layers() <= 0 || layout.block_tokens() <= 0) __builtin_trap();
    (void)layout.BytesPerToken();
    for (int g = 0; g < static_cast<int>(layout.groups().size()); ++g) {
      (void)layout.BlockBytes(g);
      (void)layout.BlocksNeeded(g, 32768);
    }
    (void)layout.fingerprint().ToHex();
  }
  return 0;
}
