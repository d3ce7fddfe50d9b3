"""Adapters of the validation protocol (engine/validate/door/protocol.py) for third-party engines.

- `engine.adapters.hf`: HF transformers' `DeepseekV3ForCausalLM` (the model
  capability), importable only where transformers >= 5.6 is installed.

Each module is imported on its own (``--impl engine.adapters.hf:HFAdapter``), so a
missing optional dependency breaks only its adapter.
"""
