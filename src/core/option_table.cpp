#include "core/option_table.h"

#include <charconv>
#include <climits>

#include "pagedattn/error.h"

namespace pagedattn::detail {

namespace {

std::string range_text(const OptionSpec& spec) {
  if (spec.max == INT_MAX) return cat("an integer >= ", spec.min);
  return cat("an integer in [", spec.min, ", ", spec.max, "]");
}

// "a, b or c" from the allowed values.
std::string join_or(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    s += (i == 0 ? "" : i + 1 == v.size() ? " or " : ", ") + v[i];
  }
  return s;
}

}  // namespace

std::vector<std::string> allowed_values(const OptionSpec& spec) {
  std::vector<std::string> out;
  for (const auto& [word, code] : spec.words) out.emplace_back(word);
  if (spec.min <= spec.max) out.push_back(range_text(spec));
  return out;
}

std::string spell(const OptionSpec& spec, int code) {
  for (const auto& [word, c] : spec.words) {
    if (c == code) return std::string(word);
  }
  return std::to_string(code);
}

int parse_value(const OptionSpec& spec, std::string_view value, std::string_view source) {
  for (const auto& [word, code] : spec.words) {
    if (value == word) return code;
  }
  if (spec.min <= spec.max) {
    int n = 0;
    const char* end = value.data() + value.size();
    const auto [ptr, ec] = std::from_chars(value.data(), end, n);
    if (!value.empty() && ec == std::errc() && ptr == end && n >= spec.min && n <= spec.max) {
      return n;
    }
  }
  fail(source, " option '", spec.name, "': '", value, "' is not ", join_or(allowed_values(spec)));
}

std::pair<std::string_view, std::string_view> split_setting(std::string_view setting,
                                                            std::string_view source) {
  const size_t eq = setting.find('=');
  require(eq != std::string_view::npos && eq > 0, source, ": '", setting,
          "' is not a setting of the form name=value");
  return {setting.substr(0, eq), setting.substr(eq + 1)};
}

void unknown_option(std::string_view source, std::string_view name,
                    const std::vector<std::string_view>& names) {
  std::string all;
  for (std::string_view n : names) all += (all.empty() ? "" : ", ") + std::string(n);
  fail(source, " has no option '", name, "'; its options: ", all.empty() ? "none" : all);
}

}  // namespace pagedattn::detail
