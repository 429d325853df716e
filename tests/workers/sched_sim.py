"""A pure-Python stand-in for the model, for scheduler tests: it 'writes' each chunk's tokens into a simulated KV
pool through the page tables and derives the next token only from what it reads back from that pool, so a wrong
page table, a shared page overwritten, or a bad prefix hit changes the generated tokens."""
from __future__ import annotations

from workers.scheduler import Scheduler, SchedulerOutput, UpdateResult

VOCAB = 97


def next_token(history: list[int]) -> int:
    """Deterministic 'greedy model': a function of the whole history."""
    h = 7
    for t in history:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


class SimModel:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv: dict[int, tuple[int, int, int]] = {}  # slot -> (token, position, history hash)
        self.written_shared = 0

    def step(self) -> tuple[SchedulerOutput, UpdateResult]:
        out = self.sched.schedule()
        pm = self.sched.pages
        ps = pm.page_size
        sampled: list[int | None] = []
        seen_decode = False
        for c in out.chunks:
            assert not (seen_decode and not c.is_decode), "prefill chunk after a decode chunk"
            seen_decode |= c.is_decode
            table = pm.page_table(c.seq.seq_id)
            for pos in range(c.start, c.start + c.num_tokens):
                page = table[pos // ps]
                if pm.ref_count(page) != 1:
                    self.written_shared += 1
                self.kv[page * ps + pos % ps] = (c.seq.token_ids[pos], pos, hash(tuple(c.seq.token_ids[:pos + 1])))
            if c.sample:
                end = c.start + c.num_tokens
                history = []
                for pos in range(end):  # read the whole context back from the cache
                    tok, p, hh = self.kv[table[pos // ps] * ps + pos % ps]
                    assert p == pos
                    history.append(tok)
                assert hh == hash(tuple(history))
                sampled.append(next_token(history))
            else:
                sampled.append(None)
        return out, self.sched.update(out, sampled)


def reference_output(prompt: list[int], max_tokens: int, eos: frozenset[int] = frozenset()) -> list[int]:
    hist = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        t = next_token(hist)
        hist.append(t)
        out.append(t)
        if t in eos:
            break
    return out
