"""Offline API: LLM(model=None, ...).generate(prompts, params) and .chat(messages, params); a pooling model's
LLM(model, runner="pooling").embed(prompts) / .encode(prompts) / .score(a, b) (cosine similarity), a classifier's
.classify(prompts) / .score(a, b)."""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

from voltllm.config import ConfigError, EngineArgs
from voltllm.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from voltllm.engine.core import EngineCore, InvalidRequestError
from voltllm.engine.data_parallel import require_one_engine
from voltllm.engine.frontend import Frontend, PromptType, generation_defaults
from voltllm.engine.request_checks import check_priority
from voltllm.engine.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                    RequestOutput, ScoringRequestOutput)
from voltllm.entrypoints.progress import ProgressBar, UseTqdm, tqdm
from voltllm.model.loader import load_tokenizer
from voltllm.multimodal.support import image_input_refusal
from voltllm.pooling.params import PoolingParams
from voltllm.sampling.params import SamplingParams
from voltllm.tracing import make_request_tracer, traced_request


def apply_chat_template(tokenizer: Any, messages: list[dict], chat_template: Optional[str] = None,
                        add_generation_prompt: bool = True, tools: Optional[list] = None,
                        **template_kwargs: Any) -> str:
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; pass one with --chat-template")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         chat_template=chat_template, tools=tools, **template_kwargs)


def _refuse_lora(lora_request: Any, what: str) -> None:
    if lora_request is not None:
        raise ValueError(f"lora_request: LoRA adapters are not built for {what} (they are for generate and chat)")


def _lora_requests(lora_request: Any, n: int, enabled: bool) -> list:
    """vLLM's lora_request: one LoRARequest for every prompt, or a list of one (or None) per prompt."""
    from voltllm.lora.request import LoRARequest

    if lora_request is None:
        return [None] * n
    if not enabled:
        raise ValueError("lora_request: LoRA is not enabled; create the LLM with enable_lora=True")
    reqs = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(reqs) != n:
        raise ValueError(f"{n} prompts but {len(reqs)} lora requests: give one, or one per prompt")
    for r in reqs:
        if r is not None and not isinstance(r, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest (voltllm.lora.request), got {type(r).__name__}")
    return reqs


def _offline_settings(kwargs: dict) -> tuple[dict, Optional[int]]:
    """(the EngineArgs keywords, max_logprobs) from vLLM's LLM(...) keywords: the ones that belong to vLLM's server-side
    engine arguments are taken here (disable_log_stats: the offline engine logs no periodic stats; max_logprobs: the
    most logprobs / prompt_logprobs a request may ask, as vLLM's), unbuilt vLLM
    settings at what voltllm does anyway (enable_prompt_adapter=False, ...) are dropped, others refused."""
    from voltllm.cli_unbuilt import is_accepted_setting, unbuilt_setting_error

    engine = {k: v for k, v in kwargs.items() if k in EngineArgs.field_names()}
    extra = {k: v for k, v in kwargs.items() if k not in engine}
    extra.pop("disable_log_stats", None)
    max_logprobs = extra.pop("max_logprobs", None)
    if max_logprobs is not None and (not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool)
                                     or max_logprobs < -1):
        raise ValueError(f"max_logprobs must be an integer >= -1 (-1: no limit), got {max_logprobs!r}")
    unknown = sorted(k for k, v in extra.items() if not is_accepted_setting(k, v))
    if unknown:
        unbuilt = [why for why in (unbuilt_setting_error(k, extra[k]) for k in unknown) if why]
        raise TypeError(unbuilt[0] if unbuilt else f"unknown engine arguments: {', '.join(unknown)}")
    return engine, (None if max_logprobs == -1 else max_logprobs)


def _prompt_list(prompts: Any) -> list:
    """One prompt (text, token ids, a dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts and
                                             isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', a list of token "
                        f"ids, or a list of those; got {type(prompts).__name__}")
    return list(prompts)


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any):
        kwargs, self.max_logprobs = _offline_settings(kwargs)
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.config = self.engine_args.create_engine_config()
        require_one_engine(self.config, "the offline LLM")
        self.tokenizer = (None if self.config.model.skip_tokenizer_init else
                          load_tokenizer(self.config.model.tokenizer, self.config.model.trust_remote_code))
        self.engine = EngineCore(self.config)
        self.config = self.engine.config  # --max-model-len auto: fitted to the KV cache by now
        m = self.config.model
        self.frontend = Frontend(self.tokenizer, m.model, m.max_model_len, pooler=m.pooler,
                                 model_name=m.served_model_name, reasoning=self.config.reasoning,
                                 prompt_embeds_width=m.prompt_embeds_width,
                                 block_size=self.config.cache.block_size)
        self._ids = itertools.count()
        from voltllm.multimodal.processor import image_processor_for

        self._images = image_processor_for(self.config)  # None: a text-only engine
        # otlp_traces_endpoint: each finished request's span, sent by a background thread; what is left is sent when
        # this LLM is dropped or the interpreter exits
        self._tracer = make_request_tracer(self.config.otlp_traces, m.served_model_name)
        if self._tracer is not None:
            weakref.finalize(self, self._tracer.shutdown)
        self._call_processor: tuple[str, Any] = ("", None)  # the latest chat call's mm_processor_kwargs' processor

    def _processor_for_call(self, mm_processor_kwargs: Optional[dict]) -> Any:
        """The image / video processor of a chat call: the engine's, or with vLLM's per-call mm_processor_kwargs
        over its --mm-processor-kwargs key by key (the same checks; ValueError naming the argument). A text-only
        engine ignores them, as it ignores --mm-processor-kwargs."""
        if not mm_processor_kwargs or self._images is None:
            return self._images
        if not isinstance(mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs must be a dict, got {type(mm_processor_kwargs).__name__}")
        import json

        from voltllm.multimodal.processed_cache import ProcessedCache
        from voltllm.multimodal.processor import ImageProcessor
        from voltllm.multimodal.support import takes_videos

        merged = {**self.config.multimodal.mm_processor_kwargs, **mm_processor_kwargs}
        try:
            key = json.dumps(merged, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mm_processor_kwargs must hold JSON values: {e}") from None
        processor = self._call_processor[1] if self._call_processor[0] == key else None
        if processor is None:
            try:
                processor = ImageProcessor.from_model(self.config.model.model, self.config.model.hf_config, merged,
                                                      takes_videos(self.config), self.config.model.mmproj)
            except ConfigError as e:
                raise ValueError(str(e).replace("--mm-processor-kwargs", "mm_processor_kwargs")) from None
            processor.video_loading = self._images.video_loading
            # (its own processed cache, as the engine's keyed by the media's bytes, for these settings; only the
            # latest settings' processor is kept, so at most twice --mm-processor-cache-gb is held)
            processor.cache = ProcessedCache(int(self.config.multimodal.processor_cache_gb * 2**30))
            self._call_processor = (key, processor)
        return processor

    def _image_parts(self, urls: list, video_urls: list) -> dict:
        """normalize_messages' image / video keywords: collect their URLs into `urls` / `video_urls` when this
        engine takes them, else refuse such parts saying why (multimodal/support.py)."""
        if self._images is None:
            return {"refusal": image_input_refusal(self.config) or "this model takes no images"}
        return {"image_urls": urls, "video_urls": video_urls}

    def _with_multi_modal_data(self, prompt: dict) -> dict:
        """vLLM's {"prompt" or "prompt_token_ids", "multi_modal_data": {"image": ...}} as the prompt this engine takes:
        its ids with each image placeholder expanded and the images' MultiModalPrompt."""
        from PIL import Image

        if self._images is None:
            raise ValueError(image_input_refusal(self.config) or "this model takes no images")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            other = sorted(set(data)) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"multi_modal_data takes {{'image': PIL image(s)}} here, got {other} (videos: LLM.chat "
                             "with video_url parts)")
        images = data.get("image") or []
        images = images if isinstance(images, (list, tuple)) else [images]
        if not all(isinstance(im, Image.Image) for im in images):
            raise ValueError("multi_modal_data's images must be PIL images")
        if len(images) > self.config.multimodal.image_limit:
            raise ValueError(f"{len(images)} images in one prompt: this LLM takes at most "
                             f"{self.config.multimodal.image_limit} (limit_mm_per_prompt)")
        text, ids = self.frontend.tokenize({k: v for k, v in prompt.items() if k != "multi_modal_data"})
        ids, mm = self._images.prepare(ids, [im.convert("RGB") for im in images], (), self.tokenizer)
        return {"prompt_token_ids": ids, "multi_modal": mm, **({"prompt": text} if text is not None else {})}

    def _prepare_images(self, ids: list[int], urls: list[str], video_urls: list[str], processor: Any = None
                        ) -> tuple[list[int], Any]:
        processor = processor or self._images
        mm = self.config.multimodal
        for what, n, limit in (("images", len(urls), mm.image_limit), ("videos", len(video_urls), mm.video_limit)):
            if n > limit:
                raise ValueError(f"{n} {what} in one conversation: this LLM takes at most {limit} "
                                 "(limit_mm_per_prompt)")
        media = mm.media_settings()
        return processor.prepare(ids, [processor.load_image(url, media) for url in urls],
                                 [processor.load_video(url, media) for url in video_urls], self.tokenizer)

    def _require_runner(self, runner: str, method: str) -> None:
        """vLLM runs one runner per engine: generate / chat on a generative model, embed / encode on a pooling one."""
        if self.config.model.runner != runner:
            raise ValueError(f"LLM.{method}() is for {'pooling (embedding)' if runner == 'pooling' else 'generative'} "
                             f"models: this LLM runs a {self.config.model.runner} model; create it with "
                             f"runner={runner!r}")

    def get_metrics(self) -> list:
        """vLLM's LLM.get_metrics(): the engine's counters and gauges now (engine/metrics_snapshot.py: Counter,
        Gauge and Vector, under voltllm's and vLLM's names), speculative decoding's drafts and per-position
        acceptance included."""
        from voltllm.engine.metrics_snapshot import metrics_snapshot

        return metrics_snapshot(self.engine.stats())

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prefix (benchmarks measure prompts without earlier runs' hits). Between
        generate / chat calls no request holds blocks, so it succeeds there. reset_connector: the CPU tier's blocks
        too (kv_offloading_size), as vLLM's resets its KV connector's only then."""
        return self.engine.reset_prefix_cache(reset_connector)

    # vLLM's profiling (LLM(profiler_config={"profiler": "torch", "torch_profiler_dir": "/abs/dir"}))
    def start_profile(self) -> None:
        """The engine's profiler runs from here until stop_profile (profiling.ProfilerError: off, or running)."""
        self.engine.start_profile()

    def stop_profile(self) -> list[str]:
        """The trace files of the work since start_profile (docs/cli.md, --profiler-config)."""
        return self.engine.stop_profile()

    # vLLM's sleep mode (LLM(enable_sleep_mode=True)): free the GPU between uses
    def sleep(self, level: int = 1) -> None:
        """Level 1: the weights go to CPU memory and the KV cache is discarded; level 2: both are discarded (wake_up
        reloads the weights from the checkpoint). The prefix cache is forgotten. generate / chat refuse to run until
        wake_up."""
        self.engine.sleep(level)  # (between generate calls no request is in flight: none is aborted)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Restore what sleep freed: everything (None), or ["weights"] / ["kv_cache"] one at a time."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    # vLLM's LLMEngine LoRA management (llm.llm_engine.add_lora / remove_lora / list_loras), on the LLM itself
    def add_lora(self, lora_request: Any) -> bool:
        """Read and check a LoRARequest's adapter now (ValueError for one that cannot run), so that its first request
        does not (LLM(enable_lora=True))."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Drop the adapter of that lora_int_id from CPU memory and its GPU slot; a later request naming it reads it
        again from its path (with a fresh prefix cache) and drops it when it ends, unless add_lora takes it back.
        False: none was loaded."""
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters loaded (by a request or add_lora; not removed)."""
        return self.engine.list_loras()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (--generation-config)."""
        m = self.config.model
        return SamplingParams(**generation_defaults(m.model, m.generation_config, m.override_generation_config))

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: UseTqdm = True, lora_request: Any = None, priority: Optional[list[int]] = None
                 ) -> list[RequestOutput]:
        """vLLM's signature. A dict prompt may carry vLLM's "multi_modal_data" ({"image": a PIL image or a list of
        them}, one image placeholder of the model in its prompt per image, in order), or "multi_modal", a
        MultiModalPrompt (multimodal/inputs.py) whose images' placeholders its prompt_token_ids hold expanded
        (LLM.chat makes them from image_url parts).
        lora_request: a LoRARequest for every prompt, or a list of one (or None) per prompt
        (LLM(enable_lora=True)). priority: one integer per prompt, lower served first
        (LLM(scheduling_policy="priority"); under fcfs only 0s).
        use_tqdm: a progress bar on stderr over the sequences completed (True, vLLM's default), none (False), or one
        made by this tqdm-like factory (called with tqdm's keyword arguments)."""
        self._require_runner("generate", "generate")
        prompts = _prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        loras = _lora_requests(lora_request, len(prompts), self.config.lora is not None)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(priorities)} priorities: give one per prompt")
        for prio in priorities:  # (before any request is added)
            check_priority(prio, self.config.scheduler.policy)
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams (or a list of them), got "
                                f"{type(sp).__name__}")
            for field in ("logprobs", "prompt_logprobs"):
                asked = getattr(sp, field)
                if self.max_logprobs is not None and asked is not None and asked > self.max_logprobs:
                    raise ValueError(f"{field} {asked}: more than this LLM's max_logprobs ({self.max_logprobs})")
        order: list[str] = []
        try:
            for prompt, sp, prio, lora in zip(prompts, params, priorities, loras):
                rid = str(next(self._ids))
                if isinstance(prompt, dict) and "multi_modal_data" in prompt:
                    prompt = self._with_multi_modal_data(prompt)
                images = prompt.get("multi_modal") if isinstance(prompt, dict) else None
                if images is not None and (why := image_input_refusal(self.config)) is not None:
                    raise ValueError(why)
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # (vLLM's prompt dicts' key)
                if salt is not None and (not isinstance(salt, str) or not salt):
                    raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
                for req in self.frontend.make_requests(rid, prompt, sp, cache_salt=salt, priority=prio,
                                                       lora_request=lora, multi_modal=images):
                    self.engine.add_request(req)
                order.append(rid)
        except Exception:
            self._abort(order + [rid])
            raise
        return self._run(order, use_tqdm, sum(sp.n for sp in params))

    def encode(self, prompts: Union[PromptType, Sequence[PromptType]],
               pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, *,
               truncate_prompt_tokens: Optional[int] = None, use_tqdm: UseTqdm = True, lora_request: Any = None,
               pooling_task: Optional[str] = None, tokenization_kwargs: Optional[dict] = None
               ) -> list[PoolingRequestOutput]:
        """vLLM's: each prompt's pooled result (`.outputs.data`, a float32 tensor), for pooling models
        (runner="pooling"): an embedding model's pooled hidden state (task embed), a classifier's label values
        (classify / score). pooling_task None: the engine's task. truncate_prompt_tokens keeps each prompt's last
        k tokens (-1: the context length), over the params' own."""
        _refuse_lora(lora_request, "pooling models")
        self._require_runner("pooling", "encode")
        if pooling_task not in (None, "embed", "classify", "score"):
            raise ValueError(f"pooling_task {pooling_task!r}: embed, classify or score (token-level pooling is not "
                             "built)")
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs: not built here (prompts are tokenized with the model's defaults; "
                             "pass token ids to control them)")
        prompts = _prompt_list(prompts)
        params = (list(pooling_params) if isinstance(pooling_params, Sequence)
                  else [pooling_params or PoolingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} pooling params")
        for p in params:
            if not isinstance(p, PoolingParams):
                raise TypeError(f"pooling_params must be PoolingParams (or a list of them), got {type(p).__name__}")
            if p.extra_kwargs:  # (LLM.score applies them and passes params without them)
                raise ValueError(f"pooling_params extra_kwargs {', '.join(p.extra_kwargs)}: apply to LLM.score "
                                 "(each query / document cut before the pair is made), not to single prompts")
        if truncate_prompt_tokens is not None:
            params = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        if pooling_task is not None:
            for p in params:
                if p.task not in (None, pooling_task):
                    raise ValueError(f"pooling_params task {p.task!r} contradicts pooling_task {pooling_task!r}")
            params = [p.clone(task=pooling_task) for p in params]
        order: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(self.frontend.make_pooling_request(rid, prompt, p))
                order.append(rid)
        except Exception:
            self._abort(order + [rid])
            raise
        return self._run(order, use_tqdm, len(prompts))

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], *, truncate_prompt_tokens: Optional[int] = None,
              use_tqdm: UseTqdm = True, pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None,
              lora_request: Any = None, tokenization_kwargs: Optional[dict] = None) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding (`.outputs.embedding`, a list of floats), for pooling models."""
        self._require_runner("pooling", "embed")
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="embed", tokenization_kwargs=tokenization_kwargs)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], *, use_tqdm: UseTqdm = True,
                 pooling_params: Union[PoolingParams, Sequence[PoolingParams], None] = None, lora_request: Any = None,
                 tokenization_kwargs: Optional[dict] = None) -> list[ClassificationRequestOutput]:
        """vLLM's: each prompt's class probabilities (`.outputs.probs`), for classifiers (a ...ForSequenceClassification
        model, or a causal LM converted by --hf-overrides classifier_from_token)."""
        self._require_classifier("classify")
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify", tokenization_kwargs=tokenization_kwargs)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: Union[str, Sequence[str]], data_2: Union[str, Sequence[str]], /, *,
              truncate_prompt_tokens: Optional[int] = None, use_tqdm: UseTqdm = True,
              pooling_params: Optional[PoolingParams] = None, lora_request: Any = None,
              tokenization_kwargs: Optional[dict] = None) -> list[ScoringRequestOutput]:
        """vLLM's: the score of each (data_1, data_2) pair (1:1, 1:N or N:N), `.outputs.score`, for pooling models.
        A one-label classifier (a cross-encoder such as a reranker: Qwen3-Reranker through --hf-overrides) reads each
        pair as one prompt, its score the classifier's sigmoid output; the caller writes the model's prompt template
        into the texts. An embedding model (a bi-encoder) embeds each text as LLM.embed does (a single data_1 once),
        a pair's score the cosine similarity of its two embeddings. vLLM's pooling_params
        extra_kwargs={"max_tokens_per_query": N, "max_tokens_per_doc": M} cut each data_1 / data_2 text to its
        first N / M tokens (special tokens not counted; 0: no cut; each below max_model_len) before the pair prompt
        is made and before truncate_prompt_tokens cuts it, as the server's /score and /rerank fields do."""
        from voltllm.pooling.scoring import (check_token_limit, cosine_scores, cut_texts, pair_token_ids,
                                             score_inputs)

        self._require_runner("pooling", "score")
        classifier = self.config.model.pooler.classifier
        if classifier is not None and classifier.num_labels != 1:
            raise ValueError(f"LLM.score() needs a one-label classifier; this one has {classifier.num_labels} labels "
                             "(use LLM.classify)")
        if self.tokenizer is None:
            raise ValueError("LLM.score() tokenizes its texts: it needs the tokenizer (skip_tokenizer_init=False)")
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"pooling_params must be PoolingParams, got {type(pooling_params).__name__}")
        firsts, seconds = score_inputs(data_1, data_2, ("data_1", "data_2"))
        if pooling_params is not None and pooling_params.extra_kwargs:
            max_len = self.config.model.max_model_len
            limits = [check_token_limit(name, value, max_len)
                      for name, value in zip(("max_tokens_per_query", "max_tokens_per_doc"),
                                             pooling_params.token_limits())]
            firsts, seconds = cut_texts(self.tokenizer, firsts, seconds, *limits)
            pooling_params = pooling_params.clone(extra_kwargs=None)
        if classifier is None:
            outs = self.encode(firsts + seconds, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed",
                               tokenization_kwargs=tokenization_kwargs)
            scored = cosine_scores(outs[:len(firsts)], outs[len(firsts):], getattr(self.tokenizer, "pad_token_id",
                                                                                    None))
            return [ScoringRequestOutput.from_base(o) for o in scored]
        if len(firsts) == 1:  # (1:N: the one data_1 with each data_2)
            firsts = firsts * len(seconds)
        prompts = [{"prompt_token_ids": pair_token_ids(self.tokenizer, classifier, a, b), "prompt": a + b}
                   for a, b in zip(firsts, seconds)]
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="score", tokenization_kwargs=tokenization_kwargs)
        return [ScoringRequestOutput.from_base(o) for o in outs]

    def _require_classifier(self, method: str) -> Any:
        self._require_runner("pooling", method)
        classifier = self.config.model.pooler.classifier
        if classifier is None:
            raise ValueError(f"LLM.{method}() is for classifiers (a ...ForSequenceClassification architecture, or "
                             "--convert classify); this LLM runs an embedding model")
        return classifier

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort_requests(self.frontend.child_ids(rid))
            self.frontend.forget(rid)
        self.engine.step()  # flush abort notices

    def _run(self, order: list[str], use_tqdm: UseTqdm = False, num_sequences: int = 0) -> list:
        """The finished outputs of `order` (RequestOutputs; PoolingRequestOutputs for pooling requests)."""
        final: dict[str, Any] = {}
        progress: Optional[ProgressBar] = None
        try:
            if use_tqdm:  # (a factory that fails aborts the requests, as any error here)
                progress = ProgressBar(use_tqdm, num_sequences)
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
                        if self._tracer is not None:
                            self._tracer.on_finished(final[st.request_id], traced_request(
                                st.params, len(st.prompt_ids), self.frontend.max_model_len))
                        if progress is not None:
                            progress.finished(final[st.request_id])
        except BaseException:
            self._abort([rid for rid in order if rid not in final])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [final[rid] for rid in order]

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams, lora_request: Any = None,
                    use_tqdm: UseTqdm = False, concurrency_limit: Optional[int] = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): per prompt the best params.beam_width sequences, best first;
        each sequence's `tokens` are the prompt's and the generated ones (a final EOS included), its `text` their
        decoded text (the EOS's only with include_stop_str_in_output). Each step runs every live beam of the prompts
        batched together (concurrency_limit of them at a time; None: all) as one-token requests; the prefix cache
        keeps each beam's earlier tokens. use_tqdm: a bar over the steps (tqdm, or this tqdm-like factory).
        lora_request: as generate's (one for every prompt, or one per prompt); every step request of a prompt's
        search runs with its adapter."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompts = _prompt_list(prompts)
        loras = _lora_requests(lora_request, len(prompts), self.config.lora is not None)
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        num_logprobs = min(params.num_candidates, self.engine.vocab_size)
        if self.max_logprobs is not None and num_logprobs > self.max_logprobs:
            raise ValueError(f"beam_width {params.beam_width}: beam search asks each step for 2 x beam_width = "
                             f"{num_logprobs} logprobs, more than this LLM's max_logprobs ({self.max_logprobs})")
        searches = [BeamSearch(self._beam_prompt(p, params), params, self.frontend.eos_ids) for p in prompts]
        step_params = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=num_logprobs,
                                     detokenize=False)
        limit = concurrency_limit or max(len(searches), 1)
        bar = None
        if use_tqdm:
            factory = use_tqdm if callable(use_tqdm) else tqdm
            bar = factory(total=params.max_tokens * -(-len(searches) // limit), desc="Beam search", unit="step")
        try:
            for start in range(0, len(searches), limit):
                batch = searches[start:start + limit]
                batch_loras = loras[start:start + limit]
                while True:
                    active = [(s, lora) for s, lora in zip(batch, batch_loras) if not s.done]
                    if not active:
                        break
                    step_loras = [lora for s, lora in active for _ in s.live]
                    outs = self.generate([{"prompt_token_ids": b.tokens} for s, _ in active for b in s.live],
                                         step_params, use_tqdm=False,
                                         lora_request=step_loras if any(step_loras) else None)
                    at = 0
                    for s, _ in active:
                        width = len(s.live)
                        s.advance([o.outputs[0].logprobs[0] for o in outs[at:at + width]])
                        at += width
                    if bar is not None:
                        bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [BeamSearchOutput([self._finished_beam(s, b) for b in s.best()]) for s in searches]

    def _beam_prompt(self, prompt: PromptType, params: BeamSearchParams) -> list[int]:
        _, ids = self.frontend.tokenize(prompt)
        max_len = self.config.model.max_model_len
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + params.max_tokens > max_len:
            raise ValueError(f"this model's maximum context length is {max_len} tokens; the beam search asks for "
                             f"{len(ids) + params.max_tokens} ({len(ids)} in the prompt + {params.max_tokens} "
                             "max_tokens); lower max_tokens or shorten the prompt")
        return ids

    def _finished_beam(self, search: BeamSearch, beam: BeamSearchSequence) -> BeamSearchSequence:
        """vLLM's offline text: the decoded prompt and output (special tokens kept); a final EOS's text only with
        include_stop_str_in_output."""
        shown = beam.tokens
        if beam.finish_reason == "stop" and not search.params.include_stop_str_in_output:
            shown = shown[:-1]
        if self.tokenizer is not None:
            beam.text = self.tokenizer.decode(shown)
        return beam

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: UseTqdm = True, lora_request: Any = None, chat_template: Optional[str] = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Optional[list] = None,
             chat_template_kwargs: Optional[dict] = None, mm_processor_kwargs: Optional[dict] = None
             ) -> list[RequestOutput]:
        """vLLM's signature (keyword use). Content reaches the template as the server's
        --chat-template-content-format does it (chat_content_format.py): one string ("string"), a list of OpenAI
        text parts ("openai"), or what the template loops over ("auto"); continue_final_message continues the last
        assistant message. mm_processor_kwargs: this call's image / video processor settings, over the engine's
        mm_processor_kwargs (--mm-processor-kwargs) key by key."""
        from voltllm.entrypoints.chat_content_format import CONTENT_FORMATS, resolve_content_format
        from voltllm.entrypoints.openai.errors import OpenAIError
        from voltllm.entrypoints.openai.serving_common import normalize_messages

        self._require_runner("generate", "chat")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r}: expected one of "
                             f"{', '.join(CONTENT_FORMATS)}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        _lora_requests(lora_request, len(conversations), self.config.lora is not None)  # (before any templating)
        template = chat_template or self.config.model.chat_template
        content_format = resolve_content_format(chat_template_content_format, self.tokenizer, template, tools)
        processor = self._processor_for_call(mm_processor_kwargs)  # (before any templating: a bad key fails first)
        kwargs = dict(chat_template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompts = []
        for conv in conversations:
            urls: list[str] = []
            video_urls: list[str] = []
            try:
                conv = normalize_messages(conv, content_format, **self._image_parts(urls, video_urls))
            except OpenAIError as e:
                raise ValueError(e.message) from None
            if continue_final_message and conv[-1].get("role") != "assistant":
                raise ValueError("continue_final_message needs the last message to be from the assistant")
            text = apply_chat_template(self.tokenizer, conv, template, add_generation_prompt, tools, **kwargs)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompt = {"prompt": text, "prompt_token_ids": ids}
            if urls or video_urls:  # as the server's chat path: media read, processed, placeholders expanded
                prompt["prompt_token_ids"], prompt["multi_modal"] = self._prepare_images(ids, urls, video_urls,
                                                                                          processor)
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)
