"""--runner / --convert / --task / --pooler-config parse and resolve as vLLM's (voltllm/pooling/config.py), the
sentence-transformers pooler is read from a checkpoint's files, and PoolingParams are checked."""
import json
from types import SimpleNamespace

import pytest

from tiny_models import make_model
from voltllm.cli import build_parser, dashed_flags, dotted_json_flags, main
from voltllm.cli_args import engine_args_from
from voltllm.config import ConfigError, EngineArgs
from voltllm.pooling.config import PoolerConfig, sentence_transformers_pooling
from voltllm.pooling.params import PoolingParams, PoolingParamsError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("tiny")), "qwen3", max_position_embeddings=128)


def _config(tiny, *flags):
    args = build_parser().parse_args(dotted_json_flags(dashed_flags(["serve", tiny, "--device", "cpu", *flags])))
    return engine_args_from(args).create_engine_config()


@pytest.mark.parametrize("flags", [["--runner", "pooling"], ["--task", "embed"], ["--task", "embedding"],
                                   ["--convert", "embed"], ["--runner", "pooling", "--convert", "embed"],
                                   ["--runner=pooling", "--pooler-config", '{"pooling_type": "LAST"}']])
def test_pooling_flags_make_a_pooling_engine(tiny, flags):
    cfg = _config(tiny, *flags)
    assert cfg.model.runner == "pooling"
    assert cfg.model.pooler == PoolerConfig("LAST", True, None, hidden_size=64)
    assert cfg.cache.enable_prefix_caching  # LAST keeps it


@pytest.mark.parametrize("flags", [[], ["--task", "generate"], ["--task", "auto"], ["--runner", "generate"],
                                   ["--runner", "auto", "--convert", "none"]])
def test_generate_stays_the_default(tiny, flags):
    cfg = _config(tiny, *flags)
    assert cfg.model.runner == "generate" and cfg.model.pooler is None


def test_pooler_config_fields(tiny):
    cfg = _config(tiny, "--runner", "pooling", "--pooler-config", '{"pooling_type": "mean", "normalize": false}')
    assert (cfg.model.pooler.pooling_type, cfg.model.pooler.normalize) == ("MEAN", False)
    assert not cfg.cache.enable_prefix_caching
    cfg = _config(tiny, "--runner", "pooling", "--pooler-config.seq_pooling_type", "CLS",
                  "--pooler-config.use_activation", "false")  # vLLM's dotted form and newer names
    assert (cfg.model.pooler.pooling_type, cfg.model.pooler.normalize) == ("CLS", False)
    cfg = _config(tiny, "--runner", "pooling", "--override-pooler-config", '{"pooling_type": "MEAN"}')
    assert cfg.model.pooler.pooling_type == "MEAN"
    cfg = _config(tiny, "--runner", "pooling", "--hf-overrides", '{"matryoshka_dimensions": [16, 32]}',
                  "--pooler-config", '{"dimensions": 16}')
    assert (cfg.model.pooler.dimensions, cfg.model.pooler.matryoshka_dimensions) == (16, (16, 32))


@pytest.mark.parametrize("flags,message", [
    (["--task", "reward"], "--task reward: reward models are not built"),
    (["--task", "draft"], "--task draft: the draft runner belongs to speculative decoding"),
    (["--task", "nonsense"], "--task must be one of auto, generate, embed"),
    (["--runner", "draft"], "--runner draft"),
    (["--runner", "pool"], "--runner must be one of auto, generate, pooling"),
    (["--convert", "reward"], "--convert reward: reward models are not built"),
    (["--runner", "generate", "--convert", "embed"], "--convert embed turns the model into a pooling model: it "
                                                     "needs --runner pooling"),
    (["--runner", "generate", "--convert", "classify"], "--convert classify turns the model into a pooling model"),
    (["--convert", "classify", "--pooler-config", '{"normalize": false}'], "--pooler-config normalize: applies to "
                                                                            "embedding models, not to a classifier"),
    (["--convert", "classify", "--hf-overrides", '{"is_original_qwen3_reranker": true}'],
     "is_original_qwen3_reranker needs classifier_from_token with two tokens"),
    (["--convert", "classify", "--hf-overrides", '{"classifier_from_token": ["no", "yes"], "method": "x"}'],
     "--hf-overrides method 'x': one of from_2_way_softmax, no_post_processing"),
    (["--convert", "classify", "--hf-overrides", '{"classifier_from_token": ["qqqzz", "yes"], '
      '"is_original_qwen3_reranker": true}'], "classifier_from_token 'qqqzz' is not a token of the model's tokenizer"),
    (["--runner", "pooling", "--pooler-config", '{"task": "classify"}'], "--pooler-config task 'classify': this "
                                                                          "engine's pooling task is embed"),
    (["--runner", "pooling", "--convert", "none"], "--runner pooling --convert none"),
    (["--task", "embed", "--runner", "generate"], "--task embed (vLLM's older flag, --runner pooling) contradicts "
                                                  "--runner generate"),
    (["--pooler-config", '{"pooling_type": "MEAN"}'], "--pooler-config applies to pooling models: add --runner "
                                                      "pooling"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MAX"}'], "--pooler-config pooling_type: one of "
                                                                            "LAST, MEAN, CLS, got 'MAX'"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "ALL"}'], "token-level pooling is not built"),
    (["--runner", "pooling", "--pooler-config", '{"poolingtype": "MEAN"}'], "--pooler-config: unknown key "
                                                                            "'poolingtype'"),
    (["--runner", "pooling", "--pooler-config", '{"step_tag_id": 3}'], "--pooler-config step_tag_id: a setting of "
                                                                       "another pooling task"),
    (["--runner", "pooling", "--pooler-config", '{"enable_chunked_processing": true}'],
     "--pooler-config enable_chunked_processing true"),
    (["--runner", "pooling", "--pooler-config", '{"dimensions": 16}'], "--pooler-config dimensions: model 'this' "
                                                                       "does not support matryoshka"),
    (["--runner", "pooling", "--pooler-config", '{"normalize": "yes"}'], "normalize must be true or false"),
    (["--runner", "pooling", "--pooler-config", '{"normalize": true, "use_activation": false}'], "name one switch"),
    (["--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}', "--override-pooler-config",
      '{"pooling_type": "CLS"}'], "--override-pooler-config is the older name of --pooler-config: give one"),
    (["--runner", "pooling", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
     "a pooling model generates nothing to speculate on"),
])
def test_bad_settings_are_refused_naming_the_flag(tiny, flags, message):
    with pytest.raises(ConfigError) as e:
        _config(tiny, *flags)
    assert message in str(e.value)


def test_refusals_exit_2_at_the_command_line(tiny, capsys):
    assert main(["serve", tiny, "--device", "cpu", "--task", "reward", "--port", "1"]) == 2
    assert "voltllm: error: --task reward: reward models are not built" in capsys.readouterr().err
    assert main(["generate", "hi", tiny, "--device", "cpu", "--runner", "pooling"]) == 2
    assert "LLM.generate() is for generative models" in capsys.readouterr().err


def test_hybrid_models_are_refused_as_pooling_models():
    hf = SimpleNamespace(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=64)
    with pytest.raises(ConfigError, match="attention-only architectures .* not 'qwen3_next'"):
        EngineArgs(runner="pooling")._resolve_runner(hf, "/nonexistent", None)
    assert EngineArgs()._resolve_runner(hf, "/nonexistent", None) == ("generate", None)


@pytest.mark.parametrize("arch,runner", [("Qwen3ForCausalLM", "generate"), ("Qwen3Model", "pooling"),
                                         ("LlamaModel", "pooling"), ("FooEmbeddingModel", "pooling"),
                                         ("Qwen3_5ForConditionalGeneration", "generate")])
def test_runner_auto_follows_the_architecture_name(arch, runner):
    from voltllm.pooling.config import resolve_runner

    assert resolve_runner(None, "auto", "auto", SimpleNamespace(architectures=[arch]), "/nonexistent")[0] == runner


@pytest.mark.parametrize("task,runner,convert,arch,want", [
    (None, "auto", "auto", "Qwen3ForSequenceClassification", ("pooling", "classify")),
    (None, "pooling", "auto", "Qwen3ForSequenceClassification", ("pooling", "classify")),
    (None, "pooling", "auto", "Qwen3ForCausalLM", ("pooling", "embed")),
    (None, "auto", "classify", "Qwen3ForCausalLM", ("pooling", "classify")),
    ("score", "auto", "auto", "Qwen3ForCausalLM", ("pooling", "classify")),
    ("classify", "auto", "auto", "Qwen3ForCausalLM", ("pooling", "classify")),
    ("embed", "auto", "auto", "Qwen3ForSequenceClassification", ("pooling", "embed")),
    (None, "generate", "auto", "Qwen3ForSequenceClassification", ("generate", None))])
def test_classifier_architectures_and_flags_make_a_classifying_pooling_engine(task, runner, convert, arch, want):
    from voltllm.pooling.config import resolve_runner

    assert resolve_runner(task, runner, convert, SimpleNamespace(architectures=[arch]), "/x") == want


def test_runner_auto_refuses_reward_architectures():
    from voltllm.pooling.config import PoolerConfigError, resolve_runner

    with pytest.raises(PoolerConfigError, match="Qwen2ForRewardModeling: reward models are not built"):
        resolve_runner(None, "auto", "auto", SimpleNamespace(architectures=["Qwen2ForRewardModeling"]), "/x")


def _st_dir(tmp_path, modules, pooling=None):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


_TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
_POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
_NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def test_sentence_transformers_pooler_as_qwen3_embedding_ships_it(tmp_path):
    """Qwen3-Embedding's files: last-token pooling, then a Normalize module."""
    path = _st_dir(tmp_path, [_TRANSFORMER, _POOLING, _NORMALIZE],
                   {"word_embedding_dimension": 1024, "pooling_mode_cls_token": False,
                    "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
                    "pooling_mode_lasttoken": True, "include_prompt": True})
    assert sentence_transformers_pooling(path) == {"pooling_type": "LAST", "normalize": True}


@pytest.mark.parametrize("pooling,expected", [
    ({"pooling_mode": "cls"}, {"pooling_type": "CLS", "normalize": False}),
    ({"pooling_mode": "lasttoken"}, {"pooling_type": "LAST", "normalize": False}),
    ({"pooling_mode_mean_tokens": True}, {"pooling_type": "MEAN", "normalize": False}),
    ({"pooling_mode_max_tokens": True}, {"normalize": False}),  # not built: the default applies (a warning)
])
def test_sentence_transformers_pooling_modes(tmp_path, pooling, expected):
    assert sentence_transformers_pooling(_st_dir(tmp_path, [_TRANSFORMER, _POOLING], pooling)) == expected


def test_no_sentence_transformers_pooler(tmp_path):
    assert sentence_transformers_pooling(str(tmp_path)) is None
    assert sentence_transformers_pooling(_st_dir(tmp_path, [_TRANSFORMER])) is None
    assert sentence_transformers_pooling(str(tmp_path / "model.gguf")) is None


def test_pooler_config_flag_wins_over_the_sentence_transformers_files(tmp_path, tiny):
    import shutil

    st = tmp_path / "st"
    shutil.copytree(tiny, st)
    _st_dir(st, [_TRANSFORMER, _POOLING, _NORMALIZE], {"pooling_mode_cls_token": True})
    cfg = _config(str(st))  # --runner auto: a sentence-transformers checkpoint is a pooling model
    assert (cfg.model.runner, cfg.model.pooler.pooling_type, cfg.model.pooler.normalize) == ("pooling", "CLS", True)
    cfg = _config(str(st), "--pooler-config", '{"pooling_type": "LAST"}')
    assert (cfg.model.pooler.pooling_type, cfg.model.pooler.normalize) == ("LAST", True)
    assert _config(str(st), "--runner", "generate").model.runner == "generate"


def test_pooling_params_checks():
    assert PoolingParams(normalize=False).normalize_asked is False
    assert PoolingParams(use_activation=True).normalize_asked is True
    for kwargs, message in [({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be an integer >= -1"),
                            ({"dimensions": 1.5}, "dimensions must be an integer"),
                            ({"normalize": 1}, "normalize must be true or false"),
                            ({"normalize": True, "use_activation": False}, "name the same switch"),
                            ({"task": "token_embed"}, "task 'token_embed': not built"),
                            ({"task": "classify", "normalize": True}, "normalize: applies to embeddings"),
                            ({"task": "score", "dimensions": 4}, "dimensions: applies to embeddings")]:
        with pytest.raises(PoolingParamsError, match=message):
            PoolingParams(**kwargs)
    pooler = PoolerConfig("LAST", normalize=False, hidden_size=64, matryoshka=True)
    resolved = pooler.resolve(PoolingParams(dimensions=8, truncate_prompt_tokens=5), "m")
    assert (resolved.dimensions, resolved.normalize, resolved.truncate_prompt_tokens) == (8, False, 5)
    assert pooler.resolve(None, "m").normalize is False
    with pytest.raises(PoolingParamsError, match="task 'classify': model 'm' is an embedding model"):
        pooler.resolve(PoolingParams(task="classify"), "m")


def test_dense_projection_modules_are_refused(tmp_path):
    from voltllm.pooling.config import PoolerConfigError

    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    with pytest.raises(PoolerConfigError, match=r"Dense modules \(2_Dense\), which are not built"):
        sentence_transformers_pooling(_st_dir(tmp_path, [_TRANSFORMER, _POOLING, dense], {"pooling_mode": "mean"}))
