#include "service/auth.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"

namespace kvs {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view key) {
  std::ifstream file(path);
  if (!file) {
    return absl::FailedPreconditionError(
        absl::StrCat(key, "=", path, ": cannot read the file: ", std::strerror(errno)));
  }
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (!absl::StrContains(text, "-----BEGIN ")) {
    return absl::FailedPreconditionError(
        absl::StrCat(key, "=", path, ": not a PEM file (no -----BEGIN line)"));
  }
  return text;
}

constexpr absl::string_view kMissingToken =
    "missing or invalid credentials: send metadata 'authorization: Bearer <token>'";

}  // namespace

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  }
  return diff == 0;
}

std::string BearerToken(const grpc::CallbackServerContext& context) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return "";
  absl::string_view value(it->second.data(), it->second.size());
  // The scheme is case-insensitive (RFC 6750 / 7235).
  if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) return "";
  value.remove_prefix(7);
  while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  return std::string(value);
}

absl::StatusOr<std::optional<std::string>> Authenticator::DataTenant(
    const grpc::CallbackServerContext& context) const {
  if (!data_auth()) return std::optional<std::string>();
  const std::string token = BearerToken(context);
  if (token.empty()) return absl::UnauthenticatedError(kMissingToken);
  // Compare against every token, whatever matches first, so timing says nothing.
  std::optional<std::string> tenant;
  for (const auto& [name, expected] : config_.tenant_tokens) {
    if (ConstantTimeEquals(token, expected)) tenant = name;
  }
  if (!tenant) return absl::UnauthenticatedError(kMissingToken);
  return tenant;
}

absl::Status Authenticator::CheckAdmin(const grpc::CallbackServerContext& context) const {
  if (!admin_auth()) return absl::OkStatus();
  const std::string token = BearerToken(context);
  if (token.empty() || !ConstantTimeEquals(token, config_.admin_token)) {
    return absl::UnauthenticatedError(
        "missing or invalid admin credentials: send metadata 'authorization: Bearer <admin "
        "token>'");
  }
  return absl::OkStatus();
}

absl::Status Authenticator::CheckOwner(const std::optional<std::string>& caller,
                                       const absl::StatusOr<std::string>& owner,
                                       absl::string_view session_id) {
  if (!caller.has_value()) return absl::OkStatus();
  if (owner.ok() && *owner == *caller) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "session ", session_id, " does not exist or does not belong to tenant ", *caller));
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsFiles& files) {
  if (files.cert_file.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto cert = ReadPem(files.cert_file, "tls.cert_file");
  if (!cert.ok()) return cert.status();
  auto key = ReadPem(files.key_file, "tls.key_file");
  if (!key.ok()) return key.status();
  pair.cert_chain = *std::move(cert);
  pair.private_key = *std::move(key);
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!files.client_ca_file.empty()) {
    auto ca = ReadPem(files.client_ca_file, "tls.client_ca_file");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *std::move(ca);
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace kvs
