// A bounded fuzz run over the request surface of the real kvsidecar binary: it starts the server
// (tests/e2e harness), attaches two sessions, creates sequences under several policies and keeps
// them fed with valid K/V, then sends requests to every RPC of the data plane and Admin (Drain
// excepted: it would end the run) built from the request descriptors: fields filled with
// plausible values (the live session and sequence ids, small sizes) and, at random, mutated to
// extremes (0, -1, INT_MIN/MAX, NaN/Inf, empty, huge or foreign ids, truncated or garbage bytes,
// out-of-range enums, unknown oneof members), plus now and then a request frame of garbage bytes.
//
// After every request it checks that
//  - the server process is alive and answers;
//  - the status code is one a client mistake may get (never INTERNAL, UNKNOWN, DATA_LOSS,
//    UNAVAILABLE or UNIMPLEMENTED; DEADLINE_EXCEEDED only for Watch, which never ends);
//  - a failed call left the sequence it named unchanged (GetLayout before and after: counts,
//    positions, budgets, next position, tokens appended, policy), except the eviction a strict
//    budget does before a Reserve/Append, which the contract keeps even if the call fails;
//  - a sequence with a strict budget never holds more than budget + prefill_block_tokens tokens.
//
// Deterministic for a seed (KVS_FUZZ_SEED, default 19) up to timing; bounded by KVS_FUZZ_SECONDS
// (default 60). Every violation is listed at the end with its request and response (at most 50;
// the run stops there). KVS_FUZZ_VERBOSE=1 also prints why the valid writes failed.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/text_format.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "kvsidecar/v1/admin.grpc.pb.h"
#include "kvsidecar/v1/sidecar.grpc.pb.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

namespace pb = ::google::protobuf;

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strtoll(value, nullptr, 10);
}

std::string Truncated(std::string text, size_t limit = 700) {
  if (text.size() > limit)
    text = text.substr(0, limit) + "...(" + std::to_string(text.size()) + ")";
  return text;
}

// Text of a request for the report (bytes fields shortened by the printer's limit).
std::string Describe(const pb::Message& message) {
  pb::TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  printer.SetTruncateStringFieldLongerThan(48);
  std::string text;
  printer.PrintToString(message, &text);
  return Truncated(text);
}

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

struct Sequence {
  std::string id;
  bool strict = false;
};

struct OwnSession {
  std::unique_ptr<kvsidecar::Session> session;
  std::string tenant;
  v1::ModelLayout layout;
  std::vector<Sequence> sequences;
};

struct Finding {
  std::string method;
  std::string request;
  std::string outcome;
};

class RequestFuzzer {
 public:
  RequestFuzzer(ServerProcess* server, uint64_t seed) : server_(server), rng_(seed) {
    channel_ = grpc::CreateChannel(server->data_target(), grpc::InsecureChannelCredentials());
    admin_channel_ =
        grpc::CreateChannel(server->admin_target(), grpc::InsecureChannelCredentials());
    sidecar_ = v1::Sidecar::NewStub(channel_);
    generic_ = std::make_unique<grpc::GenericStub>(channel_);
    admin_generic_ = std::make_unique<grpc::GenericStub>(admin_channel_);
    for (const char* name : {"kvsidecar.v1.Sidecar", "kvsidecar.v1.Admin"}) {
      const pb::ServiceDescriptor* service =
          pb::DescriptorPool::generated_pool()->FindServiceByName(name);
      for (int i = 0; i < service->method_count(); ++i) {
        const pb::MethodDescriptor* method = service->method(i);
        // Drain stops the data plane for good: the rest of the run would test nothing.
        if (method->name() == "Drain") continue;
        methods_.push_back(method);
      }
    }
  }

  absl::Status Setup() {
    auto client = server_->Connect();
    if (!client.ok()) return client.status();
    client_ = std::move(*client);
    for (int s = 0; s < 2; ++s) {
      absl::Status status = Reattach(s);
      if (!status.ok()) return status;
    }
    return absl::OkStatus();
  }

  void Run(absl::Duration budget) {
    const absl::Time end = absl::Now() + budget;
    while (absl::Now() < end && findings_.size() < 50) {
      ++iterations_;
      KeepOwnSessionsUsable();
      if (Chance(0.15)) FeedValidTokens();
      FuzzOne();
      if (!server_->process().Running()) {
        findings_.push_back(
            {"(process)", "", "the server process exited:\n" + Truncated(server_->Logs(), 4000)});
        return;
      }
    }
  }

  const std::vector<Finding>& findings() const { return findings_; }
  int64_t iterations() const { return iterations_; }
  std::string Summary() const {
    std::string out;
    for (const auto& [key, count] : outcomes_) absl::StrAppend(&out, "  ", key, ": ", count, "\n");
    return out;
  }

 private:
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  int64_t Uniform(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  template <typename T>
  const T& Pick(const std::vector<T>& values) {
    return values[Uniform(0, static_cast<int64_t>(values.size()) - 1)];
  }

  // ---- The fuzzer's own sessions and sequences: the valid ids the requests aim at. ----

  absl::Status Reattach(int index) {
    if (own_.size() <= static_cast<size_t>(index)) own_.resize(index + 1);
    OwnSession& own = own_[index];
    own.session.reset();  // detaches if it still exists
    own.sequences.clear();
    own.tenant = absl::StrCat("fuzz-", index);
    own.layout = index == 0 ? MakeLayout(2, 2, 4, 16, v1::DTYPE_FLOAT16, 4)
                            : MakeLayout(3, 1, 2, 8, v1::DTYPE_FLOAT32, 8);
    auto session = client_->Attach(own.layout, own.tenant, 256, 60000);
    if (!session.ok()) return session.status();
    own.session = std::move(*session);
    // Several policies, strict and relaxed budgets.
    struct Spec {
      const char* name;
      v1::PolicySpec policy;
      int budget;
      bool strict;
    };
    std::vector<Spec> specs;
    specs.push_back({"kd", KeyDiffPolicy(), 16, false});
    specs.push_back({"kds", KeyDiffPolicy(), 12, true});
    specs.push_back({"st", StreamingPolicy(2), 16, false});
    for (const char* policy : {"h2o", "tova", "snapkv", "d2o", "caote", "cake"}) {
      v1::PolicySpec spec;
      spec.set_name(policy);
      specs.push_back({policy, spec, 4, false});
    }
    for (const Spec& spec : specs) {
      v1::Budget budget = MakeBudget(spec.budget);
      budget.set_strict(spec.strict);
      if (spec.strict) budget.set_prefill_block_tokens(8);
      auto created = own.session->CreateSequence(spec.policy, budget, spec.name);
      if (created.ok()) own.sequences.push_back({spec.name, spec.strict});
    }
    if (own.sequences.empty()) return absl::InternalError("no sequence could be created");
    return absl::OkStatus();
  }

  // Fuzzed ForceRelease / Detach may end an own session or sequence: make new ones.
  void KeepOwnSessionsUsable() {
    for (size_t s = 0; s < own_.size(); ++s) {
      OwnSession& own = own_[s];
      if (own.session != nullptr) {
        v1::HeartbeatRequest request;
        request.set_session_id(own.session->session_id());
        v1::HeartbeatResponse response;
        grpc::ClientContext context;
        // Now and then a fresh start: fuzzed releases wear the sequences away.
        if (sidecar_->Heartbeat(&context, request, &response).ok() && !own.sequences.empty() &&
            !Chance(0.0005)) {
          continue;
        }
      }
      if (absl::Status status = Reattach(static_cast<int>(s)); !status.ok()) {
        // Other fuzzed sessions may hold the arena capacity for a while; try again later.
        ++outcomes_["(reattach failed) " + std::string(absl::StatusCodeToString(status.code()))];
      }
    }
  }

  // Valid traffic so that the fuzzed calls meet sequences with tokens in them.
  void FeedValidTokens() {
    OwnSession& own = own_[Uniform(0, own_.size() - 1)];
    if (own.session == nullptr || own.sequences.empty()) return;
    const Sequence& sequence = Pick(own.sequences);
    const int tokens = static_cast<int>(Uniform(1, sequence.strict ? 8 : 12));
    // Attention policies compress only with queries (DecodeStep, Compress): a Commit that asked
    // to compress without them would fail and leave its reservation pending.
    const bool keys_only = sequence.id == "kd" || sequence.id == "kds" || sequence.id == "st";
    const bool compress = keys_only && Chance(0.7);
    const std::string& session_id = own.session->session_id();
    auto written = WriteTokens(*own.session, sequence.id, tokens, Uniform(1, 1000), compress);
    const absl::StatusCode code = written.status().code();
    ++outcomes_[absl::StrCat("(valid write) ", absl::StatusCodeToString(code))];
    const std::string call = absl::StrCat(tokens, " tokens", compress ? ", compress" : "");
    Remember(absl::StrCat(session_id, "/", sequence.id),
             absl::StrCat("(valid write) ", absl::StatusCodeToString(code), ": ", call));
    // The written tokens are state changes like any fuzzed call's: the budget bounds hold after
    // them too (a sequence fuzzed calls made strict is written here as a relaxed one). A write
    // creates no sequence, so one that is gone now was gone before: nothing is checked then.
    CheckStrictBudget("(valid write) " + sequence.id, call, session_id, sequence.id);
    if (std::getenv("KVS_FUZZ_VERBOSE") != nullptr && !written.ok()) {
      std::printf("valid write %s %d: %s\n", sequence.id.c_str(), tokens,
                  written.status().ToString().c_str());
    }
    if (!AllowedCode(code, "valid write")) {
      findings_.push_back({"(valid write) " + sequence.id, absl::StrCat(tokens, " tokens"),
                           written.status().ToString()});
    }
  }

  // ---- Request generation. ----

  std::string RandomBytes(size_t size) {
    std::string bytes(size, '\0');
    for (char& c : bytes) c = static_cast<char>(Uniform(0, 255));
    return bytes;
  }

  // K/V- or query-like payload: mostly finite floats, the size a multiple of 2 or 4.
  std::string PayloadBytes() {
    const size_t elements = Uniform(0, 1) ? Uniform(0, 64) : Uniform(0, 4096);
    std::string bytes(elements * 4, '\0');
    for (size_t i = 0; i < elements; ++i) {
      float value = static_cast<float>(std::uniform_real_distribution<double>(-2, 2)(rng_));
      std::memcpy(&bytes[i * 4], &value, 4);
    }
    if (elements > 0 && Chance(0.05)) {  // a non-finite value somewhere
      const float odd = Chance(0.5) ? std::numeric_limits<float>::quiet_NaN()
                                    : std::numeric_limits<float>::infinity();
      std::memcpy(&bytes[Uniform(0, elements - 1) * 4], &odd, 4);
    }
    if (Chance(0.1)) bytes.resize(Uniform(0, bytes.size()));  // truncated
    return bytes;
  }

  // `elements` values of `dtype` in [-2, 2), now and then one NaN or infinity among them.
  std::string TensorBytes(size_t elements, v1::DType dtype) {
    const size_t width = dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
    std::string bytes(elements * width, '\0');
    const int64_t odd = elements > 0 && Chance(0.1) ? Uniform(0, elements - 1) : -1;
    for (size_t i = 0; i < elements; ++i) {
      float value = static_cast<float>(std::uniform_real_distribution<double>(-2, 2)(rng_));
      if (static_cast<int64_t>(i) == odd) {
        value = Chance(0.5) ? std::numeric_limits<float>::quiet_NaN()
                            : std::numeric_limits<float>::infinity();
      }
      uint32_t bits;
      std::memcpy(&bits, &value, 4);
      if (width == 4) {
        std::memcpy(&bytes[i * 4], &bits, 4);
        continue;
      }
      uint16_t half;
      if (dtype == v1::DTYPE_BFLOAT16) {
        half = static_cast<uint16_t>(bits >> 16);
      } else if (std::isnan(value)) {
        half = 0x7e00;
      } else if (std::isinf(value)) {
        half = 0x7c00;
      } else {  // |value| < 2: exponent and mantissa rounded down into binary16
        const uint32_t sign = (bits >> 16) & 0x8000;
        const int exponent = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
        half = exponent <= 0
                   ? static_cast<uint16_t>(sign)
                   : static_cast<uint16_t>(sign | (exponent << 10) | ((bits >> 13) & 0x3ff));
      }
      std::memcpy(&bytes[i * 2], &half, 2);
    }
    return bytes;
  }

  // Gives the K/V and query payloads of some DecodeStep items and Append headers exactly the
  // size the session's layout asks for, so that the call gets past the size checks into the
  // policies (non-finite values included).
  void ShapePayloads(pb::Message* request, const OwnSession& own) {
    const v1::ModelLayout& layout = own.layout;
    const size_t layers = layout.num_layers();
    const size_t row = static_cast<size_t>(layout.num_kv_heads()) * layout.head_dim();
    if (auto* decode = dynamic_cast<v1::DecodeStepRequest*>(request)) {
      const bool all = Chance(0.5);  // a whole valid step, else some items among random ones
      if (all) {
        decode->clear_items();
        for (int64_t n = Uniform(1, 2); n > 0; --n) decode->add_items();
      }
      for (v1::DecodeStepRequest::Item& item : *decode->mutable_items()) {
        if ((!all && !Chance(0.6)) || own.sequences.empty()) continue;
        item.set_session_id(own.session->session_id());
        item.set_sequence_id(Pick(own.sequences).id);
        item.set_reservation_id(0);
        item.set_inline_kv(TensorBytes(layers * 2 * row, layout.dtype()));
        v1::AttentionInputs* attention = item.mutable_attention();
        attention->Clear();
        attention->set_num_queries(1);
        attention->set_softmax_scale(0.25f);
        attention->set_inline_queries(
            TensorBytes(layers * layout.num_q_heads() * layout.head_dim(), layout.dtype()));
      }
    } else if (auto* header = dynamic_cast<v1::AppendHeader*>(request)) {
      if (Chance(0.6) && !own.sequences.empty()) {
        header->set_session_id(own.session->session_id());
        header->set_sequence_id(Pick(own.sequences).id);
        header->set_num_tokens(static_cast<int32_t>(Uniform(1, 8)));
        header->clear_positions();
        header->clear_layers();
        const size_t width = layout.dtype() == v1::DTYPE_FLOAT32 ? 4 : 2;
        header->set_payload_bytes(layers * 2 * row * header->num_tokens() * width);
        shaped_append_ = TensorBytes(layers * 2 * row * header->num_tokens(), layout.dtype());
      }
    }
  }

  OwnSession& SomeOwn() { return own_[Uniform(0, own_.size() - 1)]; }

  std::string ValidString(const pb::FieldDescriptor* field, const std::string& session_id,
                          const OwnSession& own) {
    const std::string& name = field->name();
    if (absl::EndsWith(name, "session_id")) return session_id;
    if (absl::EndsWith(name, "sequence_id") || name == "sequence_ids") {
      return own.sequences.empty() ? "kd" : Pick(own.sequences).id;
    }
    if (name == "tenant") return Pick(std::vector<std::string>{"fuzz-0", "fuzz-1", "fuzz-x"});
    if (name == "name") {
      return Pick(std::vector<std::string>{"keydiff", "streaming_llm", "h2o", "tova", "snapkv",
                                           "d2o", "caote", "cake", "omnikv"});
    }
    if (field->type() == pb::FieldDescriptor::TYPE_BYTES) return PayloadBytes();
    return absl::StrCat("fuzz-", Uniform(0, 9));
  }

  std::string MutatedString(const pb::FieldDescriptor* field) {
    switch (Uniform(0, 7)) {
      case 0:
        return "";
      case 1:
        return RandomBytes(Uniform(1, 40));
      case 2:
        return std::string(Uniform(200, 5000), 'x');
      case 3:
        return "../../../etc/passwd";
      case 4:
        return std::string("a\0b", 3);
      case 5:  // an id of the other session
        return own_.size() > 1 && own_[1].session != nullptr ? own_[1].session->session_id()
                                                             : "nope";
      case 6:
        return field->type() == pb::FieldDescriptor::TYPE_BYTES ? RandomBytes(Uniform(0, 70000))
                                                                : "*";
      default:
        return "no-such-id";
    }
  }

  int64_t ValidInt(const pb::FieldDescriptor* field) {
    const std::string& name = field->name();
    if (absl::StrContains(name, "num_tokens") || name == "tokens") return Uniform(1, 10);
    if (name == "num_blocks") return Uniform(0, 64);
    if (name == "lease_ms") return Uniform(0, 1) ? 0 : Uniform(100, 60000);
    if (absl::StrContains(name, "layer")) return Uniform(0, 2);
    if (absl::StrContains(name, "budget") || absl::StrContains(name, "tokens_per_layer")) {
      return Uniform(0, 32);
    }
    if (absl::StrContains(name, "bytes")) return Uniform(0, 1 << 16);
    if (absl::StrContains(name, "position")) return Uniform(0, 64);
    return Uniform(0, 16);
  }

  int64_t MutatedInt() {
    static const std::vector<int64_t> kExtremes = {0,
                                                   -1,
                                                   1,
                                                   std::numeric_limits<int32_t>::max(),
                                                   std::numeric_limits<int32_t>::min(),
                                                   std::numeric_limits<int64_t>::max(),
                                                   std::numeric_limits<int64_t>::min(),
                                                   1 << 20,
                                                   1 << 30,
                                                   65536,
                                                   4097};
    return Chance(0.8) ? Pick(kExtremes) : Uniform(-1000, 100000);
  }

  double MutatedDouble() {
    static const std::vector<double> kExtremes = {std::numeric_limits<double>::quiet_NaN(),
                                                  std::numeric_limits<double>::infinity(),
                                                  -std::numeric_limits<double>::infinity(),
                                                  0.0,
                                                  -0.0,
                                                  1e38,
                                                  -1e38,
                                                  1e-45};
    return Pick(kExtremes);
  }

  void SetScalar(pb::Message* message, const pb::FieldDescriptor* field, bool mutate,
                 const std::string& session_id, const OwnSession& own) {
    const pb::Reflection* r = message->GetReflection();
    const bool repeated = field->is_repeated();
    switch (field->cpp_type()) {
      case pb::FieldDescriptor::CPPTYPE_INT32: {
        const int32_t v = static_cast<int32_t>(mutate ? MutatedInt() : ValidInt(field));
        repeated ? r->AddInt32(message, field, v) : r->SetInt32(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_INT64: {
        const int64_t v = mutate ? MutatedInt() : ValidInt(field);
        repeated ? r->AddInt64(message, field, v) : r->SetInt64(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_UINT32: {
        const uint32_t v = static_cast<uint32_t>(mutate ? MutatedInt() : ValidInt(field));
        repeated ? r->AddUInt32(message, field, v) : r->SetUInt32(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_UINT64: {
        const uint64_t v = static_cast<uint64_t>(mutate ? MutatedInt() : ValidInt(field));
        repeated ? r->AddUInt64(message, field, v) : r->SetUInt64(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_FLOAT: {
        const float v = static_cast<float>(mutate ? MutatedDouble() : Uniform(-200, 200) / 100.0);
        repeated ? r->AddFloat(message, field, v) : r->SetFloat(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
        const double v = mutate ? MutatedDouble() : Uniform(-200, 200) / 100.0;
        repeated ? r->AddDouble(message, field, v) : r->SetDouble(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_BOOL: {
        const bool v = Chance(0.5);
        repeated ? r->AddBool(message, field, v) : r->SetBool(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_ENUM: {
        const pb::EnumDescriptor* type = field->enum_type();
        const int v = mutate ? static_cast<int>(Uniform(-3, 1000))
                             : type->value(Uniform(0, type->value_count() - 1))->number();
        repeated ? r->AddEnumValue(message, field, v) : r->SetEnumValue(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_STRING: {
        const std::string v = mutate ? MutatedString(field) : ValidString(field, session_id, own);
        repeated ? r->AddString(message, field, v) : r->SetString(message, field, v);
        break;
      }
      case pb::FieldDescriptor::CPPTYPE_MESSAGE:
        break;
    }
  }

  // Fills `message` with plausible values, a few of them mutated.
  void Fill(pb::Message* message, int depth, const std::string& session_id, const OwnSession& own,
            double mutation_rate) {
    const pb::Descriptor* type = message->GetDescriptor();
    const pb::Reflection* r = message->GetReflection();
    // One member per oneof (or none).
    std::set<const pb::FieldDescriptor*> chosen;
    for (int o = 0; o < type->oneof_decl_count(); ++o) {
      const pb::OneofDescriptor* oneof = type->oneof_decl(o);
      if (Chance(0.85)) chosen.insert(oneof->field(Uniform(0, oneof->field_count() - 1)));
    }
    for (int f = 0; f < type->field_count(); ++f) {
      const pb::FieldDescriptor* field = type->field(f);
      if (field->containing_oneof() != nullptr && !chosen.contains(field)) continue;
      const bool is_id = absl::EndsWith(field->name(), "_id");
      if (!is_id && Chance(0.25)) continue;  // left unset
      const bool mutate = Chance(mutation_rate);
      int count = 1;
      if (field->is_repeated()) {
        count = static_cast<int>(Uniform(0, 3));
        if (mutate && field->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE) {
          count = static_cast<int>(Uniform(0, 70));
        }
      }
      for (int i = 0; i < count; ++i) {
        if (field->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
          if (depth >= 4) break;
          pb::Message* child = field->is_repeated() ? r->AddMessage(message, field)
                                                    : r->MutableMessage(message, field);
          Fill(child, depth + 1, session_id, own, mutation_rate);
        } else {
          SetScalar(message, field, mutate, session_id, own);
        }
      }
    }
  }

  // ---- Calls. ----

  static bool AllowedCode(absl::StatusCode code, const std::string& method) {
    switch (code) {
      case absl::StatusCode::kOk:
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kNotFound:
      case absl::StatusCode::kAlreadyExists:
      case absl::StatusCode::kPermissionDenied:
      case absl::StatusCode::kUnauthenticated:
      case absl::StatusCode::kResourceExhausted:
      case absl::StatusCode::kFailedPrecondition:
      case absl::StatusCode::kAborted:
      case absl::StatusCode::kOutOfRange:
        return true;
      case absl::StatusCode::kDeadlineExceeded:
      case absl::StatusCode::kCancelled:
        return method == "Watch";
      default:
        return false;
    }
  }

  // GetLayout of (session, sequence) as text without the block table and tier (a restore on the
  // way may move blocks); "" when it cannot be read.
  std::string LayoutState(const std::string& session_id, const std::string& sequence_id,
                          v1::GetLayoutResponse* out = nullptr) {
    v1::GetLayoutRequest request;
    request.set_session_id(session_id);
    request.set_sequence_id(sequence_id);
    v1::GetLayoutResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    if (!sidecar_->GetLayout(&context, request, &response).ok()) return "";
    for (v1::LayerLayout& layer : *response.mutable_layers()) layer.clear_block_table();
    response.clear_tier();
    if (out != nullptr) *out = response;
    return response.SerializeAsString();
  }

  grpc::Status CallUnary(const pb::MethodDescriptor* method, const std::string& bytes,
                         std::string* response_text) {
    const bool admin = method->service()->name() == "Admin";
    grpc::GenericStub& stub = admin ? *admin_generic_ : *generic_;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    const grpc::ByteBuffer request = BufferOf(bytes);
    grpc::ByteBuffer response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&context, absl::StrCat("/", method->service()->full_name(), "/", method->name()),
                   grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status status) { done.set_value(std::move(status)); });
    grpc::Status status = done.get_future().get();
    if (status.ok()) {
      std::unique_ptr<pb::Message> parsed(
          pb::MessageFactory::generated_factory()->GetPrototype(method->output_type())->New());
      std::vector<grpc::Slice> slices;
      std::string flat;
      if (response.Dump(&slices).ok()) {
        for (const grpc::Slice& s : slices)
          flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
      if (parsed->ParseFromString(flat)) {
        *response_text = Describe(*parsed);
        NoteSkippedRebudgets(*parsed);
      }
    }
    return status;
  }

  grpc::Status CallAppend(const v1::AppendHeader& header, bool header_first, int data_chunks) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::AppendResponse response;
    auto writer = sidecar_->Append(&context, &response);
    v1::AppendChunk chunk;
    if (header_first) {
      *chunk.mutable_header() = header;
      writer->Write(chunk);
    }
    if (!shaped_append_.empty()) {  // the exact payload, in up to three pieces
      size_t offset = 0;
      while (offset < shaped_append_.size()) {
        const size_t size =
            std::min<size_t>(shaped_append_.size() - offset, Uniform(1, shaped_append_.size()));
        chunk.set_data(shaped_append_.substr(offset, size));
        if (!writer->Write(chunk)) break;
        offset += size;
      }
      data_chunks = 0;
    }
    for (int i = 0; i < data_chunks; ++i) {
      chunk.set_data(PayloadBytes());
      if (!writer->Write(chunk)) break;
      if (Chance(0.1)) {  // a second header in the middle
        *chunk.mutable_header() = header;
        if (!writer->Write(chunk)) break;
      }
    }
    writer->WritesDone();
    return writer->Finish();
  }

  grpc::Status CallServerStream(const std::string& method, const pb::Message& request) {
    grpc::ClientContext context;
    const bool watch = method == "Watch";
    context.set_deadline(std::chrono::system_clock::now() +
                         (watch ? std::chrono::milliseconds(100) : std::chrono::seconds(30)));
    if (watch) {
      auto reader = sidecar_->Watch(&context, static_cast<const v1::WatchRequest&>(request));
      v1::SessionEvent event;
      while (reader->Read(&event)) {
      }
      return reader->Finish();
    }
    auto reader = sidecar_->Export(&context, static_cast<const v1::ExportRequest&>(request));
    v1::ExportChunk chunk;
    int chunks = 0;
    while (reader->Read(&chunk)) {
      if (++chunks > 2 && Chance(0.3)) {
        context.TryCancel();  // the client goes away mid-stream
        break;
      }
    }
    grpc::Status status = reader->Finish();
    return status.error_code() == grpc::StatusCode::CANCELLED && chunks > 2 ? grpc::Status::OK
                                                                            : status;
  }

  // The one sequence `request` names: (session_id, sequence_id) of the request, or of its only
  // item (DecodeStep, Batch*); empty when it names none or several.
  static std::pair<std::string, std::string> TargetOf(const pb::Message& request) {
    const pb::Descriptor* type = request.GetDescriptor();
    const pb::Reflection* r = request.GetReflection();
    const pb::FieldDescriptor* session = type->FindFieldByName("session_id");
    const pb::FieldDescriptor* sequence = type->FindFieldByName("sequence_id");
    if (session != nullptr && sequence != nullptr && !session->is_repeated() &&
        !sequence->is_repeated() && session->type() == pb::FieldDescriptor::TYPE_STRING &&
        sequence->type() == pb::FieldDescriptor::TYPE_STRING) {
      return {r->GetString(request, session), r->GetString(request, sequence)};
    }
    for (const char* name : {"items", "requests"}) {
      const pb::FieldDescriptor* items = type->FindFieldByName(name);
      if (items == nullptr || !items->is_repeated() ||
          items->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE) {
        continue;
      }
      if (r->FieldSize(request, items) != 1) return {};
      return TargetOf(r->GetRepeatedMessage(request, items, 0));
    }
    return {};
  }

  void FuzzOne() {
    const pb::MethodDescriptor* method = Pick(methods_);
    OwnSession& own = SomeOwn();
    if (own.session == nullptr) return;
    std::string session_id = own.session->session_id();
    // Calls that end sessions and sequences mostly aim elsewhere, so that the sequences live
    // long enough to fill up and be compressed.
    const std::string& verb = method->name();
    if ((verb == "Detach" || verb == "ForceRelease" || verb == "ReleaseSequence") && Chance(0.9)) {
      session_id = "fuzz-elsewhere";
    }
    const double rate = Pick(std::vector<double>{0.0, 0.05, 0.15, 0.4});

    std::unique_ptr<pb::Message> request;
    const bool append = method->name() == "Append";
    if (append) {
      request = std::make_unique<v1::AppendHeader>();
    } else {
      request.reset(
          pb::MessageFactory::generated_factory()->GetPrototype(method->input_type())->New());
    }
    Fill(request.get(), 0, session_id, own, rate);
    shaped_append_.clear();
    ShapePayloads(request.get(), own);
    // Attach: a few raw sessions come and go; they are detached again below.
    auto [target_session, target_sequence] = TargetOf(*request);
    v1::GetLayoutResponse before_layout;
    const std::string before =
        target_sequence.empty() ? "" : LayoutState(target_session, target_sequence, &before_layout);

    grpc::Status status;
    std::string response_text;
    std::string request_text = Describe(*request);
    const bool garbage_frame = !append && !method->server_streaming() && Chance(0.03);
    std::string frame = request->SerializeAsString();
    if (append) {
      status = CallAppend(static_cast<const v1::AppendHeader&>(*request), Chance(0.9),
                          static_cast<int>(Uniform(0, 3)));
    } else if (method->server_streaming()) {
      status = CallServerStream(method->name(), *request);
    } else if (garbage_frame) {
      if (!frame.empty() && Chance(0.5)) {
        frame.resize(Uniform(0, frame.size() - 1));  // truncated frame
      } else {
        frame = RandomBytes(Uniform(1, 64));
      }
      request_text = "raw bytes of " + std::to_string(frame.size()) + ": " +
                     absl::CEscape(frame.substr(0, 64));
      status = CallUnary(method, frame, &response_text);
    } else {
      status = CallUnary(method, frame, &response_text);
    }
    // A frame that is no valid request (garbage, truncated, a string field that is not UTF-8)
    // never reaches the service: gRPC's callback server answers UNIMPLEMENTED with no message.
    std::unique_ptr<pb::Message> reparsed(request->New());
    const bool unparsable = !reparsed->ParseFromString(frame);
    const absl::StatusCode code = static_cast<absl::StatusCode>(status.error_code());
    ++outcomes_[absl::StrCat(method->name(), " ", absl::StatusCodeToString(code))];
    Remember(target_sequence.empty() ? "" : absl::StrCat(target_session, "/", target_sequence),
             absl::StrCat(method->name(), " ", absl::StatusCodeToString(code), ": ",
                          request_text.substr(0, 240)));

    // A session the fuzzed Attach created is detached, so that they do not pile up.
    if (method->name() == "Attach" && status.ok()) {
      // response_text is for the report; parse the id from the text form.
      const size_t at = response_text.find("session_id: \"");
      if (at != std::string::npos) {
        const size_t end = response_text.find('"', at + 13);
        v1::DetachRequest detach;
        detach.set_session_id(response_text.substr(at + 13, end - at - 13));
        v1::DetachResponse detached;
        grpc::ClientContext context;
        sidecar_->Detach(&context, detach, &detached);
      }
    }

    const std::string name = absl::StrCat(method->service()->name(), ".", method->name());
    const bool parse_refusal =
        unparsable && code == absl::StatusCode::kUnimplemented && status.error_message().empty();
    // This build has no query staging area (CUDA only); the server says so with UNIMPLEMENTED.
    const bool no_staging = code == absl::StatusCode::kUnimplemented &&
                            absl::StrContains(status.error_message(), "reserved for the CUDA");
    if (parse_refusal) ++outcomes_["(unparsable frame) UNIMPLEMENTED"];
    if (!AllowedCode(code, method->name()) && !parse_refusal && !no_staging) {
      findings_.push_back(
          {name, request_text,
           absl::StrCat(absl::StatusCodeToString(code), ": ", status.error_message())});
    }
    if (!server_->process().Running()) return;
    if (target_sequence.empty() || before.empty()) return;
    v1::GetLayoutResponse after_layout;
    const std::string after = LayoutState(target_session, target_sequence, &after_layout);
    // Strict as the sequence is just before the call, not as it was created: a fuzzed budget
    // update may have made a relaxed sequence strict since (or the reverse).
    const bool evicts_first = before_layout.budget().strict() &&
                              (method->name() == "Reserve" || append ||
                               method->name() == "BatchReserve");
    if (!status.ok() && !evicts_first && after != before && method->name() != "ReleaseSequence" &&
        method->name() != "ForceRelease") {
      findings_.push_back(
          {name, request_text,
           absl::StrCat("failed with ", absl::StatusCodeToString(code), ": ",
                        status.error_message(), "\n      but changed the sequence: before ",
                        Describe(before_layout), "\n      after ", Describe(after_layout),
                        History(target_session, target_sequence))});
    }
    if (!after.empty()) {
      CheckStrictBudget(name, request_text, target_session, target_sequence, &after_layout);
    }
  }

  // An operator's re-budget (Admin SetDefaults / SetQuota) cannot compress a sequence whose
  // policy needs queries: the response lists it ("session/sequence: reason") and it keeps its
  // tokens under the lower budget until its next step with attention (admin.proto,
  // common.proto Budget.strict). Those sequences may be over a strict bound until then.
  void NoteSkippedRebudgets(const pb::Message& response) {
    const pb::FieldDescriptor* field =
        response.GetDescriptor()->FindFieldByName("rebudget_skipped");
    if (field == nullptr || !field->is_repeated() ||
        field->cpp_type() != pb::FieldDescriptor::CPPTYPE_STRING) {
      return;
    }
    const pb::Reflection* reflection = response.GetReflection();
    for (int i = 0; i < reflection->FieldSize(response, field); ++i) {
      const std::string entry = reflection->GetRepeatedString(response, field, i);
      rebudget_skipped_.insert(entry.substr(0, entry.find(": ")));
    }
  }

  // A sequence under a strict budget holds at most budget + prefill_block_tokens per layer,
  // unless a re-budget skipped it and no step has brought it under the bound since.
  // `layout` is the sequence's state when the caller has it, else it is read here.
  void CheckStrictBudget(const std::string& name, const std::string& request_text,
                         const std::string& session_id, const std::string& sequence_id,
                         const v1::GetLayoutResponse* layout = nullptr) {
    v1::GetLayoutResponse read;
    if (layout == nullptr) {
      if (LayoutState(session_id, sequence_id, &read).empty()) return;
      layout = &read;
    }
    if (!layout->budget().strict()) return;
    const int32_t block =
        layout->budget().prefill_block_tokens() > 0 ? layout->budget().prefill_block_tokens() : 128;
    std::vector<const v1::LayerLayout*> over;
    for (const v1::LayerLayout& layer : layout->layers()) {
      if (layer.budget() > 0 && layer.count() > layer.budget() + block) over.push_back(&layer);
    }
    const std::string key = absl::StrCat(session_id, "/", sequence_id);
    if (over.empty()) {
      rebudget_skipped_.erase(key);
      return;
    }
    if (rebudget_skipped_.count(key) > 0) {
      ++outcomes_["(over a strict budget after a re-budget it was skipped by)"];
      return;
    }
    for (const v1::LayerLayout* layer : over) {
      findings_.push_back(
          {name, request_text,
           absl::StrCat("strict budget exceeded: layer ", layer->layer(), " holds ", layer->count(),
                        " > ", layer->budget(), " + ", block, History(session_id, sequence_id))});
    }
  }

  // The last calls on each sequence (key "session/sequence") and on no sequence (key ""), so
  // that a finding shows how the sequence got there: state checks run only after calls on a
  // sequence that existed before them, so the call that broke an invariant may be an earlier one
  // (a create, a restore, a change of defaults).
  void Remember(const std::string& key, std::string call) {
    std::deque<std::string>& calls = history_[key];
    calls.push_back(std::move(call));
    if (calls.size() > kHistory) calls.pop_front();
  }
  std::string History(const std::string& session, const std::string& sequence) const {
    std::string out;
    for (const std::string& key : {absl::StrCat(session, "/", sequence), std::string()}) {
      const auto it = history_.find(key);
      if (it == history_.end()) continue;
      absl::StrAppend(&out, "\n      last calls on ", key.empty() ? "no sequence" : key, ":");
      for (const std::string& call : it->second) absl::StrAppend(&out, "\n        ", call);
    }
    return out;
  }
  static constexpr size_t kHistory = 12;
  std::map<std::string, std::deque<std::string>> history_;
  // "session/sequence" of the sequences a re-budget skipped (NoteSkippedRebudgets).
  std::set<std::string> rebudget_skipped_;

  ServerProcess* const server_;
  std::mt19937_64 rng_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<grpc::Channel> admin_channel_;
  std::unique_ptr<v1::Sidecar::Stub> sidecar_;
  std::unique_ptr<grpc::GenericStub> generic_;
  std::unique_ptr<grpc::GenericStub> admin_generic_;
  std::unique_ptr<kvsidecar::Client> client_;
  std::vector<const pb::MethodDescriptor*> methods_;
  std::vector<OwnSession> own_;
  std::vector<Finding> findings_;
  std::map<std::string, int64_t> outcomes_;
  int64_t iterations_ = 0;
  std::string shaped_append_;  // the data of a shaped Append ("" = random chunks)
};

TEST(RequestFuzz, ServerSurvivesAndAnswersMutatedRequests) {
  const int64_t seconds = EnvInt("KVS_FUZZ_SECONDS", 60);
  const uint64_t seed = static_cast<uint64_t>(EnvInt("KVS_FUZZ_SEED", 19));
  ServerProcess::Options options;
  options.lease_ms = 60000;
  options.extra_args = {"--disk_tier_bytes=256M", "--host_tier_bytes=64M"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  RequestFuzzer fuzzer(server->get(), seed);
  const absl::Status setup = fuzzer.Setup();
  ASSERT_TRUE(setup.ok()) << setup;
  fuzzer.Run(absl::Seconds(seconds));
  std::printf("request_fuzz: seed %llu, %lld iterations in %llds\n%s",
              static_cast<unsigned long long>(seed), static_cast<long long>(fuzzer.iterations()),
              static_cast<long long>(seconds), fuzzer.Summary().c_str());
  EXPECT_TRUE((*server)->process().Running()) << (*server)->Logs();
  for (const Finding& finding : fuzzer.findings()) {
    ADD_FAILURE() << finding.method << "\n  request: " << finding.request
                  << "\n  outcome: " << finding.outcome;
  }
}

}  // namespace
}  // namespace kvs_e2e
