// Issue 13: what would memory keys per reservation cost, next to today's key per connection?
//
// Today a decode worker registers its KV pool once (ucp_mem_map) and every connected peer gets
// that one remote key. Per reservation, it would register the reserved slots' pages (one
// ucp_mem_map of the existing memory per contiguous run of slots), pack the key, the peer would
// unpack it, and both would drop it at release. This measures that cycle with real UCX on this
// machine's transports (UCX_TLS from the environment), per reservation, against
//   - the per-connection cycle (map + pack + unpack of the whole pool, once per peer), and
//   - a memcpy of the reservation's bytes (moving the data itself at memory speed),
// and whether the peer can still write the reserved slots directly (ucp_rkey_ptr: the
// shared-memory fast path) through a per-reservation key.
//
//   reservation_rkey_bench [--pool-bytes B] [--slot-bytes S] [--slots N] [--runs R]
//                          [--reservations K] [--allocate]
// --runs: contiguous runs the N slots fall into (1 = one run; N = every slot apart).
// --allocate: the pool is ucp_mem_map(ALLOCATE)d (shared memory, as decode workers do), else
// heap memory registered with ucp_mem_map.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transfer/ucx/ucx_handles.h"

namespace {

using ::kvrelay::transfer::ucx::CreateContext;
using ::kvrelay::transfer::ucx::CreateWorker;
using ::kvrelay::transfer::ucx::UcpEndpoint;
using ::kvrelay::transfer::ucx::UcpMemRegion;
using ::kvrelay::transfer::ucx::UcpRkeyPtr;
using ::kvrelay::transfer::ucx::UnpackRemoteKey;
using ::kvrelay::transfer::ucx::WorkerAddress;
using Clock = std::chrono::steady_clock;

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "reservation_rkey_bench: %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Die(absl::StrCat(what, ": ", v.status().ToString()));
  return *std::move(v);
}

int64_t Flag(int argc, char** argv, const std::string& name, int64_t fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (name == argv[i]) {
      int64_t v = 0;
      if (!absl::SimpleAtoi(argv[i + 1], &v) || v <= 0) {
        Die(absl::StrCat(name, ": want a positive integer, got '", argv[i + 1], "'"));
      }
      return v;
    }
  }
  return fallback;
}

bool HasFlag(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i) {
    if (name == argv[i]) return true;
  }
  return false;
}

// One register -> pack -> unpack (on the peer's endpoint) -> release cycle of [data, +bytes);
// adds the time of each part and whether the peer could map the memory directly.
struct CycleTimes {
  double map_us = 0, pack_us = 0, unpack_us = 0, release_us = 0;
  size_t packed_bytes = 0;
  bool direct = false;  // ucp_rkey_ptr succeeded: the peer writes with a plain store
  double total() const { return map_us + pack_us + unpack_us + release_us; }
};

void Cycle(ucp_context_h context, ucp_ep_h peer_ep, void* data, size_t bytes, CycleTimes* t) {
  const Clock::time_point t0 = Clock::now();
  UcpMemRegion region = Check(UcpMemRegion::Map(context, data, bytes), "ucp_mem_map");
  const Clock::time_point t1 = Clock::now();
  const std::string packed = Check(region.PackRemoteKey(), "ucp_rkey_pack");
  const Clock::time_point t2 = Clock::now();
  UcpRkeyPtr rkey = Check(UnpackRemoteKey(peer_ep, packed), "ucp_ep_rkey_unpack");
  const Clock::time_point t3 = Clock::now();
  void* mapped = nullptr;
  t->direct = ucp_rkey_ptr(rkey.get(), reinterpret_cast<uint64_t>(data), &mapped) == UCS_OK;
  const Clock::time_point t4 = Clock::now();
  rkey.reset();
  region = UcpMemRegion();
  const Clock::time_point t5 = Clock::now();
  t->map_us += Us(t1 - t0);
  t->pack_us += Us(t2 - t1);
  t->unpack_us += Us(t3 - t2);
  t->release_us += Us(t5 - t4);
  t->packed_bytes = packed.size();
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t pool_bytes = Flag(argc, argv, "--pool-bytes", int64_t{256} << 20);
  const int64_t slot_bytes = Flag(argc, argv, "--slot-bytes", int64_t{64} << 10);
  const int64_t slots = Flag(argc, argv, "--slots", 32);
  const int64_t runs = std::min(Flag(argc, argv, "--runs", 1), slots);
  const int64_t reservations = Flag(argc, argv, "--reservations", 500);
  const bool allocate = HasFlag(argc, argv, "--allocate");
  const int64_t pool_slots = pool_bytes / slot_bytes;
  // Runs are spread over the pool with one free slot between them (fragmentation).
  if (slots + runs > pool_slots) Die("--slots and --runs do not fit in --pool-bytes");
  const long page = sysconf(_SC_PAGESIZE);
  if (slot_bytes % page != 0) Die(absl::StrCat("--slot-bytes must be a multiple of ", page));

  auto context = Check(CreateContext(0), "ucp_init");
  auto decode_worker = Check(CreateWorker(context.get()), "decode worker");
  auto prefill_worker = Check(CreateWorker(context.get()), "prefill worker");
  const std::string decode_address = Check(WorkerAddress(decode_worker.get()), "worker address");
  UcpEndpoint peer_ep =
      Check(UcpEndpoint::Create(prefill_worker.get(), decode_address, nullptr), "ucp_ep_create");

  // The pool: UCX-allocated shared memory (what decode workers use) or registered heap.
  void* pool = nullptr;
  UcpMemRegion pool_region;
  std::vector<char> heap;
  if (allocate) {
    pool_region = Check(UcpMemRegion::Allocate(context.get(), pool_bytes, &pool), "allocate");
  } else {
    heap.assign(static_cast<size_t>(pool_bytes), 0);
    pool = heap.data();
  }
  std::memset(pool, 1, static_cast<size_t>(pool_bytes));  // every page present

  // Per connection: the whole pool's key, once per peer (repeated for a stable figure). A
  // UCX-allocated pool already has its memory handle (the shared-memory segment's): only pack
  // and unpack are per peer.
  CycleTimes per_connection;
  constexpr int kConnectionCycles = 20;
  for (int i = 0; i < kConnectionCycles; ++i) {
    if (!allocate) {
      Cycle(context.get(), peer_ep.get(), pool, static_cast<size_t>(pool_bytes), &per_connection);
      continue;
    }
    const Clock::time_point t0 = Clock::now();
    const std::string packed = Check(pool_region.PackRemoteKey(), "ucp_rkey_pack");
    const Clock::time_point t1 = Clock::now();
    UcpRkeyPtr rkey = Check(UnpackRemoteKey(peer_ep.get(), packed), "ucp_ep_rkey_unpack");
    const Clock::time_point t2 = Clock::now();
    void* mapped = nullptr;
    per_connection.direct =
        ucp_rkey_ptr(rkey.get(), reinterpret_cast<uint64_t>(pool), &mapped) == UCS_OK;
    const Clock::time_point t3 = Clock::now();
    rkey.reset();
    per_connection.pack_us += Us(t1 - t0);
    per_connection.unpack_us += Us(t2 - t1);
    per_connection.release_us += Us(Clock::now() - t3);
    per_connection.packed_bytes = packed.size();
  }
  const double connection_us = per_connection.total() / kConnectionCycles;

  // Per reservation: one key per contiguous run of its slots, at changing places in the pool.
  std::vector<double> reservation_us;
  CycleTimes per_run;
  std::vector<char> scratch(static_cast<size_t>(slots * slot_bytes), 2);
  double memcpy_us = 0;
  const int64_t span_slots = slots + runs;  // the reservation's slots and the gaps
  for (int64_t r = 0; r < reservations; ++r) {
    const int64_t first_slot = (r * span_slots) % (pool_slots - span_slots);
    const Clock::time_point start = Clock::now();
    int64_t slot = first_slot;
    for (int64_t run = 0; run < runs; ++run) {
      const int64_t run_slots = slots / runs + (run < slots % runs ? 1 : 0);
      Cycle(context.get(), peer_ep.get(), static_cast<char*>(pool) + slot * slot_bytes,
            static_cast<size_t>(run_slots * slot_bytes), &per_run);
      slot += run_slots + 1;
    }
    reservation_us.push_back(Us(Clock::now() - start));
    const Clock::time_point copy_start = Clock::now();
    std::memcpy(static_cast<char*>(pool) + first_slot * slot_bytes, scratch.data(), scratch.size());
    memcpy_us += Us(Clock::now() - copy_start);
  }
  std::sort(reservation_us.begin(), reservation_us.end());
  double sum = 0;
  for (double v : reservation_us) sum += v;
  const double mean_us = sum / static_cast<double>(reservation_us.size());
  const double p50 = reservation_us[reservation_us.size() / 2];
  const double p99 = reservation_us[reservation_us.size() * 99 / 100];
  const double copy_us = memcpy_us / static_cast<double>(reservations);
  const double cycles = static_cast<double>(reservations * runs);
  const char* tls = std::getenv("UCX_TLS");

  std::printf(
      "UCX %s, UCX_TLS=%s, pool %lld MiB (%s), %lld slots of %lld KiB per reservation "
      "in %lld run(s), %lld reservations\n",
      ucp_get_version_string(), tls != nullptr ? tls : "(all)",
      static_cast<long long>(pool_bytes >> 20),
      allocate ? "ucp_mem_map ALLOCATE" : "heap + ucp_mem_map", static_cast<long long>(slots),
      static_cast<long long>(slot_bytes >> 10), static_cast<long long>(runs),
      static_cast<long long>(reservations));
  std::printf(
      "per connection (whole pool, once per peer): %.1f us  (map %.1f, pack %.1f, "
      "unpack %.1f, release %.1f), packed key %zu B, peer maps it directly: %s\n",
      connection_us, per_connection.map_us / kConnectionCycles,
      per_connection.pack_us / kConnectionCycles, per_connection.unpack_us / kConnectionCycles,
      per_connection.release_us / kConnectionCycles, per_connection.packed_bytes,
      per_connection.direct ? "yes" : "no");
  std::printf(
      "per reservation: mean %.1f us, p50 %.1f us, p99 %.1f us  (per run: map %.1f, "
      "pack %.1f, unpack %.1f, release %.1f), packed key %zu B, peer maps it directly: "
      "%s\n",
      mean_us, p50, p99, per_run.map_us / cycles, per_run.pack_us / cycles,
      per_run.unpack_us / cycles, per_run.release_us / cycles, per_run.packed_bytes,
      per_run.direct ? "yes" : "no");
  std::printf("memcpy of the reservation's %lld KiB: %.1f us\n",
              static_cast<long long>((slots * slot_bytes) >> 10), copy_us);
  std::printf(
      "ratio per-reservation / per-connection cycle: %.2fx; per-reservation cycle / "
      "memcpy of its bytes: %.2fx\n",
      mean_us / connection_us, mean_us / copy_us);
  return 0;
}
