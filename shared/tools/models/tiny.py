"""Deterministic random-weight vision-language models for tests and benchmarks.

:func:`build_tiny_model` writes a Hugging Face model folder (config, safetensors weights,
generation config, tokenizer, chat template, image / video processor configs) that
``AutoProcessor.from_pretrained`` and ``Qwen2VLForConditionalGeneration`` /
``Qwen2_5_VLForConditionalGeneration`` / ``Qwen3VLForConditionalGeneration`` /
``LlavaForConditionalGeneration.from_pretrained`` load offline (the Qwen families share the tiny
Qwen2 tokenizer and Qwen2-VL's chat template).

Contract:
* Same ``(arch, size, seed)`` -> byte-identical files (every JSON is written with sorted keys,
  weights are drawn per tensor from a generator seeded by ``(seed, tensor name)``, the tokenizer
  is learned by a deterministic pure-Python BPE on a built-in corpus).
* Different seed -> different weights (tokenizer and configs stay the same).
* Weights are re-drawn with a fan-in-scaled normal, not HF's default std 0.02 init: with the
  latter the output ignores the image, so an "engine output == HF output" test could not fail.
* The checkpoint uses the Hub key layout (``visual.*`` / ``model.layers.*`` for Qwen2-VL and
  Qwen2.5-VL; ``model.visual.*`` / ``model.language_model.*`` for Qwen3-VL;
  ``vision_tower.vision_model.*`` / ``language_model.model.*`` for LLaVA), i.e. what real
  checkpoints look like; transformers 5.x maps it on load and vLLM reads it as-is.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ARCHS: dict[str, str] = {
    "qwen2_vl": "Qwen2-VL (ViT with 2x2 patch merger, M-RoPE LM)",
    "qwen2_5_vl": "Qwen2.5-VL (windowed-attention ViT with RMSNorm/SwiGLU, M-RoPE LM)",
    "qwen3_vl": "Qwen3-VL (ViT with learned position embeddings and deepstack mergers, Qwen3 LM, interleaved M-RoPE)",
    "llava": "LLaVA-1.5 style (CLIP ViT + MLP projector + Llama LM)",
    "gemma3": "Gemma 3 (SigLIP ViT, pooled to a fixed number of soft tokens; Gemma 3 LM with sliding and global layers)",
    "internvl": "InternVL 3 (InternViT on 1-6 tiles plus a thumbnail, pixel shuffle, MLP projector, Qwen2 LM)",
}


@dataclass(frozen=True)
class SizeSpec:
    description: str
    vision_layers: int
    vision_dim: int
    vision_heads: int
    vision_mlp: int  # intermediate width of the vision MLP
    lm_layers: int
    lm_dim: int
    lm_heads: int
    lm_kv_heads: int
    lm_mlp: int
    # Qwen2-VL image processor bounds (pixels); LLaVA and Gemma 3 use ``clip_image_size``.
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    clip_image_size: int = 84
    #: Gemma 3: soft tokens per image (a square: the patch grid is average-pooled to it)
    mm_tokens_per_image: int = 16
    #: InternVL: the most tiles of an image (a thumbnail is added when there are several)
    max_tiles: int = 6


#: Available (arch, size) pairs.
SIZES: dict[tuple[str, str], SizeSpec] = {
    ("qwen2_vl", "tiny"): SizeSpec(
        description="tests: 3+3 layers, LM width 96, <= 16 image tokens, loads in well under 1 s",
        vision_layers=3,
        vision_dim=64,
        vision_heads=4,
        vision_mlp=128,
        lm_layers=3,
        lm_dim=96,
        lm_heads=3,  # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
        lm_kv_heads=3,
        lm_mlp=192,
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    ),
    ("qwen2_vl", "bench"): SizeSpec(
        description="benchmarks: ~130M params, vision 10x640, LM 10x768, up to 448x448 (256 image tokens)",
        vision_layers=10,
        vision_dim=640,
        vision_heads=10,
        vision_mlp=2560,
        lm_layers=10,
        lm_dim=768,
        lm_heads=12,
        lm_kv_heads=2,
        lm_mlp=2560,
        min_pixels=56 * 56,
        max_pixels=448 * 448,
    ),
    ("qwen2_5_vl", "tiny"): SizeSpec(
        # window_size 56 px (2x2 merged tokens; real checkpoints: 112) so that a tiny image spans
        # several attention windows and the windowing is exercised
        description="tests: 3+3 layers (vision layer 2 full attention, 0-1 windowed), LM width 96, <= 16 image tokens",
        vision_layers=3,
        vision_dim=64,
        vision_heads=4,
        vision_mlp=128,
        lm_layers=3,
        lm_dim=96,
        lm_heads=3,
        lm_kv_heads=3,
        lm_mlp=192,
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    ),
    ("qwen3_vl", "tiny"): SizeSpec(
        description="tests: 3+3 layers (deepstack from vision layers 0, 1), patch 16, LM width 96, <= 16 image tokens",
        vision_layers=3,
        vision_dim=64,
        vision_heads=4,
        vision_mlp=128,
        lm_layers=3,
        lm_dim=96,
        lm_heads=3,
        lm_kv_heads=3,
        lm_mlp=192,
        min_pixels=64 * 64,
        max_pixels=128 * 128,
    ),
    ("gemma3", "tiny"): SizeSpec(
        description="tests: SigLIP 3x64 at 112x112 (8x8 patches pooled to 16 soft tokens), Gemma 3 LM 3x96"
        " (2 sliding-window layers, 1 global)",
        vision_layers=3,
        vision_dim=64,
        vision_heads=4,
        vision_mlp=128,
        lm_layers=3,
        lm_dim=96,
        lm_heads=3,  # head_dim 32 (vLLM's CPU attention: 32, 64, 80, ...)
        lm_kv_heads=1,
        lm_mlp=192,
        clip_image_size=112,
        mm_tokens_per_image=16,
    ),
    ("internvl", "tiny"): SizeSpec(
        description="tests: InternViT 3x64 on 56x56 tiles (4 tokens each after the pixel shuffle), up to 6 tiles"
        " plus a thumbnail (28 image tokens), Qwen2 LM 3x96",
        vision_layers=3,
        vision_dim=64,
        vision_heads=4,
        vision_mlp=128,
        lm_layers=3,
        lm_dim=96,
        lm_heads=3,
        lm_kv_heads=3,
        lm_mlp=192,
        clip_image_size=56,
        max_tiles=6,
    ),
    ("llava", "tiny"): SizeSpec(
        description="tests: CLIP 3x64 at 84x84 (36 image tokens), Llama 3x96",
        vision_layers=3,
        vision_dim=64,
        vision_heads=4,
        vision_mlp=128,
        lm_layers=3,
        lm_dim=96,
        lm_heads=3,  # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
        lm_kv_heads=3,
        lm_mlp=192,
        clip_image_size=84,
    ),
}

# -- tokenizer ----------------------------------------------------------------------------------

# Built-in corpus the BPE merges are learned from. Any text works; this one makes the merges
# look like English so generated token strings are readable-ish.
_CORPUS = """
The image shows a small red house next to a tall green tree under a blue sky.
A cat is sitting on the table near the window, and a dog is sleeping on the floor.
There are three people in the picture: a man, a woman and a child. They are walking in the park.
What is in this image? Describe the picture in detail. How many objects can you see?
The photo was taken at night. The lights of the city are bright and the street is wet from the rain.
This is a chart with numbers from 0 to 100. The values increase from left to right.
In the center of the image there is a white car, and behind it a large building with many windows.
The answer is yes. The answer is no. I think the color is yellow, orange, purple or brown.
Please answer the question about the image. The first image and the second image are different.
A boat is floating on the water of the lake, and mountains are visible in the background.
The text in the image says hello world. The sign on the door reads open every day from 9 to 5.
You are a helpful assistant. The user asks about the photo and the assistant answers clearly.
"""

_NUM_MERGES = 240

# The GPT-2 / Qwen2 pre-tokenizer regex (same string transformers' Qwen2Tokenizer uses).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL-Instruct's chat template, verbatim. It renders ``{"type": "image"}`` content parts as
# ``<|vision_start|><|image_pad|><|vision_end|>``.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-Instruct's tool-calling chat template (the Hermes format: the tools in the system turn,
# calls as ``<tool_call>`` JSON, tool results as ``<tool_response>`` in a user turn), verbatim but
# for two things: message content goes through Qwen2-VL's part rendering (images as
# ``<|vision_start|><|image_pad|><|vision_end|>``; a string as it is) and the default system
# prompt is Qwen2-VL's. Not what the tiny model is built with: tests copy the folder and write
# this template into it (:func:`write_chat_template`) to serve a model whose template renders tools.
QWEN2_VL_TOOLS_CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content -%}{%- for part in content -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- render_content(messages[0]['content']) }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0]['content']) + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>' + '\\n' }}"
    '{%- elif message.role == "assistant" %}'
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + render_content(message.content) }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- render_content(message.content) }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# LLaVA-1.5 style ("USER: <image>\n... ASSISTANT:"), accepting string or list content and
# rendering images where they appear in the content list.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\n' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}{{ '<image>\n' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

LLAVA_IMAGE_TOKEN = "<image>"

# Gemma 3's chat template (as its checkpoints ship it, tools aside): BOS, a system message folded
# into the first user turn, "model" for the assistant, one <start_of_image> per image (the
# processor expands it to the image's soft tokens).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# InternVL's chat template (Qwen2's turns; an image is "<IMG_CONTEXT>\n", which the processor
# expands to "<img>" + its tiles' tokens + "</img>")
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INTERNVL_SPECIAL = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
GEMMA3_SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def _learn_bpe(words: list[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair).

    Pure Python and fully ordered, so the merges never depend on hash seeds or thread timing.
    """
    counts = collections.Counter(words)
    # Sorted so every later step iterates in a fixed order.
    vocab_words: list[tuple[list[str], int]] = [(list(w), c) for w, c in sorted(counts.items())]
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pair_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for symbols, c in vocab_words:
            for a, b in zip(symbols, symbols[1:]):
                pair_counts[(a, b)] += c
        if not pair_counts:
            break
        best = min(pair_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if best[1] < 2:
            break
        a, b = best[0]
        merges.append((a, b))
        for symbols, _c in vocab_words:
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == a and symbols[i + 1] == b:
                    symbols[i : i + 2] = [a + b]
                else:
                    i += 1
    return merges


def _build_qwen2_tokenizer(
    corpus: str = _CORPUS, num_merges: int = _NUM_MERGES, extra_special: dict[str, str] | None = None
):
    """Byte-level BPE with Qwen2's normalizer / pre-tokenizer / decoder and its special tokens,
    its merges learned on ``corpus``; ``extra_special``: more special tokens, each also a named
    attribute of the tokenizer (InternVL's ``context_image_token`` etc.)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    normalizer = normalizers.NFC()
    words = [w for w, _span in pre.pre_tokenize_str(normalizer.normalize_str(corpus))]
    merges = _learn_bpe(words, num_merges)

    byte_chars = bytes_to_unicode()
    vocab: dict[str, int] = {byte_chars[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))

    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    specials = [*QWEN2_SPECIAL_TOKENS, *(extra_special or {}).values()]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    more: dict[str, Any] = {"extra_special_tokens": extra_special} if extra_special else {}
    return Qwen2Tokenizer(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,  # type: ignore[arg-type]  # Qwen2 has no unk token; transformers takes None
        model_max_length=32768,
        errors="replace",
        split_special_tokens=False,
        **more,
    )


def _byte_fallback_vocab(specials: list[str], chars: list[str], merges: list[tuple[str, str]]) -> dict[str, int]:
    """A SentencePiece-style vocabulary: ``specials`` first, the 256 byte-fallback tokens, the
    single characters, then each merge's result, in that order."""
    vocab = {token: i for i, token in enumerate(specials)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab


def _build_llama_tokenizer():
    """SentencePiece-style BPE (``▁`` word marker + byte fallback), Llama's pipeline."""
    from transformers import LlamaTokenizer

    words = ["\u2581" + w for w in _CORPUS.split()]
    merges = _learn_bpe(words, _NUM_MERGES)
    vocab = _byte_fallback_vocab(["<unk>", "<s>", "</s>"], sorted({c for w in words for c in w}), merges)
    tok = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token=None,
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=4096,
    )
    tok.add_special_tokens({"pad_token": "<pad>"})
    tok.add_tokens([_added_special(LLAVA_IMAGE_TOKEN)], special_tokens=True)
    return tok


def _build_gemma_tokenizer():
    """Gemma's pipeline (SentencePiece-style BPE, byte fallback, BOS added) with Gemma 3's turn
    and image special tokens, the image ones also as the tokenizer's ``boi_token`` /
    ``eoi_token`` / ``image_token`` (what Gemma 3's processor reads)."""
    from transformers import GemmaTokenizer

    words = ["\u2581" + w for w in _CORPUS.split()]
    # Runs of up to four newlines are one token each, as in Gemma's vocabulary (its processor puts
    # "\n\n" around every image; vLLM's Gemma 3 support looks these four tokens up)
    newlines = [("\n", "\n"), ("\n\n", "\n"), ("\n\n", "\n\n")]
    merges = newlines + _learn_bpe(words, _NUM_MERGES)
    chars = ["\n", *sorted({c for w in words for c in w})]
    vocab = _byte_fallback_vocab(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], chars, merges)
    tok = GemmaTokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # the tokenizers library takes (a, b) pairs (typed as "a b")
        add_bos_token=True, extra_special_tokens=GEMMA3_SPECIAL, model_max_length=4096
    )
    turns = ["<start_of_turn>", "<end_of_turn>", *GEMMA3_SPECIAL.values()]
    tok.add_tokens([_added_special(t) for t in turns], special_tokens=True)
    return tok


def _added_special(content: str):
    from tokenizers import AddedToken

    return AddedToken(content, special=True, normalized=False)


# -- weights ------------------------------------------------------------------------------------

_NORM_MARKERS = ("norm", "ln_q", "layrnorm", "layernorm")


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"epd-tiny|{seed}|{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(name: str, shape: tuple[int, ...], seed: int):
    """Re-draw one tensor: fan-in-scaled normal for matrices, 1 for norm scales, small biases."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    leaf = name.rsplit(".", 1)[-1]
    is_norm = any(m in name for m in _NORM_MARKERS)
    if len(shape) == 1:
        if is_norm and leaf == "weight":
            return torch.ones(shape, dtype=torch.float32)
        if is_norm:  # norm bias
            return torch.zeros(shape, dtype=torch.float32)
        if leaf == "bias":
            return torch.randn(shape, generator=gen, dtype=torch.float32) * 0.02
        # e.g. CLIP's class_embedding: an input vector of the residual stream.
        return torch.randn(shape, generator=gen, dtype=torch.float32)
    if "embed_tokens" in name or "position_embedding" in name:
        # Embedding tables feed the residual stream directly: unit scale like a fan-in-scaled
        # projection of a unit-variance input.
        return torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = math.prod(shape[1:])
    return torch.randn(shape, generator=gen, dtype=torch.float32) / math.sqrt(fan_in)


def _rewrite_weights(src: Path, dst: Path, *, arch: str, seed: int) -> int:
    """Read the (HF-initialised) checkpoint, re-draw every tensor, write the Hub layout."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    with safe_open(str(src), framework="pt") as fh:
        names = sorted(fh.keys())
        shapes = {n: tuple(fh.get_slice(n).get_shape()) for n in names}
    for name in names:
        if arch == "gemma3" and name.endswith("lm_head.weight"):
            continue  # tied to the token embeddings, as in Gemma 3 checkpoints (none has an lm_head)
        out_name = name
        if (
            arch in ("llava", "gemma3")
            and name.startswith("vision_tower.")
            and not name.startswith("vision_tower.vision_model.")
        ):
            # transformers 5.x saves CLIP / SigLIP without the ``vision_model`` level; the Hub /
            # vLLM layout has it, and transformers maps it back on load.
            out_name = "vision_tower.vision_model." + name[len("vision_tower.") :]
        tensor = _draw(out_name, shapes[name], seed)
        if arch == "gemma3" and out_name.endswith("embed_tokens.weight"):
            # Gemma scales token embeddings by sqrt(hidden) in its forward: unit scale after it, as
            # the image's soft tokens have (otherwise text drowns the image out)
            tensor = tensor / math.sqrt(shapes[name][1])
        elif out_name.endswith("mm_input_projection_weight"):
            tensor = tensor * math.sqrt(shapes[name][1] / shapes[name][0])  # used as x @ w: fan-in is dim 0
        tensors[out_name] = tensor.contiguous()
    save_file(dict(sorted(tensors.items())), str(dst), metadata={"format": "pt"})
    dst.chmod(0o644)  # safetensors creates the file 0600; the folder is shared read-only data
    return sum(t.numel() for t in tensors.values())


# -- configs ------------------------------------------------------------------------------------


def _qwen2_vl_config(spec: SizeSpec, tok) -> Any:
    from transformers import Qwen2VLConfig

    mrope = _mrope_section(spec.lm_dim // spec.lm_heads)
    ids = _qwen_ids(tok)
    return Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=spec.lm_dim,
            intermediate_size=spec.lm_mlp,
            num_hidden_layers=spec.lm_layers,
            num_attention_heads=spec.lm_heads,
            num_key_value_heads=spec.lm_kv_heads,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": mrope, "rope_theta": 1000000.0},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=None,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=spec.vision_layers,
            embed_dim=spec.vision_dim,
            hidden_size=spec.lm_dim,
            num_heads=spec.vision_heads,
            mlp_ratio=spec.vision_mlp // spec.vision_dim,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _mrope_section(head_dim: int) -> list[int]:
    """M-RoPE split of the rotary half-dim into (temporal, height, width): Qwen2-VL uses
    [16, 24, 24] for head_dim 128, i.e. 1/4, 3/8, 3/8."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _qwen_ids(tok) -> dict[str, int]:
    return {t_: tok.convert_tokens_to_ids(t_) for t_ in QWEN2_SPECIAL_TOKENS}


def _qwen2_5_vl_config(spec: SizeSpec, tok) -> Any:
    from transformers import Qwen2_5_VLConfig

    head_dim = spec.lm_dim // spec.lm_heads
    ids = _qwen_ids(tok)
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=spec.lm_dim,
            intermediate_size=spec.lm_mlp,
            num_hidden_layers=spec.lm_layers,
            num_attention_heads=spec.lm_heads,
            num_key_value_heads=spec.lm_kv_heads,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "mrope_section": _mrope_section(head_dim),
                "rope_theta": 1000000.0,
            },
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=None,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=spec.vision_layers,
            hidden_size=spec.vision_dim,
            intermediate_size=spec.vision_mlp,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.lm_dim,
            hidden_act="silu",
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[spec.vision_layers - 1],
            tokens_per_second=2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _qwen3_vl_config(spec: SizeSpec, tok) -> Any:
    from transformers import Qwen3VLConfig

    head_dim = spec.lm_dim // spec.lm_heads
    ids = _qwen_ids(tok)
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=spec.lm_dim,
            intermediate_size=spec.lm_mlp,
            num_hidden_layers=spec.lm_layers,
            num_attention_heads=spec.lm_heads,
            num_key_value_heads=spec.lm_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            # Qwen3-VL interleaves the (t, h, w) frequencies ([24, 20, 20] for head_dim 128)
            rope_parameters={
                "rope_type": "default",
                "mrope_section": _mrope_section(head_dim),
                "mrope_interleaved": True,
                "rope_theta": 5000000.0,
            },
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=None,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=spec.vision_layers,
            hidden_size=spec.vision_dim,
            intermediate_size=spec.vision_mlp,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.lm_dim,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,  # an 8x8 grid, interpolated to the image's (real: 48x48)
            # deepstack: these vision layers' merged features are added into the first LM layers
            deepstack_visual_indexes=list(range(spec.vision_layers - 1)),
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _llava_config(spec: SizeSpec, tok) -> Any:
    from transformers import LlavaConfig

    return LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=spec.vision_dim,
            intermediate_size=spec.vision_mlp,
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.vision_heads,
            image_size=spec.clip_image_size,
            patch_size=14,
            projection_dim=spec.vision_dim,
            hidden_act="quick_gelu",
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(tok),
            hidden_size=spec.lm_dim,
            intermediate_size=spec.lm_mlp,
            num_hidden_layers=spec.lm_layers,
            num_attention_heads=spec.lm_heads,
            num_key_value_heads=spec.lm_kv_heads,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=False,
        ),
        image_token_index=tok.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        image_seq_length=(spec.clip_image_size // 14) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )


def _gemma3_config(spec: SizeSpec, tok) -> Any:
    from transformers import Gemma3Config

    head_dim = spec.lm_dim // spec.lm_heads
    return Gemma3Config(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=spec.lm_dim,
            intermediate_size=spec.lm_mlp,
            num_hidden_layers=spec.lm_layers,
            num_attention_heads=spec.lm_heads,
            num_key_value_heads=spec.lm_kv_heads,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            max_position_embeddings=4096,
            sliding_window=4096,
            layer_types=["sliding_attention"] * (spec.lm_layers - 1) + ["full_attention"],
            bos_token_id=tok.bos_token_id,
            eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")],
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=spec.vision_dim,
            intermediate_size=spec.vision_mlp,
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.vision_heads,
            image_size=spec.clip_image_size,
            patch_size=14,
            vision_use_head=False,
        ),
        mm_tokens_per_image=spec.mm_tokens_per_image,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
    )


def _internvl_config(spec: SizeSpec, tok) -> Any:
    from transformers import InternVLConfig

    side = spec.clip_image_size
    return InternVLConfig(
        vision_config=dict(
            hidden_size=spec.vision_dim,
            num_hidden_layers=spec.vision_layers,
            num_attention_heads=spec.vision_heads,
            intermediate_size=spec.vision_mlp,
            image_size=[side, side],
            patch_size=[14, 14],
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=len(tok),
            hidden_size=spec.lm_dim,
            intermediate_size=spec.lm_mlp,
            num_hidden_layers=spec.lm_layers,
            num_attention_heads=spec.lm_heads,
            num_key_value_heads=spec.lm_kv_heads,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            tie_word_embeddings=False,
        ),
        image_token_id=tok.context_image_token_id,
        image_seq_length=(side // 14) ** 2 // 4,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def _internvl_processor(spec: SizeSpec, tok):
    from transformers import GotOcr2ImageProcessor, InternVLProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    side = {"height": spec.clip_image_size, "width": spec.clip_image_size}
    image_processor = GotOcr2ImageProcessor(
        size=side,
        crop_to_patches=True,
        min_patches=1,
        max_patches=spec.max_tiles,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    )
    return InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=InternVLVideoProcessor(size=side),
        image_seq_length=(spec.clip_image_size // 14) ** 2 // 4,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )


def _gemma3_processor(spec: SizeSpec, tok):
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    size = spec.clip_image_size
    image_processor = Gemma3ImageProcessor(
        size={"height": size, "width": size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_pan_and_scan=False,
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=spec.mm_tokens_per_image,
    )


def _qwen2_vl_processor(spec: SizeSpec, tok):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    return Qwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _qwen2_5_vl_processor(spec: SizeSpec, tok):
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    video_processor = Qwen2VLVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _qwen3_vl_processor(spec: SizeSpec, tok):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    # Qwen3-VL's image processor is Qwen2-VL's with 16-pixel patches and its mean/std of 0.5
    image_processor = Qwen2VLImageProcessor(
        size=size, patch_size=16, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
    )
    video_processor = Qwen3VLVideoProcessor(size=size, patch_size=16)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )


def _llava_processor(spec: SizeSpec, tok):
    from transformers import CLIPImageProcessor, LlavaProcessor

    size = spec.clip_image_size
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        do_center_crop=True,
        do_resize=True,
        do_normalize=True,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=LLAVA_IMAGE_TOKEN,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )


def _canonicalize_json_files(folder: Path) -> None:
    """Re-write every JSON config with sorted keys and a fixed layout (byte-stable output).

    ``tokenizer.json`` is left as the ``tokenizers`` library wrote it (already ordered by id).
    """
    for path in sorted(folder.glob("*.json")):
        if path.name == "tokenizer.json":
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def write_chat_template(folder: str | Path, template: str) -> None:
    """Make ``template`` the chat template of a model folder (``chat_template.jinja``, which the
    processor and the tokenizer both load; a ``chat_template`` in the JSON configs is removed so it
    cannot win)."""
    folder = Path(folder)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json", "processor_config.json"):
        path = folder / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.pop("chat_template", None) is not None:
                path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    (folder / "chat_template.json").unlink(missing_ok=True)


def default_model_dir(data_dir: Path) -> Path:
    """Where ``epd up`` / ``epd plan --validate`` build the default tiny model under their data folder."""
    return data_dir / "models" / "qwen2-vl-tiny"


def tiny_model_is_current(path: Path) -> bool:
    """The default tiny model exists and has the builder's current shape (an older build, e.g.
    with a head size vLLM's CPU attention lacks, is rebuilt)."""
    try:
        text = json.loads((path / "config.json").read_text())["text_config"]
    except (OSError, ValueError, KeyError):
        return False
    spec = SIZES[("qwen2_vl", "tiny")]
    return (text.get("num_attention_heads"), text.get("num_key_value_heads")) == (spec.lm_heads, spec.lm_kv_heads)


def build_tiny_model(out_dir: str | Path, *, arch: str = "qwen2_vl", size: str = "tiny", seed: int = 0) -> Path:
    """Write a deterministic random-weight HF model folder for ``arch`` / ``size`` into ``out_dir``.

    ``out_dir`` is created if missing; files already there with the same names are replaced.
    Returns the folder path. Same arguments -> byte-identical files.
    """
    import torch
    from transformers import (
        Gemma3ForConditionalGeneration,
        GenerationConfig,
        InternVLForConditionalGeneration,
        LlavaForConditionalGeneration,
        PreTrainedModel,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )
    from transformers.initialization import no_init_weights

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    spec = SIZES.get((arch, size))
    if spec is None:
        sizes = sorted(s for a, s in SIZES if a == arch)
        raise ValueError(f"unknown size {size!r} for {arch}; choose one of {sizes}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    qwen: dict[str, tuple[Any, Any, type[PreTrainedModel]]] = {
        "qwen2_vl": (_qwen2_vl_config, _qwen2_vl_processor, Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (_qwen2_5_vl_config, _qwen2_5_vl_processor, Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (_qwen3_vl_config, _qwen3_vl_processor, Qwen3VLForConditionalGeneration),
    }
    if arch in qwen:
        make_config, make_processor, model_cls = qwen[arch]
        tok = _build_qwen2_tokenizer()
        config = make_config(spec, tok)
        processor = make_processor(spec, tok)
        eos_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        gen_config = GenerationConfig(
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=eos_ids,
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        )
    elif arch == "internvl":
        tok = _build_qwen2_tokenizer(extra_special=INTERNVL_SPECIAL)
        config = _internvl_config(spec, tok)
        processor = _internvl_processor(spec, tok)
        model_cls = InternVLForConditionalGeneration
        gen_config = GenerationConfig(
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        )
    elif arch == "gemma3":
        tok = _build_gemma_tokenizer()
        config = _gemma3_config(spec, tok)
        processor = _gemma3_processor(spec, tok)
        model_cls = Gemma3ForConditionalGeneration
        gen_config = GenerationConfig(
            bos_token_id=tok.bos_token_id,
            eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")],
            pad_token_id=tok.pad_token_id,
        )
    else:
        tok = _build_llama_tokenizer()
        config = _llava_config(spec, tok)
        processor = _llava_processor(spec, tok)
        model_cls = LlavaForConditionalGeneration
        gen_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )

    with tempfile.TemporaryDirectory(prefix="epd-tiny-") as tmp:
        tmp_path = Path(tmp)
        # The model object only serves to produce the checkpoint key names and config.json the
        # way this transformers version writes them; its (skipped) init is overwritten anyway.
        with no_init_weights(), torch.device("cpu"):
            model = model_cls(config)
        model.generation_config = gen_config
        model.save_pretrained(tmp_path / "model")
        del model
        n_params = _rewrite_weights(
            tmp_path / "model" / "model.safetensors", out / "model.safetensors", arch=arch, seed=seed
        )
        for name in ("config.json", "generation_config.json"):
            shutil.copyfile(tmp_path / "model" / name, out / name)
        processor.save_pretrained(tmp_path / "processor")
        for path in sorted((tmp_path / "processor").iterdir()):
            shutil.copyfile(path, out / path.name)
    _canonicalize_json_files(out)
    logger.info("built %s/%s seed=%d (%.1fM params) in %s", arch, size, seed, n_params / 1e6, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a deterministic random-weight VLM folder.")
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="qwen2_vl", choices=sorted(ARCHS))
    parser.add_argument("--size", default="tiny", choices=sorted({s for _a, s in SIZES}))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(build_tiny_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
