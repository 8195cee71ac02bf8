"""Token embedding and LM head. With tensor parallelism both are vocab-parallel: each rank holds a contiguous
slice of the vocabulary (padded to a multiple of the group size); the embedding all-reduces (rows of other ranks
contribute zeros) and the LM head all-gathers the logits, so every rank holds the full logits and samples alike."""
import torch
import torch.nn.functional as F
from torch import nn

from kestrel.distributed import ParallelInfo
from kestrel.layers.linear import materialize


def load_vocab_rows(weight: torch.Tensor, loaded, num_embeddings: int, tp: ParallelInfo, name: str) -> None:
    """Copy this rank's vocabulary rows of a checkpoint tensor (read lazily) into `weight`; padding stays zero."""
    if loaded.shape[0] != num_embeddings or tuple(loaded.shape[1:]) != tuple(weight.shape[1:]):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != model ({num_embeddings}, {weight.shape[1]})")
    if tp.size == 1:
        weight.data.copy_(materialize(loaded))
        return
    rows = weight.shape[0]
    start = tp.rank * rows
    n = max(0, min(rows, num_embeddings - start))
    weight.data.zero_()
    if n:
        weight.data[:n].copy_(loaded.narrow(0, start, n))


def vocab_rows(num_embeddings: int, tp: ParallelInfo) -> int:
    return -(-num_embeddings // tp.size)


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 tp: ParallelInfo | None = None):
        super().__init__()
        self.tp = tp or ParallelInfo()
        self.num_embeddings = num_embeddings
        self.rows = vocab_rows(num_embeddings, self.tp)  # per rank, padded
        self.start = self.tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, dtype=dtype), requires_grad=False)

    def load_weight(self, param_name: str, loaded) -> None:
        load_vocab_rows(self.weight, loaded, self.num_embeddings, self.tp, param_name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; with tied embeddings it shares the embedding weight."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: VocabEmbedding | None = None,
                 tp: ParallelInfo | None = None):
        super().__init__()
        self.tp = tp or ParallelInfo()
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_rows(vocab_size, self.tp), hidden_size, dtype=dtype),
                                       requires_grad=False)

    def load_weight(self, param_name: str, loaded) -> None:
        load_vocab_rows(self.weight, loaded, self.vocab_size, self.tp, param_name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # in the model's dtype: a float copy would hold the same values (the GEMM rounds its output anyway) and
        # cost a pass over [batch, vocab] plus twice the bytes for the sampler; consumers that compute on the
        # logits (log-softmax, penalties, soft-capping) take their own float copy
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., :self.vocab_size]
