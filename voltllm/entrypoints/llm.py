"""Offline API: LLM(model=None, ...).generate(prompts, params) and .chat(messages, params)."""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Union

from voltllm.config import EngineArgs
from voltllm.engine.core import EngineCore, InvalidRequestError
from voltllm.engine.frontend import Frontend, PromptType, generation_defaults
from voltllm.engine.outputs import RequestOutput
from voltllm.model.loader import load_tokenizer
from voltllm.sampling.params import SamplingParams


def apply_chat_template(tokenizer: Any, messages: list[dict], chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True, tools: Optional[list] = None,
                        **template_kwargs: Any) -> str:
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; pass one with --chat-template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, tools=tools, **template_kwargs)


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        self.tokenizer = (None if self.config.model.skip_tokenizer_init else
                          load_tokenizer(self.config.model.tokenizer, self.config.model.trust_remote_code))
        self.engine = EngineCore(self.config)
        self.frontend = Frontend(self.tokenizer, self.config.model.model, self.config.model.max_model_len)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (--generation-config)."""
        m = self.config.model
        return SamplingParams(**generation_defaults(m.model, m.generation_config, m.override_generation_config))

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and
                                                 isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        order: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                rid = str(next(self._ids))
                for req in self.frontend.make_requests(rid, prompt, sp):
                    self.engine.add_request(req)
                order.append(rid)
        except Exception:
            self._abort(order + [rid])
            raise
        return self._run(order)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_requests(self.frontend.child_ids(rid))
            self.frontend.forget(rid)
        self.engine.step()  # flush abort notices

    def _run(self, order: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        try:
            while len(final) < len(order):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine went idle with requests unfinished")
                touched, to_abort = self.frontend.update(self.engine.step())
                errors = self.engine.take_request_errors()
                if errors:  # (a constrained request whose grammar did not compile)
                    raise InvalidRequestError(errors[0][1], "structured_outputs")
                if to_abort:
                    self.engine.abort_requests(to_abort)
                for st in touched:  # only the finished requests' outputs are returned: only they are built
                    if st.finished:
                        final[st.request_id] = self.frontend.build(st)
        except BaseException:
            self._abort([rid for rid in order if rid not in final])
            raise
        return [final[rid] for rid in order]

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False, chat_template: Optional[str] = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = chat_template or self.config.model.chat_template
        prompts = []
        for conv in conversations:
            text = apply_chat_template(self.tokenizer, conv, template, add_generation_prompt, tools,
                                       **(chat_template_kwargs or {}))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)
