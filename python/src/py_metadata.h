// The Python-side AttentionMetadata: the C++ views plus the objects that own their memory.
#pragma once

#include <memory>

#include "convert.h"

namespace pagedattn::py {

/// pagedattn.AttentionMetadata. `md` points into the arrays held below (or into `step`, the
/// buffers of a StepMetadata it was made from), so they live as long as this object.
struct PyMetadata {
  AttentionMetadata md;
  nb::object query_start_loc, seq_lens, block_table, slot_mapping;  // arrays or None
  nb::object query_start_loc_cpu, seq_lens_cpu;                     // arrays or None
  std::shared_ptr<StepMetadata> step;                               // owner of step buffers
};

}  // namespace pagedattn::py
