#!/usr/bin/env python
"""Build a tiny, randomly initialised Idefics3 VLM for the real-vLLM e2e tests, fully offline.

Why: the e2e tests need a real, unmodified vLLM that runs a real multimodal model on a 2-core CPU machine with no
model hub. This writes a ~2 M-parameter Idefics3 (SigLIP-style vision tower + pixel-shuffle connector + Llama LM)
with a byte-level BPE tokenizer trained here, the Idefics3 image processor (364 px tiles, 169 tokens per tile) and a
chat template that turns OpenAI `image_url` parts into `<image>`. Its text output is garbage by design; what matters
is that vLLM really decodes, tiles and embeds every image (prompt_tokens grow with image size).

Works WITHOUT torchvision (the PIL image-processor backend is used when torchvision is absent).
Adapted from shared/real-backend/build_tiny_idefics3.py.

Usage: python build_tiny_idefics3.py OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, PreTrainedTokenizerFast

TILE, PATCH, SCALE = 364, 14, 2  # 26x26 patches per tile, pixel-shuffle 2 -> 169 tokens per tile
VOCAB = 2048  # BPE target; the tiny corpus yields fewer and the model uses the size actually trained
SPECIALS: list[str] = (["<|begin_of_text|>", "<|end_of_text|>", "<end_of_utterance>", "<pad>",
                        "<fake_token_around_image>", "<image>", "<global-img>"]
                       + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
# Idefics3-style: "User:<image>text<end_of_utterance>\nAssistant:"; accepts HF 'image' and OpenAI 'image_url' parts.
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{ message['role'].capitalize() }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] in ['image', 'image_url'] %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] in ['image', 'image_url'] %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def build_tokenizer() -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    """Train a byte-level BPE on a tiny corpus: every byte is representable, so any text tokenizes."""
    corpus = ["You are a helpful assistant.",
              "User: Describe this image. What is in the picture? Assistant: The quick brown fox jumps over the dog.",
              "hello world 0123456789 , . ! ? : ; ' \" ( ) [ ] { } - _ / \\ = + * & ^ % $ # @",
              "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore."
              ] * 50
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=VOCAB - 64, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                     eos_token="<end_of_utterance>", pad_token="<pad>",
                                     additional_special_tokens=SPECIALS[4:], model_max_length=8192)
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok, ids


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    hf_tok, ids = build_tokenizer()
    try:
        import torchvision  # noqa: F401
        from transformers import Idefics3ImageProcessor as IP
    except Exception:  # no torchvision (removed on purpose: the PyPI wheels are CUDA builds)
        from transformers import Idefics3ImageProcessorPil as IP
    image_processor = IP(do_image_splitting=True, size={"longest_edge": 4 * TILE},
                         max_image_size={"longest_edge": TILE}, do_resize=True, do_rescale=True,
                         do_normalize=True, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    image_seq_len = (TILE // PATCH) ** 2 // (SCALE ** 2)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=hf_tok, image_seq_len=image_seq_len,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)

    cfg = Idefics3Config(
        vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=PATCH),
        # vocab_size == tokenizer size, so every sampled id decodes to text
        text_config=dict(model_type="llama", vocab_size=len(hf_tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,  # head_dim 64
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<end_of_utterance>"],
                         pad_token_id=ids["<pad>"], tie_word_embeddings=False),
        image_token_id=ids["<image>"], scale_factor=SCALE, pad_token_id=ids["<pad>"], tie_word_embeddings=False)
    cfg.torch_dtype = "bfloat16"
    model = Idefics3ForConditionalGeneration(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<end_of_utterance>"],
                   "pad_token_id": ids["<pad>"]}, f, indent=2)
    print(f"tiny Idefics3: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"image processor {IP.__name__}, {image_seq_len} tokens per tile -> {out}")

    # Offline sanity check with HF itself: the processor expands <image> and the model generates.
    from PIL import Image
    proc = Idefics3Processor.from_pretrained(out)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}]
    prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
    inputs = proc(images=[[Image.new("RGB", (512, 512), (200, 30, 30))]], text=[prompt], return_tensors="pt")
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
    print("HF sanity check ok: 512x512 image ->", tuple(inputs["input_ids"].shape)[1], "prompt tokens")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny-idefics3")
