"""tests/dependency_floor.py: installed versions against pyproject's ranges."""
from dependency_floor import out_of_range, runtime_requirements


def test_flags_only_installed_packages_outside_their_range():
    installed = {"transformers": "5.17.0", "torch": "2.13.0+cpu", "numpy": "2.1.0", "gguf": "0.19.0rc1"}
    reqs = ["transformers>=5.18,<6", "torch>=2.6", "numpy>=1.26", "gguf>=0.19", "av>=14", "jinja2"]
    assert out_of_range(reqs, installed.get) == ["transformers 5.17.0: needs <6,>=5.18"]


def test_this_environment_meets_pyproject():
    reqs = runtime_requirements()
    assert any(r.startswith("transformers") for r in reqs)
    assert out_of_range(reqs) == []
