"""Which part of a Llama-family model one tensor-parallel rank holds (pure arithmetic, no torch).

- Attention: whole KV groups (a KV head and the query heads that read it) per rank.
  When there are at least as many KV heads as ranks they are split as evenly as they
  go, *unevenly* when they do not divide: SmolLM2's 3 KV heads (9 query heads) over 2
  ranks give rank 0 KV heads 0-1 with query heads 0-5 and rank 1 KV head 2 with query
  heads 6-8. No KV head is stored twice, so the pool holds each head once; the price is
  that rank 0 does 2/3 of the attention work. With fewer KV heads than ranks each KV
  head is *replicated* on size / num_kv_heads ranks, which split its query heads.
- MLP: the intermediate size, as evenly as it goes (column-parallel gate/up, row-parallel down).
- Vocabulary (embedding and head): ceil(vocab / size) rows per rank, the last rank's
  padded with zero rows; the padded logits are cut off after the gather.
"""

from __future__ import annotations

from dataclasses import dataclass


def split(n: int, size: int, rank: int) -> range:
    """Rank's contiguous share of n items over size ranks; the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


@dataclass(frozen=True)
class ModelShard:
    rank: int
    size: int
    q_heads: range  # query heads held (checkpoint indices)
    kv_heads: range  # KV heads held
    intermediate: range  # MLP columns held
    vocab: range  # vocabulary rows held
    vocab_rows: int  # rows of the embedding/head shard (vocab padded to a multiple of size)

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
           rank: int = 0, size: int = 1) -> ModelShard:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} heads do not split into {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        if num_kv_heads >= size:
            kv = split(num_kv_heads, size, rank)
            q = range(kv.start * group, kv.stop * group)
        else:
            if size % num_kv_heads or group % (size // num_kv_heads):
                raise ValueError(f"{num_kv_heads} KV heads of {group} query heads each cannot be replicated "
                                 f"over {size} ranks")
            replicas = size // num_kv_heads
            kv_head, part = divmod(rank, replicas)
            kv = range(kv_head, kv_head + 1)
            per = group // replicas
            q = range(kv_head * group + part * per, kv_head * group + (part + 1) * per)
        if intermediate_size < size:
            raise ValueError(f"intermediate size {intermediate_size} is smaller than {size} ranks")
        rows = -(-vocab_size // size)
        vocab = range(min(vocab_size, rank * rows), min(vocab_size, (rank + 1) * rows))
        return cls(rank, size, q, kv, split(intermediate_size, size, rank), vocab, rows)
