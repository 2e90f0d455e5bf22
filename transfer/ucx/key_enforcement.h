#pragma once

// Whether this machine's UCX can use a memory domain whose remote keys the hardware enforces:
// an RDMA NIC checks every remote access against the key's registered range and refuses a key
// whose registration was unmapped. Over tcp (software-emulated RMA) and shared memory (posix /
// sysv segments mapped whole, cma's process_vm_writev) nothing bounds a write by its key.
// Decided from structured data only: UCT's component names and their memory-domain counts,
// and the UCX_TLS list (UCX's own configuration).

#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace kvrelay::transfer::ucx {

struct UctComponent {
  std::string name;      // "ib", "tcp", "posix", "sysv", "cma", "self", ...
  int md_resources = 0;  // memory domains (devices) of this component found here
};

// uct_query_components + uct_component_query (names and memory-domain counts); empty when
// UCT cannot be queried.
std::vector<UctComponent> QueryUctComponents();

// True when a component whose keys the NIC enforces ("ib": verbs / mlx5; "ugni": Cray) has a
// device here and `ucx_tls` (UCX_TLS; empty or "all": every transport) admits an RDMA
// transport of it (rc, dc, ud and their _v / _x / _mlx5 forms, or the "ib" alias). A "^..."
// list excludes: it admits RDMA unless it names "ib" or every one of rc, dc and ud.
bool HardwareEnforcedKeys(const std::vector<UctComponent>& components, absl::string_view ucx_tls);

}  // namespace kvrelay::transfer::ucx
