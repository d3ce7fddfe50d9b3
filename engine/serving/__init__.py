"""Talking to serving engines over HTTP: SGLang's native `/generate` and the OpenAI-compatible
`/v1/completions` that vLLM and SGLang serve (client.py), each exchange bounded (transport.py:
a deadline on the whole reply, a size limit, no redirect), and their speculative-decoding
counters read from Prometheus' /metrics (speculation.py). `kdtree validate --server` judges
what they serve (engine/validate/run/server.py); docs/serving.md says how to start them."""

from .client import APIS, Ask, Client, Reply, ServerError, client
from .transport import HttpStatusError

__all__ = ["APIS", "Ask", "Client", "HttpStatusError", "Reply", "ServerError", "client"]
