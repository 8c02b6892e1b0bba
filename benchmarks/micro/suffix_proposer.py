"""Host cost of suffix decoding's proposer (engine/suffix_decoding.py) against the n-gram one, no model: 64 requests
of a 1,024-token prompt decode 1,024 tokens each, one token per step, in turns as the scheduler asks them (the
worst case for per-token costs: accepted drafts bring several tokens per proposal). The tokens are code-like: a
Zipf-distributed vocabulary of 32,000 with a third of the text copied from earlier spans of 4-40 tokens.

    PYTHONPATH=$PWD python3 benchmarks/micro/suffix_proposer.py [--requests 64] [--prompt 1024] [--output 1024]
        [--cached N --finished M]

Prints the prompt's first proposal (the request's automaton built) per prompt token, the steady per-step cost per
request (catching up one token, then proposing up to K = 24 drafts) and the n-gram proposer's, and the automata's
size and Python memory per token."""
import argparse
import itertools
import random
import time
import tracemalloc
from types import SimpleNamespace

from voltllm.engine.speculative import NgramIndex
from voltllm.engine.suffix_decoding import SuffixProposer


def stream(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(vocab)))
    out: list[int] = []
    while len(out) < n:
        if len(out) > 50 and rng.random() < 0.3 / 20:  # a copied span (a third of the tokens)
            start = rng.randrange(len(out) - 4)
            out.extend(out[start:start + rng.randrange(4, 41)])
        else:
            out.extend(rng.choices(range(vocab), cum_weights=cum, k=8))
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--k", type=int, default=24)
    ap.add_argument("--cached", type=int, default=10000, help="suffix_decoding_max_cached_requests")
    ap.add_argument("--finished", type=int, default=0, help="requests whose outputs are in the cache before (with "
                    "--cached 4 x --requests and --finished 3 x --requests: three full generations and the running "
                    "requests in the fourth)")
    args = ap.parse_args()
    rng = random.Random(0)
    texts = [stream(rng, args.prompt + args.output) for _ in range(args.requests)]
    proposer = SuffixProposer(24, args.cached, 1.0, 0.1)
    for i in range(args.finished):
        done = SimpleNamespace(all_token_ids=stream(rng, 16 + args.output), num_prompt_tokens=16, suffix_state=None)
        proposer.propose(done, 0)
        proposer.release(done)
    reqs = [SimpleNamespace(all_token_ids=t[:args.prompt], num_prompt_tokens=args.prompt, suffix_state=None)
            for t in texts]
    t0 = time.perf_counter()
    for r in reqs:
        proposer.propose(r, args.k)
    build = time.perf_counter() - t0
    ngrams = [NgramIndex(2, 4) for _ in reqs]
    for r, ix in zip(reqs, ngrams):
        ix.propose(r.all_token_ids, args.k)
    suffix_s = ngram_s = 0.0
    drafted = 0
    for step in range(args.output - 1):
        for r, t in zip(reqs, texts):
            r.all_token_ids.append(t[args.prompt + step])
        t0 = time.perf_counter()
        for r in reqs:
            drafted += len(proposer.propose(r, args.k))
        t1 = time.perf_counter()
        for r, ix in zip(reqs, ngrams):
            ix.propose(r.all_token_ids, args.k)
        suffix_s += t1 - t0
        ngram_s += time.perf_counter() - t1
    n = args.requests * (args.output - 1)
    print(f"{args.requests} requests x ({args.prompt} prompt + {args.output} output) tokens, K = {args.k}, "
          f"{len(proposer.cache.generations)} cache generation(s)")
    print(f"suffix: prompt automaton {build / (args.requests * args.prompt) * 1e6:.2f} us per prompt token; "
          f"{suffix_s / n * 1e6:.1f} us per request-step ({suffix_s / (args.output - 1) * 1e3:.2f} ms per step of "
          f"{args.requests}); {drafted / n:.2f} drafts per proposal")
    print(f"ngram:  {ngram_s / n * 1e6:.1f} us per request-step")
    cached = sum(g.sam.num_states for g in list(proposer.cache.generations)[-1:])
    own = sum(r.suffix_state.sam.num_states for r in reqs)
    print(f"states per token: own {own / sum(len(t) for t in texts):.2f}, cache "
          f"{cached / (args.requests * args.output):.2f} (its newest generation)")
    # Python memory of one request's automaton
    tracemalloc.start()
    one = SuffixProposer(24, 0, 1.0, 0.1)
    r = SimpleNamespace(all_token_ids=texts[0], num_prompt_tokens=len(texts[0]), suffix_state=None)
    before = tracemalloc.get_traced_memory()[0]
    one.propose(r, args.k)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"memory: {used / len(texts[0]):.0f} bytes per token (one request's automaton)")


if __name__ == "__main__":
    main()
