"""engine: the torch reference engine for DDTree on DeepSeek-V3 / Kimi-K2-class models.

Modules: model, cache, attention, stages (the target and DDTree stages);
decode (AR and DDTree loops), drafters, metrics; adapter (the protocol a user
engine implements), validate and cli (`kdtree validate`, `kdtree demo`).
"""
