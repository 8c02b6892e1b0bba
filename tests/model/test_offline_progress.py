"""LLM.generate / LLM.chat's use_tqdm (vLLM's): a bar over the sequences completed with the token rates, on stderr;
none with False; a tqdm-like factory's bar when given one."""
import io
import re

import pytest
from tqdm import tqdm

from tiny_models import make_model
from voltllm import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "What is the capital of France? The capital of", "def add(a, b):"]
RATES = re.compile(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(make_model(str(tmp_path_factory.mktemp("tiny")), "llama", max_position_embeddings=256), block_size=4)


def _params(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=1, n=n, max_tokens=6, ignore_eos=True)


def test_default_draws_a_bar_on_stderr(llm, capsys):
    outs = llm.generate(PROMPTS, [_params(), _params(2), _params()])  # vLLM's default: use_tqdm=True
    out, err = capsys.readouterr()
    assert out == "" and "Processed prompts" in err
    assert "4/4" in err  # sequences: the n = 2 request counts twice
    input_rate, output_rate = map(float, RATES.findall(err)[-1])
    assert input_rate > 0 and output_rate > 0
    tokens_in = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outs)
    assert input_rate / output_rate == pytest.approx(tokens_in / (4 * 6), rel=0.02)


def test_false_draws_nothing(llm, capsys):
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], _params(), use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_chat_draws_the_bar(llm, capsys):
    llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello"}]], _params())
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err


def test_a_tqdm_like_factory_makes_the_bar(llm, capsys):
    made = []

    def factory(**kwargs):
        made.append((kwargs, tqdm(file=io.StringIO(), **kwargs)))
        return made[-1][1]

    llm.generate(PROMPTS, _params(), use_tqdm=factory)
    assert capsys.readouterr().err == ""
    (kwargs, bar), = made
    assert kwargs["total"] == 3 and kwargs["desc"] == "Processed prompts"
    assert bar.n == 3 and RATES.search(bar.postfix)
    assert "3/3" in bar.fp.getvalue()


def test_a_failing_factory_leaves_nothing_running(llm):
    def factory(**kwargs):
        raise RuntimeError("no terminal")

    with pytest.raises(RuntimeError, match="no terminal"):
        llm.generate(PROMPTS, _params(), use_tqdm=factory)
    assert not llm.engine.has_unfinished_requests()
    assert [len(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, _params(), use_tqdm=False)] == [6, 6, 6]
