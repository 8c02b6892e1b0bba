"""voltllm: an OpenAI-compatible LLM inference engine, fast on GPUs without native BF16/FP8 (V100)."""
__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import voltllm` stays cheap for the CLI
    if name == "LLM":
        from voltllm.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from voltllm.sampling.params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from voltllm.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "PoolingParams":
        from voltllm.pooling.params import PoolingParams

        return PoolingParams
    if name == "LoRARequest":
        from voltllm.lora.request import LoRARequest

        return LoRARequest
    if name == "RepetitionDetectionParams":
        from voltllm.sampling.repetition import RepetitionDetectionParams

        return RepetitionDetectionParams
    if name == "StructuredOutputsParams":
        from voltllm.sampling.structured import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(name)


__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "PoolingParams", "RepetitionDetectionParams", "SamplingParams",
           "StructuredOutputsParams", "__version__"]
