"""A chat prompt's images and videos: read (multimodal/media.py), decoded (multimodal/video.py) and processed
(multimodal/processor.py) off the event loop, the rendered prompt's placeholders expanded; every failure a 400."""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from voltllm.entrypoints.openai.errors import bad_request
from voltllm.multimodal.media import MediaError


async def prepare_chat_images(state: Any, prompt_ids: list[int], urls: list[str],
                              video_urls: Sequence[str] = ()) -> tuple[list[int], Any]:
    """(the prompt's ids with each image's and video's placeholder expanded, its MultiModalPrompt)."""
    for what, n, limit in (("images", len(urls), state.image_limit), ("videos", len(video_urls), state.video_limit)):
        if n > limit:
            raise bad_request(f"{n} {what} in one request: this server takes at most {limit} (--limit-mm-per-prompt)",
                              "messages")
    try:  # (read, decoded and processed here: a MediaError, or the processor's own ValueError, e.g. an aspect ratio
        # above 200)
        images = await asyncio.gather(*(asyncio.to_thread(state.images.load_image, url, state.media)
                                        for url in urls))
    except ValueError as e:
        raise bad_request(str(e) if isinstance(e, MediaError) else f"the image could not be used: {e}", "messages",
                          "invalid_image") from None
    try:  # (decoding, resizing and normalizing cost milliseconds or more per item: not on the event loop either)
        videos = await asyncio.gather(*(asyncio.to_thread(state.images.load_video, url, state.media)
                                        for url in video_urls))
    except ValueError as e:
        raise bad_request(str(e) if isinstance(e, MediaError) else f"the video could not be used: {e}", "messages",
                          "invalid_video") from None
    try:
        return await asyncio.to_thread(state.images.prepare, prompt_ids, images, videos, state.tokenizer)
    except ValueError as e:  # the placeholder count, or the processor's own (e.g. an aspect ratio above 200)
        raise bad_request(f"the {'images' if urls else 'videos'} could not be used: {e}", "messages") from None
