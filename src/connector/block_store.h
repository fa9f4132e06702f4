// Where entries live: the one interface the storage and Redis connectors differ in. A store
// object is used by one thread at a time; the connector makes one per thread that touches the
// store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

namespace pagedattn::connector {

/// One stored entry, opened for reading.
class EntryReader {
 public:
  virtual ~EntryReader() = default;
  /// The entry's size in bytes.
  virtual uint64_t size() const = 0;
  /// Reads bytes [offset, offset + n) into `dst`; false on an I/O error or a short read.
  virtual bool read(uint64_t offset, void* dst, size_t n) = 0;
};

/// The result of opening an entry.
enum class OpenStatus {
  kOk,
  kMissing,      ///< no entry under that key
  kUnavailable,  ///< the store could not be reached or read
};

class BlockStore {
 public:
  virtual ~BlockStore() = default;
  /// How many of `hashes`, from the first, the store holds (stops at the first absent one);
  /// nullopt when the store cannot be reached.
  virtual std::optional<size_t> count_present(std::span<const uint64_t> hashes) = 0;
  /// Opens the entry of `hash`; on kOk `reader` holds it.
  virtual OpenStatus open(uint64_t hash, std::unique_ptr<EntryReader>& reader) = 0;
  /// Stores `bytes` under `hash`, all or nothing (a reader sees the old entry, none, or this
  /// one whole). False on failure, with the reason in `error`.
  virtual bool put(uint64_t hash, std::span<const uint8_t> bytes, std::string& error) = 0;
};

/// Makes the store object of one thread.
using StoreFactory = std::function<std::unique_ptr<BlockStore>()>;

}  // namespace pagedattn::connector
