#include "storage/rocksdb_tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
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

// The generation a layer file's name carries; 0 for names that are not layer files.
uint64_t GenerationOfFile(std::string_view name) {
  constexpr std::string_view kSuffix = ".kvl";
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
  rocksdb::DB* raw = nullptr;
  const rocksdb::Status status = rocksdb::DB::Open(DbOptions(), options.path, &raw);
  if (!status.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("cannot open the disk tier (RocksDB) at ",
                                                      options.path, ": ", status.ToString()));
  }
  std::unique_ptr<RocksTier> tier(new RocksTier(options, std::unique_ptr<rocksdb::DB>(raw)));
  KVS_RETURN_IF_ERROR(tier->Load());
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
  // Layer files no readable metadata names: a Put cut short, a removal that did not finish, or
  // the data of a copy whose metadata is lost (unusable without it).
  std::set<uint64_t> referenced;
  for (const auto& [key, entry] : entries_) {
    if (entry.generation != 0) referenced.insert(entry.generation);
  }
  std::error_code error;
  for (const auto& file : std::filesystem::directory_iterator(LayerDir(options_.path), error)) {
    const uint64_t generation = GenerationOfFile(file.path().filename().string());
    if (generation == 0) continue;  // not ours
    max_generation = std::max(max_generation, generation);
    if (referenced.contains(generation)) continue;
    std::error_code removed;
    std::filesystem::remove(file.path(), removed);
    if (!removed) ++orphans_removed_;
  }
  if (error) {
    return absl::UnavailableError(absl::StrCat("cannot list the disk tier's layer files in ",
                                               LayerDir(options_.path), ": ", error.message()));
  }
  next_generation_ = max_generation + 1;
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
    if (status.ok()) status = SyncDirectory(LayerDir(options_.path));
    if (!status.ok()) {
      unlink(file.c_str());
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
  if (rocksdb::Status status = db_->Put(synced, MetaKey(key), value); !status.ok()) {
    unlink(file.c_str());
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
  if (previous && previous->generation != 0) unlink(FilePath(previous->generation).c_str());
  return absl::OkStatus();
}

absl::Status RocksTier::MarkLost(const SpillKey& key, uint64_t generation,
                                 const std::string& reason) const {
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    // Only the copy that was read: a concurrent Put may have replaced it.
    if (it != entries_.end() && it->second.generation == generation && it->second.lost.empty()) {
      it->second.lost = reason;
      used_bytes_ -= it->second.bytes;
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
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) return absl::OkStatus();
    entry = it->second;
  }
  rocksdb::WriteOptions synced;
  synced.sync = true;
  KVS_RETURN_IF_ERROR(FromRocks(db_->Delete(synced, MetaKey(key)), "deleting from the disk tier"));
  {
    absl::MutexLock lock(&mu_);
    if (entry->lost.empty()) used_bytes_ -= entry->bytes;
    entries_.erase(key);
  }
  // What is left after a crash here is an orphan Open removes.
  if (entry->generation != 0) unlink(FilePath(entry->generation).c_str());
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
