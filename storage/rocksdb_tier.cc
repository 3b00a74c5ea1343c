#include "storage/rocksdb_tier.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/base/status_macros.h"
#include "rocksdb/db.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/write_batch.h"
#include "storage/crc32c.h"

namespace kvs::storage {
namespace {

constexpr uint32_t kMetaFormat = 1;
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
  uint64_t generation = 0;
  int64_t spilled_ns = 0;
  std::vector<uint64_t> layer_bytes;
  std::string_view meta;
};

// Checks the checksum and the structure of a metadata value; the error says which failed.
absl::StatusOr<ParsedMeta> ParseMeta(std::string_view value) {
  uint32_t crc = 0;
  if (!ReadLE(&value, &crc)) return absl::DataLossError("metadata record is truncated");
  if (Crc32c(value) != crc) return absl::DataLossError("metadata record fails its checksum");
  ParsedMeta parsed;
  uint32_t format = 0, layers = 0;
  if (!ReadLE(&value, &format) || format != kMetaFormat || !ReadLE(&value, &parsed.generation) ||
      !ReadLE(&value, &parsed.spilled_ns) || !ReadLE(&value, &layers) ||
      value.size() / 8 < layers) {
    return absl::DataLossError("metadata record is malformed");
  }
  parsed.layer_bytes.resize(layers);
  for (uint64_t& bytes : parsed.layer_bytes) ReadLE(&value, &bytes);
  parsed.meta = value;
  return parsed;
}

uint64_t EntryBytes(const ParsedMeta& parsed) {
  uint64_t total = parsed.meta.size();
  for (uint64_t b : parsed.layer_bytes) total += b;
  return total;
}

rocksdb::Options DbOptions() {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.compression = rocksdb::kNoCompression;
  options.bottommost_compression = rocksdb::kNoCompression;
  // K/V blocks are large and incompressible: keep them in blob files, out of the LSM tree, so
  // that compactions do not rewrite them.
  options.enable_blob_files = true;
  options.min_blob_size = 64 << 10;
  options.blob_file_size = uint64_t{256} << 20;
  options.blob_compression_type = rocksdb::kNoCompression;
  options.enable_blob_garbage_collection = true;
  options.write_buffer_size = 128 << 20;
  options.max_write_buffer_number = 4;
  options.max_total_wal_size = uint64_t{512} << 20;
  options.max_background_jobs = 2;
  return options;
}

}  // namespace

std::string RocksTier::MetaKey(const SpillKey& key) {
  return std::string(1, kMetaPrefix) + EncodeKey(key);
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
  std::filesystem::create_directories(options.path, error);
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
        used_bytes_ += entry.bytes;
      } else {
        entry.lost = std::string(parsed.status().message());
      }
      entries_[key] = std::move(entry);
    }
    KVS_RETURN_IF_ERROR(FromRocks(it->status(), "scanning the disk tier"));
  }
  // Data records of a generation no metadata names: a Put cut short (or a deletion that did not
  // finish). Lost entries keep theirs until erased.
  std::set<std::pair<std::string, uint64_t>> orphans;
  {
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek(std::string(1, kDataPrefix)); it->Valid() && it->key()[0] == kDataPrefix;
         it->Next()) {
      std::string_view rest = View(it->key()).substr(1);
      SpillKey key;
      uint64_t generation = 0, layer = 0;
      if (!DecodeKey(&rest, &key) || !ReadBE(&rest, 8, &generation) || !ReadBE(&rest, 4, &layer)) {
        continue;
      }
      max_generation = std::max(max_generation, generation);
      auto entry = entries_.find(key);
      if (entry == entries_.end() ||
          (entry->second.lost.empty() && entry->second.generation != generation)) {
        orphans.emplace(std::string(1, kDataPrefix) + EncodeKey(key), generation);
      }
    }
    KVS_RETURN_IF_ERROR(FromRocks(it->status(), "scanning the disk tier"));
  }
  for (const auto& [prefix, generation] : orphans) {
    std::string begin = prefix, end = prefix;
    AppendBE64(&begin, generation);
    AppendBE64(&end, generation + 1);
    KVS_RETURN_IF_ERROR(
        FromRocks(db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), begin, end),
                  "removing an unfinished spill"));
    ++orphans_removed_;
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
  // 1. The data records of the new generation, without the WAL (the bytes would be written twice,
  // to the log and then to the blob files), then a flush that makes them durable in blob files:
  // one pass over the bulk data. A crash before the flush completes leaves records no metadata
  // names, which Open removes.
  rocksdb::WriteOptions bulk;
  bulk.sync = false;
  bulk.disableWAL = true;
  for (size_t l = 0; l < data.layers.size(); ++l) {
    const std::string& layer = data.layers[l];
    std::string header;
    AppendLE<uint32_t>(&header, Crc32c(layer));
    const std::string record_key = DataKey(key, generation, static_cast<uint32_t>(l));
    const rocksdb::Slice key_part(record_key);
    const rocksdb::Slice value_parts[2] = {rocksdb::Slice(header), rocksdb::Slice(layer)};
    rocksdb::WriteBatch batch;
    rocksdb::Status status =
        batch.Put(rocksdb::SliceParts(&key_part, 1), rocksdb::SliceParts(value_parts, 2));
    if (status.ok()) status = db_->Write(bulk, &batch);
    if (!status.ok()) {
      std::string begin = DataKey(key, generation, 0), end = DataKey(key, generation + 1, 0);
      (void)db_->DeleteRange(bulk, db_->DefaultColumnFamily(), begin, end);
      return FromRocks(status, absl::StrCat("writing sequence ", key.sequence_id, " to disk"));
    }
  }
  if (!data.layers.empty()) {
    rocksdb::FlushOptions flush;
    flush.wait = true;
    if (rocksdb::Status status = db_->Flush(flush); !status.ok()) {
      std::string begin = DataKey(key, generation, 0), end = DataKey(key, generation + 1, 0);
      (void)db_->DeleteRange(bulk, db_->DefaultColumnFamily(), begin, end);
      return FromRocks(status, absl::StrCat("writing sequence ", key.sequence_id, " to disk"));
    }
  }
  // 2. The metadata, synced through the WAL: the new version becomes visible and durable at once.
  std::string body;
  AppendLE<uint32_t>(&body, kMetaFormat);
  AppendLE<uint64_t>(&body, generation);
  AppendLE<int64_t>(&body, absl::ToUnixNanos(now));
  AppendLE<uint32_t>(&body, static_cast<uint32_t>(data.layers.size()));
  for (const std::string& layer : data.layers) AppendLE<uint64_t>(&body, layer.size());
  body += data.meta;
  std::string value;
  AppendLE<uint32_t>(&value, Crc32c(body));
  value += body;
  rocksdb::WriteOptions synced;
  synced.sync = true;
  if (rocksdb::Status status = db_->Put(synced, MetaKey(key), value); !status.ok()) {
    std::string begin = DataKey(key, generation, 0), end = DataKey(key, generation + 1, 0);
    (void)db_->DeleteRange(bulk, db_->DefaultColumnFamily(), begin, end);
    return FromRocks(status, absl::StrCat("writing sequence ", key.sequence_id, " to disk"));
  }
  {
    absl::MutexLock lock(&mu_);
    Entry& entry = entries_[key];
    if (previous && previous->lost.empty()) used_bytes_ -= previous->bytes;
    entry = Entry{generation, bytes, now, ""};
    used_bytes_ += bytes;
  }
  // 3. The previous generation (a lost entry's data: every generation but the new one).
  if (previous) {
    const std::string prefix = std::string(1, kDataPrefix) + EncodeKey(key);
    std::string begin = prefix, end = prefix;
    if (previous->lost.empty()) {
      AppendBE64(&begin, previous->generation);
      AppendBE64(&end, previous->generation + 1);
    } else {
      AppendBE64(&end, generation);
    }
    (void)db_->DeleteRange(bulk, db_->DefaultColumnFamily(), begin, end);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const SpilledSequence>> RocksTier::Get(const SpillKey& key) const {
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
  }
  auto fail = [&](absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("the disk copy of sequence ", key.sequence_id, " is corrupt: ", what));
  };
  rocksdb::PinnableSlice meta_value;
  rocksdb::Status status =
      db_->Get(rocksdb::ReadOptions(), db_->DefaultColumnFamily(), MetaKey(key), &meta_value);
  if (status.IsNotFound()) return fail("its metadata record is missing");
  KVS_RETURN_IF_ERROR(FromRocks(status, "reading the disk tier"));
  absl::StatusOr<ParsedMeta> parsed = ParseMeta(View(meta_value));
  if (!parsed.ok()) return fail(parsed.status().message());
  auto out = std::make_shared<SpilledSequence>();
  out->meta = std::string(parsed->meta);
  out->layers.resize(parsed->layer_bytes.size());
  rocksdb::ReadOptions read;
  read.verify_checksums = true;
  read.fill_cache = false;  // read once, then deleted
  for (size_t l = 0; l < parsed->layer_bytes.size(); ++l) {
    rocksdb::PinnableSlice value;
    status = db_->Get(read, db_->DefaultColumnFamily(),
                      DataKey(key, parsed->generation, static_cast<uint32_t>(l)), &value);
    if (status.IsNotFound()) return fail(absl::StrCat("the record of layer ", l, " is missing"));
    KVS_RETURN_IF_ERROR(FromRocks(status, "reading the disk tier"));
    std::string_view record = View(value);
    uint32_t crc = 0;
    if (!ReadLE(&record, &crc) || record.size() != parsed->layer_bytes[l]) {
      return fail(absl::StrCat("the record of layer ", l, " has the wrong size"));
    }
    if (Crc32c(record) != crc) {
      return fail(absl::StrCat("the record of layer ", l, " fails its checksum"));
    }
    out->layers[l].assign(record.data(), record.size());
  }
  return std::shared_ptr<const SpilledSequence>(std::move(out));
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
  // Every generation of the key; what is left after a crash here is an orphan Open removes.
  const std::string prefix = std::string(1, kDataPrefix) + EncodeKey(key);
  std::string end = prefix;
  end.push_back('\xff');
  for (int i = 0; i < 12; ++i) end.push_back('\xff');
  (void)db_->DeleteRange(rocksdb::WriteOptions(), db_->DefaultColumnFamily(), prefix, end);
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
