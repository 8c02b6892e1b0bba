"""EngineCore: add/abort requests; step() = schedule -> execute -> update. No tokenizer, no text.

It runs in the caller's process (offline LLM, tests) or in its own process behind the API server.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from voltllm.cache.kv_manager import KVCacheManager
from voltllm.config import EngineConfig
from voltllm.engine.reasoning_state import ReasoningStates, wants_state
from voltllm.engine.request import Request
from voltllm.engine.request_checks import InvalidRequestError, check_priority, check_vocab, runner_mismatch
from voltllm.engine.scheduler import Scheduler, SchedulerOutput
from voltllm.engine.types import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from voltllm.structured.matchers import GrammarMatchers
from voltllm.worker.runner import ModelRunner, StepHandle

logger = logging.getLogger("voltllm")

# structured outputs: how long an in-process step() waits for a grammar compile when nothing else can run (the engine
# process waits on its input socket and the compile's wake fd instead: grammar_wait_s = 0 there)
GRAMMAR_WAIT_S = 0.05


def check_torch_runs_on(config: EngineConfig) -> None:
    """Refuse a GPU the installed torch has no kernels for (e.g. a V100 under a CUDA 12.8 build) before anything is
    loaded: its first kernel would fail deep in the model load with "no kernel image is available"."""
    if config.device.device.type != "cuda":
        return
    from voltllm.config import ConfigError
    from voltllm.distributed.group import rank_device
    from voltllm.platform import detect, torch_arch_error

    for rank in range(config.parallel.world_size):  # (every card of the group: they may differ)
        if err := torch_arch_error(detect(rank_device(config.device.device, rank), config.device.compat)):
            raise ConfigError(err)


class EngineCore:
    def __init__(self, config: EngineConfig, model: Optional[torch.nn.Module] = None):
        check_torch_runs_on(config)
        self.config = config
        self.tp_workers = None  # rank 0's handle on the other tensor-parallel ranks (voltllm.distributed)
        # --kv-events-config: the events the block pool records (cache/kv_events.py), published once per step
        self.kv_events = None
        self.kv_event_publisher = None
        if config.parallel.world_size > 1:
            if model is not None:
                raise ValueError("a prebuilt model cannot be sharded for tensor or pipeline parallelism")
            from voltllm.distributed.executor import TPWorkers

            self.tp_workers = TPWorkers(config)
        try:
            self._start(config, model)
        except BaseException as e:
            err = self._tp_failure(e)
            self.shutdown()
            if err is not None:
                raise err from e
            raise

    def _start(self, config: EngineConfig, model: Optional[torch.nn.Module]) -> None:
        # the other TP ranks run the same steps that hold collectives, in this order (distributed/worker.py)
        torch.manual_seed(config.parallel.global_seed(config.model.seed))
        if config.kv_events is not None:  # (its sockets first: a port in use fails before the weights load)
            self._start_kv_event_publisher(config)
        tp = self.tp_workers
        if tp is not None:
            from dataclasses import replace

            from voltllm.distributed.group import rank_device

            config = replace(config, device=replace(config.device, device=rank_device(config.device.device, 0)))
            self.config = config
        self.runner = ModelRunner(config, model, tp=tp.group if tp else None, send_step=tp.send_step if tp else None,
                                  send_message=tp.send if tp else None)
        num_blocks = self.runner.initialize_kv_cache()
        config = self.config = self.runner.config  # --max-model-len auto: its length is known only now
        prefix = config.cache.enable_prefix_caching
        snapshots = self.runner.state_snapshots  # hybrid models, --mamba-cache-mode align
        if prefix and self.runner.is_hybrid and snapshots is None:
            prefix = False
            logger.warning("prefix caching is off for this hybrid model: it resumes from recurrent-state snapshots "
                           "(--mamba-cache-mode align), and %s; it applies to attention-only models",
                           "--mamba-cache-mode none keeps none" if config.cache.mamba_cache_mode == "none"
                           else "there is no memory for them")
        offload = self.runner.kv_offload  # --kv-offloading-size: the CPU tier's host slots
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, prefix,
                                 cpu_blocks=offload.num_slots if offload is not None else 0,
                                 hash_algo=config.cache.prefix_caching_hash_algo)
        if prefix and snapshots is not None:
            snapshots.hash_algo = self.kv.hash_algo
            self.kv.state_prefix = snapshots
        if self.kv_event_publisher is not None:
            from voltllm.cache.kv_events import KVEventRecorder

            if not prefix:
                logger.warning("KV cache events: prefix caching is off, so no block enters the cache and no event is "
                               "published")
            self.kv_events = KVEventRecorder(config.cache.block_size)
            self.kv.record_events(self.kv_events)
        if config.cache.kv_cache_metrics_sample:  # --kv-cache-metrics
            from voltllm.cache.residency import BlockResidency

            self.kv.pool.residency = BlockResidency(self.kv.pool.num_blocks, config.cache.kv_cache_metrics_sample,
                                                    config.model.seed)
        rings = getattr(self.runner.draft, "rings", None)  # (a DFlash drafter with sliding-window layers)
        if rings is not None:
            self.kv.recompute_tail = rings.recompute_tail
        self.scheduler = Scheduler(config.scheduler, self.kv, config.speculative,
                                   max_loras=config.lora.max_loras if config.lora is not None else 0)
        self.runner.tune_decode_gemms()
        self.runner.warm_up_mixed_step()  # (before the route counters: it is no request's work)
        from voltllm.acceleration import instrument

        instrument(self.runner)  # per-route call counters for the acceleration report (graph replays too)
        self.runner.capture_cuda_graphs()
        if tp is not None:
            tp.wait_ready(num_blocks)
        self.vocab_size = int(config.model.hf_config.get_text_config().vocab_size)
        # structured outputs: matchers over the logits' width (the tokenizer is loaded on the first constrained request,
        # in the grammar compile thread)
        self.grammars = GrammarMatchers(None if config.model.skip_tokenizer_init else self._engine_tokenizer,
                                        self.vocab_size, config.json_any_whitespace)
        self.scheduler.grammars = self.grammars
        self.reasoning = ReasoningStates()  # thinking budgets, grammars after the reasoning
        self.scheduler.reasoning = self.reasoning
        self.grammar_wait_s = GRAMMAR_WAIT_S
        self._request_errors: list[tuple[str, str]] = []  # (request id, message): requests failed after add_request
        self.max_model_len = config.model.max_model_len
        # async scheduling: step N+1 is scheduled and launched before step N's tokens reach the host
        self.async_scheduling = config.scheduler.async_scheduling
        self._inflight: Optional[tuple[SchedulerOutput, StepHandle]] = None
        self.sleep_state = None  # --enable-sleep-mode: worker.sleep_mode.RunnerSleep (a group: distributed.sleep's)
        from voltllm.profiling import EngineProfiler

        self.perf = None  # --enable-mfu-metrics: each step's estimated FLOPs / bytes per GPU (perf_metrics.py)
        if config.enable_mfu_metrics:
            from voltllm.perf_metrics import step_perf_for

            self.perf = step_perf_for(config, self.runner)
        # (--profiler-config; under TP / PP every rank profiles itself, rank 0 telling the workers when)
        self.profiler = EngineProfiler(config.profiler, config.parallel.data_parallel_rank,
                                       0 if tp is not None else None)
        if config.enable_sleep_mode:
            from voltllm.worker.sleep_mode import RunnerSleep

            self.sleep_state = RunnerSleep(self.runner)
            if tp is not None:  # every rank sleeps and wakes its own memory
                from voltllm.distributed.sleep import GroupSleep

                self.sleep_state = GroupSleep(self.sleep_state, tp)

    def _start_kv_event_publisher(self, config: EngineConfig) -> None:
        import weakref

        from voltllm.engine.kv_event_publisher import KVEventPublisher

        publisher = KVEventPublisher(config.kv_events, config.parallel.data_parallel_rank)
        self.kv_event_publisher = publisher
        # an engine dropped without shutdown() (an offline LLM going out of scope) still closes its sockets
        weakref.finalize(self, publisher.close)

    def _publish_kv_events(self) -> None:
        events = self.kv_events.take()
        if events:
            self.kv_event_publisher.publish(events)

    def start_profile(self) -> None:
        """vLLM's: the profiler runs from here until stop_profile (profiling.ProfilerError: off, or running), on
        every rank of a group."""
        from voltllm.profiling import ProfilerError

        self.profiler.start(self.runner.device)
        errors, _ = self._profile_workers("start")
        if errors:  # (a worker could not start: none runs, so start and stop keep alternating everywhere)
            self.profiler.stop()
            self._profile_workers("stop")
            raise ProfilerError(errors[0])

    def stop_profile(self) -> list[str]:
        """The steps since start_profile into the trace files it returns, every rank's (profiling.ProfilerError: not
        running)."""
        from voltllm.profiling import ProfilerError

        files = self.profiler.stop()
        errors, theirs = self._profile_workers("stop")
        if errors:
            raise ProfilerError("; ".join(errors) + (f" (written: {', '.join(files + theirs)})" if files else ""))
        return files + theirs

    def _profile_workers(self, what: str) -> tuple[list[str], list[str]]:
        """("profile", what) to every worker: (their errors, "rank r: ..."; the files they wrote)."""
        if self.tp_workers is None:
            return [], []
        self.tp_workers.send(("profile", what))
        answers = self.tp_workers.collect("profile")
        errors = [f"rank {r}: {a[0]}" for r, a in enumerate(answers, 1) if a[0] is not None]
        return errors, [f for a in answers for f in a[1]]

    def _engine_tokenizer(self):
        mc = self.config.model
        from voltllm.model.loader import load_tokenizer

        return load_tokenizer(mc.tokenizer, mc.trust_remote_code)

    def validate(self, req: EngineCoreRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        pooling = req.pooling_params is not None
        if pooling != (self.config.model.runner == "pooling"):  # one runner per engine, as vLLM's
            raise InvalidRequestError(runner_mismatch(self.config.model.runner))
        if pooling and n > self.max_model_len:  # (an embedding needs no room for a generated token)
            raise InvalidRequestError(
                f"the input has {n} tokens, more than the maximum context length ({self.max_model_len}); shorten it "
                "or raise --max-model-len")
        if not pooling and n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, at or over the maximum context length ({self.max_model_len}); "
                "shorten it or raise --max-model-len")
        sp = req.sampling_params
        # (prompt + max_tokens past the context: generation stops there with finish_reason "length", as vLLM's
        # engine does; the HTTP API refuses such a request first, as vLLM's server does: AsyncLLM.validate)
        check_vocab(req.prompt_token_ids, sp, self.vocab_size)
        check_priority(req.priority, self.scheduler.config.policy)
        if req.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already running")

    def add_request(self, req: EngineCoreRequest) -> None:
        if self.is_sleeping():
            raise InvalidRequestError("the engine is sleeping (--enable-sleep-mode): wake it up (LLM.wake_up(), "
                                      "POST /wake_up) before sending requests")
        self.validate(req)
        lora_key = self._register_lora(req.lora_request) if req.lora_request is not None else None
        r = Request(req, self.max_model_len)
        r.lora_key = lora_key
        sp = r.sampling_params
        if sp.seed is not None:
            r.generator = torch.Generator(device=self.runner.device).manual_seed(sp.seed)
        ready = True
        if sp.structured_outputs is not None:
            ready = self.grammars.attach(r)  # False: its grammar compiles in the background; it waits meanwhile
        self.reasoning.attach(r)
        self.scheduler.add_request(r, ready)

    def _register_lora(self, lora_request):
        """The key of the request's adapter, read and checked on its first use (InvalidRequestError: a 400 naming
        it)."""
        from voltllm.lora.adapter import LoRAAdapterError

        try:
            return self._lora_manager().register(lora_request, self._live_lora_keys)
        except LoRAAdapterError as e:
            raise InvalidRequestError(str(e), "model") from None

    def _lora_manager(self):
        if self.runner.lora is None:
            raise InvalidRequestError("a LoRA adapter was asked for, but LoRA is not enabled (--enable-lora)", "model")
        return self.runner.lora

    def _live_lora_keys(self) -> set:
        return {r.lora_key for r in self.scheduler.requests.values() if r.lora_key}

    def _drop_retired_loras(self) -> None:
        """Removed adapters whose last requests ended leave CPU memory and their GPU slot."""
        if self.runner.lora is not None and self.runner.lora.retiring:
            self.runner.lora.drop_retired(self._live_lora_keys)

    # vLLM's LoRA management (LLMEngine.add_lora / remove_lora / list_loras; the server's load / unload routes)
    def add_lora(self, lora_request) -> bool:
        """Read and check the adapter now (LoRAAdapterError, a ValueError, for one that cannot run), so that its
        first request does not; a removed lora_int_id is taken again."""
        self._lora_manager().add(lora_request, self._live_lora_keys)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Remove the adapter(s) of that id: requests running with it finish with it, then it leaves CPU memory and
        its GPU slot; a later request naming it reads it again (new weights at its path included) and drops it when
        it ends, unless add_lora takes it back. False: none was loaded."""
        return self._lora_manager().remove(lora_int_id, self._live_lora_keys)

    def list_loras(self) -> set[int]:
        """The lora_int_ids of the adapters loaded (read by a request or add_lora, not removed)."""
        return self._lora_manager().ids()

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self._drop_retired_loras()

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Forget every cached prefix, and a hybrid's state snapshots (vLLM's): later requests recompute their
        prompts from the start. False, changing nothing, while requests hold KV blocks. reset_connector (vLLM's):
        the CPU tier's blocks too (--kv-offloading-size); without it they stay, as vLLM keeps its connector's."""
        if self.has_unfinished_requests() or not self.kv.pool.reset_prefix_cache():
            return False
        if self.kv.state_prefix is not None:
            self.kv.state_prefix.reset()
        if reset_connector:
            self.kv.reset_cpu_tier()
        if self.kv_events is not None:  # (outside a step: published now)
            if self.kv.cpu is not None and not reset_connector:
                from voltllm.cache.kv_events import MEDIUM_CPU

                # a consumer may read AllBlocksCleared as every medium forgotten: the CPU tier's blocks, kept, are
                # told again after it
                for h in self.kv.cpu.hashes():
                    self.kv_events.stored_elsewhere(h, MEDIUM_CPU)
            self._publish_kv_events()
        return True

    # vLLM's sleep mode (--enable-sleep-mode; worker/sleep_mode.py)
    def _sleep_mode(self):
        if self.sleep_state is None:
            raise ValueError("sleep mode is off: create the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        return self.sleep_state

    def sleep(self, level: int = 1) -> list[EngineCoreOutput]:
        """Free the device memory of the weights (level 1: kept in CPU memory; level 2: discarded, reloaded from the
        checkpoint at wake-up) and of the KV cache (discarded). Requests still unfinished are aborted first (vLLM's
        default "abort" mode): the returned outputs are the step in flight's and their abort notices, which the
        caller delivers. The prefix cache is forgotten (its blocks' contents go)."""
        state = self._sleep_mode()
        state.check(level)
        if state.is_sleeping:
            state.sleep(level)  # (a warning: already asleep)
            return []
        outputs: list[EngineCoreOutput] = []
        if self._inflight is not None:
            outputs += self._finish_inflight()
        unfinished = list(self.scheduler.requests)
        if unfinished:
            logger.info("sleep: aborting %d unfinished request(s)", len(unfinished))
            self.abort_requests(unfinished)
        outputs += self.step()  # (schedules nothing: flushes the abort notices, releases the requests' runner state)
        if self.has_unfinished_requests() or not self.reset_prefix_cache(reset_connector=self.kv.cpu is not None):
            raise RuntimeError("sleep: requests still hold KV blocks after they were aborted")
        state.sleep(level)
        return outputs

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Restore what sleep() freed: tags None (all), or a list of "weights" and / or "kv_cache" (vLLM's, e.g. the
        weights first to update them, then the KV cache). The engine runs requests again once both are awake."""
        from voltllm.worker.sleep_mode import check_tags

        check_tags(tags)
        self._sleep_mode().wake_up(tags)

    def is_sleeping(self) -> bool:
        """True from sleep() until every tag is awake again."""
        return self.sleep_state is not None and self.sleep_state.is_sleeping

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def waiting_only_for_grammars(self) -> bool:
        """Nothing can run until a grammar compile ends: the only unfinished requests are waiting for theirs."""
        s = self.scheduler
        return bool(s.waiting_for_grammar) and not s.waiting and not s.running and self._inflight is None

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, message) of the requests that failed since the last call, after add_request had taken them
        (a grammar that did not compile in the background): each is gone from the engine and sent no output; the
        caller reports the error to its client, as it does for an InvalidRequestError from add_request."""
        errors, self._request_errors = self._request_errors, []
        return errors

    def _samples_constrained(self, sched: SchedulerOutput) -> bool:
        """Whether a request that samples in this step may get an allowed-token row, while the step in flight's
        tokens are not known: a grammar's, or a thinking budget's forced end (one near its budget only)."""
        if not (self.grammars.live or self.reasoning.live):
            return False
        for s in sched.scheduled:
            if not s.samples:
                continue
            r = s.request
            st = r.reasoning
            # (num_pending counts this step's own token too)
            if st.may_constrain(r.num_pending - 1) if st is not None else r.grammar is not None:
                return True
        return False

    def _admit_compiled(self) -> None:
        """Requests whose grammar compile ended join the queue, or fail with its error."""
        ready, failed = self.grammars.poll()
        for r in ready:
            self.scheduler.grammar_ready(r)
        for r, message in failed:
            self.scheduler.drop(r)
            self._request_errors.append((r.request_id, message))

    def _may_draft(self) -> bool:
        """Whether this step's requests may take drafts (speculation on, and its dynamic schedule gives the running
        batch's size some). Async scheduling with speculation (host drafts and a schedule with K = 0 somewhere:
        EngineArgs) finishes the step in flight before scheduling such a step, so the drafts follow every token;
        at K = 0 steps overlap as without speculation."""
        spec = self.scheduler.spec
        return spec is not None and spec.drafts_for_batch(len(self.scheduler.running)) > 0

    def _finish_inflight(self) -> list[EngineCoreOutput]:
        sched, handle = self._inflight
        self._inflight = None
        return self.scheduler.update(sched, self.runner.collect(handle))

    def _tp_failure(self, e: BaseException):
        """Under TP, the worker's own error when a worker's failure caused `e` (a collective whose peer died, a
        closed pipe); None otherwise."""
        if self.tp_workers is None or isinstance(e, (InvalidRequestError, KeyboardInterrupt)):
            return None
        err = self.tp_workers.failure()
        return None if err is e else err

    def shutdown(self) -> None:
        """Stop the grammar compile thread and the tensor-parallel workers. The engine cannot step afterwards."""
        grammars = getattr(self, "grammars", None)
        if grammars is not None:
            grammars.shutdown()
        profiler = getattr(self, "profiler", None)
        if profiler is not None and profiler.running:  # (what it recorded is written, not lost: every rank's)
            try:
                self.stop_profile()
            except Exception as e:  # noqa: BLE001 -- shutting down anyway
                logger.warning("the profiler's trace was not written at shutdown: %s", e)
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is not None:
            if self.kv_events is not None:
                self._publish_kv_events()
            publisher.close()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step that completed."""
        if self.tp_workers is None:
            return self._step()
        try:
            outputs = self._step()
            self.tp_workers.check()  # a worker that died mid-step (CUDA: the group was aborted) fails the step
            return outputs
        except Exception as e:
            err = self._tp_failure(e)
            if err is not None:
                raise err from e
            self.tp_workers.abandon(e)  # rank 0's own error: the workers may be waiting inside the step
            raise

    def _step(self) -> list[EngineCoreOutput]:
        """Schedule and launch one step; return the outputs of the step that completed.

        Synchronous mode returns this step's outputs. Async mode launches step N+1 before waiting
        for step N (whose tokens the GPU feeds to N+1 directly), so the CPU's scheduling and input
        preparation overlap the GPU's forward.

        Structured outputs: requests whose grammar finished compiling join the queue first; when nothing else can
        run, the step waits up to grammar_wait_s for a compile (rather than return at once, for a caller that steps
        in a loop).
        """
        if self.grammars.compiling:
            self._admit_compiled()
            if self.grammar_wait_s > 0 and self.waiting_only_for_grammars():
                self.grammars.wait(self.grammar_wait_s)
                self._admit_compiled()
        outputs: list[EngineCoreOutput] = []
        if self._inflight is not None and self._may_draft():
            outputs += self._finish_inflight()  # (drafts are proposed from the host's tokens)
        sched = self.scheduler.schedule()
        if self.perf is not None and not sched.empty:
            self.perf.add(sched.scheduled)
        if self._inflight is not None and (not sched.empty and self.runner.needs_host_history(sched)):
            outputs += self._finish_inflight()
        handle = None
        if sched.empty:
            self.runner.release(sched.released_ids)
        elif self._inflight is not None and self._samples_constrained(sched):
            # structured outputs and thinking budgets under async scheduling: the masks need the step in flight's
            # tokens, the forward does not (its pending input ids are fed on the device). Launch the forward, then
            # wait for the step in flight, advance the matchers and reasoning states and fill the masks while the
            # device runs it, then launch the sampling.
            launched = self.runner.launch_forward(sched)
            outputs += self._finish_inflight()
            sched.grammar_masks = self.grammars.masks(sched.scheduled)
            handle = self.runner.launch_sampling(launched)
        elif self._inflight is None and (self.grammars.live or self.reasoning.live):
            # (nothing in flight: every constrained request's previous token is known; with a step in flight, no
            # request that samples here can be constrained: _samples_constrained)
            sched.grammar_masks = self.grammars.masks(sched.scheduled)
        if handle is None and not sched.empty:
            handle = self.runner.execute_async(sched)
        if self._inflight is not None:
            outputs += self._finish_inflight()
        if handle is not None:
            self._inflight = (sched, handle)
            # (a speculative step's tokens are verified on the host before the next step is scheduled)
            if not self.async_scheduling or (self.scheduler.spec is not None
                                             and any(s.spec_tokens for s in sched.scheduled)):
                outputs += self._finish_inflight()
        outputs += self.scheduler.take_abort_notices()
        self._drop_retired_loras()
        if self.kv_events is not None:
            self._publish_kv_events()
        if handle is not None:  # (--profiler-config's delay / max iterations count the steps that ran a forward)
            self.profiler.step()
        return outputs

    def stats(self) -> SchedulerStats:
        s = self.scheduler.stats()
        if self.perf is not None:
            s.extra.update(self.perf.totals())
        return s

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.is_sleeping():
            assert not self.has_unfinished_requests(), "a sleeping engine holds requests"
            assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks and not self.kv.pool.cached, \
                "a sleeping engine's KV blocks are in use or cached"
        offload = self.runner.kv_offload
        assert (self.kv.cpu.num_slots if self.kv.cpu is not None else 0) == (
            offload.num_slots if offload is not None else 0), "the CPU tier's index and host slots differ"
        g, s = self.grammars, self.scheduler
        leaked = (set(g.live) | set(g.waiting)) - set(s.requests)
        assert not leaked, f"grammar state of finished requests: {sorted(leaked)}"
        assert set(g.waiting) == set(s.waiting_for_grammar), \
            f"requests waiting for a grammar: {sorted(g.waiting)} (matchers) vs {sorted(s.waiting_for_grammar)}"
        orphans = set(g.compiling) - {key for key, _ in g.waiting.values()}
        assert not orphans, f"grammar compiles nobody waits for: {sorted(k[0] for k in orphans)}"
        for rid, r in s.requests.items():
            if r.sampling_params.structured_outputs is not None and rid not in g.waiting:
                assert r.grammar is not None and g.live.get(rid) is r.grammar, f"request {rid} has no matcher"
            if wants_state(r.sampling_params):
                assert r.reasoning is not None and self.reasoning.live.get(rid) is r.reasoning, \
                    f"request {rid} has no reasoning state"
        leaked = set(self.reasoning.live) - set(s.requests)
        assert not leaked, f"reasoning state of finished requests: {sorted(leaked)}"
        if self.runner.lora is not None:
            self.runner.lora.check_integrity(self._live_lora_keys())
        if self.runner.state_cache is not None:
            self.runner.state_cache.check_integrity()
        if self.runner.state_snapshots is not None:
            self.runner.state_snapshots.check_integrity(set(self.scheduler.requests))
            assert (self.runner.state_snapshots.host_index is not None) == (self.kv.cpu is not None), \
                "a CPU tier without host slots for the hybrid's snapshots, or host slots without a CPU tier"

