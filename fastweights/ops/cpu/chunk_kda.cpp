#include "chunk_common.h"
void register_chunk_kda(pybind11::module& m) {}
