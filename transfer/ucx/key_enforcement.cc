#include "transfer/ucx/key_enforcement.h"

#include <uct/api/uct.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvrelay::transfer::ucx {

std::vector<UctComponent> QueryUctComponents() {
  std::vector<UctComponent> out;
  uct_component_h* components = nullptr;
  unsigned count = 0;
  if (uct_query_components(&components, &count) != UCS_OK) return out;
  for (unsigned i = 0; i < count; ++i) {
    uct_component_attr_t attr = {};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[i], &attr) != UCS_OK) continue;
    out.push_back(
        UctComponent{.name = attr.name, .md_resources = static_cast<int>(attr.md_resource_count)});
  }
  uct_release_component_list(components);
  return out;
}

namespace {

// The UCX_TLS names of the enforcing components' RDMA transports, by family.
bool IsRdmaTransport(absl::string_view tl, absl::string_view family) {
  if (tl == family) return true;
  for (absl::string_view suffix : {"_v", "_x", "_mlx5", "_verbs"}) {
    if (absl::StartsWith(tl, family) && tl.substr(family.size()) == suffix) return true;
  }
  return false;
}

bool AdmitsRdma(absl::string_view ucx_tls) {
  if (ucx_tls.empty() || ucx_tls == "all") return true;
  const bool negated = absl::ConsumePrefix(&ucx_tls, "^");
  std::vector<absl::string_view> names = absl::StrSplit(ucx_tls, ',', absl::SkipEmpty());
  auto names_family = [&names](absl::string_view family) {
    return std::any_of(names.begin(), names.end(),
                       [family](absl::string_view tl) { return IsRdmaTransport(tl, family); });
  };
  auto names_exactly = [&names](absl::string_view tl) {
    return std::find(names.begin(), names.end(), tl) != names.end();
  };
  if (negated) {
    if (names_exactly("ib")) return false;
    return !(names_family("rc") && names_family("dc") && names_family("ud"));
  }
  return names_exactly("ib") || names_exactly("all") || names_family("rc") || names_family("dc") ||
         names_family("ud") || names_exactly("ugni_rdma");
}

}  // namespace

bool HardwareEnforcedKeys(const std::vector<UctComponent>& components, absl::string_view ucx_tls) {
  const bool device = std::any_of(components.begin(), components.end(), [](const auto& c) {
    return (c.name == "ib" || c.name == "ugni") && c.md_resources > 0;
  });
  return device && AdmitsRdma(ucx_tls);
}

}  // namespace kvrelay::transfer::ucx
