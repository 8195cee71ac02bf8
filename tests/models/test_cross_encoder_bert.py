"""BERT and XLM-RoBERTa cross-encoders (*ForSequenceClassification, one label: ms-marco MiniLM, BGE rerankers):
LLM.score / LLM.classify on tiny random checkpoints equal transformers' on the same weights and the same
tokenizer's pair encoding (CPU float32): BERT's pooler + classifier and the pair's token types ([CLS] a [SEP]
b [SEP]: b is type 1), RoBERTa's classification head; several pairs batched in one step keep their own types;
truncate_prompt_tokens cuts a pair as the tokenizer does."""
from __future__ import annotations

import pytest
import torch

from tests.pooling_tiny import ENCODER, _randomize
from tests.tiny import VOCAB_SIZE

ATOL = 1e-5
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "the quick brown fox", "berlin is the capital of germany today"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
          "Berlin is the capital of Germany.", "What is the capital? Hello world, today.", "0123456789 . , ; ?"]
# (special tokens in id order, single template, pair template)
TEMPLATES = {
    "bert": (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"),
    "xlm-roberta": (["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "<s> $A </s>", "<s> $A </s> </s> $B </s>"),
}


def encoder_tokenizer(model_type: str):
    """A tiny WordPiece tokenizer with the family's special tokens and text-pair template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, single, pair = TEMPLATES[model_type]
    unk = specials[1] if model_type == "bert" else specials[3]
    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                       special_tokens=[(t, i) for i, t in enumerate(specials)])
    tok.decoder = decoders.WordPiece()
    names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), specials)) \
        if model_type == "bert" else dict(zip(("bos_token", "pad_token", "eos_token", "unk_token", "mask_token"),
                                              specials), cls_token="<s>", sep_token="</s>")
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if model_type == "bert" else ["input_ids",
                                                                                          "attention_mask"]
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_input_names=inputs, **names)


def make_cross_encoder(root, model_type: str):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    extra = dict(max_position_embeddings=514, pad_token_id=1, type_vocab_size=1) if model_type == "xlm-roberta" \
        else dict(max_position_embeddings=512)
    cfg = AutoConfig.for_model(model_type, **{**ENCODER, **extra}, num_labels=1)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    _randomize(model, 7)
    with torch.no_grad():  # LayerNorm weights and biases away from 1 and 0, so that they matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    out = root / f"{model_type}_cross_encoder"
    model.save_pretrained(out)
    encoder_tokenizer(model_type).save_pretrained(out)
    return out


@torch.no_grad()
def hf_scores(path, query: str | None, texts: list[str], max_length: int | None = None) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    cut = dict(truncation=True, max_length=max_length) if max_length else {}
    out = []
    for t in texts:
        enc = tok(query, t, return_tensors="pt", **cut) if query is not None else tok(t, return_tensors="pt")
        out.append(float(model(**enc).logits[0, 0].sigmoid()))
    return out


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_cross_encoder_equals_transformers(tmp_path, model_type):
    from kestrel import LLM

    path = make_cross_encoder(tmp_path, model_type)
    refs = hf_scores(path, QUERY, DOCS)
    with LLM(str(path), progress=False, device="cpu", num_kv_blocks=32, max_model_len=128) as llm:
        got = [o.outputs.score for o in llm.score(QUERY, DOCS)]  # the three pairs in one step
        assert got == pytest.approx(refs, abs=ATOL)
        # truncate_prompt_tokens on a pair: the tokenizer cuts the longer text, keeping [CLS] and the [SEP]s
        cut = llm.score(QUERY, DOCS, truncate_prompt_tokens=9)
        assert all(len(o.prompt_token_ids) == 9 for o in cut)
        assert [o.outputs.score for o in cut] == pytest.approx(hf_scores(path, QUERY, DOCS, 9), abs=ATOL)
        # a single text: its last k tokens between the kept [CLS] and [SEP] (a tokenizer truncating on the left)
        left = llm.classify(DOCS[2], truncate_prompt_tokens=5)[0]
        from transformers import AutoTokenizer

        ref = AutoTokenizer.from_pretrained(path, truncation_side="left")
        assert left.prompt_token_ids == ref(DOCS[2], truncation=True, max_length=5)["input_ids"]
        single = llm.classify(DOCS[:2])
        assert [o.outputs.probs[0] for o in single] == pytest.approx(hf_scores(path, None, DOCS[:2]), abs=ATOL)
    if model_type == "bert":  # the pair's token types matter: typing the document 0 would give other scores
        from transformers import AutoTokenizer

        enc = AutoTokenizer.from_pretrained(path)(QUERY, DOCS[0])
        assert 1 in enc["token_type_ids"]


def test_pair_segments():
    from kestrel.models.bert import pair_segments

    sep = 3  # two prompts flattened: [CLS] a [SEP] b b [SEP] | [CLS] c [SEP]
    ids = torch.tensor([2, 9, 3, 8, 8, 3, 2, 7, 3])
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    assert pair_segments(ids, pos, sep).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
