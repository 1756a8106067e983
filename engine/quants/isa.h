// STRATA_QUANTS_ISA: the highest of the C++ builds a process may pick ("portable", "avx2", "vnni";
// unset: the CPU's), as ONEDNN_MAX_CPU_ISA caps oneDNN, so one machine can compare them. Read by
// engine/quants/ops.cpp (its kernels) and engine/attend.cpp (its two builds).
#pragma once
#include <cstdlib>
#include <string_view>

inline std::string_view isa_cap() {
  const char* cap = std::getenv("STRATA_QUANTS_ISA");
  return cap ? cap : "";
}
