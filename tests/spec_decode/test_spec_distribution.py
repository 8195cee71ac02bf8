"""Unseeded sampling keeps the target distribution under speculation: on a 16-token-vocabulary model, the tokens
at the verified output positions, with and without speculation, pass a chi-square test of homogeneity
(p > 0.01), with a drafter right about half the time."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.tiny import make_checkpoint

VOCAB, N, PROMPT = 16, 6000, [3, 7, 1, 12]


def chi2_homogeneity_p(a: list[int], b: list[int]) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    total = ca + cb
    keep = total >= 10  # pool the rare categories into one
    ca = torch.cat([ca[keep], ca[~keep].sum()[None]]) if (~keep).any() else ca
    cb = torch.cat([cb[keep], cb[~keep].sum()[None]]) if (~keep).any() else cb
    total = ca + cb
    ea, eb = total * len(a) / (len(a) + len(b)), total * len(b) / (len(a) + len(b))
    stat = (((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb)).sum()
    df = len(total) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi2_helper_rejects_different_distributions():
    g = torch.Generator().manual_seed(0)
    a = torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), 3000, True, generator=g).tolist()
    b = torch.multinomial(torch.tensor([0.45, 0.3, 0.25]), 3000, True, generator=g).tolist()
    c = torch.multinomial(torch.tensor([0.5, 0.3, 0.2]), 3000, True, generator=g).tolist()
    assert chi2_homogeneity_p(a, b) < 0.01 < chi2_homogeneity_p(a, c)


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, tiny_tokenizer):
    return make_checkpoint("llama", tmp_path_factory.mktemp("small_vocab"), tokenizer=tiny_tokenizer,
                           vocab_size=VOCAB, logit_scale=6.0)


def sample_tokens(path, spec=None):
    llm = LLM(str(path), progress=False, seed=1 if spec else 2, speculative_config=spec)
    outs = llm.generate([PROMPT] * N, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def plain_and_spec(small_vocab_model):
    """Samples without speculation, and the speculative config: a replay drafter proposing the greedy output,
    each token kept with probability 0.5."""
    greedy = LLM(str(small_vocab_model), progress=False).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids
    spec = {"method": "replay", "num_speculative_tokens": 3, "alpha": 0.5, "replay_references": [[PROMPT, greedy]],
            "disable_by_batch_size": None}
    return sample_tokens(small_vocab_model)[0], spec


def test_unseeded_tokens_keep_the_target_distribution(small_vocab_model, plain_and_spec):
    plain, spec = plain_and_spec
    drafted, llm = sample_tokens(small_vocab_model, spec)
    sp = llm.engine.core.speculation
    assert 0.1 * sp.num_draft_tokens < sp.num_accepted_tokens < 0.8 * sp.num_draft_tokens
    for pos in range(1, 4):  # output positions the verify steps sampled
        a, b = [t[pos] for t in plain], [t[pos] for t in drafted]
        assert len(set(a)) > 3  # a real distribution, not a near-deterministic one
        assert chi2_homogeneity_p(a, b) > 0.01, pos
    # the joint of positions 1 and 2 too (acceptance at 2 depends on the token at 1)
    assert chi2_homogeneity_p([t[1] * VOCAB + t[2] for t in plain], [t[1] * VOCAB + t[2] for t in drafted]) > 0.01


def test_a_biased_verifier_is_detected(small_vocab_model, plain_and_spec, monkeypatch):
    """The test has power: a verifier that accepts every draft after a first match skews position 2."""
    import kestrel.worker.step_outputs as step_outputs

    def accept_all(first, verified, drafts):
        return [first] + ([*drafts[1:], verified[-1]] if drafts and first == drafts[0] else [])

    monkeypatch.setattr(step_outputs, "accept", accept_all)
    plain, spec = plain_and_spec
    drafted, _ = sample_tokens(small_vocab_model, spec)
    assert chi2_homogeneity_p([t[2] for t in plain], [t[2] for t in drafted]) < 0.01
