"""KV transfer between a prefill shard and a decode shard: `KVSender` / `KVReceiver` (DESIGN.md §4).

What travels, for one request: its pages of every layer, K and V (the KV-head range the route assigns) and the
index-K of sparse layers (one head, replicated on every tp rank, so exactly one route per receiving shard carries
it). Pages are matched by position: page `page_ids[i]` on the sender lands in `page_ids[i]` on the receiver.

How it travels, per request and pair (posted in one order on both sides, so messages of different requests
never interleave):
  1. sender: header (JSON: request id, page count, layers, head range, dims, dtype, chunk cap) -> the pair's
     header stream (transport.py; the receiving pair thread is already blocked reading it)
  2. sender: gathers the pages of all layers and both families into a few contiguous staging buffers, each at
     most `max_chunk_bytes` (one large message moves ~15x faster than 1 MiB ones on NCCL, PERF.md), with ONE copy
     launch per chunk (kernels.page_copy; on CUDA it reads the page ids from the pair's pinned host buffer),
     sends them point-to-point right behind the header (on GPU our own NCCL calls, nccl.py) and posts the
     receive of the status; all of it from the caller's thread when the pair is idle (no thread hand-off before
     the bytes move). Receiver: reads the header, posts the first receives (their sizes follow from the header),
     then checks the header against what it prepared, and scatters each chunk into its own page ids (one launch
     per chunk, queued behind the receive on the copy stream).
  3. receiver: status (ok / reason, a 512-byte tensor) -> sender over the backend; the sender's pair thread sees
     it and the sender's op is DONE.
Several requests finished by one prefill step go as one payload (`send_many`: one header listing them, their
pages back to back, one status each). An *announced* payload (`announce`, TransferConfig.announce) splits step 1
from step 2: the header goes while the pages are still being written, and after the pages a trailer on the
header stream carries each request's meta or says the sender withdrew it (the receiver reads it before answering).
A header that does not match (unknown or aborted request, wrong page count, head range, dims or dtype) is not
an error of the wire: the receiver drains the payload into scratch memory, so the pair stays in step, and both
sides end FAILED with the reason. A timeout or a dead peer in the middle of a payload breaks the pair: the
operation and every later one on that pair end FAILED ("pair_broken"), the other side learns it from the header
stream's end (transport.PairChannel.abort), and the wiring layer makes a new pair.

States (`TransferState`): PENDING (prepared / queued) -> TRANSFERRING (header sent / received) -> DONE | FAILED.
Pages may be freed (both sides) once a request is *settled*: every pair operation of it is DONE or FAILED.

Modules: config (TransferConfig, states), routes (who sends which heads), wire (header, chunk plan, status and
trailer codecs), endpoint (operations, results, the endpoint state machine, the pair thread), sender, receiver,
agent (one shard's end: TransferAgent), commands (what a step carries: KVCommands in, KVEvents out), worker (the
worker side on each shard: KVWorker runs a step's commands on its agent), connector / handoff / remote (the
scheduler side beside each engine core), pairs (pair wiring), group_agent (pair calls over a tp group's shard
actors), transport (PairChannel: the header stream and point-to-point backend), nccl (our own NCCL calls), faults
(a faulty wire for tests and fault drills).
"""
