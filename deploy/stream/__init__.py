"""The one ingress <-> engine stream: what an engine replica publishes per request, and how the ingress consumes it.

```
EngineServer (engine_side)                                   Ingress (ingress_side)
  engine RequestOutput (cumulative ids)                        Stream: one request; its first event from the router
    -> DeltaTracker -> EngineChunk (new ids only)                (a Redirect, or disaggregated the first token),
    -> Outbox: one per subscriber (ingress replica), per          then from the engine replica the Redirect names
       request its chunks since the last item, merged           EngineStreams: one Subscription per engine replica,
  Publisher.serve(subscriber) ── one Serve stream ──────────▶     each item split into the requests' EventQueues
    one item per step for all of a subscriber's requests          (what piled up meanwhile comes as one chunk)
  start(subscriber, "generate" | "decode", args) ◀──────────    Stream.chunks(): text made (deploy/output.py), stop
  stop / abort ◀────────────────────────────────────────────      strings sent back as `stop`; abort / release owed
```

- `chunks`: the unit both sides share. An `EngineChunk` is a delta; consecutive ones concatenate (`merge_chunks`,
  `merge_runs`), so a hop that lags sends fewer, larger chunks with the same tokens (`EventQueue`); the Serve knobs
  that let a replica see its own backlog (`replica_actor_options`).
- `engine_side`: the engine replica's half (`DeltaTracker`, `Outbox`, `Publisher`); no text, no ingress imports.
- `ingress_side`: the ingress's half (`Subscription`, `EngineStreams`, `Stream`, `interleave` of a request's
  prompts, the SSE body `guarded` / `SSEResponse`).

Wire types (`EngineChunk`, `SampleDelta`, `EngineError`, `Redirect`) are deploy/protocol.py's. The import-linter
contracts in pyproject.toml keep the two halves apart: both may use `chunks`, neither the other.
"""
