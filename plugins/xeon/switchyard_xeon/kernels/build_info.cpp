// What this library was built as: its ISA level and the hash of the sources it was
// compiled from (both passed by setup.py), so the loader can tell which variant
// it opened and whether the sources changed since.
#include <torch/library.h>

#include <string>

#ifndef SY_ISA
#define SY_ISA "unknown"
#endif
#ifndef SY_SOURCE_HASH
#define SY_SOURCE_HASH "unknown"
#endif

namespace {

std::string build_isa() { return SY_ISA; }
std::string build_source_hash() { return SY_SOURCE_HASH; }

}  // namespace

// No tensor arguments: registered with their schema as catch-all kernels.
TORCH_LIBRARY_FRAGMENT(switchyard_xeon, m) {
  m.def("build_isa() -> str", &build_isa);
  m.def("build_source_hash() -> str", &build_source_hash);
}
