#pragma once

// Every size and range limit of kvrelay's wire contracts, once. Validators on every side
// (gateway, prefill, decode, cache store, CLI) read these; the .proto comments quote them.
// Header-only, no dependencies (target kvrelay::limits).

#include <cstddef>
#include <cstdint>

namespace kvrelay::limits {

// Requests.
inline constexpr int32_t kMaxPromptTokens = 32768;   // tokens per prompt (also <= model max)
inline constexpr int32_t kMaxGenerateTokens = 4096;  // max_tokens per request
inline constexpr size_t kMaxTenantBytes = 128;       // tenant id
inline constexpr size_t kMaxTenantSaltBytes = 64;    // derived salt on internal RPCs
inline constexpr size_t kMaxRequestIdBytes = 64;     // [A-Za-z0-9._:-]
inline constexpr size_t kMaxModelNameBytes = 256;
inline constexpr float kMaxTemperature = 100.0f;

// Identities and addresses.
inline constexpr size_t kMaxNodeIdBytes = 128;
inline constexpr size_t kMaxAddressBytes = 256;

// Cache store calls.
inline constexpr int kMaxChainBlocks = 4096;  // chain / blocks / hashes entries per call
inline constexpr int kMaxSegmentsPerNode = 64;
inline constexpr size_t kMaxMemoryKeyBytes = 4096;
inline constexpr int64_t kMaxTtlMs = 600000;  // node TTL and lease TTL
inline constexpr int kMaxStoreMessageBytes = 4 << 20;
// MatchPrefixStream: lookups in one stream message (`lookups`), and their chain blocks in all.
inline constexpr int kMaxLookupsPerStreamMessage = 64;
inline constexpr int kMaxBlocksPerStreamMessage = 16384;
// Initial metadata key a store that accepts `lookups` sends on MatchPrefixStream.
inline constexpr char kLookupBatchMetadataKey[] = "kvrelay-lookup-batch";

// Any gRPC message between kvrelay components.
inline constexpr int kMaxMessageBytes = 16 << 20;

}  // namespace kvrelay::limits
