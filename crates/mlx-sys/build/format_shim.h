// Force-included into the mlx-c translation unit.
//
// mlx-c's private/io.h builds error messages with std::format, which the
// libstdc++ of GCC 12 does not have yet. Those messages only use plain `{}`
// placeholders, so a tiny stand-in that substitutes arguments in order is
// enough. Toolchains that have std::format keep their own.
#pragma once
#include <version>
#if !defined(__cpp_lib_format)
#include <sstream>
#include <string>
#include <string_view>

namespace std {
inline void mlx_sys_format_rest(ostringstream& out, string_view fmt) {
  out << fmt;
}

template <class First, class... Rest>
void mlx_sys_format_rest(ostringstream& out, string_view fmt, const First& first,
                         const Rest&... rest) {
  const auto hole = fmt.find("{}");
  if (hole == string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, hole) << first;
  mlx_sys_format_rest(out, fmt.substr(hole + 2), rest...);
}

template <class... Args>
string format(string_view fmt, const Args&... args) {
  ostringstream out;
  mlx_sys_format_rest(out, fmt, args...);
  return out.str();
}
}  // namespace std
#endif
