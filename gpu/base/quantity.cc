#include "gpu/base/quantity.h"

#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvs {
namespace {

using u128 = unsigned __int128;

constexpr absl::string_view kGrammar =
    "a whole number of bytes with an optional Kubernetes suffix (Ki, Mi, Gi, Ti, Pi, Ei = powers "
    "of 1024; k, M, G, T, P, E = powers of 1000), e.g. 1073741824, 1Gi, 512Mi or 1.5Gi";

// The multiplier of a suffix: 2^binary_shift * 10^decimal_exponent.
struct Suffix {
  absl::string_view name;
  int binary_shift;
  int decimal_exponent;
};

constexpr Suffix kSuffixes[] = {
    {"", 0, 0},     {"Ki", 10, 0},  {"Mi", 20, 0},  {"Gi", 30, 0},  {"Ti", 40, 0},
    {"Pi", 50, 0},  {"Ei", 60, 0},  {"k", 0, 3},    {"M", 0, 6},    {"G", 0, 9},
    {"T", 0, 12},   {"P", 0, 15},   {"E", 0, 18},
    // Compatibility aliases (not Kubernetes): xiB = xi, xB = x.
    {"KiB", 10, 0}, {"MiB", 20, 0}, {"GiB", 30, 0}, {"TiB", 40, 0}, {"PiB", 50, 0},
    {"EiB", 60, 0}, {"KB", 0, 3},   {"MB", 0, 6},   {"GB", 0, 9},   {"TB", 0, 12},
    {"PB", 0, 15},  {"EB", 0, 18}};

// Significant digits a mantissa may have: 10^38 still fits in 128 bits.
constexpr int kMaxDigits = 38;
constexpr u128 kMaxBytes = std::numeric_limits<uint64_t>::max();

u128 Pow(u128 base, int exponent) {
  u128 out = 1;
  for (int i = 0; i < exponent; ++i) out *= base;
  return out;
}

}  // namespace

absl::StatusOr<uint64_t> ParseQuantityBytes(absl::string_view text, absl::string_view field) {
  const absl::string_view trimmed = absl::StripAsciiWhitespace(text);
  const auto malformed = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must be a byte size: ", kGrammar, "; got '", text, "'"));
  };
  absl::string_view rest = trimmed;
  if (!rest.empty() && rest.front() == '-') {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " must not be negative (a byte size), got '", text, "'"));
  }
  if (!rest.empty() && rest.front() == '+') rest.remove_prefix(1);

  // Mantissa: digits, optionally a '.' and more digits; at least one digit in all.
  u128 mantissa = 0;
  int significant = 0;
  int fraction_digits = 0;
  bool any_digit = false;
  bool in_fraction = false;
  while (!rest.empty() && (absl::ascii_isdigit(rest.front()) || rest.front() == '.')) {
    const char c = rest.front();
    rest.remove_prefix(1);
    if (c == '.') {
      if (in_fraction) return malformed();
      in_fraction = true;
      continue;
    }
    any_digit = true;
    if (in_fraction) ++fraction_digits;
    if (mantissa == 0 && c == '0') continue;  // leading zeros carry nothing
    if (++significant > kMaxDigits) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " has too many digits to be a byte size: '", text, "'"));
    }
    mantissa = mantissa * 10 + static_cast<u128>(c - '0');
  }
  if (!any_digit) return malformed();

  // Suffix: a named one, or a decimal exponent e<int> / E<int>.
  int binary_shift = 0;
  int decimal_exponent = 0;
  bool known = false;
  for (const Suffix& suffix : kSuffixes) {
    if (rest == suffix.name) {
      binary_shift = suffix.binary_shift;
      decimal_exponent = suffix.decimal_exponent;
      known = true;
      break;
    }
  }
  if (!known && rest.size() >= 2 && (rest.front() == 'e' || rest.front() == 'E')) {
    int exponent = 0;
    if (absl::SimpleAtoi(rest.substr(1), &exponent) && exponent >= -2 * kMaxDigits &&
        exponent <= 2 * kMaxDigits) {
      decimal_exponent = exponent;
      known = true;
    }
  }
  if (!known) {
    if (rest.empty() || absl::ascii_isdigit(rest.front()) || rest.front() == '.') return malformed();
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has an unknown size suffix '", rest, "' in '", text,
                     "': use Ki, Mi, Gi, Ti, Pi, Ei (powers of 1024) or k, M, G, T, P, E (powers "
                     "of 1000); KiB..EiB and KB..EB are accepted as their aliases"));
  }

  const auto too_large = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " is larger than 2^64-1 bytes: '", text, "'"));
  };
  const auto fractional = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be a whole number of bytes, got '", text, "' (", kGrammar, ")"));
  };
  if (mantissa == 0) return uint64_t{0};
  // bytes = mantissa * 2^binary_shift * 10^scale.
  int scale = decimal_exponent - fraction_digits;
  while (scale < 0 && mantissa % 10 == 0) {
    mantissa /= 10;
    ++scale;
  }
  u128 bytes = mantissa;
  if (scale >= 0) {
    if (scale > kMaxDigits) return too_large();
    if (__builtin_mul_overflow(bytes, Pow(10, scale), &bytes)) return too_large();
    if (bytes > kMaxBytes) return too_large();
    if (binary_shift > 0 && bytes > (kMaxBytes >> binary_shift)) return too_large();
    return static_cast<uint64_t>(bytes << binary_shift);
  }
  // A fraction left over: 10^-scale = 2^-scale * 5^-scale must divide mantissa * 2^binary_shift.
  const int down = -scale;
  if (down > kMaxDigits) return fractional();
  const u128 fives = Pow(5, down);
  if (bytes % fives != 0) return fractional();
  bytes /= fives;
  if (binary_shift >= down) {
    const int shift = binary_shift - down;
    if (bytes > kMaxBytes || (shift > 0 && bytes > (kMaxBytes >> shift))) return too_large();
    return static_cast<uint64_t>(bytes << shift);
  }
  const int shift = down - binary_shift;
  if (shift >= 128 || (bytes & ((u128{1} << shift) - 1)) != 0) return fractional();
  bytes >>= shift;
  if (bytes > kMaxBytes) return too_large();
  return static_cast<uint64_t>(bytes);
}

}  // namespace kvs
