"""The door: how an adapter's code is entered. The protocols an adapter implements (protocol,
protocol_v2) and which of their capabilities it has (capabilities); loading it from `--impl
module:factory` (load); the guard around every entry into its code (guard); the proxies that
check each call's outputs (checked); and the supervisor that runs a validation in a watched
child process (supervise). Imports only the reports (and the engine's ragged helpers)."""
