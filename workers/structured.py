"""Structured outputs, the engine-independent half: grammars compiled against the model's vocabulary, one matcher
per constrained request, and the packed token bitmask the sampler applies to the logits.

What it holds:
  - `GrammarSpec`: what a request asks for (`json_object`, `json_schema`, and vLLM's extras `choice`, `regex`,
    EBNF `grammar`, xgrammar `structural_tag`: the way to force a tool call's markers), hashable: the cache key.
  - `StructuredOutputCompiler`: built once per engine from our `Tokenizer` and the lm_head's vocab size; compiles
    specs (LRU-cached by spec) and hands out `GrammarState`s.
  - `GrammarState`: one request's matcher: `fill_bitmask(bitmask, row)`, `accept(token)`, `is_terminated()`,
    `rollback(n)`. EOS (the tokenizer's stop ids) is allowed only once the grammar is complete; after it the
    matcher is terminated and its row allows the stop ids alone.
  - `fill_token_bitmask(states, vocab_size)`: the step's [N, ceil(V/32)] int32 host bitmask (None when no row is
    constrained; unconstrained rows all ones), and `apply_token_bitmask(logits, bitmask)`: disallowed ids -> -inf
    in place, on CPU or CUDA (the bitmask travels host->device once a step, inside the sampler's staged copy).

How the engine uses it (one step): per running row, its request's GrammarState or None ->
`fill_token_bitmask(states, compiler.vocab_size, threads=...)` on the host -> `SamplingBatch.build(...,
token_bitmask=...)`, which stages it with the step's other sampling inputs (one host->device copy) -> the Sampler
masks before anything else -> `state.accept(token)` for each sampled token (host side, where the ids arrive anyway)
-> a row whose state `is_terminated()` finishes (its token is an EOS id). The engine must not suppress EOS
(`min_tokens`) on a row whose grammar is complete: EOS would be its only allowed token and the row would have none.

Why xgrammar rather than our own: compiling JSON Schema (bounds, enums, required fields, nesting) into a
tokenizer-aware automaton and computing a vocab-sized mask per step in microseconds is a large, subtle body of
work (token-boundary handling of byte-level BPE, caching of context-independent tokens, Earley parsing with
rollback). xgrammar is maintained, used by vLLM and SGLang as their default backend, and ships CPU and CUDA (triton)
mask kernels; we own only the glue.

xgrammar is imported lazily (`_xgr`): importing it takes ~2 s and pulls in transformers, which an engine that never
sees a constrained request should not pay.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from workers.structured_spec import KINDS, MAX_JSON_WHITESPACE, GrammarError, GrammarSpec

if TYPE_CHECKING:
    import xgrammar

    from workers.tokenizer import Tokenizer

# Bits per word of the packed bitmask (xgrammar's layout: int32 words, bit j of word w = token 32 * w + j).
WORD_BITS = 32
_DEFAULT_CACHE_SIZE = 256
# Below this many constrained rows, a thread pool's hand-off costs more than filling the rows one by one.
BATCH_FILL_MIN_ROWS = 8


def _xgr():
    import xgrammar  # lazy: see the module docstring

    return xgrammar


def _error_text(e: Exception) -> str:
    """xgrammar's message without its "[hh:mm:ss] /project/cpp/file.cc:123: " prefix (useless to a client)."""
    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", last)[:500]


def _choice_ebnf(choices: list[str]) -> str:
    """root ::= "a" | "b" ...: each choice a string literal. JSON string escapes (\\" \\\\ \\n \\uXXXX) are valid
    EBNF literal escapes, so json.dumps quotes any text safely."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: "Tokenizer", vocab_size: int | None = None,
                   grammar_special_tokens: Sequence[int] = ()) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of our tokenizer, without transformers' AutoTokenizer: the raw vocab of the `tokenizers`
    backend (ids kept), its encoding (byte-level / byte-fallback / raw, read by xgrammar from tokenizer.json) and
    the EOS ids as stop tokens.

    vocab_size: the lm_head's width (the mask's width); ids the tokenizer lacks (padding) are never allowed.
    Special added tokens (BOS, PAD, role markers) are blanked: xgrammar would otherwise read them as their literal
    text (a "<s>" inside a JSON string) while detokenization drops them; blank entries are never allowed. Except
    `grammar_special_tokens`: ids a grammar must be able to emit (a tool call's marker token, matched by id in a
    structural tag); text grammars may then also produce them where their literal text fits, the cost of keeping
    them."""
    xgr = _xgr()
    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(vocab_size or 0, max(vocab.values()) + 1)
    encoded = [""] * size
    for token, idx in vocab.items():
        encoded[idx] = token
    for idx in tokenizer.special_token_ids - set(grammar_special_tokens):
        encoded[idx] = ""
    # A documented-private helper, but it is exactly what `TokenizerInfo.from_huggingface` does with a fast
    # tokenizer's backend string; going through transformers would add a dependency for no gain.
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=size,
                             stop_token_ids=list(tokenizer.eos_token_ids) or None,
                             add_prefix_space=meta["add_prefix_space"])


class StructuredOutputCompiler:
    """Compiles `GrammarSpec`s for one tokenizer and model vocab; thread-safe; LRU cache of `cache_size` grammars.

    `vocab_size`: the model's lm_head width (>= the tokenizer's; None: the tokenizer's). Bitmasks are
    [N, bitmask_width] int32 with bitmask_width = ceil(vocab_size / 32). `grammar_special_tokens`: see
    `tokenizer_info`."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int | None = None, *, max_threads: int = 2,
                 cache_size: int = _DEFAULT_CACHE_SIZE, any_whitespace: bool = True,
                 grammar_special_tokens: Sequence[int] = ()) -> None:
        xgr = _xgr()
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size, grammar_special_tokens)
        self.vocab_size: int = self.tokenizer_info.vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(self.tokenizer_info.stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("tokenizer: no EOS token id; a grammar could never end a request")
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)
        self._any_whitespace = any_whitespace
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def bitmask_width(self) -> int:
        return -(-self.vocab_size // WORD_BITS)

    def compile(self, spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of `spec` (cached). Raises GrammarError for an invalid spec."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        compiled = self._compile(spec)  # outside the lock: compiling a large schema can take milliseconds
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> "xgrammar.CompiledGrammar":
        c = self._compiler
        ws = {"any_whitespace": self._any_whitespace, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        try:
            if spec.kind == "json_object":  # OpenAI's json_object: an object, any content (vLLM does the same)
                return c.compile_json_schema('{"type": "object"}', **ws)
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.spec, **ws)
            if spec.kind == "choice":
                return c.compile_grammar(_choice_ebnf(json.loads(spec.spec)))
            if spec.kind == "regex":
                return c.compile_regex(spec.spec)
            if spec.kind == "structural_tag":
                return c.compile_structural_tag(spec.spec)
            return c.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors are RuntimeError subclasses
            where = f"{spec.source}: " if spec.source else ""
            raise GrammarError(f"{where}{spec.kind}: cannot compile: {_error_text(e)}") from None

    def state(self, spec: GrammarSpec) -> "GrammarState":
        """A fresh matcher for one request (or one of its n samples: each sample needs its own)."""
        return GrammarState(self._xgr_matcher(self.compile(spec)), self.stop_token_ids, self.vocab_size)

    @staticmethod
    def _xgr_matcher(compiled) -> "xgrammar.GrammarMatcher":
        return _xgr().GrammarMatcher(compiled)


class LazyCompiler:
    """An engine's `StructuredOutputCompiler`, built by `make()` on the first constrained request (importing
    xgrammar and reading the vocab cost seconds an engine that never sees one should not pay); thread-safe, so
    requests validated on the serving thread and the step thread share it."""

    def __init__(self, make: Callable[[], StructuredOutputCompiler]) -> None:
        self._make = make
        self._compiler: StructuredOutputCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> StructuredOutputCompiler:
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    self._compiler = self._make()
        return self._compiler


class GrammarState:
    """One sequence's position in its grammar. Not thread-safe; the engine owns it with the request.

    Contract per step: `fill_bitmask(bitmask, row)` before sampling, then `accept(sampled)`. `accept` returns False
    for a token the grammar forbids (possible only if the mask was not applied, e.g. a token forced from
    elsewhere): the state is unchanged and the engine should finish the request with an error."""

    def __init__(self, matcher: "xgrammar.GrammarMatcher", stop_token_ids: Sequence[int], vocab_size: int) -> None:
        self._m = matcher
        self._stop_ids = tuple(stop_token_ids)
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row `row` of `bitmask` ([N, ceil(vocab_size / 32)] int32, CPU): bit set = token allowed.
        EOS is set only when the text so far is a complete match; once terminated, only the stop ids."""
        if self._m.is_terminated():
            # xgrammar refuses to fill after its stop token; allowing only EOS lets an engine that keeps the row
            # one more step (ignore_eos) end it rather than emit text past the grammar.
            bitmask[row].zero_()
            for t in self._stop_ids:
                bitmask[row, t // WORD_BITS] |= _bit(t % WORD_BITS)
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar forbids it."""
        ok = bool(self._m.accept_token(int(token_id)))
        self.num_accepted += ok
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Replay tokens (a recomputed or migrated request's output so far); stops at the first refused one."""
        return all(self.accept(t) for t in token_ids)

    def is_terminated(self) -> bool:
        """The stop token was accepted: the request should finish."""
        return bool(self._m.is_terminated())

    def is_completed(self) -> bool:
        """The text so far is a complete match (EOS would now be allowed)."""
        return bool(self._m.is_completed())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"rollback: {num_tokens} tokens, {self.num_accepted} accepted")
        if num_tokens:
            self._m.rollback(num_tokens)
            self.num_accepted -= num_tokens


def _bit(j: int) -> int:
    """Bit j of an int32 word as a Python int that fits int32 (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab_size / 32)] int32 on the CPU, every token allowed (all bits set)."""
    return torch.full((num_rows, -(-vocab_size // WORD_BITS)), -1, dtype=torch.int32)


def fill_token_bitmask(states: Sequence[GrammarState | None], vocab_size: int,
                       out: torch.Tensor | None = None, *, threads: int = 1) -> torch.Tensor | None:
    """The step's host bitmask: row i from states[i], all-allowed where states[i] is None. None when no row has a
    grammar (the sampler then skips masking entirely). `out`: a reusable [>= N, W] int32 CPU buffer (pinned, say)
    of which the first N rows are used. `threads` > 1: rows filled in parallel by xgrammar's C++ thread pool once
    there are BATCH_FILL_MIN_ROWS of them (a row costs tens of microseconds; a big batch adds up to milliseconds)."""
    constrained = [i for i, s in enumerate(states) if s is not None]
    if not constrained:
        return None
    n = len(states)
    width = -(-vocab_size // WORD_BITS)
    if out is None:
        bitmask = allocate_token_bitmask(n, vocab_size)
    else:
        if out.shape[0] < n or out.shape[1] != width or out.dtype != torch.int32:
            raise ValueError(f"out: expected >= [{n}, {width}] int32, got {list(out.shape)} {out.dtype}")
        bitmask = out[:n]
        bitmask.fill_(-1)
    for i in constrained:
        if states[i].vocab_size != vocab_size:
            raise ValueError(f"states[{i}]: compiled for vocab {states[i].vocab_size}, bitmask for {vocab_size}")
    live = [i for i in constrained if not states[i].is_terminated()]
    parallel = threads > 1 and len(live) >= BATCH_FILL_MIN_ROWS
    for i in constrained if not parallel else sorted(set(constrained) - set(live)):
        states[i].fill_bitmask(bitmask, i)
    if parallel:
        _batch_filler(threads).batch_fill_next_token_bitmask([states[i]._m for i in live], bitmask, live)
    return bitmask


@functools.lru_cache(maxsize=4)
def _batch_filler(threads: int) -> "xgrammar.BatchGrammarMatcher":
    """One thread pool per thread count for the process (xgrammar's pool is reusable and thread-safe to call)."""
    return _xgr().BatchGrammarMatcher(max_threads=threads)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to -inf, in place. logits: [N, V] (any float dtype, CPU or CUDA); bitmask: [N, W]
    int32 from `fill_token_bitmask`, on the logits' device or the CPU (then copied once, non-blocking).

    Logits wider than the mask (V > 32 * W) lose their extra ids on every constrained row (a row not all ones);
    rows that are all ones are untouched. No host sync: everything is decided on the device."""
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits [N, V] and bitmask [N, W]: got {list(logits.shape)} and {list(bitmask.shape)}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    covered = min(logits.shape[1], bitmask.shape[1] * WORD_BITS)
    kernel = logits.is_contiguous() and (logits.device.type == "cuda" or logits.dtype == torch.float32)
    try:
        if kernel:  # xgrammar's: triton on CUDA, C++ on CPU
            _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=covered)
    except ImportError:  # a CUDA torch without triton: the torch reference does the same, slower
        kernel = False
    if not kernel:
        apply_token_bitmask_torch(logits[:, :covered], bitmask)
    if logits.shape[1] > covered:
        constrained = (bitmask != -1).any(dim=1, keepdim=True)
        logits[:, covered:].masked_fill_(constrained, float("-inf"))


def warm_up(device: torch.device | str, vocab_size: int) -> None:
    """Import xgrammar and compile its mask kernel for `device` now (on CUDA, triton's JIT takes seconds), so the
    first constrained request does not pay it. Call at engine start when structured outputs are enabled."""
    logits = torch.zeros(1, vocab_size, device=device)
    apply_token_bitmask(logits, allocate_token_bitmask(1, vocab_size))


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Pure torch reference of the kernel (any device and dtype): logits [N, V] with V <= 32 * W, in place."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    logits.masked_fill_(~allowed, float("-inf"))


__all__ = ["GrammarError", "GrammarSpec", "GrammarState", "KINDS", "LazyCompiler", "StructuredOutputCompiler", "allocate_token_bitmask",
           "apply_token_bitmask", "apply_token_bitmask_torch", "fill_token_bitmask", "tokenizer_info", "warm_up"]
