// Environment switches read by the core. The words for on and off are the
// ones moe_a2a.switches accepts; Python refuses any other value before the
// core starts (moe_a2a.switches.check_all), so the core never has to guess.
#pragma once

#include <cctype>
#include <cstdlib>
#include <string>

namespace moe_a2a::a2a {

// -1 when `name` is unset or empty, 0 for 0/false/no/off, 1 for 1/true/yes/on
// (any case); -1 for anything else too, which Python has already refused.
inline int env_switch(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return -1;
  std::string w;
  for (const char* c = raw; *c; ++c) w += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  if (w == "1" || w == "true" || w == "yes" || w == "on") return 1;
  if (w == "0" || w == "false" || w == "no" || w == "off") return 0;
  return -1;
}

// The positive integer in `name`; 0 when unset or empty (and for anything
// else, which Python has already refused).
inline long env_count(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || *raw == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(raw, &end, 10);
  return end != raw && *end == '\0' && v > 0 ? v : 0;
}

}  // namespace moe_a2a::a2a
