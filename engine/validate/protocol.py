"""The adapter protocol (v1) where adapters import it, `engine.validate.protocol`: the contract is
door/protocol.py, the capability rules door/capabilities.py, loading an adapter door/load.py."""

from .door.capabilities import capabilities, capability_table, declared_capabilities, resolve_capabilities
from .door.load import load_impl
from .door.protocol import CAPABILITIES, METHODS, EngineAdapter, Method, Output, protocol_version

__all__ = ["CAPABILITIES", "METHODS", "EngineAdapter", "Method", "Output", "capabilities", "capability_table",
           "declared_capabilities", "load_impl", "protocol_version", "resolve_capabilities"]
