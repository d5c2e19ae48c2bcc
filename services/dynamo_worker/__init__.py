"""The Dynamo worker stage: one pagedserve engine (scheduler + executor) behind NVIDIA Dynamo.

Dynamo's frontend (`python -m dynamo.frontend`) tokenizes, applies chat templates, routes
(round robin, or KV-aware from our KV events) and detokenizes; a worker only registers a
model and serves a token-in/token-out `generate` endpoint. This stage plays the gateway's
part toward its engine's scheduler: it turns Dynamo's PreprocessedRequest into a
TokenizedRequest (`requests`), streams the scheduler's TokenDeltas back as Dynamo's
LLMEngineOutput (`outputs`), aborts what Dynamo stops (`handler`), keeps the scheduler
sure it is alive (`engine_link`), reads the engine's heartbeats for readiness and load
(`engine_status`, `load`), relays the scheduler's KV events to Dynamo's router
(`kv_relay`) and registers itself (`service`). Dynamo is imported only by `service`,
`load` and `kv_relay`, so the base install runs without the `pagedserve[dynamo]` extra.
"""
