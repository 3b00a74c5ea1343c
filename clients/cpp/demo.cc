// kvs_demo: a worker's view of kvsidecar in a few lines of output. Attaches a small model layout,
// writes 256 tokens of K/V straight into the mapped arena (Reserve -> memcpy -> Commit), asks the
// sidecar to compress the sequence to 64 tokens per layer with KeyDiff, then reads the kept tokens
// back in place (block table + positions) and through Export and checks them bit for bit against
// what it wrote. A StreamingLLM sequence follows for contrast. Exits non-zero on any mismatch.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gpu/base/dtype.h"
#include "kvsidecar/client.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "kvsidecar data-plane address");
ABSL_FLAG(std::string, admin_target, "",
          "kvsidecar Admin address; when set, the demo shows the server's stats after detaching");
ABSL_FLAG(std::string, tenant, "demo", "tenant to attach as");
ABSL_FLAG(int, tokens, 256, "tokens written per sequence (in two Reserve/Commit rounds)");
ABSL_FLAG(int, budget, 64, "tokens per layer kept by compression");

namespace {

namespace v1 = kvsidecar::v1;

constexpr int kLayers = 4;
constexpr int kKvHeads = 2;
constexpr int kQHeads = 8;
constexpr int kHeadDim = 64;

// The value the demo writes for element d of the (layer, kv, head) row of the token at `position`:
// a deterministic pseudo-random fp16, so every kept token can be re-derived and compared exactly.
uint16_t ValueAt(uint64_t seed, int layer, int kv, int head, int position, int d) {
  uint64_t x = seed;
  for (uint64_t part :
       {uint64_t(layer), uint64_t(kv), uint64_t(head), uint64_t(position), uint64_t(d)}) {
    x = (x ^ part) * 0x9e3779b97f4a7c15ull;
    x ^= x >> 29;
  }
  const float unit = static_cast<float>(x >> 40) / static_cast<float>(1 << 24);  // [0, 1)
  return kvs::FloatToFloat16(unit * 4.0f - 2.0f);
}

std::vector<uint8_t> RowAt(uint64_t seed, int layer, int kv, int head, int position) {
  std::vector<uint8_t> row(kHeadDim * sizeof(uint16_t));
  for (int d = 0; d < kHeadDim; ++d) {
    const uint16_t bits = ValueAt(seed, layer, kv, head, position, d);
    std::memcpy(row.data() + d * sizeof(uint16_t), &bits, sizeof(bits));
  }
  return row;
}

bool SameBytes(absl::Span<const uint8_t> a, const std::vector<uint8_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), b.size()) == 0;
}

// Writes, compresses, reads back and verifies one sequence; prints what happened.
absl::Status RunSequence(kvsidecar::Session& session, const std::string& name,
                         const v1::PolicySpec& policy, uint64_t seed) {
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int budget = absl::GetFlag(FLAGS_budget);
  v1::Budget budget_spec;
  budget_spec.set_tokens_per_layer(budget);
  auto created = session.CreateSequence(policy, budget_spec, "demo-" + name);
  if (!created.ok()) return created.status();
  const std::string seq = created->sequence_id();

  // Two rounds, as a worker would write a prompt in blocks: reserve slots, write every (layer,
  // kv, head) row of every new token into the mapped arena, commit.
  const int rounds = 2;
  for (int round = 0; round < rounds; ++round) {
    const int n = tokens / rounds + (round == 0 ? tokens % rounds : 0);
    auto reservation = session.Reserve(seq, n);
    if (!reservation.ok()) return reservation.status();
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int head = 0; head < kKvHeads; ++head) {
          for (int i = 0; i < n; ++i) {
            const auto row = RowAt(seed, layer, kv, head, reservation->positions()[i]);
            absl::Status written = session.WriteReserved(*reservation, layer, kv, head, i, row);
            if (!written.ok()) return written;
          }
        }
      }
    }
    auto committed = session.Commit(*reservation);
    if (!committed.ok()) return committed.status();
  }
  auto before = session.GetLayout(seq, {}, /*omit_positions=*/true);
  if (!before.ok()) return before.status();

  kvsidecar::CompressOptions compress_options;
  compress_options.return_positions = true;
  auto compressed = session.Compress(seq, compress_options);
  if (!compressed.ok()) return compressed.status();
  auto after = session.GetLayout(seq);
  if (!after.ok()) return after.status();

  const uint64_t token_bytes = 2ull * kKvHeads * kHeadDim * sizeof(uint16_t);
  uint64_t bytes_before = 0, bytes_after = 0;
  int blocks_before = 0, blocks_after = 0;
  for (const auto& layer : before->layers()) {
    bytes_before += layer.count() * token_bytes;
    blocks_before += layer.block_table_size();
  }
  std::vector<int> kept, evicted;
  for (const auto& layer : compressed->layers()) {
    kept.push_back(layer.kept());
    evicted.push_back(layer.evicted());
  }
  for (const auto& layer : after->layers()) {
    bytes_after += layer.count() * token_bytes;
    blocks_after += layer.block_table_size();
  }

  // Verify every kept token in place (block table + position table) and through Export.
  auto exported = session.Export(seq);
  if (!exported.ok()) return exported.status();
  int verified = 0;
  for (int li = 0; li < after->layers_size(); ++li) {
    const v1::LayerLayout& layer = after->layers(li);
    // Export lists the layers in the order GetLayout does (all of them, ascending).
    const int export_index = li;
    if (li >= exported->header.layers_size() ||
        exported->header.layers(li).layer() != layer.layer() ||
        exported->header.layers(li).count() != layer.count()) {
      return absl::DataLossError(
          absl::StrCat("Export disagrees with GetLayout on layer ", layer.layer()));
    }
    const v1::LayerLayout* exported_layer = &exported->header.layers(li);
    for (int head = 0; head < kKvHeads; ++head) {
      for (int slot = 0; slot < layer.count(); ++slot) {
        const int position = layer.positions(head * layer.count() + slot);
        if (exported_layer->positions(head * layer.count() + slot) != position) {
          return absl::DataLossError(absl::StrCat("Export position mismatch at layer ",
                                                  layer.layer(), " head ", head, " slot ", slot));
        }
        for (int kv = 0; kv < 2; ++kv) {
          const auto expected = RowAt(seed, layer.layer(), kv, head, position);
          // A copy (ReadRowInto), so that the demo also checks a device (CUDA IPC) arena.
          std::vector<uint8_t> in_place(expected.size());
          if (absl::Status read =
                  session.ReadRowInto(layer, kv, head, slot, absl::MakeSpan(in_place));
              !read.ok()) {
            return read;
          }
          auto via_export = exported->Row(export_index, kv, head, slot);
          if (!via_export.ok()) return via_export.status();
          if (!SameBytes(in_place, expected) || !SameBytes(*via_export, expected)) {
            return absl::DataLossError(absl::StrFormat(
                "%s: layer %d %s head %d position %d (slot %d) differs from what was written", name,
                layer.layer(), kv == 0 ? "K" : "V", head, position, slot));
          }
        }
        ++verified;
      }
    }
  }

  std::vector<int> head0;
  const v1::LayerLayout& layer0 = after->layers(0);
  head0.assign(layer0.positions().begin(), layer0.positions().begin() + layer0.count());
  std::sort(head0.begin(), head0.end());
  if (head0.size() > 12) head0.resize(12);

  const std::string tag = absl::StrCat("[", name, "]");
  absl::PrintF("%s wrote %d tokens x %d layers into the mapped arena (%d Reserve/Commit rounds)\n",
               tag, tokens, kLayers, rounds);
  absl::PrintF("%s compressed to %d tokens/layer: kept per layer [%s], evicted [%s]\n", tag, budget,
               absl::StrJoin(kept, " "), absl::StrJoin(evicted, " "));
  absl::PrintF("%s KV bytes %d -> %d (blocks %d -> %d, %d freed)\n", tag, bytes_before, bytes_after,
               blocks_before, blocks_after, compressed->blocks_freed());
  absl::PrintF("%s layer 0 head 0 first kept positions: %s ...\n", tag, absl::StrJoin(head0, " "));
  absl::PrintF(
      "%s verified %d kept tokens bit-for-bit (K and V of every (layer, head), in place "
      "and via Export)\n",
      tag, verified);

  auto released = session.ReleaseSequence(seq);
  if (!released.ok()) return released.status();
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string target = absl::GetFlag(FLAGS_target);
  kvsidecar::ClientOptions options;
  options.worker_name = "kvs_demo";
  auto client = kvsidecar::Client::Connect(target, options);
  if (!client.ok()) {
    absl::FPrintF(stderr, "kvs_demo: %s\n", client.status().ToString());
    return 1;
  }
  v1::ModelLayout layout;
  layout.set_num_layers(kLayers);
  layout.set_num_kv_heads(kKvHeads);
  layout.set_num_q_heads(kQHeads);
  layout.set_head_dim(kHeadDim);
  layout.set_dtype(v1::DTYPE_FLOAT16);
  layout.set_block_tokens(16);
  auto session = (*client)->Attach(layout, absl::GetFlag(FLAGS_tenant), /*num_blocks=*/256,
                                   /*lease_ms=*/10000);
  if (!session.ok()) {
    absl::FPrintF(stderr, "kvs_demo: attach: %s\n", session.status().ToString());
    return 1;
  }
  const v1::ArenaHandle& arena = (*session)->arena();
  absl::PrintF(
      "kvs_demo: attached to %s as session %s (%s backend); mapped arena %s: %d blocks of %d "
      "bytes\n",
      target, (*session)->session_id(), (*session)->attach_response().backend(),
      arena.kind() == v1::ArenaHandle::KIND_MEMFD ? "(memfd from " + arena.fd_socket_path() + ")"
                                                  : arena.shm_path(),
      arena.num_blocks(), arena.block_bytes());
  absl::PrintF("kvs_demo: model L=%d H=%d Hq=%d D=%d fp16, block_tokens=%d\n", kLayers, kKvHeads,
               kQHeads, kHeadDim, (*session)->layout().block_tokens());

  v1::PolicySpec keydiff;
  keydiff.set_name("keydiff");
  keydiff.mutable_keydiff();
  v1::PolicySpec streaming;
  streaming.set_name("streaming_llm");
  streaming.mutable_streaming_llm()->set_n_sink(4);

  int failures = 0;
  for (const auto& [name, policy, seed] :
       {std::tuple{std::string("keydiff"), keydiff, uint64_t{1}},
        std::tuple{std::string("streaming_llm"), streaming, uint64_t{2}}}) {
    absl::Status status = RunSequence(**session, name, policy, seed);
    if (!status.ok()) {
      absl::FPrintF(stderr, "kvs_demo: [%s] FAILED: %s\n", name, status.ToString());
      ++failures;
    }
  }
  auto detached = (*session)->Detach();
  if (!detached.ok()) {
    absl::FPrintF(stderr, "kvs_demo: detach: %s\n", detached.status().ToString());
    ++failures;
  }
  if (const std::string admin_target = absl::GetFlag(FLAGS_admin_target); !admin_target.empty()) {
    auto admin = kvsidecar::AdminClient::Connect(admin_target, options);
    auto stats = admin.ok() ? (*admin)->GetStats() : admin.status();
    if (!stats.ok()) {
      absl::FPrintF(stderr, "kvs_demo: admin stats: %s\n", stats.status().ToString());
      ++failures;
    } else {
      absl::PrintF(
          "kvs_demo: after detach the sidecar reports %d sessions, %d sequences, %d arena bytes in "
          "use; %d token-layers appended, %d evicted\n",
          stats->sessions(), stats->sequences(), stats->arena_bytes_used(),
          stats->tokens_appended(), stats->tokens_evicted());
    }
  }
  absl::PrintF("kvs_demo: %s\n", failures == 0 ? "OK" : "FAILED");
  return failures == 0 ? 0 : 1;
}
