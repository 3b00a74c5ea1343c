#include "storage/rocksdb_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cache/spill_buffers.h"
#include "gpu/base/status_macros.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/write_batch.h"
#include "storage/crc32c.h"

namespace kvs::storage {
namespace {

constexpr uint32_t kMetaFormat = 2;
constexpr char kMetaPrefix = 'M';
constexpr char kDataPrefix = 'D';
// "L" key -> generation u64 LE, then the reason: a copy found lost (a layer failing its checksum
// on a Get, or a metadata record RocksDB could not read back), kept so that it stays reported
// lost across restarts, with its layer file kept for inspection until the copy is released.
constexpr char kLostPrefix = 'L';

void AppendBE32(std::string* out, uint32_t v) {
  for (int i = 3; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void AppendBE64(std::string* out, uint64_t v) {
  for (int i = 7; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
template <typename T>
void AppendLE(std::string* out, T v) {
  char raw[sizeof(T)];
  std::memcpy(raw, &v, sizeof(T));
  out->append(raw, sizeof(T));
}
bool ReadBE(std::string_view* in, int bytes, uint64_t* v) {
  if (in->size() < static_cast<size_t>(bytes)) return false;
  *v = 0;
  for (int i = 0; i < bytes; ++i) *v = (*v << 8) | static_cast<uint8_t>((*in)[i]);
  in->remove_prefix(bytes);
  return true;
}
template <typename T>
bool ReadLE(std::string_view* in, T* v) {
  if (in->size() < sizeof(T)) return false;
  std::memcpy(v, in->data(), sizeof(T));
  in->remove_prefix(sizeof(T));
  return true;
}

std::string EncodeKey(const SpillKey& key) {
  std::string out;
  for (const std::string* part : {&key.tenant, &key.session_id, &key.sequence_id}) {
    AppendBE32(&out, static_cast<uint32_t>(part->size()));
    out += *part;
  }
  return out;
}

bool DecodeKey(std::string_view* in, SpillKey* key) {
  for (std::string* part : {&key->tenant, &key->session_id, &key->sequence_id}) {
    uint64_t n = 0;
    if (!ReadBE(in, 4, &n) || n > in->size()) return false;
    part->assign(in->data(), n);
    in->remove_prefix(n);
  }
  return true;
}

std::string_view View(const rocksdb::Slice& s) { return std::string_view(s.data(), s.size()); }

// RocksDB status -> absl: no space is RESOURCE_EXHAUSTED, corruption DATA_LOSS, the rest
// UNAVAILABLE (an I/O error of the tier, not of the request).
absl::Status FromRocks(const rocksdb::Status& status, absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": ", status.ToString());
  if (status.IsNoSpace() || status.subcode() == rocksdb::Status::kSpaceLimit)
    return absl::ResourceExhaustedError(message);
  if (status.IsCorruption()) return absl::DataLossError(message);
  if (status.IsNotFound()) return absl::NotFoundError(message);
  return absl::UnavailableError(message);
}

struct ParsedMeta {
  uint32_t format = 0;
  uint64_t generation = 0;
  int64_t spilled_ns = 0;
  std::vector<uint64_t> layer_bytes;
  std::vector<uint32_t> layer_crcs;
  std::string_view meta;
};

// Checks the checksum and the structure of a metadata value; the error says which failed.
absl::StatusOr<ParsedMeta> ParseMeta(std::string_view value) {
  uint32_t crc = 0;
  if (!ReadLE(&value, &crc)) return absl::DataLossError("metadata record is truncated");
  if (Crc32c(value) != crc) return absl::DataLossError("metadata record fails its checksum");
  ParsedMeta parsed;
  if (!ReadLE(&value, &parsed.format)) return absl::DataLossError("metadata record is malformed");
  if (parsed.format != kMetaFormat) {
    return absl::DataLossError(absl::StrCat("metadata record has format ", parsed.format,
                                            ", this build reads format ", kMetaFormat,
                                            " (format 1 was written by an earlier build)"));
  }
  uint32_t layers = 0;
  if (!ReadLE(&value, &parsed.generation) || !ReadLE(&value, &parsed.spilled_ns) ||
      !ReadLE(&value, &layers) || value.size() / 12 < layers || parsed.generation == 0) {
    return absl::DataLossError("metadata record is malformed");
  }
  parsed.layer_bytes.resize(layers);
  parsed.layer_crcs.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    ReadLE(&value, &parsed.layer_bytes[l]);
    ReadLE(&value, &parsed.layer_crcs[l]);
  }
  parsed.meta = value;
  return parsed;
}

uint64_t LayerBytes(const ParsedMeta& parsed) {
  uint64_t total = 0;
  for (uint64_t b : parsed.layer_bytes) total += b;
  return total;
}

uint64_t EntryBytes(const ParsedMeta& parsed) { return parsed.meta.size() + LayerBytes(parsed); }

rocksdb::Options DbOptions() {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.compression = rocksdb::kNoCompression;
  options.bottommost_compression = rocksdb::kNoCompression;
  // Only metadata lives in RocksDB now; blob files stay enabled so that the data records of
  // record format 1 (large values, in blob files) can still be found and removed.
  options.enable_blob_files = true;
  options.min_blob_size = 64 << 10;
  options.blob_compression_type = rocksdb::kNoCompression;
  options.enable_blob_garbage_collection = true;
  options.max_background_jobs = 2;
  // A write-ahead log record that fails its checksum fails the Open instead of ending the
  // replay there (RocksDB's default, kPointInTimeRecovery, silently drops it and every record
  // after it: acknowledged copies would vanish). Open then salvages (RocksTier::Open).
  options.wal_recovery_mode = rocksdb::WALRecoveryMode::kAbsoluteConsistency;
  options.paranoid_checks = true;
  return options;
}

// errno of a failed file call -> absl: a full disk or quota is RESOURCE_EXHAUSTED, the rest
// UNAVAILABLE (an I/O error of the tier, not of the request).
absl::Status FromErrno(int error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  if (error == ENOSPC || error == EDQUOT) return absl::ResourceExhaustedError(message);
  return absl::UnavailableError(message);
}

absl::Status WriteAll(int fd, const char* data, size_t n, absl::string_view what) {
  while (n > 0) {
    const ssize_t done = write(fd, data, std::min<size_t>(n, size_t{1} << 30));
    if (done < 0) {
      if (errno == EINTR) continue;
      return FromErrno(errno, what);
    }
    data += done;
    n -= static_cast<size_t>(done);
  }
  return absl::OkStatus();
}

// Reads exactly n bytes at `offset`; false on a short file.
absl::StatusOr<bool> ReadAll(int fd, char* data, size_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t done = pread(fd, data, n, static_cast<off_t>(offset));
    if (done < 0) {
      if (errno == EINTR) continue;
      return FromErrno(errno, "reading a layer file of the disk tier");
    }
    if (done == 0) return false;
    data += done;
    n -= static_cast<size_t>(done);
    offset += static_cast<uint64_t>(done);
  }
  return true;
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FromErrno(errno, absl::StrCat("opening ", dir));
  const int rc = fsync(fd);
  const int error = errno;
  close(fd);
  if (rc != 0) return FromErrno(error, absl::StrCat("syncing ", dir));
  return absl::OkStatus();
}

// The generation a layer file's (or with kKeySuffix, a key file's) name carries; 0 for other
// names.
constexpr std::string_view kLayerSuffix = ".kvl";
constexpr std::string_view kKeySuffix = ".kvk";
uint64_t GenerationOfFile(std::string_view name, std::string_view kSuffix = kLayerSuffix) {
  if (name.size() != 16 + kSuffix.size() || name.substr(16) != kSuffix) return 0;
  uint64_t generation = 0;
  for (char c : name.substr(0, 16)) {
    int digit = 0;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else {
      return 0;
    }
    generation = (generation << 4) | static_cast<uint64_t>(digit);
  }
  return generation;
}

// Writes `bytes` to `path` (mode 0600) and makes them durable (fdatasync).
absl::Status WriteSmallFile(const std::string& path, const std::string& bytes,
                            absl::string_view what) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return FromErrno(errno, absl::StrCat(what, ": creating ", path));
  absl::Status status = WriteAll(fd, bytes.data(), bytes.size(), what);
  if (status.ok() && fdatasync(fd) != 0) status = FromErrno(errno, what);
  close(fd);
  return status;
}

// The key a key file names (crc32c u32 LE of the encoded key, then the key); nullopt when the
// file is missing or fails its checksum.
std::optional<SpillKey> ReadKeyFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string bytes;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0 && bytes.size() < (1u << 20)) {
    bytes.append(buffer, static_cast<size_t>(n));
  }
  close(fd);
  if (bytes.size() < 4) return std::nullopt;
  uint32_t crc = 0;
  std::memcpy(&crc, bytes.data(), sizeof(crc));
  std::string_view rest = std::string_view(bytes).substr(4);
  if (Crc32c(rest) != crc) return std::nullopt;
  SpillKey key;
  if (!DecodeKey(&rest, &key) || !rest.empty()) return std::nullopt;
  return key;
}

// Collects the metadata ("M") and lost ("L") records of write batches into `records`, applying
// puts and deletes in order; everything else (legacy data records and their range deletion) is
// skipped.
class SalvageHandler final : public rocksdb::WriteBatch::Handler {
 public:
  explicit SalvageHandler(std::map<std::string, std::string>* records) : records_(records) {}
  rocksdb::Status PutCF(uint32_t family, const rocksdb::Slice& key,
                        const rocksdb::Slice& value) override {
    if (Ours(family, key)) (*records_)[key.ToString()] = value.ToString();
    return rocksdb::Status::OK();
  }
  rocksdb::Status DeleteCF(uint32_t family, const rocksdb::Slice& key) override {
    if (Ours(family, key)) records_->erase(key.ToString());
    return rocksdb::Status::OK();
  }
  rocksdb::Status SingleDeleteCF(uint32_t family, const rocksdb::Slice& key) override {
    return DeleteCF(family, key);
  }
  rocksdb::Status DeleteRangeCF(uint32_t, const rocksdb::Slice&, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }
  rocksdb::Status PutBlobIndexCF(uint32_t, const rocksdb::Slice&, const rocksdb::Slice&) override {
    return rocksdb::Status::OK();
  }

 private:
  static bool Ours(uint32_t family, const rocksdb::Slice& key) {
    return family == 0 && key.size() > 0 && (key[0] == kMetaPrefix || key[0] == kLostPrefix);
  }
  std::map<std::string, std::string>* records_;
};

// Replays the write-ahead log files of the damaged database in `dir` into `records`, record by
// record, past damaged ones. RocksDB's own reader, even in kSkipAnyCorruptedRecords, drops the
// rest of a 32 KiB log block after a record that fails its checksum, taking intact records of
// other copies with it; here only the damaged physical record is skipped. Format (RocksDB's
// log_format.h): 32 KiB blocks of records [masked crc32c u32 LE][length u16 LE][type u8][payload],
// type 1 a whole write batch, 2/3/4 its first/middle/last fragment.
void ReplayWalSalvage(const std::string& dir, std::map<std::string, std::string>* records) {
  std::vector<std::string> logs;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().extension() == ".log") logs.push_back(entry.path().string());
  }
  std::sort(logs.begin(), logs.end());  // zero-padded log numbers: oldest first
  constexpr size_t kBlock = 32768;
  constexpr size_t kHeader = 7;
  SalvageHandler handler(records);
  auto apply = [&](const std::string& rep) {
    if (rep.size() < 12) return;  // sequence number u64 + count u32
    rocksdb::WriteBatch batch(rep);
    (void)batch.Iterate(&handler);  // a malformed batch stops at its first bad entry
  };
  for (const std::string& log : logs) {
    std::ifstream in(log, std::ios::binary);
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::string pending;
    bool fragment = false;
    for (size_t block = 0; block < data.size(); block += kBlock) {
      const size_t end = std::min(block + kBlock, data.size());
      size_t pos = block;
      while (pos + kHeader <= end) {
        const auto* h = reinterpret_cast<const uint8_t*>(data.data() + pos);
        const uint32_t masked = uint32_t{h[0]} | uint32_t{h[1]} << 8 | uint32_t{h[2]} << 16 |
                                uint32_t{h[3]} << 24;
        const size_t length = size_t{h[4]} | size_t{h[5]} << 8;
        const uint8_t type = h[6];
        if (type == 0 && length == 0) break;  // the zero-filled tail of a block
        if (pos + kHeader + length > end) {   // a damaged length: nothing more in this block
          fragment = false;
          pending.clear();
          break;
        }
        const uint32_t rotated = masked - 0xa282ead8u;
        const uint32_t expected = (rotated >> 17) | (rotated << 15);
        const uint32_t actual = Crc32cExtend(Crc32cExtend(0, &type, 1), h + kHeader, length);
        const std::string_view payload(data.data() + pos + kHeader, length);
        pos += kHeader + length;
        if (actual != expected) {  // this record only
          fragment = false;
          pending.clear();
          continue;
        }
        switch (type) {
          case 1:
            apply(std::string(payload));
            fragment = false;
            break;
          case 2:
            pending.assign(payload);
            fragment = true;
            break;
          case 3:
            if (fragment) pending.append(payload);
            break;
          case 4:
            if (fragment) apply(pending.append(payload));
            fragment = false;
            pending.clear();
            break;
          default:
            break;
        }
      }
    }
  }
}

// Moves every entry of the database directory `path` but the layer files' directory and earlier
// quarantines into a new quarantine directory, returned.
absl::StatusOr<std::string> Quarantine(const std::string& path, const std::string& layer_dir) {
  const std::string target =
      absl::StrCat(path, "/quarantine-", absl::ToUnixNanos(absl::Now()));
  std::error_code error;
  std::filesystem::create_directories(target, error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create ", target, ": ", error.message()));
  }
  std::filesystem::permissions(target, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, error);
  std::vector<std::filesystem::path> entries;
  for (const auto& entry : std::filesystem::directory_iterator(path, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.path() == std::filesystem::path(layer_dir) || name.rfind("quarantine-", 0) == 0) {
      continue;
    }
    entries.push_back(entry.path());
  }
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot list ", path, ": ", error.message()));
  }
  for (const std::filesystem::path& from : entries) {
    std::filesystem::rename(from, std::filesystem::path(target) / from.filename(), error);
    if (error) {
      return absl::FailedPreconditionError(absl::StrCat("cannot move ", from.string(), " to ",
                                                        target, ": ", error.message()));
    }
  }
  return target;
}

}  // namespace

std::string RocksTier::MetaKey(const SpillKey& key) {
  std::string out(1, kMetaPrefix);
  out += EncodeKey(key);
  return out;
}

std::string RocksTier::FilePath(uint64_t generation) const {
  char name[32];
  std::snprintf(name, sizeof(name), "%016llx.kvl", static_cast<unsigned long long>(generation));
  return absl::StrCat(LayerDir(options_.path), "/", name);
}

std::string RocksTier::LostKey(const SpillKey& key) {
  std::string out(1, kLostPrefix);
  out += EncodeKey(key);
  return out;
}

std::string RocksTier::KeyFilePath(uint64_t generation) const {
  std::string path = FilePath(generation);
  path.replace(path.size() - kLayerSuffix.size(), kLayerSuffix.size(), kKeySuffix);
  return path;
}

void RocksTier::RemoveFiles(uint64_t generation) const {
  if (generation == 0) return;
  unlink(FilePath(generation).c_str());
  unlink(KeyFilePath(generation).c_str());
}

std::string RocksTier::LayerFile(const SpillKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end() || !it->second.lost.empty()) return "";
  return FilePath(it->second.generation);
}

std::string RocksTier::DataKey(const SpillKey& key, uint64_t generation, uint32_t layer) {
  std::string out(1, kDataPrefix);
  out += EncodeKey(key);
  AppendBE64(&out, generation);
  AppendBE32(&out, layer);
  return out;
}

RocksTier::RocksTier(Options options, std::unique_ptr<rocksdb::DB> db)
    : options_(std::move(options)), db_(std::move(db)) {}

RocksTier::~RocksTier() {
  if (db_) (void)db_->Close();
}

absl::StatusOr<std::unique_ptr<RocksTier>> RocksTier::Open(const Options& options) {
  std::error_code error;
  std::filesystem::create_directories(LayerDir(options.path), error);
  if (error) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create the disk tier directory ",
                                                      options.path, ": ", error.message()));
  }
  // The database, its WAL and the layer files hold tenant, session and sequence ids: owner only.
  std::filesystem::permissions(options.path, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, error);
  std::filesystem::permissions(LayerDir(options.path), std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, error);
  rocksdb::DB* raw = nullptr;
  rocksdb::Status status = rocksdb::DB::Open(DbOptions(), options.path, &raw);
  std::map<std::string, std::string> salvaged;
  std::string corruption;
  // Written before a damaged database is moved aside and removed only once Load has recorded
  // the lost copies: a crash in between must not make the next start take the fresh, partly
  // filled database for a healthy one and delete the layer files only the damaged one named.
  const std::string salvage_marker = LayerDir(options.path) + "/salvage-pending";
  const bool salvage_interrupted = std::filesystem::exists(salvage_marker);
  if (status.IsCorruption()) {
    // A damaged record (a flipped byte in the WAL, a torn write): the database is moved aside
    // untouched, every record still readable in it is carried into a fresh one, and the copies
    // whose records are gone are found from their key files and reported lost (Load).
    corruption = status.ToString();
    {
      const int fd = open(salvage_marker.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0 || fsync(fd) != 0) {
        if (fd >= 0) close(fd);
        return absl::UnavailableError(absl::StrCat("cannot write ", salvage_marker, ": ",
                                                   std::strerror(errno)));
      }
      close(fd);
      KVS_RETURN_IF_ERROR(SyncDirectory(LayerDir(options.path)));
    }
    KVS_ASSIGN_OR_RETURN(const std::string quarantine,
                         Quarantine(options.path, LayerDir(options.path)));
    corruption = absl::StrCat(corruption, " (the damaged database is kept in ", quarantine, ")");
    rocksdb::Options salvage = DbOptions();
    salvage.create_if_missing = false;
    salvage.paranoid_checks = false;
    salvage.wal_recovery_mode = rocksdb::WALRecoveryMode::kSkipAnyCorruptedRecords;
    rocksdb::DB* old_db = nullptr;
    if (rocksdb::DB::OpenForReadOnly(salvage, quarantine, &old_db).ok()) {
      std::unique_ptr<rocksdb::DB> old(old_db);
      std::unique_ptr<rocksdb::Iterator> it(old->NewIterator(rocksdb::ReadOptions()));
      for (it->SeekToFirst(); it->Valid(); it->Next()) {
        const char prefix = it->key().size() > 0 ? it->key()[0] : 0;
        if (prefix == kMetaPrefix || prefix == kLostPrefix) {
          salvaged[it->key().ToString()] = it->value().ToString();
        }
      }
    }
    // What the read-only open replayed is replayed again (same order: the same end state), and
    // the records past the damage with it.
    ReplayWalSalvage(quarantine, &salvaged);
    status = rocksdb::DB::Open(DbOptions(), options.path, &raw);
  }
  if (!status.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot open the disk tier (RocksDB) at ",
                                                      options.path, ": ", status.ToString()));
  }
  std::unique_ptr<RocksTier> tier(new RocksTier(options, std::unique_ptr<rocksdb::DB>(raw)));
  if (!salvaged.empty()) {
    rocksdb::WriteBatch batch;
    for (const auto& [key, value] : salvaged) batch.Put(key, value);
    rocksdb::WriteOptions synced;
    synced.sync = true;
    KVS_RETURN_IF_ERROR(
        FromRocks(tier->db_->Write(synced, &batch), "carrying the salvaged disk tier records"));
  }
  if (corruption.empty() && salvage_interrupted) {
    corruption = "a salvage of a damaged database did not finish (the damaged database is kept "
                 "in a quarantine folder beside it)";
  }
  tier->corruption_ = corruption;
  KVS_RETURN_IF_ERROR(tier->Load());
  if (std::filesystem::exists(salvage_marker)) {
    unlink(salvage_marker.c_str());
    SyncDirectory(LayerDir(options.path)).IgnoreError();  // a marker left: the next start re-checks
  }
  return tier;
}

absl::Status RocksTier::Load() {
  absl::MutexLock lock(&mu_);
  uint64_t max_generation = 0;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, kMetaPrefix)); it->Valid() && it->key()[0] == kMetaPrefix;
         it->Next()) {
      std::string_view rest = View(it->key()).substr(1);
      SpillKey key;
      if (!DecodeKey(&rest, &key) || !rest.empty()) continue;  // not ours: cannot even name it
      Entry entry;
      absl::StatusOr<ParsedMeta> parsed = ParseMeta(View(it->value()));
      if (parsed.ok()) {
        entry.generation = parsed->generation;
        entry.bytes = EntryBytes(*parsed);
        entry.spilled = absl::FromUnixNanos(parsed->spilled_ns);
        max_generation = std::max(max_generation, entry.generation);
        // One stat per copy: a file a crash or an operator cut short is reported now, not on
        // the Restore that needs it. Its bytes are checked on every Get.
        struct stat st;
        const std::string file = FilePath(entry.generation);
        if (stat(file.c_str(), &st) != 0) {
          entry.lost = absl::StrCat("its layer file ", file, " is missing");
        } else if (static_cast<uint64_t>(st.st_size) != LayerBytes(*parsed)) {
          entry.lost = absl::StrCat("its layer file ", file, " has ", st.st_size,
                                    " bytes, the metadata says ", LayerBytes(*parsed));
        }
      } else {
        entry.lost = std::string(parsed.status().message());
      }
      if (entry.lost.empty()) used_bytes_ += entry.bytes;
      entries_[key] = std::move(entry);
    }
    KVS_RETURN_IF_ERROR(FromRocks(it->status(), "scanning the disk tier"));
  }
  // Copies found lost before: they stay lost (their layer file is kept until released).
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, kLostPrefix)); it->Valid() && it->key()[0] == kLostPrefix;
         it->Next()) {
      std::string_view rest = View(it->key()).substr(1);
      SpillKey key;
      std::string_view value = View(it->value());
      if (!DecodeKey(&rest, &key) || !rest.empty() || value.size() < 8) continue;
      uint64_t generation = 0;
      std::memcpy(&generation, value.data(), sizeof(generation));
      Entry& entry = entries_[key];
      if (entry.generation != 0 && entry.generation != generation) continue;  // replaced since
      if (entry.lost.empty()) used_bytes_ -= std::min(used_bytes_, entry.bytes);
      entry.generation = generation;
      entry.lost = std::string(value.substr(8));
      max_generation = std::max(max_generation, generation);
    }
    KVS_RETURN_IF_ERROR(FromRocks(it->status(), "scanning the disk tier"));
  }
  // Data records of record format 1 (this build keeps layers in files): removed, with the
  // metadata of that format reported lost above.
  {
    int legacy = 0;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, kDataPrefix)); it->Valid() && it->key()[0] == kDataPrefix;
         it->Next()) {
      ++legacy;
    }
    KVS_RETURN_IF_ERROR(FromRocks(it->status(), "scanning the disk tier"));
    if (legacy > 0) {
      KVS_RETURN_IF_ERROR(
          FromRocks(db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(),
                                     std::string(1, kDataPrefix), std::string(1, kDataPrefix + 1)),
                    "removing data records of record format 1"));
      orphans_removed_ += legacy;
    }
  }
  // Layer files no readable metadata names. Their key file says whose they are. A copy whose
  // metadata record could not be read (unreadable, or lost with a damaged WAL) keeps its file and
  // is reported lost, persistently; a file of a key with no record, in an undamaged database, is
  // a Put cut short or a removal that did not finish: removed.
  std::set<uint64_t> referenced;
  bool any_unreadable_record = false;
  for (const auto& [key, entry] : entries_) {
    if (entry.generation != 0) referenced.insert(entry.generation);
    if (entry.generation == 0) any_unreadable_record = true;
  }
  std::error_code error;
  std::vector<std::pair<SpillKey, Entry>> found_lost;
  for (const auto& file : std::filesystem::directory_iterator(LayerDir(options_.path), error)) {
    const std::string name = file.path().filename().string();
    uint64_t generation = GenerationOfFile(name);
    if (generation == 0) {
      // A key file whose layer file is gone: the end of a removal.
      const uint64_t key_generation = GenerationOfFile(name, kKeySuffix);
      if (key_generation != 0 && !std::filesystem::exists(FilePath(key_generation))) {
        unlink(file.path().c_str());
      }
      continue;  // not a layer file
    }
    max_generation = std::max(max_generation, generation);
    if (referenced.contains(generation)) continue;
    const std::optional<SpillKey> key = ReadKeyFile(KeyFilePath(generation));
    auto it = key ? entries_.find(*key) : entries_.end();
    const bool unreadable_record = it != entries_.end() && it->second.generation == 0;
    // With a damaged log, a file of a key whose copy is intact is still a Put cut short (or a
    // removal that did not finish): only a key without a usable copy lost one.
    const bool lost_with_log =
        !corruption_.empty() && (it == entries_.end() || !it->second.lost.empty());
    // A file with no readable key file (older builds wrote none) may be the copy of a record that
    // could not be read: never removed then.
    const bool maybe_unreadable = !key && any_unreadable_record;
    if (unreadable_record || lost_with_log || maybe_unreadable) {
      Entry entry;
      entry.generation = generation;
      entry.spilled = absl::UnixEpoch();
      entry.lost = unreadable_record
                       ? absl::StrCat(it->second.lost, "; its layer file ", file.path().string(),
                                      " is kept")
                       : absl::StrCat("its metadata record could not be read back from the "
                                      "RocksDB write-ahead log: ",
                                      corruption_, "; its layer file ", file.path().string(),
                                      " is kept");
      if (key) {
        found_lost.emplace_back(*key, std::move(entry));
      } else {
        // Kept under a name no later start takes for a layer file (so no later start, with the
        // damage no longer in sight, removes it as an orphan); no key to list it under.
        const std::string kept = file.path().string() + ".lost";
        if (rename(file.path().c_str(), kept.c_str()) == 0) {
          unnamed_lost_files_.push_back(kept);
        } else {
          unnamed_lost_files_.push_back(file.path().string());
        }
      }
      continue;
    }
    RemoveFiles(generation);
    ++orphans_removed_;
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("cannot list the disk tier's layer files in ",
                                               LayerDir(options_.path), ": ", error.message()));
  }
  next_generation_ = max_generation + 1;
  if (!found_lost.empty()) {
    // Several for one key: the newest generation is the copy the key had last.
    std::sort(found_lost.begin(), found_lost.end(),
              [](const auto& a, const auto& b) { return a.second.generation < b.second.generation; });
    rocksdb::WriteBatch batch;
    for (auto& [key, entry] : found_lost) {
      std::string value;
      AppendLE<uint64_t>(&value, entry.generation);
      value += entry.lost;
      batch.Put(LostKey(key), value);
      entries_[key] = std::move(entry);
    }
    rocksdb::WriteOptions synced;
    synced.sync = true;
    KVS_RETURN_IF_ERROR(FromRocks(db_->Write(synced, &batch), "recording lost disk copies"));
  }
  return absl::OkStatus();
}

absl::Status RocksTier::Put(const SpillKey& key, const SpilledSequence& data, absl::Time now) {
  const uint64_t bytes = data.bytes();
  uint64_t generation = 0;
  std::optional<Entry> previous;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it != entries_.end()) previous = it->second;
    const uint64_t replaced = previous && previous->lost.empty() ? previous->bytes : 0;
    if (options_.capacity_bytes != 0 && used_bytes_ - replaced + bytes > options_.capacity_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the disk tier holds ", used_bytes_ - replaced, " of its ", options_.capacity_bytes,
          " bytes (--disk_tier_bytes); sequence ", key.sequence_id, " needs ", bytes));
    }
    generation = next_generation_++;
  }
  const std::string what = absl::StrCat("writing sequence ", key.sequence_id, " to disk");
  // 1. The layer file of the new generation: the bulk bytes pass through memory once (the
  // checksum) and are written with plain write()s and made durable with one fdatasync, then the
  // directory entry is synced. A crash before the metadata names the file leaves a file Open
  // removes.
  const std::string file = FilePath(generation);
  std::vector<uint32_t> crcs(data.layers.size());
  {
    const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return FromErrno(errno, absl::StrCat(what, ": creating ", file));
    absl::Status status;
    for (size_t l = 0; l < data.layers.size() && status.ok(); ++l) {
      crcs[l] = Crc32c(data.layers[l]);
      status = WriteAll(fd, data.layers[l].data(), data.layers[l].size(), what);
    }
    if (status.ok() && fdatasync(fd) != 0) status = FromErrno(errno, what);
    close(fd);
    // Whose file this is, for the day its metadata record cannot be read (Load).
    if (status.ok()) {
      const std::string encoded = EncodeKey(key);
      std::string key_file;
      AppendLE<uint32_t>(&key_file, Crc32c(encoded));
      key_file += encoded;
      status = WriteSmallFile(KeyFilePath(generation), key_file, what);
    }
    if (status.ok()) status = SyncDirectory(LayerDir(options_.path));
    if (!status.ok()) {
      RemoveFiles(generation);
      return status;
    }
  }
  // 2. The metadata, synced through the WAL: the new version becomes visible and durable at once.
  std::string body;
  AppendLE<uint32_t>(&body, kMetaFormat);
  AppendLE<uint64_t>(&body, generation);
  AppendLE<int64_t>(&body, absl::ToUnixNanos(now));
  AppendLE<uint32_t>(&body, static_cast<uint32_t>(data.layers.size()));
  for (size_t l = 0; l < data.layers.size(); ++l) {
    AppendLE<uint64_t>(&body, data.layers[l].size());
    AppendLE<uint32_t>(&body, crcs[l]);
  }
  body += data.meta;
  std::string value;
  AppendLE<uint32_t>(&value, Crc32c(body));
  value += body;
  rocksdb::WriteOptions synced;
  synced.sync = true;
  rocksdb::WriteBatch batch;
  batch.Put(MetaKey(key), value);
  if (previous && !previous->lost.empty()) batch.Delete(LostKey(key));  // replaced by this copy
  if (rocksdb::Status status = db_->Write(synced, &batch); !status.ok()) {
    RemoveFiles(generation);
    return FromRocks(status, what);
  }
  {
    absl::MutexLock lock(&mu_);
    Entry& entry = entries_[key];
    if (previous && previous->lost.empty()) used_bytes_ -= previous->bytes;
    entry = Entry{generation, bytes, now, ""};
    used_bytes_ += bytes;
  }
  // 3. The previous generation's file (a crash before this leaves a file Open removes).
  if (previous) RemoveFiles(previous->generation);
  return absl::OkStatus();
}

absl::Status RocksTier::MarkLost(const SpillKey& key, uint64_t generation,
                                 const std::string& reason) const {
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    // Only the copy that was read: a concurrent Put may have replaced it, a concurrent Erase
    // removed it (then nothing is recorded: a lost record of a released sequence would bring it
    // back as a lost copy after a restart). Erase deletes under the same lock.
    if (it != entries_.end() && it->second.generation == generation && it->second.lost.empty()) {
      it->second.lost = reason;
      used_bytes_ -= it->second.bytes;
      // Recorded, so that the copy is listed lost after a restart too (best effort: the
      // checksum would find it again on the next Get anyway).
      std::string value;
      AppendLE<uint64_t>(&value, generation);
      value += reason;
      rocksdb::WriteOptions synced;
      synced.sync = true;
      (void)db_->Put(synced, LostKey(key), value);
    }
  }
  return absl::DataLossError(
      absl::StrCat("the disk copy of sequence ", key.sequence_id, " is corrupt: ", reason));
}

absl::StatusOr<std::shared_ptr<const SpilledSequence>> RocksTier::Get(const SpillKey& key) const {
  uint64_t generation = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      return absl::NotFoundError(
          absl::StrCat("sequence ", key.sequence_id, " has no copy in the disk tier"));
    }
    if (!it->second.lost.empty()) {
      return absl::DataLossError(absl::StrCat("the disk copy of sequence ", key.sequence_id,
                                              " is lost: ", it->second.lost));
    }
    generation = it->second.generation;
  }
  rocksdb::PinnableSlice meta_value;
  rocksdb::Status status =
      db_->Get(rocksdb::ReadOptions(), db_->DefaultColumnFamily(), MetaKey(key), &meta_value);
  if (status.IsNotFound()) return MarkLost(key, generation, "its metadata record is missing");
  KVS_RETURN_IF_ERROR(FromRocks(status, "reading the disk tier"));
  absl::StatusOr<ParsedMeta> parsed = ParseMeta(View(meta_value));
  if (!parsed.ok()) return MarkLost(key, generation, std::string(parsed.status().message()));
  if (parsed->generation != generation) {
    return MarkLost(key, generation, "its metadata names another generation");
  }
  const std::string file = FilePath(generation);
  const int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return MarkLost(key, generation, absl::StrCat(file, " is missing"));
    return FromErrno(errno, absl::StrCat("opening ", file));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != LayerBytes(*parsed)) {
    close(fd);
    return MarkLost(key, generation, absl::StrCat(file, " has the wrong size"));
  }
  SpilledSequence out;
  out.meta = std::string(parsed->meta);
  out.layers.resize(parsed->layer_bytes.size());
  uint64_t offset = 0;
  for (size_t l = 0; l < parsed->layer_bytes.size(); ++l) {
    const uint64_t n = parsed->layer_bytes[l];
    // Recycled buffers (cache/spill_buffers.h): the restore that reads them gives them back.
    out.layers[l] = SpillBuffers::Default().Take(n);
    absl::StatusOr<bool> complete = ReadAll(fd, out.layers[l].data(), n, offset);
    if (!complete.ok() || !*complete) {
      close(fd);
      SpillBuffers::Default().Give(std::move(out.layers));
      if (!complete.ok()) return complete.status();
      return MarkLost(key, generation, absl::StrCat("the record of layer ", l, " is truncated"));
    }
    offset += n;
    if (Crc32c(out.layers[l]) != parsed->layer_crcs[l]) {
      close(fd);
      SpillBuffers::Default().Give(std::move(out.layers));
      return MarkLost(key, generation,
                      absl::StrCat("the record of layer ", l, " fails its checksum"));
    }
  }
  close(fd);
  return SpillBuffers::Default().Share(std::move(out));
}

absl::Status RocksTier::Erase(const SpillKey& key) {
  std::optional<Entry> entry;
  {
    // The records and the entry go together, under the lock MarkLost records under.
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return absl::OkStatus();
    entry = it->second;
    rocksdb::WriteOptions synced;
    synced.sync = true;
    rocksdb::WriteBatch batch;
    batch.Delete(MetaKey(key));
    batch.Delete(LostKey(key));
    KVS_RETURN_IF_ERROR(FromRocks(db_->Write(synced, &batch), "deleting from the disk tier"));
    if (entry->lost.empty()) used_bytes_ -= entry->bytes;
    entries_.erase(key);
  }
  // What is left after a crash here is an orphan Open removes.
  RemoveFiles(entry->generation);
  return absl::OkStatus();
}

std::optional<SpilledInfo> RocksTier::Find(const SpillKey& key) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return SpilledInfo{key, StorageTier::kDisk, it->second.bytes, it->second.spilled,
                     it->second.lost};
}

std::vector<SpilledInfo> RocksTier::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<SpilledInfo> result;
  for (const auto& [key, entry] : entries_) {
    result.push_back(SpilledInfo{key, StorageTier::kDisk, entry.bytes, entry.spilled, entry.lost});
  }
  return result;
}

uint64_t RocksTier::TenantBytes(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  uint64_t total = 0;
  for (const auto& [key, entry] : entries_) {
    if (key.tenant == tenant && entry.lost.empty()) total += entry.bytes;
  }
  return total;
}

uint64_t RocksTier::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

}  // namespace kvs::storage
