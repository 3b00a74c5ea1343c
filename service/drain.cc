#include "service/drain.h"

#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cache/clock.h"
#include "service/log.h"

namespace kvs {

namespace {

// Host copies die with the process and arena sequences with their session: both must move.
bool InTarget(const SequenceInfo& info, StorageTier target) { return info.tier == target; }

// A Spill blocked by a pending reservation can succeed once the worker commits or cancels it.
bool Retryable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition &&
         absl::StrContains(status.message(), "pending reservation");
}

}  // namespace

absl::StatusOr<StorageTier> ParseDrainTarget(absl::string_view text, absl::string_view name) {
  if (text == "disk") return StorageTier::kDisk;
  if (text == "remote") return StorageTier::kRemote;
  if (text == "none") return StorageTier::kArena;
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be disk, remote or none, got \"", text, "\""));
}

std::string DrainTargetName(StorageTier tier) {
  if (tier == StorageTier::kDisk) return "disk";
  if (tier == StorageTier::kRemote) return "remote";
  if (tier == StorageTier::kArena) return "none";
  return StorageTierName(tier);
}

DrainReport DrainSequences(KvPool& pool, StorageTier target, absl::Time deadline, bool retry) {
  const absl::Time start = MonotonicNow();
  DrainReport report;
  using Key = std::pair<std::string, std::string>;  // (session, sequence)
  std::map<Key, DrainedSequence> results;
  // Sequences whose failure is final for this drain (not tried again).
  std::map<Key, bool> final_failure;
  const std::string target_name = DrainTargetName(target);
  for (bool first = true;; first = false) {
    std::vector<SequenceInfo> listed = pool.ListSequences("");
    bool pending = false;   // something left that another pass could move
    for (const SequenceInfo& info : listed) {
      const Key key{info.session_id, info.sequence_id};
      DrainedSequence& out = results[key];
      out.tenant = info.tenant;
      out.session_id = info.session_id;
      out.sequence_id = info.sequence_id;
      if (InTarget(info, target)) {
        if (!out.moved) {
          out.moved = true;
          out.tier = target;
          out.bytes = target == StorageTier::kDisk ? info.disk_bytes : out.bytes;
          out.reason.clear();
        }
        continue;
      }
      out.moved = false;
      out.tier = info.tier;
      if (final_failure.contains(key)) continue;
      if (MonotonicNow() >= deadline) {
        report.grace_expired = true;
        out.reason = absl::StrCat("not moved to the ", target_name,
                                  " tier: the grace period ended first",
                                  out.reason.empty() ? "" : " (last attempt: ", out.reason,
                                  out.reason.empty() ? "" : ")");
        continue;
      }
      absl::StatusOr<SpillResult> spilled = pool.Spill(info.session_id, info.sequence_id, target);
      if (spilled.ok()) {
        out.moved = true;
        out.tier = spilled->tier;
        out.bytes = spilled->bytes;
        out.reason.clear();
        continue;
      }
      if (spilled.status().code() == absl::StatusCode::kNotFound) {
        // Released (or its session ended) since the listing: nothing left to move.
        results.erase(key);
        continue;
      }
      out.reason = std::string(spilled.status().message());
      if (retry && Retryable(spilled.status())) {
        pending = true;
      } else {
        final_failure[key] = true;
      }
    }
    // Sequences released or sessions ended since an earlier pass are no longer reported.
    if (!first) {
      std::map<Key, bool> present;
      for (const SequenceInfo& info : listed) present[{info.session_id, info.sequence_id}] = true;
      for (auto it = results.begin(); it != results.end();) {
        it = present.contains(it->first) ? std::next(it) : results.erase(it);
      }
    }
    if (!retry || MonotonicNow() >= deadline) break;
    // Another pass when a move may still succeed, or a call brought a moved sequence back.
    bool again = pending;
    if (!again) {
      for (const SequenceInfo& info : pool.ListSequences("")) {
        if (!InTarget(info, target) && !final_failure.contains({info.session_id, info.sequence_id})) {
          again = true;
          break;
        }
      }
    }
    if (!again) break;
    absl::SleepFor(std::min(absl::Milliseconds(20), deadline - MonotonicNow()));
  }
  for (auto& [key, out] : results) {
    if (!out.moved && out.reason.empty()) {
      report.grace_expired = true;
      out.reason = absl::StrCat("not moved to the ", target_name,
                                " tier: the grace period ended first");
    }
    (out.moved ? report.moved : report.not_moved)++;
    report.sequences.push_back(std::move(out));
  }
  report.elapsed = MonotonicNow() - start;
  return report;
}

void LogDrainReport(const DrainReport& report, StorageTier target, absl::string_view event) {
  for (const DrainedSequence& sequence : report.sequences) {
    if (sequence.moved) {
      KVS_LOG(kDebug, event)
      ("tenant", sequence.tenant)("session", sequence.session_id)("sequence",
                                                                  sequence.sequence_id)(
          "moved", "true")("bytes", sequence.bytes);
      continue;
    }
    KVS_LOG(kWarning, event)
    ("tenant", sequence.tenant)("session", sequence.session_id)("sequence", sequence.sequence_id)(
        "moved", "false")("tier", StorageTierName(sequence.tier))("reason", sequence.reason);
  }
  KVS_LOG(kInfo, event)
  ("to", DrainTargetName(target))("moved", report.moved)("not_moved", report.not_moved)(
      "grace_expired", report.grace_expired ? "true" : "false")(
      "elapsed_ms", absl::ToInt64Milliseconds(report.elapsed));
}

}  // namespace kvs
