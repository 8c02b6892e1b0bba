"""A chat prompt's images: read (multimodal/media.py) and processed (multimodal/processor.py) off the event loop, the
rendered prompt's placeholders expanded; every failure a 400."""
from __future__ import annotations

import asyncio
from typing import Any

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.multimodal.media import MediaError, load_image


async def prepare_chat_images(state: Any, prompt_ids: list[int], urls: list[str]) -> tuple[list[int], Any]:
    """(the prompt's ids with each image's placeholder expanded, its MultiModalPrompt)."""
    if len(urls) > state.image_limit:
        raise bad_request(f"{len(urls)} images in one request: this server takes at most {state.image_limit} "
                          "(--limit-mm-per-prompt)", "messages")
    try:
        images = await asyncio.gather(*(asyncio.to_thread(load_image, url, state.media) for url in urls))
        # (resizing and normalizing costs milliseconds per image: not on the event loop either)
        return await asyncio.to_thread(state.images.prepare, prompt_ids, images)
    except MediaError as e:
        raise bad_request(str(e), "messages", "invalid_image") from None
    except ValueError as e:  # the placeholder count, or the processor's own (e.g. an aspect ratio above 200)
        raise bad_request(f"the images could not be used: {e}", "messages") from None
