"""Which data-parallel engine takes a new request: the least busy, unless one already holds its prompt's beginning.

Each engine has its own prefix cache, so a chat's next turn (the last prompt, the answer and a new message) is
cheap only on the engine that served the last turn. The router remembers, per engine, chained hashes of the
beginnings of the prompts it sent there (fixed chunks of the text, or of the token ids; the cache salt and the
LoRA adapter start the chain, as they key the engine's cache blocks) and prefers the engine matching the most
leading chunks, as long as it is at most SLACK requests busier than the least busy one; otherwise, and for prompts
no engine has seen, the least busy engine takes it (ties in turn). A system prompt every request shares soon
matches on every engine, so it does not pull the load onto one.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional, Sequence

TEXT_CHUNK = 128  # characters per chunk of a text prompt (about 30 tokens)
IDS_CHUNK = 32  # token ids per chunk of a token-id prompt
MAX_CHUNKS = 256  # chunks hashed per prompt (32K characters / 8K ids): enough to tell conversations apart
REMEMBERED = 1 << 16  # chunk hashes kept per engine (least recently used dropped)
SLACK = 4  # requests in flight an engine holding the prompt may have above the least busy one


def prompt_keys(prompt: Any, cache_salt: Optional[str] = None, adapter: Optional[str] = None) -> list[int]:
    """The chained hashes of the prompt's full leading chunks (empty for a prompt shorter than one chunk or of a
    form not read here)."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if isinstance(prompt, str):
        size, body = TEXT_CHUNK, prompt
    elif isinstance(prompt, (list, tuple)):
        size, body = IDS_CHUNK, tuple(prompt)
    else:
        return []
    keys: list[int] = []
    h = hash(("voltllm-dp", cache_salt, adapter))
    for start in range(0, min(len(body) // size, MAX_CHUNKS) * size, size):
        h = hash((h, body[start:start + size]))
        keys.append(h)
    return keys


class PrefixRouter:
    def __init__(self, num_engines: int):
        self.seen: list[OrderedDict] = [OrderedDict() for _ in range(num_engines)]
        self._next = 0  # where the search for the least busy engine starts (round robin among equals)

    def _matched(self, engine: int, keys: Sequence[int]) -> int:
        seen = self.seen[engine]
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        return n

    def choose(self, keys: Sequence[int], loads: Sequence[int]) -> int:
        """The engine for a prompt with these keys, given each engine's requests in flight; remembers the choice."""
        n = len(loads)
        order = [(self._next + i) % n for i in range(n)]
        least = min(order, key=lambda e: loads[e])
        chosen = least
        if keys:
            matched = [self._matched(e, keys) for e in range(n)]
            best = max(order, key=lambda e: (matched[e], -loads[e]))
            if matched[best] > matched[least] and loads[best] <= loads[least] + SLACK:
                chosen = best
        if chosen == least:
            self._next = (least + 1) % n
        seen = self.seen[chosen]
        for k in keys:
            seen[k] = None
            seen.move_to_end(k)
        while len(seen) > REMEMBERED:
            seen.popitem(last=False)
        return chosen
