"""`computed gateway`: an OpenAI-compatible HTTP front door over the replica fleet
(docs/gateway.md). It speaks HTTP to applications and ZeroMQ to statesvc and the replicas,
and imports no JAX and nothing of `computed`: only `shared` (the wire protocol, keys, the
tokenizer and the stop-string rule of shared/text.py)."""
