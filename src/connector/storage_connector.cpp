// The "storage" connector: each entry is one file,
//   <dir>/pagedattn-kv-v1/<namespace>/<first two hex digits>/<hash, 16 hex digits>.safetensors
// written atomically (a temporary file in the same directory, fsync, rename, fsync of the
// directory), so a reader sees a whole entry or none; a writer killed mid-write leaves only a
// "*.tmp.*" file that no reader opens. Several engines (processes, or machines sharing the
// directory over a file system with atomic rename) can share one directory.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "connector/block_store.h"
#include "connector/block_store_connector.h"
#include "connector/builtin_connectors.h"
#include "connector/kv_entry.h"
#include "pagedattn/error.h"

namespace pagedattn::connector {

using detail::cat;

namespace {

class FileReader final : public EntryReader {
 public:
  FileReader(int fd, uint64_t size) : fd_(fd), size_(size) {}
  ~FileReader() override { ::close(fd_); }
  uint64_t size() const override { return size_; }
  bool read(uint64_t offset, void* dst, size_t n) override {
    if (offset > size_ || n > size_ - offset) return false;
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t got = ::pread(fd_, p, n, off_t(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) return false;  // an error, or the file shrank under us
      p += got;
      offset += uint64_t(got);
      n -= size_t(got);
    }
    return true;
  }

 private:
  int fd_;
  uint64_t size_;
};

// Test hook (option fault=crash-during-write:N): the N-th entry this process writes stops
// half-way and the process kills itself, as a `kill -9` during a save would.
std::atomic<int64_t> g_puts{0};

class FileStore final : public BlockStore {
 public:
  FileStore(std::string dir, bool sync, int64_t crash_at_put)
      : dir_(std::move(dir)), sync_(sync), crash_at_put_(crash_at_put) {}

  std::optional<size_t> count_present(std::span<const uint64_t> hashes) override {
    size_t n = 0;
    for (const uint64_t h : hashes) {
      struct stat st {};
      if (::stat(path(h).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) break;
      ++n;
    }
    return n;
  }

  OpenStatus open(uint64_t hash, std::unique_ptr<EntryReader>& reader) override {
    const int fd = ::open(path(hash).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      return errno == ENOENT || errno == ENOTDIR ? OpenStatus::kMissing : OpenStatus::kUnavailable;
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return OpenStatus::kUnavailable;
    }
    reader = std::make_unique<FileReader>(fd, uint64_t(st.st_size));
    return OpenStatus::kOk;
  }

  bool put(uint64_t hash, std::span<const uint8_t> bytes, std::string& error) override {
    const std::string final_path = path(hash);
    const std::string folder = final_path.substr(0, final_path.rfind('/'));
    std::error_code ec;
    std::filesystem::create_directories(folder, ec);
    if (ec) {
      error = cat("cannot create ", folder, ": ", ec.message());
      return false;
    }
    static std::atomic<uint64_t> counter{0};
    const std::string tmp = cat(final_path, ".tmp.", ::getpid(), ".", counter++);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
      error = cat("cannot create ", tmp, ": ", std::strerror(errno));
      return false;
    }
    const bool crash = crash_at_put_ > 0 && ++g_puts == crash_at_put_;
    const size_t to_write = crash ? bytes.size() / 2 : bytes.size();
    bool ok = write_all(fd, bytes.data(), to_write);
    if (crash) {
      ::kill(::getpid(), SIGKILL);  // the test hook: die with the temporary file half written
      ::pause();
    }
    int saved_errno = errno;
    if (ok && sync_ && ::fsync(fd) != 0) {
      ok = false;
      saved_errno = errno;
    }
    if (::close(fd) != 0 && ok) {
      ok = false;
      saved_errno = errno;
    }
    if (ok && ::rename(tmp.c_str(), final_path.c_str()) != 0) {
      ok = false;
      saved_errno = errno;
    }
    if (!ok) {
      ::unlink(tmp.c_str());
      error = cat("cannot write ", bytes.size(), " bytes to ", final_path, ": ",
                  std::strerror(saved_errno));
      return false;
    }
    if (sync_) {
      // The rename itself must survive a crash: sync the directory entry.
      const int dfd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dfd >= 0) {
        ::fsync(dfd);
        ::close(dfd);
      }
    }
    return true;
  }

 private:
  static bool write_all(int fd, const uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t put = ::write(fd, p, n);
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0) return false;
      p += put;
      n -= size_t(put);
    }
    return true;
  }
  std::string path(uint64_t hash) const {
    const std::string h = hex64(hash);
    return cat(dir_, "/", h.substr(0, 2), "/", h, ".safetensors");
  }

  std::string dir_;
  bool sync_;
  int64_t crash_at_put_;
};

int64_t parse_crash_fault(const KVConnectorConfig& c) {
  const std::string fault = c.option("fault");
  if (fault.empty()) return 0;
  const std::string prefix = "crash-during-write:";
  char* end = nullptr;
  const long long n =
      fault.rfind(prefix, 0) == 0 ? std::strtoll(fault.c_str() + prefix.size(), &end, 10) : 0;
  detail::require(n >= 1 && end && *end == '\0', "storage connector: option fault='", fault,
                  "' is not crash-during-write:N with N >= 1");
  return n;
}

}  // namespace

std::unique_ptr<KVConnector> make_storage_connector(const KVConnectorConfig& config,
                                                    KVConnectorRole role) {
  check_known_options(config,
                      {"fsync", "io_threads", "max_inflight_mb", "max_load_staging_mb", "fault"});
  detail::require(!config.address.empty(), "storage connector: the directory is empty");
  const std::string dir = cat(config.address, "/pagedattn-kv-v1/", config.namespace_name());
  const bool sync = config.int_option("fsync", 1, 0, 1) == 1;
  const int64_t crash_at = parse_crash_fault(config);
  return std::make_unique<BlockStoreConnector>(config, role, "storage", [dir, sync, crash_at] {
    return std::make_unique<FileStore>(dir, sync, crash_at);
  });
}

}  // namespace pagedattn::connector
