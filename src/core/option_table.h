// A backend's run-time options as a table, and the one parser of "name=value" settings that
// every backend (and so every tool, through Registry::configure) uses. Each option is a name, a
// line of help, the words it accepts (each standing for an int code) and an optional integer
// range; the backend maps codes to and from its typed options struct.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pagedattn/backend.h"

namespace pagedattn::detail {

/// One option: its spellings and their codes.
struct OptionSpec {
  std::string_view name;
  std::string_view help;
  std::vector<std::pair<std::string_view, int>> words;  ///< spelling -> code
  int min = 1, max = 0;  ///< integers in [min, max] are codes of their own (none when min > max)
};

/// What `spec` accepts: each word, then "an integer in [min, max]" (or ">= min").
std::vector<std::string> allowed_values(const OptionSpec& spec);
/// The spelling of `code`: its first word, else the integer.
std::string spell(const OptionSpec& spec, int code);
/// The code `value` stands for. Throws InvalidArgument "<source> option '<name>': '<value>' is
/// not <what is allowed>".
int parse_value(const OptionSpec& spec, std::string_view value, std::string_view source);
/// "name=value" split at its first '='; throws InvalidArgument naming the setting otherwise.
std::pair<std::string_view, std::string_view> split_setting(std::string_view setting,
                                                            std::string_view source);
/// Throws InvalidArgument: `source` has no option `name`; lists `names`.
[[noreturn]] void unknown_option(std::string_view source, std::string_view name,
                                 const std::vector<std::string_view>& names);

/// An option of the typed options struct O: its spec and how its code is read and written.
template <class O>
struct OptionField {
  OptionSpec spec;
  int (*get)(const O&);
  void (*set)(O&, int);
};

/// Sets option `name` of `o` from the text `value`; `source` names the backend (and where the
/// text came from) in errors.
template <class O>
void set_option(const std::vector<OptionField<O>>& table, O& o, std::string_view name,
                std::string_view value, std::string_view source) {
  for (const OptionField<O>& f : table) {
    if (f.spec.name == name) return f.set(o, parse_value(f.spec, value, source));
  }
  std::vector<std::string_view> names;
  for (const OptionField<O>& f : table) names.push_back(f.spec.name);
  unknown_option(source, name, names);
}

/// Applies "name=value" settings in order to a copy of `o`; `o` changes only if all parse.
template <class O>
O with_settings(const std::vector<OptionField<O>>& table, const O& o,
                const std::vector<std::string>& settings, std::string_view source) {
  O next = o;
  for (const std::string& s : settings) {
    const auto [name, value] = split_setting(s, source);
    set_option(table, next, name, value, source);
  }
  return next;
}

/// Every option of `o`, with its current value.
template <class O>
std::vector<BackendOptionInfo> describe_options(const std::vector<OptionField<O>>& table,
                                                const O& o) {
  std::vector<BackendOptionInfo> out;
  for (const OptionField<O>& f : table) {
    out.push_back({std::string(f.spec.name), spell(f.spec, f.get(o)), allowed_values(f.spec),
                   std::string(f.spec.help)});
  }
  return out;
}

}  // namespace pagedattn::detail
