// End to end: the real server answers standard gRPC health checks (grpc.health.v1) and server
// reflection (v1alpha and v1) on both ports, and the health service can be called the way
// reflection-based clients do. The calls are raw (generic stub, hand-encoded protobuf, dynamic
// messages over reflected descriptors) so the test needs none of these services' generated code.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/unknown_field_set.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvsidecar/client.h"
#include "tests/e2e/e2e_util.h"

namespace kvs_e2e {
namespace {

using ::google::protobuf::UnknownField;
using ::google::protobuf::UnknownFieldSet;

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const grpc::Slice& slice : slices) {
    out.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  return out;
}

grpc::ByteBuffer BufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
}

// Waits for the completion queue event tagged `tag`; the calls below run one op at a time.
bool Await(grpc::CompletionQueue* cq, intptr_t tag) {
  void* got = nullptr;
  bool ok = false;
  if (!cq->Next(&got, &ok)) return false;
  return ok && reinterpret_cast<intptr_t>(got) == tag;
}

void Drain(grpc::CompletionQueue* cq) {
  cq->Shutdown();
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) {
  }
}

// grpc.health.v1.Health/Check for `service`; the HealthCheckResponse.status value.
absl::StatusOr<int> HealthStatus(const std::string& target, const std::string& service) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::CompletionQueue cq;
  std::string request;  // HealthCheckRequest { string service = 1; }
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  auto call =
      stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", BufferOf(request), &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  const bool done = Await(&cq, 1);
  Drain(&cq);
  if (!done) return absl::InternalError("health call did not complete");
  if (!status.ok()) return kvsidecar::ToStatus(status);
  UnknownFieldSet fields;
  if (!fields.ParseFromString(Flatten(response))) {
    return absl::InternalError("cannot parse HealthCheckResponse");
  }
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == 1 && fields.field(i).type() == UnknownField::TYPE_VARINT) {
      return static_cast<int>(fields.field(i).varint());
    }
  }
  return 0;  // proto3 default: UNKNOWN
}

// A length-delimited protobuf field: tag, varint length, bytes.
std::string LengthDelimited(int field, const std::string& bytes) {
  std::string out;
  out.push_back(static_cast<char>(field << 3 | 2));
  size_t n = bytes.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + bytes;
}

// One ServerReflectionInfo exchange (`request`: a serialized ServerReflectionRequest) on
// `version` ("v1alpha" or "v1"); the serialized ServerReflectionResponse.
absl::StatusOr<std::string> Reflect(const std::string& target, const std::string& version,
                                    const std::string& request) {
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection." + version + ".ServerReflection/ServerReflectionInfo", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  bool ok = Await(&cq, 1);
  grpc::ByteBuffer response;
  if (ok) {
    call->Write(BufferOf(request), reinterpret_cast<void*>(2));
    ok = Await(&cq, 2);
  }
  bool have_response = false;
  if (ok) {
    call->Read(&response, reinterpret_cast<void*>(3));
    have_response = Await(&cq, 3);
    call->WritesDone(reinterpret_cast<void*>(4));
    Await(&cq, 4);
  }
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  Await(&cq, 5);
  Drain(&cq);
  if (!status.ok()) return kvsidecar::ToStatus(status);
  if (!have_response) return absl::InternalError("no reflection response");
  return Flatten(response);
}

// The length-delimited values of field `number` of `message`.
std::vector<std::string> FieldsOf(const std::string& message, int number) {
  std::vector<std::string> values;
  UnknownFieldSet fields;
  if (!fields.ParseFromString(message)) return values;
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == number &&
        fields.field(i).type() == UnknownField::TYPE_LENGTH_DELIMITED) {
      values.push_back(fields.field(i).length_delimited());
    }
  }
  return values;
}

// ServerReflectionInfo with list_services; the service names. `version` is "v1alpha" or "v1".
absl::StatusOr<std::set<std::string>> ListServices(const std::string& target,
                                                   const std::string& version) {
  // ServerReflectionRequest { string list_services = 7; } = "*"
  auto response = Reflect(target, version, LengthDelimited(7, "*"));
  if (!response.ok()) return response.status();
  // ServerReflectionResponse { ListServiceResponse list_services_response = 6; }
  // ListServiceResponse { repeated ServiceResponse service = 1; } ServiceResponse { name = 1 }
  std::set<std::string> names;
  for (const std::string& list : FieldsOf(*response, 6)) {
    for (const std::string& service : FieldsOf(list, 1)) {
      for (const std::string& name : FieldsOf(service, 1)) names.insert(name);
    }
  }
  return names;
}

// ServerReflectionInfo with file_containing_symbol: the files of the answer (the file defining
// `symbol` and its imports) in a fresh descriptor pool, nothing compiled in.
absl::StatusOr<std::unique_ptr<google::protobuf::DescriptorPool>> ReflectSymbol(
    const std::string& target, const std::string& version, const std::string& symbol) {
  // ServerReflectionRequest { string file_containing_symbol = 4; }
  auto response = Reflect(target, version, LengthDelimited(4, symbol));
  if (!response.ok()) return response.status();
  // ServerReflectionResponse { FileDescriptorResponse file_descriptor_response = 4;
  //                            ErrorResponse error_response = 7; }
  for (const std::string& error : FieldsOf(*response, 7)) {
    std::vector<std::string> message = FieldsOf(error, 2);
    return absl::NotFoundError(absl::StrCat(
        "reflection ", version, " error for ", symbol, ": ", message.empty() ? "" : message[0]));
  }
  auto pool = std::make_unique<google::protobuf::DescriptorPool>();
  std::vector<google::protobuf::FileDescriptorProto> files;
  for (const std::string& descriptors : FieldsOf(*response, 4)) {
    for (const std::string& bytes : FieldsOf(descriptors, 1)) {
      google::protobuf::FileDescriptorProto file;
      if (!file.ParseFromString(bytes)) return absl::InternalError("bad FileDescriptorProto");
      files.push_back(std::move(file));
    }
  }
  if (files.empty()) return absl::NotFoundError("no file descriptors in the response");
  // Imports before the files that need them.
  for (size_t round = 0; round < files.size() + 1; ++round) {
    for (const auto& file : files) {
      if (pool->FindFileByName(file.name()) != nullptr) continue;
      bool ready = true;
      for (const std::string& dependency : file.dependency()) {
        ready = ready && pool->FindFileByName(dependency) != nullptr;
      }
      if (ready && pool->BuildFile(file) == nullptr) {
        return absl::InternalError("cannot build " + file.name());
      }
    }
  }
  if (pool->FindFileByName(files.front().name()) == nullptr) {
    return absl::InternalError("imports missing from the response of " + files.front().name());
  }
  return pool;
}

// grpc.health.v1.Health/Check called the way grpcurl does without proto files: the service,
// method and messages come from reflection `version`, the request is a dynamic message.
absl::StatusOr<std::string> HealthCheckViaReflection(const std::string& target,
                                                     const std::string& version,
                                                     const std::string& service) {
  namespace pb = ::google::protobuf;
  auto pool = ReflectSymbol(target, version, "grpc.health.v1.Health");
  if (!pool.ok()) return pool.status();
  const pb::ServiceDescriptor* health = (*pool)->FindServiceByName("grpc.health.v1.Health");
  if (health == nullptr) return absl::NotFoundError("no grpc.health.v1.Health in the files");
  const pb::MethodDescriptor* check = health->FindMethodByName("Check");
  if (check == nullptr) return absl::NotFoundError("no Check method");
  pb::DynamicMessageFactory factory(pool->get());
  std::unique_ptr<pb::Message> request(factory.GetPrototype(check->input_type())->New());
  const pb::FieldDescriptor* service_field = check->input_type()->FindFieldByName("service");
  if (service_field == nullptr) return absl::NotFoundError("no field service in the request");
  request->GetReflection()->SetString(request.get(), service_field, service);

  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(&context);
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&context, "/" + health->full_name() + "/" + check->name(),
                                    BufferOf(request->SerializeAsString()), &cq);
  call->StartCall();
  grpc::ByteBuffer response_bytes;
  grpc::Status status;
  call->Finish(&response_bytes, &status, reinterpret_cast<void*>(1));
  const bool done = Await(&cq, 1);
  Drain(&cq);
  if (!done) return absl::InternalError("health call did not complete");
  if (!status.ok()) return kvsidecar::ToStatus(status);
  std::unique_ptr<pb::Message> response(factory.GetPrototype(check->output_type())->New());
  if (!response->ParseFromString(Flatten(response_bytes))) {
    return absl::InternalError("cannot parse the response");
  }
  const pb::FieldDescriptor* status_field = check->output_type()->FindFieldByName("status");
  if (status_field == nullptr) return absl::NotFoundError("no field status in the response");
  return response->GetReflection()->GetEnum(*response, status_field)->name();
}

constexpr int kServing = 1;

class HealthReflectionTest : public SharedServerTest<HealthReflectionTest> {};

TEST_F(HealthReflectionTest, HealthCheckIsServingOnBothPorts) {
  ASSERT_NE(server_, nullptr);
  auto overall = HealthStatus(server_->data_target(), "");
  ASSERT_TRUE(overall.ok()) << overall.status();
  EXPECT_EQ(*overall, kServing);
  auto sidecar = HealthStatus(server_->data_target(), "kvsidecar.v1.Sidecar");
  ASSERT_TRUE(sidecar.ok()) << sidecar.status();
  EXPECT_EQ(*sidecar, kServing);
  auto admin = HealthStatus(server_->admin_target(), "kvsidecar.v1.Admin");
  ASSERT_TRUE(admin.ok()) << admin.status();
  EXPECT_EQ(*admin, kServing);
  auto unknown = HealthStatus(server_->data_target(), "no.such.Service");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
}

TEST_F(HealthReflectionTest, ReflectionListsTheServicesInV1AndV1Alpha) {
  ASSERT_NE(server_, nullptr);
  for (const std::string version : {"v1alpha", "v1"}) {
    SCOPED_TRACE(version);
    auto data = ListServices(server_->data_target(), version);
    ASSERT_TRUE(data.ok()) << data.status();
    EXPECT_TRUE(data->count("kvsidecar.v1.Sidecar")) << ::testing::PrintToString(*data);
    EXPECT_TRUE(data->count("grpc.health.v1.Health")) << ::testing::PrintToString(*data);
    EXPECT_TRUE(data->count("grpc.reflection.v1.ServerReflection"))
        << ::testing::PrintToString(*data);
    auto admin = ListServices(server_->admin_target(), version);
    ASSERT_TRUE(admin.ok()) << admin.status();
    EXPECT_TRUE(admin->count("kvsidecar.v1.Admin")) << ::testing::PrintToString(*admin);
  }
}

// What grpcurl does without proto files: the health service's descriptors from reflection, then
// Check with a dynamic message (issue 19: "target server does not expose service
// grpc.health.v1.Health").
TEST_F(HealthReflectionTest, HealthIsCallableThroughReflection) {
  ASSERT_NE(server_, nullptr);
  for (const std::string version : {"v1alpha", "v1"}) {
    SCOPED_TRACE(version);
    auto overall = HealthCheckViaReflection(server_->data_target(), version, "");
    ASSERT_TRUE(overall.ok()) << overall.status();
    EXPECT_EQ(*overall, "SERVING");
    auto admin = HealthCheckViaReflection(server_->admin_target(), version, "kvsidecar.v1.Admin");
    ASSERT_TRUE(admin.ok()) << admin.status();
    EXPECT_EQ(*admin, "SERVING");
    // The service's own descriptors resolve too, with their imports.
    auto sidecar = ReflectSymbol(server_->data_target(), version, "kvsidecar.v1.Sidecar");
    ASSERT_TRUE(sidecar.ok()) << sidecar.status();
    EXPECT_NE((*sidecar)->FindMethodByName("kvsidecar.v1.Sidecar.Attach"), nullptr);
    auto missing = ReflectSymbol(server_->data_target(), version, "no.such.Symbol");
    EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  }
}

}  // namespace
}  // namespace kvs_e2e
