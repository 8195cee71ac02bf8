"""seed_oss: Seed-OSS's <seed:think>...</seed:think>."""
from kestrel.server.reasoning.base import ReasoningParser


class SeedOssReasoningParser(ReasoningParser):
    starts, ends = ("<seed:think>",), ("</seed:think>",)
