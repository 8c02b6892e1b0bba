"""vLLM's --compilation-config (-cc), -O / --optimization-level and --cuda-graph-sizes: parsed, mapped onto the CUDA
graphs voltllm has (DeviceConfig.cuda_graphs), refused by name where they ask for what is not built; and the decode
graph batch sizes the runner would capture (the graphs themselves need a GPU)."""
from __future__ import annotations

import weakref

import pytest

from flag_parsing import parse_engine_flags as _parse
from tiny_models import make_model
from voltllm.config import ConfigError, EngineArgs
from voltllm.cuda_graph_config import CudaGraphConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny_graphs")), "qwen3", max_position_embeddings=1024)


def _device(tiny, *argv):
    return _parse(tiny, "--device", "cpu", *argv).create_engine_config().device


def test_default_is_full_decode_graphs_and_piecewise_prompt_graphs(tiny):
    dev = _device(tiny)
    assert dev.cuda_graphs == CudaGraphConfig("FULL_AND_PIECEWISE")
    assert not dev.enforce_eager and dev.prompt_graph_max_tokens is None  # None: prompt graphs sized automatically


@pytest.mark.parametrize("argv", [("-O0",), ("-O", "0"), ("--optimization-level", "0"), ("--optimization_level=0",),
                                  ("-cc", '{"cudagraph_mode": "none"}'), ("-cc.cudagraph_mode=NONE",),
                                  ("--compilation-config.cudagraph_mode", "NONE"), ("--enforce-eager", "-O3")])
def test_no_graphs(tiny, argv):
    dev = _device(tiny, *argv)
    assert dev.cuda_graphs.mode == "NONE" and dev.enforce_eager and dev.prompt_graph_max_tokens == 0


@pytest.mark.parametrize("argv", [("-O2",), ("-O3",), ("-cc", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'),
                                  ("-cc", '{"cudagraph_mode": "FULL"}'),  # as vLLM without whole mixed-batch graphs
                                  ("-cc", '{"mode": 0}'), ("-cc", '{"level": 0}'), ("-cc", '{"mode": "none"}'),
                                  ("-cc", "0"), ("-cc", "3"), ("-cc", '{"level": 3}'),  # vLLM's default pipeline
                                  ("-cc", '{"mode": "VLLM_COMPILE", "cudagraph_capture_sizes": [1, 2]}')])
def test_default_graphs(tiny, argv):
    dev = _device(tiny, *argv)
    assert dev.cuda_graphs.mode == "FULL_AND_PIECEWISE" and not dev.enforce_eager
    assert dev.prompt_graph_max_tokens is None


def test_full_decode_only_turns_prompt_graphs_off(tiny):
    dev = _device(tiny, "-cc", '{"cudagraph_mode": "FULL_DECODE_ONLY"}')
    assert dev.cuda_graphs.mode == "FULL_DECODE_ONLY" and not dev.enforce_eager
    assert dev.prompt_graph_max_tokens == 0
    # an explicit mode wins over -O's default, as in vLLM
    assert _device(tiny, "-O0", "-cc.cudagraph_mode=FULL_DECODE_ONLY").cuda_graphs.mode == "FULL_DECODE_ONLY"


@pytest.mark.parametrize("argv", [("-cc", '{"cudagraph_capture_sizes": [8, 1, 4, 4]}'),
                                  ("--cuda-graph-sizes", "1", "4", "8"), ("--cudagraph-capture-sizes", "8", "4", "1"),
                                  ("-cc.cudagraph_capture_sizes=[1,4,8]", "-cc.max_cudagraph_capture_size=8")])
def test_capture_sizes(tiny, argv):
    graphs = _device(tiny, *argv).cuda_graphs
    assert graphs.capture_sizes == (1, 4, 8) and graphs.max_capture_size == 8


def test_capture_sizes_above_the_step_budget_are_dropped(tiny):
    graphs = _device(tiny, "--max-num-batched-tokens", "64", "--cuda-graph-sizes", "1", "32", "64", "128").cuda_graphs
    assert graphs.capture_sizes == (1, 32, 64)
    assert _device(tiny, "--max-num-batched-tokens", "64", "--max-cudagraph-capture-size", "256"
                   ).cuda_graphs.max_capture_size == 64
    with pytest.raises(ConfigError, match="every size is above --max-num-batched-tokens 64"):
        _device(tiny, "--max-num-batched-tokens", "64", "--cudagraph-capture-sizes", "128")


def test_one_cuda_graph_size_is_the_top_of_vllms_ladder(tiny):
    """vLLM's --cuda-graph-sizes N (one value): 1, 2, 4 and the multiples of 8 up to N, not N alone (a lone 512
    above every batch would capture nothing useful)."""
    assert _device(tiny, "--cuda-graph-sizes", "40").cuda_graphs.capture_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert _device(tiny, "--cuda-graph-sizes", "4").cuda_graphs.capture_sizes == (1, 2, 4)
    assert _device(tiny, "--cudagraph-capture-sizes", "40").cuda_graphs.capture_sizes == (40,)


def test_offline_engine_args_take_the_same_fields(tiny):
    cfg = EngineArgs(model=tiny, device="cpu", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"},
                     cuda_graph_sizes=[2, 1]).create_engine_config()
    assert cfg.device.cuda_graphs == CudaGraphConfig("FULL_DECODE_ONLY", (1, 2), 2)
    assert EngineArgs(model=tiny, device="cpu", optimization_level=0).create_engine_config().device.enforce_eager


@pytest.mark.parametrize("kwargs,match", [
    ({"optimization_level": 1}, r"-O1: piecewise CUDA graphs for decode batches are not built"),
    ({"compilation_config": {"cudagraph_mode": "PIECEWISE"}}, "cudagraph_mode PIECEWISE: piecewise CUDA graphs"),
    ({"compilation_config": {"cudagraph_mode": "SOMETIMES"}}, "cudagraph_mode must be one of NONE, PIECEWISE"),
    ({"compilation_config": {"level": 2}}, "level 2: a torch.compile mode; voltllm does not compile"),
    ({"compilation_config": {"mode": "STOCK_TORCH_COMPILE"}}, "mode STOCK_TORCH_COMPILE: a torch.compile mode"),
    ({"compilation_config": 1}, "mode 1: a torch.compile mode"),
    ({"compilation_config": {"mode": 7}}, "mode must be 0 to 3 or NONE, STOCK_TORCH_COMPILE"),
    ({"compilation_config": {"custom_ops": ["none"]}}, "custom_ops: a torch.compile setting"),
    ({"compilation_config": {"pass_config": {}}}, "pass_config: a torch.compile setting"),
    ({"compilation_config": {"cudagraph_num_of_warmups": 1}}, "cudagraph_num_of_warmups: not built"),
    ({"compilation_config": {"cudagraph_sizes": [1]}}, "--compilation-config cudagraph_sizes: unknown key"),
    ({"compilation_config": '{"cudagraph_mode": '}, "--compilation-config must be a JSON object"),
    ({"compilation_config": {"cudagraph_capture_sizes": [1, 0]}}, "must be a non-empty list of batch sizes >= 1"),
    ({"compilation_config": {"cudagraph_capture_sizes": []}}, "must be a non-empty list of batch sizes >= 1"),
    ({"compilation_config": {"cudagraph_capture_sizes": [1, 2]}, "cuda_graph_sizes": [4]},
     "cudagraph_capture_sizes and --cuda-graph-sizes both set"),
    ({"compilation_config": {"cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 4}},
     "max_cudagraph_capture_size 4 must be the largest of cudagraph_capture_sizes"),
    ({"compilation_config": {"max_capture_size": 8}, "max_cudagraph_capture_size": 16}, "given twice"),
    ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size must be a batch size >= 1"),
    ({"optimization_level": 4}, "--optimization-level must be 0, 1, 2 or 3"),
])
def test_refused_by_name(tiny, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=tiny, device="cpu", **kwargs).create_engine_config()


def test_refused_before_the_model_is_read(tmp_path):
    with pytest.raises(ConfigError, match="-O1"):
        EngineArgs(model=str(tmp_path / "missing"), device="cpu", optimization_level=1).create_engine_config()


def test_cli_exit_code(tiny, capsys):
    from voltllm.cli import main

    assert main(["generate", "hi", tiny, "--device", "cpu", "-cc.custom_ops=[\"none\"]"]) == 2
    assert "voltllm: error: --compilation-config custom_ops: a torch.compile setting" in capsys.readouterr().err


class _Runner:
    """What DecodeGraphs reads of a runner before it captures: its config and input buffers' row capacity."""

    def __init__(self, config, rows):
        self.config = config
        self.buffers = type("Buffers", (), {"max_seqs": rows})()


def _decode_sizes(config, rows, set_rows=None):
    from voltllm.worker.cuda_graphs import DecodeGraphs

    runner = _Runner(config, rows)
    graphs = DecodeGraphs(runner, rows=set_rows)
    assert isinstance(graphs.runner, weakref.ProxyTypes)
    return graphs.sizes


def test_decode_graph_sizes_the_runner_captures(tiny):
    default = EngineArgs(model=tiny, device="cpu", max_num_seqs=40).create_engine_config()
    assert _decode_sizes(default, 40) == [1, 2, 4, 8, 16, 32, 40]
    capped = EngineArgs(model=tiny, device="cpu", max_num_seqs=40, max_cudagraph_capture_size=20
                        ).create_engine_config()
    assert _decode_sizes(capped, 40) == [1, 2, 4, 8, 16, 20]  # batches of 21..40 run eagerly
    chosen = EngineArgs(model=tiny, device="cpu", max_num_seqs=40, cudagraph_capture_sizes=[3, 12, 64]
                        ).create_engine_config()
    assert _decode_sizes(chosen, 40) == [3, 12]  # 64 is above the buffers' 40 rows
    assert _decode_sizes(chosen, 40, set_rows=8) == [3]  # a set of fewer rows (a hybrid's plain decode graphs)
    assert _decode_sizes(chosen, 2) == []  # nothing to capture: every batch runs eagerly
