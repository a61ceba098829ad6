"""Front-end image handling: decode images (Pillow), run transformers' image processor for the model, expand
each image placeholder to its token count, and compute the M-RoPE positions. Raises ValueError naming the
field on bad input."""

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from ostinato.layers.mrope import mrope_positions
from ostinato.multimodal.inputs import MultiModalInputs

VISION_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")


@dataclass
class MediaLimits:
    max_images: int = 4  # per prompt (--limit-mm-per-prompt)
    max_image_bytes: int = 20 << 20  # encoded size of one image
    max_image_pixels: int = 64 << 20  # decoded width * height of one image
    fetch_timeout_s: float = 10.0
    allowed_local_media_path: str | None = None


def is_multimodal(config: PretrainedConfig) -> bool:
    return any(a in VISION_ARCHITECTURES for a in (getattr(config, "architectures", None) or []))


def load_image(item: Any, limits: MediaLimits, field: str = "image"):
    """A Pillow RGB image from a PIL image, raw bytes, a `data:` URL, an http(s) URL or (under the allowed local
    media path) a `file://` URL."""
    from PIL import Image

    if isinstance(item, Image.Image):
        img = item
    else:
        if isinstance(item, str):
            data = _fetch(item, limits, field)
        elif isinstance(item, bytes | bytearray):
            data = bytes(item)
        else:
            raise ValueError(f"{field}: expected a PIL image, bytes or a URL string, got {type(item).__name__}")
        if len(data) > limits.max_image_bytes:
            raise ValueError(f"{field}: image is {len(data)} bytes, over the limit of {limits.max_image_bytes}")
        try:
            img = Image.open(io.BytesIO(data))
            img.load()
        except Exception as e:
            raise ValueError(f"{field}: the image could not be decoded ({type(e).__name__})") from None
    if img.width * img.height > limits.max_image_pixels:
        raise ValueError(f"{field}: image is {img.width}x{img.height} pixels, over the limit of "
                         f"{limits.max_image_pixels} pixels")
    return img.convert("RGB")


def _fetch(url: str, limits: MediaLimits, field: str) -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        head, _, payload = url.partition(",")
        if not head.endswith(";base64"):
            raise ValueError(f"{field}: data URLs must be base64 (data:image/...;base64,...)")
        if len(payload) > limits.max_image_bytes * 4 // 3 + 4:
            raise ValueError(f"{field}: image is over the limit of {limits.max_image_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{field}: the data URL is not valid base64") from None
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as resp:
                data = resp.read(limits.max_image_bytes + 1)
        except Exception as e:
            raise ValueError(f"{field}: could not fetch {url!r} ({type(e).__name__}: {e})") from None
        if len(data) > limits.max_image_bytes:
            raise ValueError(f"{field}: image at {url!r} is over the limit of {limits.max_image_bytes} bytes")
        return data
    if scheme == "file":
        root = limits.allowed_local_media_path
        if not root:
            raise ValueError(f"{field}: file:// URLs are not allowed (start with --allowed-local-media-path)")
        path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        if os.path.commonpath([path, os.path.realpath(root)]) != os.path.realpath(root):
            raise ValueError(f"{field}: {path!r} is outside the allowed local media path")
        try:
            with open(path, "rb") as f:
                return f.read(limits.max_image_bytes + 1)
        except OSError as e:
            raise ValueError(f"{field}: could not read {path!r} ({e.strerror})") from None
    raise ValueError(f"{field}: URL scheme {scheme or '(none)'!r} is not allowed (data, http, https"
                     f"{', file' if limits.allowed_local_media_path else ''})")


def qwen2_vl_image_processor_class() -> type:
    """transformers' Qwen2-VL image processor that needs no torchvision (its Pillow backend where the installed
    transformers splits backends, the class itself before that)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


class ImageInputProcessor:
    """Turns (prompt token ids with one placeholder per image, images) into expanded token ids and the
    request's MultiModalInputs, through the model's own transformers image processor."""

    def __init__(self, model_dir: str, config: PretrainedConfig, limits: MediaLimits | None = None) -> None:
        from transformers import AutoImageProcessor

        if os.path.isfile(os.path.join(model_dir, "preprocessor_config.json")):
            self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        else:  # dummy weights from a preset: the model's processor class at its defaults, sized to the tower
            v = config.vision_config
            self.image_processor = qwen2_vl_image_processor_class()(
                patch_size=v.patch_size, merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
                min_pixels=3136, max_pixels=12845056)  # the released Qwen2.5-VL processor's bounds
        self.config = config
        self.limits = limits or MediaLimits()
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size

    def process(self, prompt_token_ids: list[int], images: list[Any]) -> tuple[list[int], MultiModalInputs]:
        if len(images) > self.limits.max_images:
            raise ValueError(f"multi_modal_data: {len(images)} images, over the limit of {self.limits.max_images} "
                             f"per prompt (--limit-mm-per-prompt)")
        slots = [i for i, t in enumerate(prompt_token_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            raise ValueError(f"prompt: {len(slots)} image placeholders for {len(images)} images")
        if slots and slots[-1] == len(prompt_token_ids) - 1:
            # the last prompt token may be computed by a decode step, which has no image inputs
            raise ValueError("prompt: must not end with an image placeholder (close it with <|vision_end|>)")
        decoded = [load_image(img, self.limits, f"image[{i}]") for i, img in enumerate(images)]
        out = self.image_processor(images=decoded, return_tensors="pt")
        grids = [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        ids: list[int] = []
        prev = 0
        for slot, (t, h, w) in zip(slots, grids, strict=True):
            ids.extend(prompt_token_ids[prev:slot])
            ids.extend([self.image_token_id] * (t * h * w // self.merge**2))
            prev = slot + 1
        ids.extend(prompt_token_ids[prev:])
        positions, delta = mrope_positions(ids, grids, self.image_token_id, self.merge)
        rows = torch.tensor([i for i, t in enumerate(ids) if t == self.image_token_id], dtype=torch.int64)
        return ids, MultiModalInputs(out["pixel_values"].float(), grids, rows, positions, delta)


def make_image_input_processor(source, max_images: int, allowed_local_media_path: str | None):
    """The processor for a vision model's ModelSource (None for a text model). Dummy presets have no
    preprocessor_config.json: they get the model's image processor at its default sizes."""
    config = source.hf_config
    if not is_multimodal(config):
        return None
    limits = MediaLimits(max_images=max_images, allowed_local_media_path=allowed_local_media_path)
    return ImageInputProcessor(source.path, config, limits)


def chat_images(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """OpenAI chat messages with `image_url` content parts -> messages whose image parts are `{"type": "image"}`
    (what the Qwen chat templates expand to a placeholder) and the images' URLs (or objects) in order."""
    images: list[Any] = []
    out = []
    for m_i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for p_i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise ValueError(f"messages[{m_i}].content[{p_i}].image_url.url: must be a string")
                images.append(url)
                parts.append({"type": "image"})
            elif kind == "image" or kind == "image_pil":
                images.append(part.get("image") if kind == "image" else part.get("image_pil"))
                parts.append({"type": "image"})
            elif kind == "text":
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise ValueError(f"messages[{m_i}].content[{p_i}].type: {kind!r} is not supported (text, image_url)")
        out.append({**message, "content": parts})
    return out, images
