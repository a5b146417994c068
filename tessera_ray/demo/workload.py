"""The agent fleet's prompts: seeded token ids, no Ray and no model.

Every agent's prompt in round ``r`` is, in this order::

    system prompt + tool schemas | one of the documents | own preamble | own questions 0..r | tail

The first two parts are shared (by every agent, by the agents reading the same document); the
rest is the agent's own. Because token keys are chained, a block is shared exactly when the whole
prefix before it is: the preamble comes after the document so that the document is reusable. The
conversation grows by one question per round, so an agent's earlier turns are hits too. The tail
is a partial block (the turn marker of the question being asked): it is never stored, because
only full blocks are pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera_ray.errors import DemoConfigError

__all__ = ["DemoConfig", "Request", "Fleet"]


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """The demo's workload and tier size (counts of 64-token blocks unless named otherwise)."""

    num_agents: int = 16
    num_rounds: int = 3
    num_documents: int = 3
    system_blocks: int = 2
    """System prompt and tool schemas, shared by every agent."""
    document_blocks: int = 4
    preamble_blocks: int = 1
    """Each agent's own instructions (not shared)."""
    question_blocks: int = 1
    """Blocks each round's question adds to the agent's conversation."""
    tail_tokens: int = 20
    """Tokens of the partial last block of every prompt (never stored)."""
    num_blocks_per_pool: int = 24
    """Memory of each pool, in blocks; small enough that the fleet spills to disk."""
    pools_per_node: int = 3
    num_shards: int = 2
    parity_every: int = 2
    """Check decode parity on every n-th request (1: all of them)."""
    seed: int = 0
    tenant: str = "fleet"
    """The fleet's namespace: every token key is chained under it."""
    ray_namespace: str = "tessera-demo"

    def __post_init__(self) -> None:
        for name in (
            "num_agents", "num_rounds", "num_documents", "system_blocks", "document_blocks",
            "preamble_blocks", "question_blocks", "num_blocks_per_pool", "pools_per_node",
            "num_shards", "parity_every",
        ):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DemoConfigError(
                    f"demo setting {name} must be a positive integer, got {value}"
                )
        if not 0 <= self.tail_tokens < 64:
            raise DemoConfigError(f"tail_tokens must be in [0, 64), got {self.tail_tokens}")
        if not self.tenant or not self.ray_namespace:
            raise DemoConfigError("tenant and ray_namespace must be non-empty")

    def max_prompt_blocks(self) -> int:
        """Full blocks of the longest prompt (the last round's)."""
        return (
            self.system_blocks
            + self.document_blocks
            + self.preamble_blocks
            + self.question_blocks * self.num_rounds
        )


@dataclass(frozen=True, slots=True)
class Request:
    """One agent turn: the prompt's token ids and which pool the agent runs next to."""

    index: int
    round: int
    agent: int
    document: int
    pool_index: int
    tokens: torch.Tensor
    """int64 ``[T]``: full blocks then ``tail_tokens``."""


class Fleet:
    """Builds every request of the run from the seed (the same seed, the same prompts)."""

    def __init__(self, config: DemoConfig, *, vocab_size: int, block_tokens: int, num_pools: int):
        self.config = config
        self.block_tokens = block_tokens
        self.num_pools = num_pools
        gen = torch.Generator().manual_seed(config.seed)

        def blocks(n: int) -> torch.Tensor:
            return torch.randint(0, vocab_size, (n * block_tokens,), generator=gen)

        c = config
        self.system = blocks(c.system_blocks)
        self.documents = [blocks(c.document_blocks) for _ in range(c.num_documents)]
        self.preambles = [blocks(c.preamble_blocks) for _ in range(c.num_agents)]
        self.questions = [
            [blocks(c.question_blocks) for _ in range(c.num_rounds)] for _ in range(c.num_agents)
        ]
        self.tails = [
            [
                torch.randint(0, vocab_size, (c.tail_tokens,), generator=gen)
                for _ in range(c.num_rounds)
            ]
            for _ in range(c.num_agents)
        ]

    def document_of(self, agent: int) -> int:
        return agent % self.config.num_documents

    def pool_of(self, agent: int) -> int:
        # Not aligned with the document, so agents reading one document sit on different pools
        # and shared blocks cross pools (the transfers the demo counts).
        return (agent + agent // self.config.num_documents) % self.num_pools

    def requests(self) -> list[Request]:
        out: list[Request] = []
        for r in range(self.config.num_rounds):
            for a in range(self.config.num_agents):
                d = self.document_of(a)
                tokens = torch.cat(
                    [
                        self.system,
                        self.documents[d],
                        self.preambles[a],
                        *self.questions[a][: r + 1],
                        self.tails[a][r],
                    ]
                )
                out.append(Request(len(out), r, a, d, self.pool_of(a), tokens))
        return out
