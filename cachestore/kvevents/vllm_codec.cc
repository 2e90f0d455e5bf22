#include "cachestore/kvevents/vllm_codec.h"

#include <msgpack.h>

#include <string_view>

namespace kvrelay::cachestore::kvevents {
namespace {

// msgpack_sbuffer with an owner: freed on every path.
class Buffer {
 public:
  Buffer() {
    msgpack_sbuffer_init(&sbuf_);
    msgpack_packer_init(&pk_, &sbuf_, msgpack_sbuffer_write);
  }
  ~Buffer() { msgpack_sbuffer_destroy(&sbuf_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  msgpack_packer* pk() { return &pk_; }
  std::string Take() const { return std::string(sbuf_.data, sbuf_.size); }

 private:
  msgpack_sbuffer sbuf_;
  msgpack_packer pk_;
};

void Str(msgpack_packer* pk, std::string_view s) {
  msgpack_pack_str(pk, s.size());
  msgpack_pack_str_body(pk, s.data(), s.size());
}

void OptStr(msgpack_packer* pk, const std::optional<std::string>& s) {
  if (s) {
    Str(pk, *s);
  } else {
    msgpack_pack_nil(pk);
  }
}

void Hashes(msgpack_packer* pk, const std::vector<uint64_t>& hashes) {
  msgpack_pack_array(pk, hashes.size());
  for (uint64_t h : hashes) msgpack_pack_uint64(pk, h);
}

void Pack(msgpack_packer* pk, const BlockStored& e) {
  const size_t optional_fields = (e.group_idx ? 1 : 0) + (e.kv_cache_spec_kind ? 1 : 0) +
                                 (e.kv_cache_spec_sliding_window ? 1 : 0);
  msgpack_pack_map(pk, 8 + optional_fields);
  Str(pk, "type");
  Str(pk, "BlockStored");
  Str(pk, "block_hashes");
  Hashes(pk, e.block_hashes);
  Str(pk, "parent_block_hash");
  if (e.parent_block_hash) {
    msgpack_pack_uint64(pk, *e.parent_block_hash);
  } else {
    msgpack_pack_nil(pk);
  }
  Str(pk, "token_ids");
  msgpack_pack_array(pk, e.token_ids.size());
  for (int32_t t : e.token_ids) msgpack_pack_int32(pk, t);
  Str(pk, "block_size");
  msgpack_pack_int32(pk, e.block_size);
  Str(pk, "lora_id");
  msgpack_pack_nil(pk);
  Str(pk, "medium");
  OptStr(pk, e.medium);
  Str(pk, "lora_name");
  msgpack_pack_nil(pk);
  if (e.group_idx) {
    Str(pk, "group_idx");
    msgpack_pack_int32(pk, *e.group_idx);
  }
  if (e.kv_cache_spec_kind) {
    Str(pk, "kv_cache_spec_kind");
    Str(pk, *e.kv_cache_spec_kind);
  }
  if (e.kv_cache_spec_sliding_window) {
    Str(pk, "kv_cache_spec_sliding_window");
    msgpack_pack_int32(pk, *e.kv_cache_spec_sliding_window);
  }
}

void Pack(msgpack_packer* pk, const BlockRemoved& e) {
  msgpack_pack_map(pk, 3 + (e.group_idx ? 1 : 0));
  Str(pk, "type");
  Str(pk, "BlockRemoved");
  Str(pk, "block_hashes");
  Hashes(pk, e.block_hashes);
  Str(pk, "medium");
  OptStr(pk, e.medium);
  if (e.group_idx) {
    Str(pk, "group_idx");
    msgpack_pack_int32(pk, *e.group_idx);
  }
}

void Pack(msgpack_packer* pk, const AllBlocksCleared&) {
  msgpack_pack_map(pk, 1);
  Str(pk, "type");
  Str(pk, "AllBlocksCleared");
}

}  // namespace

std::string EncodeKvEventBatch(const KvEventBatch& batch) {
  Buffer buf;
  msgpack_packer* pk = buf.pk();
  msgpack_pack_map(pk, 3);
  Str(pk, "ts");
  msgpack_pack_double(pk, batch.ts);
  Str(pk, "events");
  msgpack_pack_array(pk, batch.events.size());
  for (const KvEvent& e : batch.events) {
    std::visit([pk](const auto& event) { Pack(pk, event); }, e);
  }
  Str(pk, "data_parallel_rank");
  msgpack_pack_int32(pk, batch.data_parallel_rank);
  return buf.Take();
}

}  // namespace kvrelay::cachestore::kvevents
