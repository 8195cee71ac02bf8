"""The frontend half of pooling models: which requests a pooling (or generative) engine takes, the sampling
parameters a pooling request rides with, the results LLM.embed / classify / score return, and the inputs of a
relevance score (a cross-encoder's text pair, or two embeddings' cosine)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kestrel.core.pooling import PoolingParams
from kestrel.core.sampling_params import SamplingParams
from kestrel.errors import InvalidRequest

def pooling_sampling(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """What a pooling request rides with: one prefill step, whose one "token" is a placeholder (never
    detokenized); `truncate_prompt_tokens`: keep the prompt's last k tokens (kestrel/frontend/truncation.py)."""
    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                          truncate_prompt_tokens=truncate_prompt_tokens)


def check_request_kind(facts: dict | None, pooling: PoolingParams | None) -> None:
    """A pooling engine serves pooling requests of its own task only; a generative one serves no pooling.
    `facts`: the engine's pooling facts (kestrel/core/pooling.py pooling_facts; None: generative)."""
    if facts is None:
        if pooling is not None:
            raise InvalidRequest("this model generates text: embeddings, classification and scores need a "
                                 "pooling model (kestrel serve --runner pooling)", param="model")
        return
    task = facts["task"]
    if pooling is None:
        raise InvalidRequest(f"this server runs a pooling model ({task}): it does not generate text; use "
                             + ("/v1/embeddings" if task == "embed" else "/classify, /score or /rerank"),
                             param="model")
    if pooling.task != task:
        raise InvalidRequest(f"this model's pooling task is {task}, not {pooling.task}", param="model")
    if pooling.dimensions:
        dims = facts.get("matryoshka_dimensions")
        if dims is None:
            raise InvalidRequest("this model does not support Matryoshka embeddings: `dimensions` would truncate "
                                 "them into poor ones", param="dimensions")
        if pooling.dimensions < 1 or pooling.dimensions > facts["hidden_size"] or (dims and pooling.dimensions
                                                                                  not in dims):
            allowed = ", ".join(map(str, dims)) if dims else f"1 to {facts['hidden_size']}"
            raise InvalidRequest(f"dimensions {pooling.dimensions} is not one this model serves ({allowed})",
                                 param="dimensions")


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label (softmax; one sigmoid score for a single label; raw logits without activation)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    """vLLM's PoolingOutput (LLM.encode, LLM.reward): the pooled values as a float32 tensor."""
    data: "torch.Tensor"

    @classmethod
    def of(cls, values: list[float]) -> "PoolingOutput":
        import torch

        return cls(torch.tensor(values, dtype=torch.float32))


# vLLM's per-token pooling tasks: every prompt token's vector; the engine pools one vector per prompt
PER_TOKEN_TASKS = ("token_embed", "token_classify", "encode", "reward")


def resolve_pooling_params(facts: dict | None, params: PoolingParams | None, task: str | None) -> PoolingParams:
    """LLM.encode's pooling: `params` as given, else the model's own task with its defaults; a `task` that is not
    the model's (or a per-token task) is refused by name."""
    if facts is None:
        raise ValueError("encode needs a pooling model (runner='pooling'); this model generates text")
    if task in PER_TOKEN_TASKS:
        raise ValueError(f"pooling_task {task!r}: per-token pooling is not implemented (one vector per prompt: "
                         f"{facts['task']})")
    if task is not None and task not in ("embed", "classify", "score"):
        raise ValueError(f"pooling_task {task!r} is not one of embed, classify, score")
    want = "classify" if task == "score" else task or (params.task if params is not None else facts["task"])
    if want != facts["task"] or (params is not None and params.task != want):
        raise ValueError(f"pooling_task {want!r}: this model's pooling task is {facts['task']}")
    return params if params is not None else PoolingParams(task=want)


@dataclass
class PoolingRequestOutput:
    """vLLM's EmbeddingRequestOutput / ClassificationRequestOutput / ScoringRequestOutput, in one shape."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    finished: bool = True


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def pair_token_ids(tokenizer, query: str, document: str, max_length: int | None = None) -> list[int]:
    """A cross-encoder's input: the tokenizer's own text-pair encoding (its template: [CLS] q [SEP] d [SEP] for
    BERT-style vocabularies, plain concatenation for most decoders); `max_length` (truncate_prompt_tokens): cut
    by the tokenizer, the longer text first, its special tokens kept."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer: scores need text", param="text_1")
    if max_length is None:
        return list(tokenizer(query, document)["input_ids"])
    return list(tokenizer(query, document, truncation=True, max_length=max_length)["input_ids"])


def score_pairs(queries: list, documents: list) -> list[tuple]:
    """vLLM's score pairing: one query with N documents, or N with N."""
    if not documents:
        raise InvalidRequest("no documents to score", param="text_2")
    if len(queries) == 1:
        return [(queries[0], d) for d in documents]
    if len(queries) != len(documents):
        raise InvalidRequest(f"{len(queries)} queries for {len(documents)} documents: give one query, or one "
                             f"per document", param="text_1")
    return list(zip(queries, documents))


@dataclass
class ScorePlan:
    """How a score request runs on a pooling engine: the prompts to pool, with what, and how their vectors make
    one score per (query, document) pair."""
    prompts: list
    pooling: PoolingParams
    pairs: list[tuple[int, int]]  # per pair: the indices of its vectors in `prompts` order (cross-encoder: (i, i))

    def scores(self, vectors: list[list[float]]) -> list[float]:
        if self.pooling.task == "classify":
            return [vectors[i][0] for i, _ in self.pairs]
        return [cosine(vectors[i], vectors[j]) for i, j in self.pairs]


def plan_scores(facts: dict | None, tokenizer, queries: list, documents: list, tokenize: bool = True,
                max_length: int | None = None) -> ScorePlan:
    """A cross-encoder (a one-label classifier) scores each text pair as one prompt; an embedding model scores
    the cosine of the two texts' embeddings (vLLM's rules). `tokenize=False`: a cross-encoder's prompts are the
    (query, document) pairs, for the caller to tokenize (pair_token_ids; the server does it in chunks on its
    render threads)."""
    pairs = score_pairs(queries, documents)
    if facts is None:
        raise InvalidRequest("this model generates text: scores need a pooling model (kestrel serve --runner "
                             "pooling)", param="model")
    if facts["task"] == "classify":
        if len(facts["labels"]) != 1:
            raise InvalidRequest(f"scores need a cross-encoder with one output label; this classifier has "
                                 f"{len(facts['labels'])} (use /classify)", param="model")
        prompts = [pair_token_ids(tokenizer, q, d, max_length) for q, d in pairs] if tokenize else pairs
        return ScorePlan(prompts, PoolingParams(task="classify"), [(i, i) for i in range(len(prompts))])
    n = len(queries)
    index = [(0 if n == 1 else k, n + k) for k in range(len(documents))]
    return ScorePlan(list(queries) + list(documents), PoolingParams(task="embed"), index)
