// Umbrella header: the whole public C++ API.
#pragma once

#include "pagedattn/accuracy.h"
#include "pagedattn/backend.h"
#include "pagedattn/case_file.h"
#include "pagedattn/config.h"
#include "pagedattn/connector.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/error.h"
#include "pagedattn/forward_context.h"
#include "pagedattn/kv_cache.h"
#include "pagedattn/kv_cache_spec.h"
#include "pagedattn/layer.h"
#include "pagedattn/metadata.h"
#include "pagedattn/registry.h"
#include "pagedattn/safetensors.h"
#include "pagedattn/tensor.h"
