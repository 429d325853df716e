"""Batched token sampling: penalties, temperature, min-p / top-k / top-p, seeded draws and logprobs.

Everything runs on the logits' device as whole-batch tensor ops; Python touches the batch only per row (never
per vocabulary entry): building the small per-row parameter tensors and drawing per-row noise for seeded rows.

Order of operations (vLLM's, so users get the same behaviour):
  raw logits --(logprobs are taken here: log_softmax of the raw logits)
  -> grammar bitmask (structured outputs, `workers.structured`): ids the row's grammar forbids set to -inf, first,
     so no later stage can bring one back
  -> suppressed ids (e.g. EOS before `min_tokens`) set to -inf
  -> repetition penalty (tokens seen in prompt or output), then frequency and presence penalties (output only)
  -> greedy rows: argmax here
  -> temperature -> min-p (relative to the top probability) -> top-k -> top-p -> draw.

The draw uses the exponential race: with E_i ~ Exp(1) i.i.d., argmax_i p_i / E_i is distributed as p. Each
seeded row draws its E from its own `torch.Generator`, so a seeded request gets the same tokens whatever else
is in the batch. Rows without a generator share one batched draw from the sampler's generator (or torch's
default one).

Logprobs under a grammar are those of the raw logits: the model's own probability of the token it was forced
to, and top-N lists that may name forbidden tokens. vLLM v1 masks in its model runner before its sampler, so its
logprobs on constrained rows are of the masked (renormalised) distribution instead; we keep the raw ones, as for
every other stage here (penalties, top-k and temperature do not change logprobs either).

Parallel samples (`n > 1`) are separate rows; the engine gives sample j of a request seeded `s` the generator
`make_generator(s, j, device)`, i.e. seed `s + j` (vLLM's convention), so the samples differ yet reproduce.
"""
from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Callable, Sequence

import numpy as np
import torch

from msa.metadata import host_tensor
from workers.request import SamplingParams
from workers.structured import apply_token_bitmask

# Temperatures below this are treated as greedy: dividing by them would overflow fp32 logits.
GREEDY_TEMPERATURE_EPS = 1e-5


def make_generator(seed: int, sample_index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for sample `sample_index` of a request seeded `seed` (seed + sample_index), on `device`."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed((seed + sample_index) % 2**63)
    return gen


def suppressed_token_ids(
    params: SamplingParams, num_output_tokens: int, eos_token_ids: Sequence[int]
) -> list[int]:
    """Token ids that may not be sampled now: EOS and stop token ids while fewer than `min_tokens` exist."""
    if num_output_tokens >= params.min_tokens:
        return []
    stops = [] if params.ignore_eos else list(eos_token_ids)
    return sorted(set(stops) | set(params.stop_token_ids))


def _flat_pairs(rows_of_ids: Sequence[Sequence[Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """(row index [M], token id [M]) int64 numpy arrays for every id of every row, duplicates kept.

    rows_of_ids[r] is a tuple of id sequences for row r (e.g. its prompt and its output), read without
    concatenating them. numpy's fromiter keeps this at C speed: a step can carry 100k+ prompt ids."""
    lengths = np.fromiter((sum(len(s) for s in parts) for parts in rows_of_ids), dtype=np.int64,
                          count=len(rows_of_ids))
    total = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(rows_of_ids)),
                      dtype=np.int64, count=total)
    rows = np.repeat(np.arange(len(rows_of_ids), dtype=np.int64), lengths)
    return rows, ids


@dataclass(frozen=True, kw_only=True)
class SamplingBatch:
    """Per-row sampling parameters of one step as device tensors (N rows), plus host-side flags that let the
    sampler skip stages no row uses (no device sync needed to decide)."""

    num_rows: int
    temperature: torch.Tensor  # [N] fp32; 1.0 on greedy rows (never divided by 0)
    greedy: torch.Tensor  # [N] bool
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] fp32; 1.0 = off
    min_p: torch.Tensor  # [N] fp32; 0.0 = off
    repetition_penalty: torch.Tensor  # [N] fp32; 1.0 = off
    presence_penalty: torch.Tensor  # [N] fp32
    frequency_penalty: torch.Tensor  # [N] fp32
    # (row, token) pairs; masks/counts are built at sampling time when the logits' vocab width is known.
    seen_rows: torch.Tensor | None  # [M] int64: prompt + output tokens (repetition penalty)
    seen_ids: torch.Tensor | None  # [M] int64
    output_rows: torch.Tensor | None  # [M'] int64: output tokens (presence / frequency penalties)
    output_ids: torch.Tensor | None  # [M'] int64
    suppressed_rows: torch.Tensor | None  # [S] int64
    suppressed_ids: torch.Tensor | None  # [S] int64
    # [N, ceil(V / 32)] int32 packed allowed-token bits (workers.structured.fill_token_bitmask); None: no grammar
    token_bitmask: torch.Tensor | None
    generators: tuple[torch.Generator | None, ...]  # per row
    num_logprobs: int  # K = max requested top logprobs (0 = none)
    all_greedy: bool
    any_greedy: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_repetition: bool
    do_presence_frequency: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        device: torch.device | str,
        *,
        suppressed_ids: Sequence[Sequence[int]] | None = None,
        token_bitmask: torch.Tensor | np.ndarray | None = None,
        stage: Callable[[list[tuple[Sequence, torch.dtype]]], list[torch.Tensor]] | None = None,
    ) -> "SamplingBatch":
        """One row per sequence being sampled this step (a request with n > 1 has n rows).

        `suppressed_ids[i]`: ids row i may not sample (see `suppressed_token_ids` for `min_tokens`).
        `token_bitmask`: [N, W] int32 host bitmask of the grammar rows (`workers.structured.fill_token_bitmask`;
        None when no row has one); it rides in the same staged copy as the rest.
        `stage`: puts [(host values, dtype)] on `device` in one go (the runner's `msa.metadata.Stager.stage`: one
        pinned non-blocking copy, so the batch is built while the forward still runs); None: one copy a tensor.
        """
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError(
                f"rows: params/prompt_token_ids/output_token_ids/generators lengths differ "
                f"({n}, {len(prompt_token_ids)}, {len(output_token_ids)}, {len(generators)})"
            )
        if suppressed_ids is not None and len(suppressed_ids) != n:
            raise ValueError(f"suppressed_ids: expected {n} rows, got {len(suppressed_ids)}")
        greedy = [p.temperature < GREEDY_TEMPERATURE_EPS for p in params]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        do_rep = any(p.repetition_penalty != 1.0 for p in params)
        do_pf = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        f32 = torch.float32
        lists: dict[str, tuple] = {
            "temperature": ([1.0 if g else p.temperature for p, g in zip(params, greedy)], f32),
            "greedy": (greedy, torch.bool), "top_k": (top_k, torch.int64),
            "top_p": ([p.top_p for p in params], f32), "min_p": ([p.min_p for p in params], f32),
            "repetition_penalty": ([p.repetition_penalty for p in params], f32),
            "presence_penalty": ([p.presence_penalty for p in params], f32),
            "frequency_penalty": ([p.frequency_penalty for p in params], f32)}

        def pairs(name: str, rows_of_ids: Sequence[Sequence[Sequence[int]]]) -> None:
            rows, ids = _flat_pairs(rows_of_ids)
            lists[f"{name}_rows"], lists[f"{name}_ids"] = (rows, torch.int64), (ids, torch.int64)

        if do_rep:
            # Rows without a repetition penalty contribute no pairs (their factor would be 1 anyway).
            pairs("seen", [(pr, out) if p.repetition_penalty != 1.0 else ()
                           for p, pr, out in zip(params, prompt_token_ids, output_token_ids)])
        if do_pf:
            pairs("output", [(out,) if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) else ()
                             for p, out in zip(params, output_token_ids)])
        if suppressed_ids is not None and any(len(s) for s in suppressed_ids):
            pairs("suppressed", [(s,) for s in suppressed_ids])
        if token_bitmask is not None:
            bits = np.asarray(token_bitmask, dtype=np.int32)  # a CPU tensor: a view, no copy
            if bits.ndim != 2 or bits.shape[0] != n:
                raise ValueError(f"token_bitmask: expected [{n}, W] int32, got {list(bits.shape)}")
            lists["token_bitmask"] = (bits.reshape(-1), torch.int32)
        if stage is None:
            dev = torch.device(device)
            tensors = [host_tensor(values, dtype).to(dev, non_blocking=True) for values, dtype in lists.values()]
        else:
            tensors = stage(list(lists.values()))
        t = dict(zip(lists, tensors))
        return cls(
            num_rows=n, **{k: t[k] for k in ("temperature", "greedy", "top_k", "top_p", "min_p",
                                             "repetition_penalty", "presence_penalty", "frequency_penalty")},
            seen_rows=t.get("seen_rows"), seen_ids=t.get("seen_ids"), output_rows=t.get("output_rows"),
            output_ids=t.get("output_ids"), suppressed_rows=t.get("suppressed_rows"),
            suppressed_ids=t.get("suppressed_ids"),
            token_bitmask=None if token_bitmask is None else t["token_bitmask"].view(n, -1),
            generators=tuple(generators),
            num_logprobs=max((p.logprobs or 0) for p in params) if params else 0,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            do_top_k=any(k > 0 for k, g in zip(top_k, greedy) if not g),
            do_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy) if not g),
            do_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
            do_repetition=do_rep,
            do_presence_frequency=do_pf,
        )


@dataclass(frozen=True, kw_only=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] fp32: log_softmax(raw logits) at the sampled token
    top_token_ids: torch.Tensor  # [N, K] int64, K = max requested logprobs (0 -> [N, 0])
    top_logprobs: torch.Tensor  # [N, K] fp32, descending

    def logprob_dicts(self, num_logprobs: Sequence[int | None]) -> list[dict[int, float] | None]:
        """Per row: {token id: logprob} with the sampled token and the row's top-N (None where not requested).

        One host transfer for the whole batch."""
        sampled = self.token_ids.tolist()
        sampled_lp = self.logprobs.tolist()
        top_ids = self.top_token_ids.tolist()
        top_lp = self.top_logprobs.tolist()
        out: list[dict[int, float] | None] = []
        for r, k in enumerate(num_logprobs):
            if k is None:
                out.append(None)
                continue
            d = {tid: lp for tid, lp in zip(top_ids[r][:k], top_lp[r][:k])}
            d[sampled[r]] = sampled_lp[r]
            out.append(d)
        return out


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens, then frequency/presence over output counts (in place).

    logits: [N, V] fp32. Repetition (CTRL-style): a seen token's logit is divided by the penalty when positive,
    multiplied when negative. Frequency subtracts penalty * count; presence subtracts penalty once if count > 0.
    """
    n, vocab = logits.shape
    if batch.do_repetition and batch.seen_ids is not None and batch.seen_ids.numel():
        seen = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
        seen[batch.seen_rows, batch.seen_ids] = True
        rp = batch.repetition_penalty.unsqueeze(1).expand_as(logits)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalised, logits)
    if batch.do_presence_frequency and batch.output_ids is not None and batch.output_ids.numel():
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=logits.device)
        ones = torch.ones_like(batch.output_ids, dtype=torch.float32)
        counts.index_put_((batch.output_rows, batch.output_ids), ones, accumulate=True)
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (top probability). logits [N, V], min_p [N]."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k most likely tokens (k = 0: all), then the smallest prefix of them, in descending
    probability, whose mass reaches top_p (renormalised over the top-k survivors). One sort serves both.

    Ties at the k-th place are broken by sort position (exactly k survive)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        drop |= rank >= k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        # Rows at top_p = 1 must lose nothing, even where fp32 rounding lets the cumulative mass reach 1 early.
        drop |= (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always survives
    # Scatter the sorted-order mask back to vocab order.
    drop_vocab = torch.empty_like(drop).scatter_(1, order, drop)
    return logits.masked_fill(drop_vocab, float("-inf"))


def _exponential_noise(
    shape: tuple[int, int], generators: Sequence[torch.Generator | None], device: torch.device,
    default: torch.Generator | None,
) -> torch.Tensor:
    """Exp(1) noise [N, V]: each seeded row from its own generator, the other rows in one shared draw."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if len(unseeded) == shape[0]:
        noise.exponential_(generator=default)
        return noise
    for r, g in enumerate(generators):
        if g is not None:
            noise[r].exponential_(generator=g)
    if unseeded:
        idx = torch.tensor(unseeded, dtype=torch.int64, device=device)
        shared = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=device)
        noise[idx] = shared.exponential_(generator=default)
    return noise


def skip_draws(gen: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Advance a seeded row's generator past `num_tokens` sampled tokens: each sampled token costs it one [V]
    Exp(1) draw (`_exponential_noise`), so replaying the same draws leaves it where an unbroken run would be.
    For a generator made after some tokens already exist: on the decode replica after the prefill replica
    sampled the first."""
    if num_tokens <= 0:
        return
    scratch = torch.empty(vocab_size, dtype=torch.float32, device=gen.device)
    for _ in range(num_tokens):
        scratch.exponential_(generator=gen)


class Sampler:
    """Callable: `Sampler()(logits [N, V] fp32, batch) -> SamplerOutput`. Does not modify `logits`."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator  # for unseeded rows; None = torch's default generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits: expected [{batch.num_rows}, V], got {list(logits.shape)}")
        logits = logits.float()
        token_ids = self._choose(logits, batch)
        logprobs, top_ids, top_lps = gather_logprobs(logits, token_ids, batch.num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, top_token_ids=top_ids, top_logprobs=top_lps)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.token_bitmask is not None:
            logits = logits.clone()  # masked in place; the raw logits still serve the logprobs
            apply_token_bitmask(logits, batch.token_bitmask)
        if batch.suppressed_ids is not None:
            # the -inf made on the device: a host scalar would be a synchronising copy
            logits = logits.index_put((batch.suppressed_rows, batch.suppressed_ids),
                                      logits.new_full((), float("-inf")))
        logits = apply_penalties(logits, batch)
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None
        if batch.all_greedy:
            return greedy_ids
        logits = logits / batch.temperature.unsqueeze(1)
        if batch.do_min_p:
            logits = apply_min_p(logits, batch.min_p)
        if batch.do_top_k or batch.do_top_p:
            logits = apply_top_k_top_p(
                logits, batch.top_k if batch.do_top_k else None, batch.top_p if batch.do_top_p else None
            )
        probs = torch.softmax(logits, dim=-1)
        noise = _exponential_noise(tuple(probs.shape), batch.generators, probs.device, self.generator)
        # A zero draw would turn 0/0 into NaN on masked tokens; the clamp keeps them at 0.
        sampled_ids = (probs / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
        if greedy_ids is None:
            return sampled_ids
        return torch.where(batch.greedy, greedy_ids, sampled_ids)


def gather_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax(logits) at `token_ids` [N] and the top `num_top` per row, without materialising the full
    [N, V] log_softmax: logprob = logit - logsumexp(row). Returns ([N] fp32, [N, K] int64, [N, K] fp32)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    chosen = logits.gather(1, token_ids.unsqueeze(1)) - lse
    if num_top > 0:
        top_vals, top_ids = torch.topk(logits, min(num_top, logits.shape[-1]), dim=-1)
        top_lps = top_vals - lse
    else:
        top_ids = torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
        top_lps = torch.empty((logits.shape[0], 0), dtype=torch.float32, device=logits.device)
    return chosen.squeeze(1), top_ids, top_lps


def prompt_logprobs(
    logits: torch.Tensor, prompt_token_ids: Sequence[int], num_top: int
) -> list[dict[int, float] | None]:
    """Prompt logprobs in the API shape: entry 0 is None (nothing predicts the first token); entry i >= 1 is
    {prompt token i: its logprob, plus the top `num_top`} under the logits at position i - 1.

    logits: [L, V] fp32 for prompt positions 0..L-1 (the last row, predicting past the prompt, may be absent:
    L = len(prompt) - 1 or len(prompt))."""
    n = len(prompt_token_ids)
    if n == 0:
        return []
    if logits.shape[0] not in (n - 1, n):
        raise ValueError(f"logits: expected {n - 1} or {n} prompt positions, got {logits.shape[0]}")
    targets = torch.tensor(list(prompt_token_ids[1:]), dtype=torch.int64, device=logits.device)
    chosen, top_ids, top_lps = gather_logprobs(logits[: n - 1].float(), targets, num_top)
    out = SamplerOutput(token_ids=targets, logprobs=chosen, top_token_ids=top_ids, top_logprobs=top_lps)
    return [None] + out.logprob_dicts([num_top] * (n - 1))
