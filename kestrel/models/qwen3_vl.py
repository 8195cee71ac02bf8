"""Qwen3-VL: the Qwen3-VL vision tower (kestrel/models/vision/qwen3_vit.py) -> a Qwen3 decoder with interleaved
M-RoPE ([24, 20, 20] unless the config says otherwise) and DeepStack. DeepStack rides in the embeddings: an
image's rows are [merger | level 1 | ... | level k] (embed_image), a text token's the same width with zero levels
(embed_input_ids), so the image add-on's merge and its encoder cache need nothing new; the decoder adds level i to
layer i's output (adding zeros to text rows changes nothing, and forward(input_ids) skips it)."""
from __future__ import annotations

import torch

from kestrel.layers.linear import materialize
from kestrel.models.qwen import Qwen3ForCausalLM
from kestrel.models.qwen_moe import Qwen3MoeDecoderLayer, Qwen3MoeForCausalLM
from kestrel.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration, mrope_decoder
from kestrel.models.vision.qwen3_vit import Qwen3VisionTransformer


class DeepStack:
    """A decoder whose first layers' outputs take DeepStack levels (mixed into a Llama-style decoder class)."""

    def forward(self, input_ids, positions, ctx, inputs_embeds=None, deepstack=None) -> torch.Tensor:
        """`deepstack` [T, levels, hidden]: added to the first layers' outputs."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, ctx)
            if deepstack is not None and i < deepstack.shape[1]:
                hidden = hidden + deepstack[:, i]
        hidden, _ = self.norm(hidden, residual)
        return hidden


MROPE = ([24, 20, 20], True)


class Qwen3VLTextModel(DeepStack, mrope_decoder(Qwen3ForCausalLM, MROPE)):
    pass


class Qwen3VLMoeDecoderLayer(Qwen3MoeDecoderLayer):
    norm_topk = True  # transformers' Qwen3-VL-MoE router always renormalises (its config has no norm_topk_prob)


class Qwen3VLMoeDecoder(Qwen3MoeForCausalLM):
    decoder_layer_cls = Qwen3VLMoeDecoderLayer


class Qwen3VLMoeTextModel(DeepStack, mrope_decoder(Qwen3VLMoeDecoder, MROPE)):
    pass


class FrameVideos:
    """Videos as Qwen3-VL's processor writes them (Qwen3.5's too): each frame group "<{t:.1f} seconds>" then its own
    vision-start / placeholders / vision-end, t the mean time of its frames; positions per group as for an image
    (time row 0). The tower attends within a frame group only, so each group is its own feature of grid
    (1, h, w): encoding them one by one gives the video's embeddings."""
    video_style = "qwen3_vl"

    @staticmethod
    def video_replacements(hf_config, processed: dict, tokens: dict[str, str]) -> list[str]:
        merge = hf_config.vision_config.spatial_merge_size ** 2
        temporal = hf_config.vision_config.temporal_patch_size
        out = []
        for g, meta in zip(processed["video_grid_thw"], processed["video_metadata"]):
            idx = list(meta.frames_indices)
            idx += [idx[-1]] * (-len(idx) % temporal)
            times = [(idx[i] / meta.fps + idx[i + temporal - 1] / meta.fps) / 2 for i in range(0, len(idx), temporal)]
            frame = tokens["vision_start"] + tokens["video"] * int(g[1:].prod() // merge) + tokens["vision_end"]
            out.append("".join(f"<{times[i]:.1f} seconds>{frame}" for i in range(int(g[0]))))
        return out

    @staticmethod
    def split_videos(hf_config, processed) -> list[dict[str, torch.Tensor]]:
        out, start = [], 0
        for g in processed["video_grid_thw"]:
            t, hw = int(g[0]), int(g[1:].prod())
            for _ in range(t):
                out.append({"pixel_values": processed["pixel_values_videos"][start:start + hw],
                            "image_grid_thw": torch.tensor([1, int(g[1]), int(g[2])])})
                start += hw
        return out


class Qwen3VLForConditionalGeneration(FrameVideos, Qwen2_5_VLForConditionalGeneration):
    text_model_cls = Qwen3VLTextModel
    tower_cls = Qwen3VisionTransformer
    max_pixels = 16777216  # Qwen3-VL's processor default longest_edge (4096 x 4096): 256 x 256 patches of 16

    def __init__(self, ctx, prefix: str = "model"):
        super().__init__(ctx, prefix)
        self.levels = len(ctx.config.hf.vision_config.deepstack_visual_indexes)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        text = super().embed_input_ids(input_ids)
        return torch.cat([text, text.new_zeros(text.shape[0], text.shape[1] * self.levels)], dim=-1)

    def forward(self, input_ids, positions, ctx, inputs_embeds=None) -> torch.Tensor:
        if inputs_embeds is None:
            return self.language_model(input_ids, positions, ctx)
        t, h = inputs_embeds.shape[0], self.config.hidden_size
        deep = inputs_embeds[:, h:].view(t, self.levels, h) if self.levels else None
        return self.language_model(input_ids, positions, ctx, inputs_embeds=inputs_embeds[:, :h].contiguous(),
                                   deepstack=deep)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL on the Qwen3-MoE decoder. Its experts come stacked: transformers' own layout (gate_up [E, 2I, H],
    down [E, H, I]) or, as the released checkpoints store them, each transposed; the latter is turned around."""
    text_model_cls = Qwen3VLMoeTextModel

    def text_weights(self, weights):
        h, inter = self.config.hidden_size, self.config.moe_intermediate_size
        for name, t in weights:
            if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
                stored = (h, 2 * inter) if name.endswith("gate_up_proj") else (inter, h)
                if stored[0] != stored[1] and tuple(t.shape[1:]) == stored:
                    t = materialize(t).transpose(1, 2)
            yield name, t
