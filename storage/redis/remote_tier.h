// RemoteTier: the remote tier, spilled sequences kept in Redis (a single node or a Redis
// Cluster, through storage/redis/redis_client.h) so that they outlive the sidecar's pod and can
// be restored by another sidecar sharing the same Redis.
//
// Naming. A remote copy is addressed by (tenant, sequence id) alone: unlike the host and disk
// tiers, the session that spilled it is not part of its name (it is recorded in the metadata
// for Admin.ListSpilled), so that a new session on any sidecar of the tenant can name it. Within
// one tenant a sequence id therefore names one remote copy across every sidecar sharing the
// Redis; a later spill of the same id replaces it. Every key of a copy shares one hash tag,
// {<hex tenant>:<sequence id>}, hence one cluster slot and one node:
//   kvs:{T:S}:m                the metadata (written last)
//   kvs:{T:S}:c:<gen>:<n>      chunk n of the K/V bytes (layers in order, each cut into chunks
//                              of at most chunk_bytes) of generation gen
//   kvs:{T:S}:claim            the restore claim: the claiming sidecar's id, with a TTL
//   kvs:{idx}:copies           a hash (its own slot) listing every copy for List and the quotas:
//                              field <hex tenant>:<sequence id>, value "<bytes> <unix ms> <session>"
// The tenant is hex-encoded, so no tenant name can reach into another's keys, and the metadata
// names its tenant and sequence, checked on every read.
//
// Metadata: crc32c(rest) u32 LE, format u32 (1), gen u64, spilled unix ns i64, tenant, sequence
// id, session id (each u32 length + bytes), layers u32, per layer bytes u64, chunk_bytes u64,
// chunks u32, per chunk crc32c u32, snapshot meta (u64 length + bytes).
//
// Integrity. A Put writes the chunks of a fresh generation (each with the TTL), then, in one
// MULTI/EXEC, the metadata and the deletion of the previous generation's chunks: a reader sees
// the old copy or the new one, never a mix, and a Put cut short leaves only chunks no metadata
// names, which expire. A Get checks the metadata's and every chunk's CRC-32C and that no chunk is
// missing: a copy is served whole or answered DATA_LOSS, never partly.
//
// Claims. A Get for a restore first takes the claim (SET NX PX: atomic in Redis), so that of two
// sidecars racing to restore one copy exactly one reads it; the other gets ABORTED naming the
// claim's holder. The winner deletes the copy (Erase) once the sequence is in its arena, or drops
// the claim (Release) if the restore fails; a claim whose holder died expires after claim_ttl.
//
// Threading: thread-safe (the client serialises its calls).
#ifndef KVSIDECAR_STORAGE_REDIS_REMOTE_TIER_H_
#define KVSIDECAR_STORAGE_REDIS_REMOTE_TIER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cache/tier.h"
#include "storage/redis/redis_client.h"

namespace kvs::storage {

struct RemoteTierOptions {
  redis::ClientOptions client;  // seeds empty = no remote tier
  // Every key of a copy expires this long after its spill, so that copies no one restores (their
  // worker never came back) do not stay forever.
  absl::Duration ttl = absl::Hours(24 * 7);
  absl::Duration claim_ttl = absl::Seconds(60);
  uint64_t chunk_bytes = uint64_t{8} << 20;
  // Who claims (a random id per sidecar process unless set): named in a losing claim's error.
  std::string owner;
};

class RemoteTier {
 public:
  explicit RemoteTier(RemoteTierOptions options);

  // RESOURCE_EXHAUSTED when Redis is out of memory, UNAVAILABLE when it cannot be reached;
  // the previous copy (if any) stays then.
  absl::Status Put(const SpillKey& key, const SpilledSequence& data, absl::Time now);
  // Claims the copy and reads it: NOT_FOUND without one, ABORTED when another sidecar holds its
  // claim, DATA_LOSS when a checksum fails or a chunk is missing (the claim is dropped then).
  // With claim = false (a published prefix, read by many) the copy is read without a claim.
  absl::StatusOr<std::shared_ptr<const SpilledSequence>> Get(const SpillKey& key,
                                                             bool claim = true);
  // Drops this sidecar's claim on the copy (a restore that failed after Get).
  void Release(const SpillKey& key);
  absl::Status Erase(const SpillKey& key);
  // The copy's entry (its session id is the spilling one's); nullopt without a copy. When Redis
  // cannot be reached, an entry of unknown size (a copy may exist: Get then says UNAVAILABLE).
  std::optional<SpilledInfo> Find(const SpillKey& key) const;
  std::vector<SpilledInfo> List() const;
  // Bytes of `tenant`'s remote copies (every sidecar's), for the remote_bytes quota.
  absl::StatusOr<uint64_t> TenantBytes(const std::string& tenant) const;
  std::string Describe() const { return client_->Describe(); }

  // Key names, for tests that damage copies with redis-cli.
  static std::string Tag(const SpillKey& key);
  static std::string MetaKey(const SpillKey& key);
  static std::string ChunkKey(const SpillKey& key, uint64_t generation, uint32_t chunk);
  static std::string ClaimKey(const SpillKey& key);

 private:
  struct Meta;
  absl::StatusOr<Meta> ReadMeta(const SpillKey& key, const redis::Reply& reply) const;
  absl::Status RemoveIndex(const SpillKey& key) const;

  const RemoteTierOptions options_;
  const std::unique_ptr<redis::Client> client_;
};

}  // namespace kvs::storage

#endif  // KVSIDECAR_STORAGE_REDIS_REMOTE_TIER_H_
