// The stored form of one full block (an "entry"): a safetensors file holding the block's K/V in
// every layer the connector moves, one tensor per layer named after it,
// [2, block_size, num_kv_heads, head_size] (K then V, NHD, the cache's element type), and a
// `__metadata__` that names the format, its version, the model namespace, the block (chain
// hash, parent hash, token ids), the shape and dtype fields, the fp8 scales and one CRC-32C per
// layer. docs/connector.md documents every field. The reader checks the header against what
// this engine would write before it reads any data, and each layer's checksum before that
// layer reaches a cache.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/connector.h"
#include "pagedattn/tensor.h"

namespace pagedattn::connector {

inline constexpr std::string_view kEntryFormat = "pagedattn.kv_block";
inline constexpr int kEntryFormatVersion = 1;
/// Largest header the reader accepts (a block of 4096 tokens with 200 layers stays far below).
inline constexpr uint64_t kMaxEntryHeaderBytes = 16u << 20;

/// Which block an entry holds.
struct EntryIdentity {
  uint64_t hash = 0;         ///< chain hash of the block (the store key)
  uint64_t parent_hash = 0;  ///< chain hash of the block before it (kNoParentHash for block 0)
  std::span<const int32_t> token_ids;  ///< the block's block_size token ids
};

/// "%016x" of a hash, the form keys and headers use.
std::string hex64(uint64_t value);

/// Bytes of one layer's tensor in an entry.
size_t entry_layer_bytes(const KVConnectorConfig& config);

/// The bytes of an entry (a safetensors file). `layers[i]` is layer i's host tensor
/// [2, block_size, num_kv_heads, head_size]; `crcs[i]` its CRC-32C; `scales[i]` its k/v
/// scales (written for fp8 caches only).
std::vector<uint8_t> serialize_entry(const KVConnectorConfig& config, const std::string& ns,
                                     const EntryIdentity& id, std::span<const Tensor> layers,
                                     std::span<const uint32_t> crcs,
                                     std::span<const KVScales> scales);

/// Where each layer's data sits in a checked entry.
struct EntryLayout {
  uint64_t data_begin = 0;             ///< where the tensor data starts (8 + header length)
  std::vector<uint64_t> layer_offset;  ///< [layer] byte offset in the entry
  std::vector<uint32_t> layer_crc;     ///< [layer] CRC-32C the writer computed
};

/// Outcome of a header check: ok, or the reason the entry is rejected.
struct EntryCheck {
  bool ok = false;
  std::string reason;  ///< names the field, the value found and the value expected
  EntryLayout layout;
};

/// Reads the 8-byte little-endian header length at the start of an entry.
uint64_t entry_header_length(const uint8_t prefix[8]);

/// Checks an entry's header (`header` = the JSON text after the 8-byte length) for an entry of
/// `entry_size` bytes against what this engine would write for `id`: format and version,
/// namespace, block identity, shape, dtype and layout fields, fp8 scales (`scales`, one per
/// layer; checked for fp8 caches), one tensor per layer with the exact dtype and shape, byte
/// ranges tiling the data exactly to the end of the entry (a truncated or extended entry
/// fails), and well-formed checksums.
EntryCheck check_entry_header(std::string_view header, uint64_t entry_size,
                              const KVConnectorConfig& config, const std::string& ns,
                              const EntryIdentity& id, std::span<const KVScales> scales);

}  // namespace pagedattn::connector
