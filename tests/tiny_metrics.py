"""Tiny random DINOv2, DINO (v1) and CLIP models (with their processors), saved with save_pretrained so the script
loads them from a folder exactly as it would load facebook/dinov2-base, facebook/dino-vits16 or
openai/clip-vit-base-patch32."""

from pathlib import Path

import torch


def byte_alphabet():
    """GPT-2's printable stand-in for each byte, as CLIP's byte-level BPE spells its vocabulary."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in kept]
    return [chr(b) for b in kept] + [chr(256 + i) for i in range(len(extra))]


def build_tiny_dino(path, seed=0):
    """A 2-layer DINOv2 (hidden size 32, patch 14) and DINOv2's preprocessing: 256 px shortest side, 224 px centre
    crop, ImageNet mean and std."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    torch.manual_seed(seed)
    Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                             patch_size=14, image_size=224)).save_pretrained(path)
    BitImageProcessor(size={"shortest_edge": 256}, resample=3, crop_size={"height": 224, "width": 224},
                      do_center_crop=True, image_mean=[0.485, 0.456, 0.406],
                      image_std=[0.229, 0.224, 0.225]).save_pretrained(path)
    return Path(path)


def build_tiny_dino_v1(path, seed=0):
    """A 2-layer DINO v1 ViT (hidden size 32, patch 16): a ViTModel saved without a pooler (DINO trained none; loading
    adds a random one, which the scores must not read) and a ViT image processor (224 px, ImageNet mean and std)."""
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(seed)
    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=16,
                       image_size=224), add_pooling_layer=False).save_pretrained(path)
    ViTImageProcessor(size={"height": 224, "width": 224}, image_mean=[0.485, 0.456, 0.406],
                      image_std=[0.229, 0.224, 0.225]).save_pretrained(path)
    return Path(path)


def build_tiny_clip(path, seed=0):
    """A 2-layer CLIP (text and vision, hidden size 32, projection 16) with a byte-level tokenizer (one token a
    character, no merges) and CLIP's image preprocessing."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    chars = byte_alphabet()
    vocab = {token: i for i, token in enumerate(chars + [c + "</w>" for c in chars]
                                               + ["<|startoftext|>", "<|endoftext|>"])}
    torch.manual_seed(seed)
    bos, eos = len(vocab) - 2, len(vocab) - 1
    CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=bos, eos_token_id=eos,
                         pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=224, patch_size=32),
        projection_dim=16)).save_pretrained(path)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=CLIPTokenizer(vocab=vocab, merges=[])
                  ).save_pretrained(path)
    return Path(path)
