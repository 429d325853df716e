"""Sampler: support restrictions and frequencies (statistically), temperature, penalties against a hand-written
reference, seeds independent of batch neighbours, greedy, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from workers.request import SamplingParams
from workers.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    make_generator,
    prompt_logprobs,
    suppressed_token_ids,
)

# A toy distribution with well separated probabilities (sums to 1).
TOY_PROBS = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
TOY_LOGITS = TOY_PROBS.log() + 1.7  # a constant shift must not matter

# 99.9% quantiles of the chi-square distribution by degrees of freedom (1..7).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
DRAWS = 20000


def _batch(params: list[SamplingParams], *, prompts=None, outputs=None, generators=None, device="cpu",
           **kw) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[0]] * n,
        outputs if outputs is not None else [[]] * n,
        generators if generators is not None else [None] * n,
        device,
        **kw,
    )


def _draw(params: SamplingParams, logits: torch.Tensor = TOY_LOGITS, draws: int = DRAWS) -> torch.Tensor:
    """Counts per token of `draws` independent samples (one row each, one sampler call)."""
    gen = torch.Generator().manual_seed(1234)
    batch = _batch([params] * draws)
    out = Sampler(generator=gen)(logits.expand(draws, -1).contiguous(), batch)
    return torch.bincount(out.token_ids, minlength=logits.numel())


def _assert_matches(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Support equals expected_probs' support and a chi-square test on it passes at the 0.1% level."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the allowed set: {counts.tolist()}"
    assert (counts[support] > 0).all(), f"an allowed token was never sampled: {counts.tolist()}"
    total = counts.sum().item()
    exp = expected_probs[support] / expected_probs[support].sum() * total
    chi2 = (((counts[support].double() - exp.double()) ** 2) / exp.double()).sum().item()
    dof = int(support.sum()) - 1
    if dof > 0:
        assert chi2 < CHI2_999[dof], f"chi2={chi2:.2f} (dof {dof}) counts={counts.tolist()} expected={exp.tolist()}"


def _renorm(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def test_plain_sampling_matches_softmax():
    _assert_matches(_draw(SamplingParams(temperature=1.0)), TOY_PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_reshapes_distribution(temperature):
    expected = torch.softmax(TOY_LOGITS / temperature, dim=0)
    counts = _draw(SamplingParams(temperature=temperature))
    _assert_matches(counts, expected)
    # The effect is real: a sharper (or flatter) distribution than T=1 is detected by the same test.
    with pytest.raises(AssertionError):
        _assert_matches(counts, TOY_PROBS)


@pytest.mark.parametrize(
    "kwargs, keep",
    [
        (dict(top_k=2), [0, 1]),
        (dict(top_k=5), [0, 1, 2, 3, 4]),
        (dict(top_p=0.6), [0, 1, 2]),  # mass before token 2 = 0.50 < 0.6, before token 3 = 0.65
        (dict(top_p=0.05), [0]),  # the top token always survives
        (dict(min_p=0.3), [0, 1, 2, 3, 4]),  # threshold 0.09
        (dict(min_p=0.6), [0, 1]),  # threshold 0.18
        # top-p applies to the top-k survivors renormalised: 0.30/0.77 = 0.39, +0.26 = 0.65 >= 0.55 -> 2 tokens
        # (on the full distribution top_p=0.55 would keep 3).
        (dict(top_k=4, top_p=0.55), [0, 1]),
        (dict(top_k=6, min_p=0.3), [0, 1, 2, 3, 4]),
    ],
)
def test_support_restriction_and_renormalised_frequencies(kwargs, keep):
    _assert_matches(_draw(SamplingParams(temperature=1.0, **kwargs)), _renorm(TOY_PROBS, keep))


def test_min_p_acts_on_temperature_scaled_probs():
    # At T=2 the probabilities flatten; min_p=0.5 of the top then keeps more tokens than at T=1.
    scaled = torch.softmax(TOY_LOGITS / 2.0, dim=0)
    keep = [i for i in range(8) if scaled[i] >= 0.5 * scaled.max()]
    assert len(keep) > 2
    _assert_matches(_draw(SamplingParams(temperature=2.0, min_p=0.5)), _renorm(scaled, keep))


def test_top_p_one_keeps_tiny_tail():
    # fp32 cumulative mass can reach 1.0 before the tail: top_p=1 must still allow the tail tokens.
    logits = torch.tensor([30.0, 0.0, 0.0, 12.0])
    gen = torch.Generator().manual_seed(0)
    out = Sampler(generator=gen)(logits.expand(4, -1).contiguous(), _batch([SamplingParams(top_p=1.0)] * 4))
    assert out.token_ids.tolist() == [0, 0, 0, 0]


def test_greedy_is_argmax_and_mixes_with_sampling():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    gens = [None if p.seed is None else make_generator(p.seed) for p in params]
    out = Sampler()(logits, _batch(params, generators=gens))
    argmax = logits.argmax(-1)
    assert out.token_ids[0::2].tolist() == argmax[0::2].tolist()
    # Greedy ignores top-k/top-p/min-p and tiny temperatures count as greedy.
    out2 = Sampler()(logits, _batch([SamplingParams(temperature=1e-7, top_k=3, top_p=0.1)] * 6))
    assert out2.token_ids.tolist() == argmax.tolist()


def test_seeded_rows_reproduce_regardless_of_batch_neighbours():
    torch.manual_seed(0)
    vocab, steps = 64, 8
    step_logits = torch.randn(steps, vocab)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def run(rows_before: int, rows_after: int, neighbour_seed: int | None) -> list[int]:
        gen = make_generator(7)
        neighbours_before = [make_generator(neighbour_seed + i) if neighbour_seed is not None else None
                             for i in range(rows_before)]
        neighbours_after = [None] * rows_after
        tokens = []
        for s in range(steps):
            n = rows_before + 1 + rows_after
            logits = torch.randn(n, vocab) * 3  # neighbours see different logits each step
            logits[rows_before] = step_logits[s]
            plist = [SamplingParams(temperature=0.8)] * rows_before + [params] + \
                [SamplingParams(temperature=0.0)] * rows_after
            batch = _batch(plist, generators=neighbours_before + [gen] + neighbours_after)
            tokens.append(Sampler()(logits, batch).token_ids[rows_before].item())
        return tokens

    alone = run(0, 0, None)
    assert run(3, 2, 100) == alone
    assert run(1, 4, None) == alone
    assert run(5, 0, 11) == alone
    # Per-sample seeds (n > 1): seed + sample index, so samples differ but each reproduces.
    g0, g1 = make_generator(7, 0), make_generator(7, 1)
    logits = torch.zeros(2, 1000)
    out = Sampler()(logits, _batch([params, params], generators=[g0, g1]))
    assert out.token_ids[0] != out.token_ids[1]
    assert make_generator(7, 1).initial_seed() == make_generator(8, 0).initial_seed() == 8


def _reference_penalties(logits, params, prompts, outputs):
    """Straight per-row, per-token version of vLLM's penalty semantics."""
    out = logits.clone()
    for r, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        for tok in set(prompt) | set(output):
            v = out[r, tok].item()
            out[r, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(output):
            count = output.count(tok)
            out[r, tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_penalties_match_hand_computed_reference():
    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(4, vocab) * 2
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
        SamplingParams(),  # no penalties: untouched even though others have them
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 7, 8], [1, 2]]
    outputs = [[9, 9, 3], [4, 10, 10, 10], [6, 11, 11], [1, 1, 1]]
    batch = _batch(params, prompts=prompts, outputs=outputs)
    got = apply_penalties(logits.clone(), batch)
    want = _reference_penalties(logits, params, prompts, outputs)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[3], logits[3])
    assert not torch.equal(got[:3], logits[:3])
    # Greedy decisions use the penalised logits (vLLM applies penalties before argmax) ...
    gparams = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                              presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty)
               for p in params]
    out = Sampler()(logits, _batch(gparams, prompts=prompts, outputs=outputs, ))
    assert out.token_ids.tolist() == want.argmax(-1).tolist()
    # ... while the reported logprobs stay those of the raw logits.
    torch.testing.assert_close(out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0])


def test_penalty_pushes_greedy_off_repeated_token():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    plain = Sampler()(logits, _batch([SamplingParams(temperature=0.0)], outputs=[[0]]))
    penal = Sampler()(logits, _batch([SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[0]]))
    assert plain.token_ids.item() == 0 and penal.token_ids.item() == 1


def test_logprobs_are_raw_log_softmax_and_top_k_sized_by_max_request():
    torch.manual_seed(2)
    logits = torch.randn(3, 30) * 2
    params = [SamplingParams(temperature=0.7, top_k=5, logprobs=2, presence_penalty=1.0),
              SamplingParams(temperature=0.0, logprobs=4),
              SamplingParams(temperature=1.3)]
    out = Sampler(generator=torch.Generator().manual_seed(0))(logits, _batch(params, outputs=[[1], [2], [3]]))
    ref = torch.log_softmax(logits, dim=-1)
    assert out.top_token_ids.shape == (3, 4) and out.top_logprobs.shape == (3, 4)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    top_vals, top_ids = ref.topk(4, dim=-1)
    assert torch.equal(out.top_token_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_vals)
    dicts = out.logprob_dicts([p.logprobs for p in params])
    assert dicts[2] is None
    assert set(dicts[0]) == set(top_ids[0, :2].tolist()) | {out.token_ids[0].item()}
    assert len(dicts[1]) == 4 and dicts[1][out.token_ids[1].item()] == pytest.approx(ref[1].max().item())
    # No logprobs requested anywhere -> K = 0.
    none = Sampler()(logits, _batch([SamplingParams()] * 3))
    assert none.top_token_ids.shape == (3, 0)


def test_suppressed_ids_for_min_tokens():
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    assert suppressed_token_ids(p, 0, [2]) == [2, 4]
    assert suppressed_token_ids(p, 2, [2]) == []
    assert suppressed_token_ids(SamplingParams(min_tokens=1, ignore_eos=True), 0, [2]) == []
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0, 4.0, 3.0]])
    out = Sampler()(logits, _batch([p], suppressed_ids=[suppressed_token_ids(p, 0, [2])]))
    assert out.token_ids.item() == 5
    # Sampling never picks a suppressed id either.
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=1.0)
    many = Sampler(generator=gen)(logits.expand(500, -1).contiguous(),
                                  _batch([sp] * 500, suppressed_ids=[[2, 4]] * 500))
    assert not torch.isin(many.token_ids, torch.tensor([2, 4])).any()


def test_prompt_logprobs_helper():
    torch.manual_seed(3)
    prompt = [5, 1, 7, 7, 2]
    logits = torch.randn(len(prompt), 10)
    got = prompt_logprobs(logits, prompt, 2)
    ref = torch.log_softmax(logits, -1)
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert got[i][prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-6)
        top = ref[i - 1].topk(2).indices.tolist()
        assert set(got[i]) == set(top) | {prompt[i]}
    assert prompt_logprobs(logits[:-1], prompt, 0)[1] == {1: pytest.approx(ref[0, 1].item(), abs=1e-6)}
    with pytest.raises(ValueError, match="logits"):
        prompt_logprobs(logits[:2], prompt, 1)


def test_masked_vocab_padding_is_never_sampled_and_gives_finite_logprobs():
    # Padded vocab columns carry -inf; no NaN may appear and they are never chosen.
    logits = torch.randn(64, 12)
    logits[:, 9:] = float("-inf")
    params = [SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, top_k=11)] * 64
    out = Sampler(generator=torch.Generator().manual_seed(5))(logits, _batch(params))
    assert (out.token_ids < 9).all()
    assert torch.isfinite(out.logprobs).all()
    assert math.isclose(torch.exp(torch.log_softmax(logits, -1)[:, :9]).sum(-1).mean().item(), 1.0, rel_tol=1e-5)


@pytest.mark.gpu
def test_cuda_sampler_matches_cpu_semantics():
    dev = torch.device("cuda")
    # Support restriction and frequencies on the device, with penalties, suppressed ids and seeded neighbours.
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.55)
    gen = torch.Generator(device=dev).manual_seed(9)
    out = Sampler(generator=gen)(TOY_LOGITS.to(dev).expand(DRAWS, -1).contiguous(), _batch([params] * DRAWS, device=dev))
    _assert_matches(torch.bincount(out.token_ids.cpu(), minlength=8), _renorm(TOY_PROBS, [0, 1]))
    # Seeded rows reproduce whatever their neighbours, with device generators.
    torch.manual_seed(0)
    row = torch.randn(4, 100)
    seeded = SamplingParams(temperature=0.9, min_p=0.05, seed=5, logprobs=3, repetition_penalty=1.2)

    def tokens(neighbours: int) -> list[int]:
        g = make_generator(5, 0, dev)
        got = []
        for s in range(4):
            logits = torch.randn(neighbours + 1, 100, device=dev)
            logits[neighbours] = row[s].to(dev)
            plist = [SamplingParams(temperature=0.7, presence_penalty=0.3)] * neighbours + [seeded]
            batch = _batch(plist, outputs=[[1, 2]] * (neighbours + 1), generators=[None] * neighbours + [g],
                           device=dev, suppressed_ids=[[3]] * (neighbours + 1))
            got.append(Sampler()(logits, batch).token_ids[neighbours].item())
        return got

    assert tokens(0) == tokens(6) == tokens(2)
    # Greedy and logprobs agree with the CPU path.
    logits = torch.randn(8, 300)
    gp = [SamplingParams(temperature=0.0, logprobs=5, frequency_penalty=0.5, repetition_penalty=1.3)] * 8
    outs = [[i, i + 1, i + 1] for i in range(8)]
    cpu = Sampler()(logits, _batch(gp, outputs=outs))
    cuda = Sampler()(logits.to(dev), _batch(gp, outputs=outs, device=dev))
    assert torch.equal(cpu.token_ids, cuda.token_ids.cpu())
    torch.testing.assert_close(cpu.top_logprobs, cuda.top_logprobs.cpu(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu.logprobs, cuda.logprobs.cpu(), atol=1e-5, rtol=1e-5)
