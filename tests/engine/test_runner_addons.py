"""The runner's add-ons without a model: the runner calls only the hooks an add-on overrides, the LoRA add-on
keeps the adapters of live requests (never evicted) from add/remove alone, the prefix-mask add-on gives per-row
lengths only to chunks inside a prefix, and the graph rules belong to the add-ons."""
from __future__ import annotations

import torch

from kestrel.core.extras import RequestExtras
from kestrel.core.sampling_params import SamplingParams
from kestrel.core.step import ScheduledChunk
from kestrel.worker.addons import HOOKS, StepAddon, overriding
from kestrel.worker.addons.grammar import GrammarBitmask
from kestrel.worker.addons.images import ImageEncoderCache
from kestrel.worker.addons.lora import LoRAAddon
from kestrel.worker.addons.prefix_mask import BidirectionalPrefix
from kestrel.worker.input_batch import RequestState


def _state(rid, n=8, **extras):
    return RequestState(rid, list(range(n)), [], SamplingParams(), [], RequestExtras(**extras))


def test_only_overridden_hooks_are_called():
    prefix, grammar = BidirectionalPrefix(), GrammarBitmask()
    hooks = {h: overriding([prefix, grammar], h) for h in HOOKS}
    assert hooks["attention_fields"] == [prefix.attention_fields]
    assert hooks["before_sample"] == [grammar.before_sample]
    assert hooks["prepare"] == hooks["add_request"] == hooks["inputs_embeds"] == []


class _FakeManager:
    backend = "torch"
    encoder_mappings = {}

    def __init__(self):
        self.calls = []

    def set_mapping(self, ids, tokens, live):
        self.calls.append((ids, tokens, set(live)))


def test_lora_addon_tracks_live_adapters():
    manager = _FakeManager()
    addon = LoRAAddon(manager, model=None)
    a, b, c = _state("a", lora_id=3), _state("b", lora_id=3), _state("c", lora_id=5)
    for st in (a, b, c, _state("base")):
        addon.add_request(st)
    addon.prepare([ScheduledChunk("a", 4, 0, False), ScheduledChunk("c", 1, 7, True)], [a, c])
    assert manager.calls[-1] == ([3, 5], [4, 1], {3, 5})
    addon.remove_request(a)
    addon.remove_request(c)
    addon.prepare([ScheduledChunk("b", 2, 0, False)], [b])
    assert manager.calls[-1] == ([3], [2], {3})  # b still holds adapter 3; 5 may be evicted now
    assert not addon.supports_graphs()  # the PyTorch reference reads the mapping on the host


def test_prefix_mask_marks_only_chunks_inside_the_prefix():
    addon = BidirectionalPrefix()
    inside, past, plain = _state("a", 20, bidirectional_len=12), _state("b", 20, bidirectional_len=6), _state("c")
    chunks = [ScheduledChunk("b", 1, 10, True), ScheduledChunk("a", 12, 0, True), ScheduledChunk("c", 8, 0, True)]
    assert addon.attention_fields(chunks, [past, inside, plain]) == {"bidirectional_lens_cpu": [0, 12, 0]}
    assert addon.attention_fields(chunks[:1], [past]) == {}  # no row in a prefix: causal metadata


def test_image_steps_run_eagerly_and_the_cache_goes_with_its_request():
    from kestrel.core.multimodal import MMFeature

    class Model:
        def embed_image(self, image):
            return torch.full((3, 2), 7.0)

        def embed_input_ids(self, ids):
            return torch.zeros(len(ids), 2)

    addon = ImageEncoderCache(Model(), torch.device("cpu"))
    st = _state("a", 8, mm_features=[MMFeature(2, 3, "h")])
    first = addon.inputs_embeds([ScheduledChunk("a", 3, 0, False)], [st], torch.zeros(3, dtype=torch.long))
    assert first[2].tolist() == [7.0, 7.0] and first[:2].eq(0).all() and not addon.step_graph_ok()
    assert list(addon.cache["a"]) == [0]  # placeholders 3 and 4 come in the next chunk
    addon.remove_request(st)
    assert "a" not in addon.cache
    assert addon.inputs_embeds([ScheduledChunk("a", 1, 7, True)], [st], torch.zeros(1, dtype=torch.long)) is None
    assert addon.step_graph_ok()
    assert StepAddon().step_graph_ok() and StepAddon().supports_graphs()
