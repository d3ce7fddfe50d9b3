"""The rows: what is checked, per fixture and stage. Model fixtures through the adapter (model,
over cases), the built-in engine's decode (engine), the kernel cases (kernel, corpus), paged KV
(paged), the batched rows of a protocol v2 adapter (batched, batched_model), the invariant
DDTree == AR (invariant), a serving engine's answers (served) and what it says it drafted and
accepted (speculation). Each returns report rows,
judged by the judging package; it reaches the adapter only through the door."""
