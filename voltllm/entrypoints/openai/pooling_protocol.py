"""POST /pooling request (vLLM's PoolingRequest): the /v1/embeddings body in its two forms (`input` or `messages`,
with vLLM's extras) plus the pooling `task` and the classifier's activation switches (`use_activation`, older
`softmax` / `activation`). vLLM's IO-processor form (`data`) is named so that it is refused as not built."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import model_validator

from voltllm.entrypoints.openai.embeddings_protocol import EmbeddingRequest
from voltllm.entrypoints.openai.errors import bad_request

# vLLM's pooling tasks voltllm does not run, and why (a request naming one is a 400 saying so)
UNBUILT_TASKS = {
    "token_embed": "per-token embeddings (vLLM's ALL pooling, multi-vector retrieval) are not built: an engine pools "
                   "one row per prompt",
    "token_classify": "per-token classification (reward and token-classification models) is not built: an engine "
                      "pools one row per prompt",
    "embed&token_classify": "the combined embed + per-token classification task (BGE-M3 style) is not built",
    "plugin": "IO processor plugins are not built",
    # (the names vLLM removed, with its advice)
    "score": "the 'score' task was removed in vLLM: use 'classify' (a classifier's output is its score)",
    "encode": "the 'encode' task was removed in vLLM (its successors token_embed / token_classify are not built "
              "here): use the engine's task (embed, or classify on a classifier)",
}


class PoolingRequest(EmbeddingRequest):
    task: Optional[str] = None  # embed / classify: the engine's (None: the engine's)
    softmax: Optional[bool] = None  # (vLLM's older names of use_activation)
    activation: Optional[bool] = None
    data: Optional[Any] = None  # vLLM's IO-processor plugin form (task plugin): refused

    @model_validator(mode="after")
    def _one_form(self) -> "PoolingRequest":
        # (the plugin form carries `data` instead of input / messages: create_pooling refuses it by name)
        if self.data is None and (self.input is None) == (self.messages is None):
            raise ValueError("give either 'input' (text or token ids) or 'messages' (a chat)")
        return self

    def check_task(self, engine_task: str) -> str:
        """The task this request runs: the engine's (embed on an embedding model, classify on a classifier), which
        `task` may name; vLLM's other tasks and the engine's other one are 400s naming `task`."""
        if self.data is not None:
            raise bad_request("data: vLLM's IO processor plugin requests (task 'plugin') are not built in voltllm; "
                              "send 'input' or 'messages'", "data")
        task = engine_task if self.task is None else self.task
        if task in UNBUILT_TASKS:
            raise bad_request(f"task {task!r}: {UNBUILT_TASKS[task]}", "task")
        if task not in ("embed", "classify"):
            raise bad_request(f"task must be one of embed, classify, {', '.join(UNBUILT_TASKS)} (vLLM's pooling "
                              f"tasks), got {task!r}", "task")
        if task != engine_task:
            kind = "an embedding model" if engine_task == "embed" else "a classifier"
            raise bad_request(f"Unsupported task: {task!r}: this server runs {kind}, whose pooling task is "
                              f"{engine_task!r} (one task per engine, as vLLM's)", "task")
        if self.dimensions is not None:
            raise bad_request("dimensions is currently not supported on /pooling (as vLLM's); use /v1/embeddings "
                              "for a matryoshka model's shortened embeddings", "dimensions")
        return task

    def activation_switch(self) -> Optional[bool]:
        """use_activation under any of its names (normalize for embeddings, softmax / activation for a classifier);
        None: the model's default. Names given different values are a 400."""
        given = {name: getattr(self, name) for name in ("use_activation", "normalize", "softmax", "activation")
                 if getattr(self, name) is not None}
        if len(set(given.values())) > 1:
            raise bad_request(f"{', '.join(given)} name the same switch (use_activation) with different values: "
                              "give one", next(iter(given)))
        return next(iter(given.values()), None)
