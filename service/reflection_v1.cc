#include "service/reflection_v1.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <set>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvs {
namespace {

namespace pb = ::google::protobuf;
using ::grpc::reflection::v1::ServerReflectionRequest;
using ::grpc::reflection::v1::ServerReflectionResponse;

void SetError(ServerReflectionResponse* response, grpc::StatusCode code,
              const std::string& message) {
  response->mutable_error_response()->set_error_code(code);
  response->mutable_error_response()->set_error_message(message);
}

// Adds `file` and, transitively, the files it imports. An import already sent on this stream is
// not sent again: clients keep the files they got by name.
void AddFileAndDependencies(const pb::FileDescriptor* file, std::set<std::string>* sent,
                            ServerReflectionResponse* response) {
  std::vector<const pb::FileDescriptor*> pending = {file};
  // The file asked for always goes first, even if sent before: the client asked for it.
  bool first = true;
  while (!pending.empty()) {
    const pb::FileDescriptor* next = pending.back();
    pending.pop_back();
    if (!first && sent->contains(next->name())) continue;
    first = false;
    sent->insert(next->name());
    pb::FileDescriptorProto proto;
    next->CopyTo(&proto);
    response->mutable_file_descriptor_response()->add_file_descriptor_proto(
        proto.SerializeAsString());
    for (int i = 0; i < next->dependency_count(); ++i) pending.push_back(next->dependency(i));
  }
}

}  // namespace

ReflectionV1Service::ReflectionV1Service(std::vector<std::string> services)
    : services_(std::move(services)) {}

grpc::Status ReflectionV1Service::ServerReflectionInfo(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<ServerReflectionResponse, ServerReflectionRequest>* stream) {
  const pb::DescriptorPool* pool = pb::DescriptorPool::generated_pool();
  std::set<std::string> sent;
  ServerReflectionRequest request;
  while (stream->Read(&request)) {
    ServerReflectionResponse response;
    response.set_valid_host(request.host());
    *response.mutable_original_request() = request;
    switch (request.message_request_case()) {
      case ServerReflectionRequest::kListServices:
        for (const std::string& name : services_) {
          response.mutable_list_services_response()->add_service()->set_name(name);
        }
        break;
      case ServerReflectionRequest::kFileByFilename: {
        const pb::FileDescriptor* file = pool->FindFileByName(request.file_by_filename());
        if (file == nullptr) {
          SetError(&response, grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("file not found: ", request.file_by_filename()));
        } else {
          AddFileAndDependencies(file, &sent, &response);
        }
        break;
      }
      case ServerReflectionRequest::kFileContainingSymbol: {
        const pb::FileDescriptor* file =
            pool->FindFileContainingSymbol(request.file_containing_symbol());
        if (file == nullptr) {
          SetError(&response, grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("symbol not found: ", request.file_containing_symbol()));
        } else {
          AddFileAndDependencies(file, &sent, &response);
        }
        break;
      }
      case ServerReflectionRequest::kFileContainingExtension: {
        const auto& ext = request.file_containing_extension();
        const pb::Descriptor* type = pool->FindMessageTypeByName(ext.containing_type());
        const pb::FieldDescriptor* field =
            type == nullptr ? nullptr : pool->FindExtensionByNumber(type, ext.extension_number());
        if (field == nullptr) {
          SetError(&response, grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("extension not found: ", ext.containing_type(), " ",
                                ext.extension_number()));
        } else {
          AddFileAndDependencies(field->file(), &sent, &response);
        }
        break;
      }
      case ServerReflectionRequest::kAllExtensionNumbersOfType: {
        const pb::Descriptor* type =
            pool->FindMessageTypeByName(request.all_extension_numbers_of_type());
        if (type == nullptr) {
          SetError(&response, grpc::StatusCode::NOT_FOUND,
                   absl::StrCat("type not found: ", request.all_extension_numbers_of_type()));
        } else {
          std::vector<const pb::FieldDescriptor*> extensions;
          pool->FindAllExtensions(type, &extensions);
          auto* numbers = response.mutable_all_extension_numbers_response();
          numbers->set_base_type_name(type->full_name());
          for (const pb::FieldDescriptor* field : extensions) {
            numbers->add_extension_number(field->number());
          }
        }
        break;
      }
      case ServerReflectionRequest::MESSAGE_REQUEST_NOT_SET:
        SetError(&response, grpc::StatusCode::INVALID_ARGUMENT,
                 "message_request must be set (list_services, file_by_filename, "
                 "file_containing_symbol, file_containing_extension or "
                 "all_extension_numbers_of_type)");
        break;
    }
    if (!stream->Write(response)) break;
    if (context->IsCancelled()) break;
  }
  return grpc::Status::OK;
}

}  // namespace kvs
