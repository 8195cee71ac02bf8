"""What a request carries beyond its tokens and sampling parameters: the per-request features (LoRA adapter,
images, attention-mask policy, cache salt), in one typed struct that travels whole from the frontend
(EngineCoreRequest) through the engine core (Request) and the scheduler's deltas (NewRequestData) to the model
runner (RequestState). A msgspec struct, so it crosses the process boundaries as it is (never pickle); frozen,
because every holder shares the one instance (nothing copies it per step: the runner's add-ons read it once, when
the request arrives). A new request feature adds a field here and a runner add-on (kestrel/worker/addons/); see
docs/architecture.md, "How to add a request feature"."""
from __future__ import annotations

import msgspec

from kestrel.core.multimodal import MMFeature, block_extra
from kestrel.core.pooling import PoolingParams
from kestrel.core.positions import PromptPositions
from kestrel.errors import InvalidRequest


class RequestExtras(msgspec.Struct, frozen=True, omit_defaults=True):
    lora_id: int = 0  # the adapter registered under this id on every engine core (0: the base model)
    mm_features: list[MMFeature] = []  # images: encoder inputs, placeholder ranges, content hashes
    # attention-mask policy: the leading prompt tokens that attend to each other both ways (PaliGemma's image +
    # prompt; 0: causal). The scheduler computes such a prefix in one step.
    bidirectional_len: int = 0
    cache_salt: str = ""  # mixed into every KV block hash: requests with different salts never share blocks
    pooling: PoolingParams | None = None  # a pooling request (embedding, class scores): no sampling, see core/pooling.py
    # the prompt's positions where they are not its token indices (M-RoPE with images: core/positions.py). Not in
    # block_salt: they follow from the tokens and the images, which the block hashes cover already.
    positions: PromptPositions | None = None

    def block_salt(self, start: int, end: int) -> bytes:
        """What the KV of tokens [start, end) depends on beyond the tokens and the earlier blocks, except a
        bidirectional prefix's content (Request.block_extra adds that): the salt, the adapter and the images whose
        placeholders overlap it."""
        extra = self.cache_salt.encode() if self.cache_salt else b""
        if self.lora_id:
            extra += b"lora:%d" % self.lora_id  # two adapters never share KV blocks
        if self.mm_features:
            extra += block_extra(self.mm_features, start, end)
        return extra

    def check_step_budget(self, max_num_batched_tokens: int) -> None:
        """The scheduler computes a bidirectional prefix in one step, so it must fit the step's token budget. The
        engine's rule; the frontend runs the same check to answer 400 before sending."""
        if self.bidirectional_len > max_num_batched_tokens:
            raise InvalidRequest(f"the prompt's bidirectional prefix (its tokens attend both ways: an image model's "
                                 f"image + prompt, an encoder's whole prompt; {self.bidirectional_len} tokens) is "
                                 f"computed in one step and exceeds --max-num-batched-tokens "
                                 f"{max_num_batched_tokens}", param="prompt")


NO_EXTRAS = RequestExtras()  # the shared default of a plain text request
