// The built-in connector kinds, registered by default_kv_connector_registry().
#pragma once

#include <initializer_list>
#include <memory>
#include <string_view>

#include "pagedattn/connector.h"

namespace pagedattn::connector {

/// Throws InvalidArgument naming an option of `config` that is not in `known`, and the known ones.
void check_known_options(const KVConnectorConfig& config,
                         std::initializer_list<std::string_view> known);

/// "storage": entries are files under a directory (storage_connector.cpp).
std::unique_ptr<KVConnector> make_storage_connector(const KVConnectorConfig& config,
                                                    KVConnectorRole role);
/// "redis": entries are values on a Redis server (redis_connector.cpp); NotSupported when the
/// library was built without hiredis.
std::unique_ptr<KVConnector> make_redis_connector(const KVConnectorConfig& config,
                                                  KVConnectorRole role);

}  // namespace pagedattn::connector
