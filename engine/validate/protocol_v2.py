"""The adapter protocol v2 where adapters import it, `engine.validate.protocol_v2`: the contract,
the per-request view and the ragged helpers are door/protocol_v2.py's."""

from .door.protocol_v2 import (CAPABILITIES_V2, METHODS_V2, STAGE_OF, Offsets, PerRequest, adapter_device, offsets_of,
                               pack_visibility, per_request, sizes, to_padded, to_ragged, unpack_visibility, widest)

__all__ = ["CAPABILITIES_V2", "METHODS_V2", "STAGE_OF", "Offsets", "PerRequest", "adapter_device", "offsets_of",
           "pack_visibility", "per_request", "sizes", "to_padded", "to_ragged", "unpack_visibility", "widest"]
