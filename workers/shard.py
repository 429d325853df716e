"""`ShardWorker`: the Ray actor that owns one device and runs one shard's `ModelRunner`.

The engine reaches it through an executor (workers/executor/): `RayExecutor` for a lone shard actor,
`WorkerGroup` for the tp * dp shards of a group.

A shard of a multi-rank group starts in two calls, because its peers must exist before any of them can join
the process group: rank 0 opens the rendezvous store on a free port of its own node (`open_rendezvous`), then
every rank joins it (`start`: `init_parallel`, then this rank's weight slices and KV pool).
"""
from __future__ import annotations

import os
import pickle
import socket
from datetime import timedelta

import ray

from workers.batch import StepBatch
from workers.config import EngineConfig, ParallelConfig
from workers.runner import ModelRunner, StepResult


_KV_CONTROL = frozenset({"listen", "connect", "wait_ready", "drop", "broken", "set_faults", "transfer_ids"})


class ShardWorker:
    """One shard: model weights and KV pages on this actor's device.

    With `parallel` None (or a world of one) the model loads in the constructor, as a lone shard. Otherwise the
    constructor only records the rank; `open_rendezvous` (rank 0) and `start` (every rank) bring it up."""

    def __init__(self, model_dir: str, engine_config: EngineConfig, device: str = "auto", *, rank: int = 0,
                 parallel: ParallelConfig | None = None, moe_dispatch: str = "alltoall",
                 collective_timeout_s: float = 600.0) -> None:
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.device = device
        self.rank = rank
        self.parallel = parallel or ParallelConfig()
        self.moe_dispatch = moe_dispatch
        self.collective_timeout_s = collective_timeout_s
        self.ctx = None
        self.runner: ModelRunner | None = None
        self._store = None
        self.num_calls = 0  # group steps this rank ran (one Ray call each)
        self.num_kv_steps = 0  # group KV-only steps (no forward) this rank ran
        self.agent = None  # this shard's KV transfer end (workers.kv.agent.TransferAgent), prefill/decode roles
        self.kv_worker = None  # runs each step's KV commands on `agent` (workers.kv.worker.KVWorker)
        if self.parallel.world_size == 1:
            self.runner = ModelRunner(model_dir, engine_config=engine_config, device=device)

    # ---- group start ------------------------------------------------------------------------------------
    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: listen on a free port of this node's address and serve the group's TCPStore there.
        -> (host, port) for the other ranks. The socket is bound by us and handed to the store, so no other
        process can take the port between finding it and using it, and it listens on this node's address only
        (loopback on a single-node test cluster), not on every interface."""
        from torch.distributed import TCPStore

        host = ray.util.get_node_ip_address()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        self._store = TCPStore(host, port, self.parallel.world_size, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=self.collective_timeout_s),
                               master_listen_fd=sock.fileno())
        sock.detach()  # the store owns the descriptor now and closes it; Python must not close it a second time
        return host, port

    def start(self, host: str, port: int) -> dict:
        """Join the group's process groups through the store at host:port, then load this rank's weight slices
        and allocate its KV pool. -> `info()`."""
        import torch
        from torch.distributed import TCPStore

        from msa.parallel import init_parallel

        p = self.parallel
        store = self._store
        if store is None:
            store = TCPStore(host, port, p.world_size, is_master=False,
                             timeout=timedelta(seconds=self.collective_timeout_s))
        device = self.device
        backend = "nccl" if str(device).startswith("cuda") else "gloo"
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            _gloo_on_loopback(host)
        self.ctx = init_parallel(self.rank, p.world_size, tp=p.tp, ep=p.ep, dp=p.dp, store=store, backend=backend,
                                 moe_dispatch=self.moe_dispatch, timeout_s=self.collective_timeout_s, device=device)
        self.runner = ModelRunner(self.model_dir, engine_config=self.engine_config, device=device, ctx=self.ctx)
        return self.info()

    # ---- steps ------------------------------------------------------------------------------------------
    def info(self) -> dict:
        return self.runner.info()

    def execute(self, batch: StepBatch) -> StepResult:
        return self._step(batch)

    def execute_pickled(self, payload: bytes) -> StepResult | None:
        """A step whose batch the engine pickled once for every rank of the group. Only a sampling rank (tp
        rank 0) returns its result; the others return None (nothing the engine reads, nothing to send back), or
        a bare result carrying their KV events when the batch had KV commands."""
        batch = pickle.loads(payload)
        if batch.chunks or batch.kv is None or batch.kv.forward:
            self.num_calls += 1
        else:
            self.num_kv_steps += 1
        return self._step(batch)

    def _step(self, batch: StepBatch) -> StepResult | None:
        """The forward, with the batch's KV commands around it (this shard's `KVWorker`)."""
        def forward(b: StepBatch) -> StepResult | None:
            result = self.runner.execute(b)
            return result if self.runner.samples else None

        if self.kv_worker is None or batch.kv is None:
            return forward(batch)
        return self.kv_worker.run_step(batch, forward)

    def counters(self) -> dict:
        """{"calls": group steps run, "kv_steps": KV-only steps run, "idle_forwards": empty forwards run for
        lockstep peers, "graph_steps": steps that replayed a decode CUDA graph} (tests)."""
        return {"calls": self.num_calls, "kv_steps": self.num_kv_steps, "idle_forwards": self.runner.num_idle_forwards,
                "graph_steps": self.runner.num_graph_steps}

    def ping(self) -> str:
        return "ok"

    # ---- KV transfer (disaggregation): this shard's TransferAgent and KVWorker ------------------------------
    # The pages live in this process, so the agent does too. Per-request work (prepare, announce, send, abort,
    # release, results) rides the step (`StepBatch.kv`, run by `self.kv_worker`); what stays here are the
    # per-pair control calls (`workers.kv.group_agent.GroupAgentControl` fans them out to a tp group's shards).
    def kv_init(self, role: str, num_kv_heads: int, config) -> dict:
        """Build this shard's agent (replacing one built before). -> {"tp", "tp_rank", "host"}."""
        from workers.kv.agent import TransferAgent
        from workers.kv.worker import KVWorker

        if self.agent is not None:
            self.agent.close()
        ctx = self.runner.ctx
        host = ray.util.get_node_ip_address()
        self.agent = TransferAgent(self.runner.kv, role=role, num_kv_heads=num_kv_heads, tp=ctx.tp_size,
                                   tp_rank=ctx.tp_rank, config=config, host=host)
        self.kv_worker = KVWorker(self.agent)
        return {"tp": ctx.tp_size, "tp_rank": ctx.tp_rank, "host": host}

    def kv_control(self, method: str, *args):
        """A pair call on this shard's agent: listen, connect, wait_ready, drop, broken, set_faults (tests),
        transfer_ids (tests: none may be left)."""
        if method not in _KV_CONTROL:
            raise ValueError(f"method: {method!r} is not a pair call ({sorted(_KV_CONTROL)})")
        if self.agent is None:
            if method == "transfer_ids":
                return []
            raise RuntimeError(f"rank {self.rank}: no KV transfer agent (kv_init first)")
        return getattr(self.agent, method)(*args)

    def kv_close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = self.kv_worker = None

    def stop(self) -> None:
        """Leave the process group cleanly (all ranks call this together)."""
        from msa.parallel import destroy_parallel

        if self.ctx is not None:
            destroy_parallel(self.ctx)
            self.ctx = None


def _gloo_on_loopback(host: str) -> None:
    """A group met on a loopback address keeps its gloo connections there too (gloo otherwise binds the
    address this host's name resolves to). An explicit GLOO_SOCKET_IFNAME wins."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or not (host.startswith("127.") or host == "::1"):
        return
    names = [name for _i, name in socket.if_nameindex()]
    if "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
