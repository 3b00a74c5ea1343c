#include "storage/redis/remote_tier.h"

#include <sys/random.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cache/spill_buffers.h"
#include "storage/crc32c.h"

namespace kvs::storage {
namespace {

using redis::Reply;

constexpr uint32_t kFormat = 1;
constexpr char kIndexKey[] = "kvs:{idx}:copies";
// Bytes of chunk values sent in one pipeline (bounds the client's buffers).
constexpr uint64_t kPipelineBytes = uint64_t{64} << 20;

std::string HexTenant(const std::string& tenant) { return absl::BytesToHexString(tenant); }

std::string IndexField(const SpillKey& key) {
  return absl::StrCat(HexTenant(key.tenant), ":", key.sequence_id);
}

std::string RandomOwner() {
  unsigned char raw[8] = {};
  size_t got = 0;
  while (got < sizeof(raw)) {
    const ssize_t n = getrandom(raw + got, sizeof(raw) - got, 0);
    if (n > 0) got += n;
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(raw), sizeof(raw)));
}

uint64_t RandomGeneration() {
  uint64_t value = 0;
  while (value == 0) {
    if (getrandom(&value, sizeof(value), 0) != sizeof(value)) value = 0;
  }
  return value;
}

template <typename T>
void Append(std::string* out, T value) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));  // little-endian hosts only (x86-64, aarch64)
  out->append(bytes, sizeof(T));
}
void PutString(std::string* out, const std::string& s) {
  Append<uint32_t>(out, static_cast<uint32_t>(s.size()));
  out->append(s);
}

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  template <typename T>
  bool Get(T* value) {
    if (data_.size() < sizeof(T)) return false;
    std::memcpy(value, data_.data(), sizeof(T));
    data_.remove_prefix(sizeof(T));
    return true;
  }
  bool GetBytes(uint64_t size, std::string* out) {
    if (data_.size() < size) return false;
    out->assign(data_.data(), size);
    data_.remove_prefix(size);
    return true;
  }
  bool GetString(std::string* out) {
    uint32_t size = 0;
    return Get(&size) && GetBytes(size, out);
  }
  bool done() const { return data_.empty(); }

 private:
  std::string_view data_;
};

std::string Ms(absl::Duration d) { return absl::StrCat(std::max<int64_t>(1, absl::ToInt64Milliseconds(d))); }

// The first error reply among `replies` (an EXEC's nested ones included), as a status.
absl::Status FirstError(std::string_view what, const std::vector<Reply>& replies) {
  for (const Reply& reply : replies) {
    if (reply.is_error()) {
      // EXECABORT repeats the queued command's error; the queued one is more precise.
      if (reply.str.rfind("EXECABORT", 0) == 0) continue;
      return redis::ErrorReplyStatus(what, reply.str);
    }
    if (reply.type == Reply::Type::kArray) {
      if (absl::Status nested = FirstError(what, reply.elements); !nested.ok()) return nested;
    }
  }
  for (const Reply& reply : replies) {
    if (reply.is_error()) return redis::ErrorReplyStatus(what, reply.str);
  }
  return absl::OkStatus();
}

}  // namespace

struct RemoteTier::Meta {
  uint64_t generation = 0;
  absl::Time spilled;
  std::string tenant;
  std::string sequence_id;
  std::string session_id;
  std::vector<uint64_t> layer_bytes;
  uint64_t chunk_bytes = 0;
  std::vector<uint32_t> chunk_crcs;
  std::string snapshot;

  uint64_t bytes() const {
    uint64_t total = snapshot.size();
    for (uint64_t b : layer_bytes) total += b;
    return total;
  }
  // Chunk n's layer and offset in it, in layer order.
  std::vector<std::pair<uint32_t, uint64_t>> Chunks() const {
    std::vector<std::pair<uint32_t, uint64_t>> out;
    for (uint32_t layer = 0; layer < layer_bytes.size(); ++layer) {
      for (uint64_t offset = 0; offset < layer_bytes[layer]; offset += chunk_bytes) {
        out.emplace_back(layer, offset);
      }
    }
    return out;
  }
  std::string Encode() const {
    std::string rest;
    Append<uint32_t>(&rest, kFormat);
    Append<uint64_t>(&rest, generation);
    Append<int64_t>(&rest, absl::ToUnixNanos(spilled));
    PutString(&rest, tenant);
    PutString(&rest, sequence_id);
    PutString(&rest, session_id);
    Append<uint32_t>(&rest, static_cast<uint32_t>(layer_bytes.size()));
    for (uint64_t b : layer_bytes) Append<uint64_t>(&rest, b);
    Append<uint64_t>(&rest, chunk_bytes);
    Append<uint32_t>(&rest, static_cast<uint32_t>(chunk_crcs.size()));
    for (uint32_t crc : chunk_crcs) Append<uint32_t>(&rest, crc);
    Append<uint64_t>(&rest, snapshot.size());
    rest.append(snapshot);
    std::string out;
    Append<uint32_t>(&out, Crc32c(rest));
    out.append(rest);
    return out;
  }
};

RemoteTier::RemoteTier(RemoteTierOptions options)
    : options_([&] {
        if (options.owner.empty()) options.owner = RandomOwner();
        if (options.chunk_bytes == 0) options.chunk_bytes = uint64_t{8} << 20;
        return options;
      }()),
      client_(std::make_unique<redis::Client>(options_.client)) {}

std::string RemoteTier::Tag(const SpillKey& key) {
  return absl::StrCat("{", HexTenant(key.tenant), ":", key.sequence_id, "}");
}
std::string RemoteTier::MetaKey(const SpillKey& key) { return absl::StrCat("kvs:", Tag(key), ":m"); }
std::string RemoteTier::ChunkKey(const SpillKey& key, uint64_t generation, uint32_t chunk) {
  return absl::StrCat("kvs:", Tag(key), ":c:", absl::Hex(generation, absl::kZeroPad16), ":", chunk);
}
std::string RemoteTier::ClaimKey(const SpillKey& key) {
  return absl::StrCat("kvs:", Tag(key), ":claim");
}

absl::StatusOr<RemoteTier::Meta> RemoteTier::ReadMeta(const SpillKey& key,
                                                      const Reply& reply) const {
  if (reply.is_error()) return redis::ErrorReplyStatus("reading a remote copy", reply.str);
  if (reply.is_nil()) {
    return absl::NotFoundError(absl::StrCat("sequence ", key.sequence_id,
                                            " has no remote copy for tenant ", key.tenant));
  }
  const std::string& raw = reply.str;
  auto lost = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("the remote copy of sequence ", key.sequence_id,
                                            " is lost: its metadata ", why));
  };
  uint32_t crc = 0;
  Reader header(raw);
  if (!header.Get(&crc) || Crc32c(std::string_view(raw).substr(4)) != crc) {
    return lost("fails its checksum");
  }
  Reader r(std::string_view(raw).substr(4));
  Meta meta;
  uint32_t format = 0, layers = 0, chunks = 0;
  int64_t spilled_ns = 0;
  uint64_t snapshot_bytes = 0;
  bool ok = r.Get(&format) && format == kFormat && r.Get(&meta.generation) && r.Get(&spilled_ns) &&
            r.GetString(&meta.tenant) && r.GetString(&meta.sequence_id) &&
            r.GetString(&meta.session_id) && r.Get(&layers) && layers <= (1u << 16);
  for (uint32_t i = 0; ok && i < layers; ++i) {
    uint64_t b = 0;
    ok = r.Get(&b);
    meta.layer_bytes.push_back(b);
  }
  ok = ok && r.Get(&meta.chunk_bytes) && meta.chunk_bytes > 0 && r.Get(&chunks) &&
       chunks <= (1u << 24);
  for (uint32_t i = 0; ok && i < chunks; ++i) {
    uint32_t c = 0;
    ok = r.Get(&c);
    meta.chunk_crcs.push_back(c);
  }
  ok = ok && r.Get(&snapshot_bytes) && r.GetBytes(snapshot_bytes, &meta.snapshot) && r.done();
  if (!ok || meta.Chunks().size() != meta.chunk_crcs.size()) return lost("cannot be parsed");
  // The key embeds the tenant, but the copy must also say so: a copy is only ever served to the
  // tenant and sequence it was spilled as.
  if (meta.tenant != key.tenant || meta.sequence_id != key.sequence_id) {
    return lost("names another tenant or sequence");
  }
  meta.spilled = absl::FromUnixNanos(spilled_ns);
  return meta;
}

absl::Status RemoteTier::Put(const SpillKey& key, const SpilledSequence& data, absl::Time now) {
  const std::string what = absl::StrCat("spilling sequence ", key.sequence_id, " to Redis");
  const std::string ttl = Ms(options_.ttl);
  Meta meta;
  meta.generation = RandomGeneration();
  meta.spilled = now;
  meta.tenant = key.tenant;
  meta.sequence_id = key.sequence_id;
  meta.session_id = key.session_id;
  meta.chunk_bytes = options_.chunk_bytes;
  meta.snapshot = data.meta;
  for (const std::string& layer : data.layers) meta.layer_bytes.push_back(layer.size());
  const std::vector<std::pair<uint32_t, uint64_t>> chunks = meta.Chunks();
  meta.chunk_crcs.reserve(chunks.size());

  // The previous copy's generation, to delete its chunks with the new metadata.
  std::optional<Meta> previous;
  {
    absl::StatusOr<std::vector<Reply>> got = client_->Run(Tag(key), {{"GET", MetaKey(key)}});
    if (!got.ok()) return got.status();
    absl::StatusOr<Meta> parsed = ReadMeta(key, (*got)[0]);
    if (parsed.ok()) previous = *std::move(parsed);
  }

  // The chunks of the new generation, pipelined in batches.
  std::vector<std::vector<std::string>> batch;
  uint64_t batch_bytes = 0;
  auto flush = [&]() -> absl::Status {
    if (batch.empty()) return absl::OkStatus();
    absl::StatusOr<std::vector<Reply>> replies = client_->Run(Tag(key), batch);
    batch.clear();
    batch_bytes = 0;
    if (!replies.ok()) return replies.status();
    return FirstError(what, *replies);
  };
  absl::Status status = absl::OkStatus();
  for (uint32_t n = 0; n < chunks.size() && status.ok(); ++n) {
    const auto [layer, offset] = chunks[n];
    const std::string_view bytes =
        std::string_view(data.layers[layer]).substr(offset, meta.chunk_bytes);
    meta.chunk_crcs.push_back(Crc32c(bytes));
    batch.push_back({"SET", ChunkKey(key, meta.generation, n), std::string(bytes), "PX", ttl});
    batch_bytes += bytes.size();
    if (batch_bytes >= kPipelineBytes) status = flush();
  }
  if (status.ok()) status = flush();
  if (status.ok()) {
    // Metadata last, with the old generation's removal, in one transaction.
    std::vector<std::vector<std::string>> tx = {{"MULTI"},
                                                {"SET", MetaKey(key), meta.Encode(), "PX", ttl},
                                                {"DEL", ClaimKey(key)}};
    if (previous && previous->generation != meta.generation) {
      std::vector<std::string> del = {"DEL"};
      for (uint32_t n = 0; n < previous->chunk_crcs.size(); ++n) {
        del.push_back(ChunkKey(key, previous->generation, n));
      }
      if (del.size() > 1) tx.push_back(std::move(del));
    }
    tx.push_back({"EXEC"});
    absl::StatusOr<std::vector<Reply>> replies = client_->Run(Tag(key), tx);
    status = replies.ok() ? FirstError(what, *replies) : replies.status();
    if (status.ok() && replies->back().is_nil()) {
      status = absl::AbortedError(absl::StrCat(what, ": the transaction was discarded"));
    }
  }
  if (status.ok()) {
    absl::StatusOr<std::vector<Reply>> indexed = client_->Run(
        kIndexKey, {{"HSET", kIndexKey, IndexField(key),
                     absl::StrCat(meta.bytes(), " ", absl::ToUnixMillis(now), " ",
                                  key.session_id)}});
    status = indexed.ok() ? FirstError(what, *indexed) : indexed.status();
    if (status.ok()) return status;
    // Unlisted, the copy would escape the quotas: take it back.
    (void)Erase(key);
    return status;
  }
  // Best effort: the new chunks no metadata names (they expire with the TTL otherwise).
  std::vector<std::string> del = {"DEL"};
  for (uint32_t n = 0; n < meta.chunk_crcs.size(); ++n) {
    del.push_back(ChunkKey(key, meta.generation, n));
  }
  if (del.size() > 1) (void)client_->Run(Tag(key), {del});
  return status;
}

absl::StatusOr<std::shared_ptr<const SpilledSequence>> RemoteTier::Get(const SpillKey& key,
                                                                       bool claim) {
  const std::string what = absl::StrCat("restoring sequence ", key.sequence_id, " from Redis");
  absl::StatusOr<std::vector<Reply>> first =
      claim ? client_->Run(Tag(key),
                           {{"SET", ClaimKey(key), options_.owner, "NX", "PX",
                             Ms(options_.claim_ttl)},
                            {"GET", ClaimKey(key)},
                            {"GET", MetaKey(key)}})
            : client_->Run(Tag(key), {{"GET", MetaKey(key)}});
  if (!first.ok()) return first.status();
  if (claim) {
    if (absl::Status error = FirstError(what, {(*first)[0], (*first)[1]}); !error.ok()) {
      return error;
    }
    const Reply& holder = (*first)[1];
    if ((*first)[0].is_nil() && holder.str != options_.owner) {
      return absl::AbortedError(absl::StrCat(
          "the remote copy of sequence ", key.sequence_id, " is claimed by sidecar ",
          holder.is_nil() ? "(a claim that just ended)" : holder.str,
          " (restore claim ", ClaimKey(key), "): another sidecar is restoring it"));
    }
  }
  // Failures give up the claim taken above (none for an unclaimed read).
  auto release = [&] {
    if (claim) Release(key);
  };
  absl::StatusOr<Meta> meta = ReadMeta(key, claim ? (*first)[2] : (*first)[0]);
  if (!meta.ok()) {
    release();
    return meta.status();
  }
  SpilledSequence result;
  result.meta = meta->snapshot;
  result.layers.reserve(meta->layer_bytes.size());
  // Layer buffers from the spill buffer cache (pages already mapped), filled in place.
  for (uint64_t bytes : meta->layer_bytes) {
    result.layers.push_back(SpillBuffers::Default().Take(bytes));
  }
  auto give_back = [&] { SpillBuffers::Default().Give(std::move(result.layers)); };
  const std::vector<std::pair<uint32_t, uint64_t>> chunks = meta->Chunks();
  const uint32_t per_batch =
      static_cast<uint32_t>(std::max<uint64_t>(1, kPipelineBytes / meta->chunk_bytes));
  std::vector<uint32_t> crcs(chunks.size(), 0);
  for (uint32_t start = 0; start < chunks.size(); start += per_batch) {
    std::vector<std::vector<std::string>> batch;
    const uint32_t end = std::min<uint32_t>(chunks.size(), start + per_batch);
    for (uint32_t n = start; n < end; ++n) {
      batch.push_back({"GET", ChunkKey(key, meta->generation, n)});
    }
    auto expected_bytes = [&](uint32_t n) {
      const auto [layer, offset] = chunks[n];
      return std::min<uint64_t>(meta->chunk_bytes, meta->layer_bytes[layer] - offset);
    };
    // Each chunk is checksummed and copied into its place in the layer as it arrives (a retried
    // pipeline writes the same places again).
    auto sink = [&](size_t index, std::string_view bytes) {
      const uint32_t n = start + static_cast<uint32_t>(index);
      if (n >= end || bytes.size() != expected_bytes(n)) return;
      const auto [layer, offset] = chunks[n];
      crcs[n] = Crc32cCopy(bytes, result.layers[layer].data() + offset);
    };
    absl::StatusOr<std::vector<Reply>> replies = client_->Run(Tag(key), batch, sink);
    if (!replies.ok()) {
      give_back();
      release();
      return replies.status();
    }
    for (uint32_t n = start; n < end; ++n) {
      const Reply& reply = (*replies)[n - start];
      const uint64_t expected = expected_bytes(n);
      std::string why;
      if (reply.is_error()) {
        give_back();
        release();
        return redis::ErrorReplyStatus(what, reply.str);
      }
      if (reply.is_nil()) {
        why = "is missing";
      } else if (static_cast<uint64_t>(reply.integer) != expected) {
        why = absl::StrCat("has ", reply.integer, " bytes, not ", expected);
      } else if (crcs[n] != meta->chunk_crcs[n]) {
        why = "fails its checksum";
      }
      if (!why.empty()) {
        give_back();
        release();
        return absl::DataLossError(absl::StrCat(
            "the remote copy of sequence ", key.sequence_id, " is lost: chunk ", n, " (layer ",
            chunks[n].first, ", ", ChunkKey(key, meta->generation, n), ") ", why,
            "; it is never served (spill the sequence again, or erase it)"));
      }
    }
  }
  // The layer buffers go back to the spill buffer cache when the restore is done with them.
  return SpillBuffers::Default().Share(std::move(result));
}

void RemoteTier::Release(const SpillKey& key) {
  // Only our own claim: compare and delete in one script.
  (void)client_->Run(Tag(key),
                     {{"EVAL",
                       "if redis.call('GET', KEYS[1]) == ARGV[1] then "
                       "return redis.call('DEL', KEYS[1]) end return 0",
                       "1", ClaimKey(key), options_.owner}});
}

absl::Status RemoteTier::RemoveIndex(const SpillKey& key) const {
  absl::StatusOr<std::vector<Reply>> replies =
      client_->Run(kIndexKey, {{"HDEL", kIndexKey, IndexField(key)}});
  if (!replies.ok()) return replies.status();
  return FirstError("erasing a remote copy", *replies);
}

absl::Status RemoteTier::Erase(const SpillKey& key) {
  absl::StatusOr<std::vector<Reply>> got = client_->Run(Tag(key), {{"GET", MetaKey(key)}});
  if (!got.ok()) return got.status();
  std::vector<std::string> del = {"DEL", MetaKey(key), ClaimKey(key)};
  if (absl::StatusOr<Meta> meta = ReadMeta(key, (*got)[0]); meta.ok()) {
    for (uint32_t n = 0; n < meta->chunk_crcs.size(); ++n) {
      del.push_back(ChunkKey(key, meta->generation, n));
    }
  }
  absl::StatusOr<std::vector<Reply>> replies = client_->Run(Tag(key), {del});
  if (!replies.ok()) return replies.status();
  if (absl::Status status = FirstError("erasing a remote copy", *replies); !status.ok()) {
    return status;
  }
  return RemoveIndex(key);
}

std::optional<SpilledInfo> RemoteTier::Find(const SpillKey& key) const {
  absl::StatusOr<std::vector<Reply>> got = client_->Run(Tag(key), {{"GET", MetaKey(key)}});
  SpilledInfo info;
  info.key = key;
  info.tier = StorageTier::kRemote;
  if (!got.ok() && absl::IsUnavailable(got.status())) {
    // Redis unreachable: whether a copy exists cannot be told. Report one that may exist (its
    // size unknown) so that a restore goes on to Get and answers UNAVAILABLE (retry later),
    // never NOT_FOUND for a copy the worker was told is stored.
    return info;
  }
  if (!got.ok() || (*got)[0].is_nil() || (*got)[0].is_error()) return std::nullopt;
  absl::StatusOr<Meta> meta = ReadMeta(key, (*got)[0]);
  if (meta.ok()) {
    info.key.session_id = meta->session_id;
    info.bytes = meta->bytes();
    info.spilled = meta->spilled;
  } else {
    info.lost = std::string(meta.status().message());
  }
  return info;
}

std::vector<SpilledInfo> RemoteTier::List() const {
  std::vector<SpilledInfo> out;
  absl::StatusOr<std::vector<Reply>> all = client_->Run(kIndexKey, {{"HGETALL", kIndexKey}});
  if (!all.ok() || (*all)[0].type != Reply::Type::kArray) return out;
  const std::vector<Reply>& fields = (*all)[0].elements;
  for (size_t i = 0; i + 1 < fields.size(); i += 2) {
    const std::string& field = fields[i].str;
    const size_t colon = field.find(':');
    std::string tenant;
    if (colon == std::string::npos || colon % 2 != 0) continue;
    tenant = absl::HexStringToBytes(field.substr(0, colon));
    std::vector<std::string> value = absl::StrSplit(fields[i + 1].str, absl::MaxSplits(' ', 2));
    SpilledInfo info;
    info.key = {tenant, value.size() == 3 ? value[2] : "", field.substr(colon + 1)};
    info.tier = StorageTier::kRemote;
    int64_t ms = 0;
    if (value.size() >= 2) {
      (void)absl::SimpleAtoi(value[0], &info.bytes);
      (void)absl::SimpleAtoi(value[1], &ms);
    }
    info.spilled = absl::FromUnixMillis(ms);
    // The copy may have expired (its TTL) or been restored by a sidecar that died before
    // updating the list: drop such entries.
    absl::StatusOr<std::vector<Reply>> exists =
        client_->Run(Tag(info.key), {{"EXISTS", MetaKey(info.key)}});
    if (!exists.ok()) continue;
    if ((*exists)[0].integer == 0) {
      (void)RemoveIndex(info.key);
      continue;
    }
    out.push_back(std::move(info));
  }
  return out;
}

absl::StatusOr<uint64_t> RemoteTier::TenantBytes(const std::string& tenant) const {
  uint64_t total = 0;
  for (const SpilledInfo& info : List()) {
    if (info.key.tenant == tenant) total += info.bytes;
  }
  return total;
}

}  // namespace kvs::storage
