"""A small byte-level BPE tokenizer trained in memory (no hub): for the tests' tiny checkpoints and for benchmark
models with random weights that need a real tokenizer and chat template (benchmarks/mm_serve.py's LLaVA shape)."""
from __future__ import annotations

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the same roles, with image parts of a message rendered as the image token
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
IMAGE_TOKEN = "<image>"
QWEN_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Hello world! How are you today? I am fine, thank you.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Kestrel serves language models fast, on one GPU or many, and on the CPU.",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" stop STOP end",
]
VOCAB_SIZE = 384


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tokenizer_with_image_token():
    """make_tokenizer() plus IMAGE_TOKEN as a special token (LLaVA-style processors expand it per image)."""
    from tokenizers import AddedToken

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(IMAGE_TOKEN, normalized=False, special=True)]})
    return tok
