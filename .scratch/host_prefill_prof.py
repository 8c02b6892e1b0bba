"""Host-side cost of the 64 x 128 prompt step on CPU with a tiny model: add_request, schedule, prepare."""
import sys, time, tempfile, cProfile, pstats
sys.path.insert(0, "tests")
from tiny_models import make_model
from voltllm.config import EngineArgs
from voltllm.engine.core import EngineCore
from voltllm.engine.types import EngineCoreRequest
from voltllm.bench.inprocess import sampling_params, random_prompts
d = tempfile.mkdtemp()
path = make_model(d, "qwen3", max_position_embeddings=1024)
cfg = EngineArgs(model=path, device="cpu", max_model_len=512, max_num_seqs=64).create_engine_config()
eng = EngineCore(cfg)
def run(b):
    prompts = random_prompts(64, 128, 100, b)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        eng.add_request(EngineCoreRequest(f"r{b}-{i}", ids, sampling_params(4, 0.0, 1.0, -1, i), arrival_time=t0))
    t1 = time.perf_counter()
    s = eng.scheduler.schedule()
    t2 = time.perf_counter()
    eng.runner.prepare(s)
    t3 = time.perf_counter()
    print(f"add {1e3*(t1-t0):.2f} ms  schedule {1e3*(t2-t1):.2f} ms  prepare {1e3*(t3-t2):.2f} ms  tokens {sum(x.num_new_tokens for x in s.scheduled)}")
    eng.scheduler.abort_requests([f"r{b}-{i}" for i in range(64)])
    eng.runner.release([f"r{b}-{i}" for i in range(64)])
for b in range(3): run(b)
pr = cProfile.Profile(); pr.enable(); run(9); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
