"""Suffix decoding's proposer (engine/suffix_decoding.py) and its --speculative-config keys: proposals equal a
brute-force reading of the method (occurrence counts of every substring of at most D tokens, the best-scoring
continuation over the match lengths) on random sequences, alone and through the cache of other requests' outputs;
crafted cases (a repeated code block, reuse across requests, the probability floor, the depth bound, the adaptive
length, eviction, freeing a request's state)."""
import random
from types import SimpleNamespace

import pytest

from voltllm.engine.speculative import SpeculativeConfig, SpeculativeConfigError
from voltllm.engine.suffix_decoding import SuffixAutomaton, SuffixCache, SuffixProposer


def _count(seqs, s):
    n = len(s)
    return sum(1 for q in seqs for i in range(len(q) - n + 1) if q[i:i + n] == s)


def _brute_tree(gens, pattern, k, depth, factor, min_prob):
    """(tokens, score) of the best draft from one source, straight from the definition: `gens` lists the source's
    automata, each a list of sequences (the cache's generations; a request's own tokens are one of one)."""
    seqs = [q for g in gens for q in g]
    best, best_score = [], 0.0
    for L in range(1, len(pattern)):
        ctx = list(pattern[-L:])
        if not _count(seqs, ctx):
            break
        cap = min(k, int(L * factor + 1e-6), depth - L)
        tokens, prob, score, s = [], 1.0, 0.0, ctx
        while len(tokens) < cap:
            picks = set()  # each automaton's most frequent continuation, then the best of those over them all
            for g in gens:
                follow = {q[i + len(s)] for q in g for i in range(len(q) - len(s)) if q[i:i + len(s)] == s}
                if follow:
                    picks.add(min(follow, key=lambda t: (-_count(g, s + [t]), t)))
            if not picks:
                break
            t = min(picks, key=lambda t: (-_count(seqs, s + [t]), t))
            prob *= _count(seqs, s + [t]) / _count(seqs, s)
            if prob < min_prob:
                break
            tokens.append(t)
            score += prob
            s = s + [t]
        if tokens and score >= best_score:
            best, best_score = tokens, score
    return best, best_score


def _brute(own, outputs, k, depth, factor, min_prob, one_each=False):
    """outputs: the cached outputs, in one automaton, or one_each in an automaton of its own."""
    pattern = own[-depth:]
    mine = _brute_tree([[own]], pattern, k, depth, factor, min_prob)
    gens = [[o] for o in outputs] if one_each else [outputs]
    shared = _brute_tree(gens, pattern, k, depth, factor, min_prob) if outputs else ([], 0.0)
    return shared[0] if shared[1] > mine[1] else mine[0]


def _req(tokens, num_prompt):
    return SimpleNamespace(all_token_ids=list(tokens), num_prompt_tokens=num_prompt, suffix_state=None)


@pytest.mark.parametrize("depth,factor,min_prob,alphabet", [(6, 1.0, 0.1, 3), (5, 2.0, 0.0, 2), (8, 0.5, 0.3, 4),
                                                            (1, 1.0, 0.1, 2), (24, 1.0, 0.1, 5)])
def test_own_tokens_match_brute_force(depth, factor, min_prob, alphabet):
    rng = random.Random(depth)
    proposer = SuffixProposer(depth, 0, factor, min_prob)
    req = _req([rng.randrange(alphabet) for _ in range(10)], 10)
    for _ in range(150):
        k = rng.randrange(1, 9)
        assert proposer.propose(req, k) == _brute(req.all_token_ids, [], k, depth, factor, min_prob)
        req.all_token_ids += [rng.randrange(alphabet)] * rng.choice((1, 1, 2))


@pytest.mark.parametrize("limit", [100, 4])
def test_cached_outputs_of_interleaved_requests_match_brute_force(limit):
    """Four requests decode in random turns; each proposal reads its own tokens and every cached output (its own
    too), in one automaton (limit 100) or one a request (limit 4: generations of one, their counts summed)."""
    rng = random.Random(1)
    depth, k = 7, 6
    proposer = SuffixProposer(depth, limit, 1.0, 0.1)
    reqs = [_req([rng.randrange(3) for _ in range(rng.randrange(1, 6))], 0) for _ in range(4)]
    for r in reqs:
        r.num_prompt_tokens = len(r.all_token_ids)
    synced: dict = {}  # request -> its tokens when it last proposed (the cache has its output up to there)
    for step in range(160):
        r = reqs[rng.randrange(4)]
        synced[id(r)] = len(r.all_token_ids)
        outputs = [q.all_token_ids[q.num_prompt_tokens:synced[id(q)]] for q in reqs if id(q) in synced]
        got = proposer.propose(r, k)
        assert got == _brute(r.all_token_ids, outputs, k, depth, 1.0, 0.1, one_each=limit == 4)
        r.all_token_ids += [rng.randrange(3)]
    assert len(proposer.cache.generations) == (1 if limit == 100 else 4)


def test_matches_in_unchanged_generations_go_on_with_new_tokens():
    """Finished requests' generations no longer change: a running request's match there advances with its new
    tokens only, and its proposals still equal the brute force's."""
    rng = random.Random(2)
    depth, k = 6, 5
    proposer = SuffixProposer(depth, 4, 1.0, 0.1)
    outputs = []
    for _ in range(3):
        done = _req([9] + [rng.randrange(3) for _ in range(40)], 1)
        proposer.propose(done, 0)
        proposer.release(done)
        outputs.append(done.all_token_ids[1:])
    r = _req([rng.randrange(3) for _ in range(5)], 5)
    for step in range(80):
        got = proposer.propose(r, k)
        assert got == _brute(r.all_token_ids, outputs + [r.all_token_ids[5:]], k, depth, 1.0, 0.1, one_each=True)
        r.all_token_ids += [rng.randrange(3)] * rng.choice((1, 2))
    assert len(r.suffix_state.matches) == 4


def test_repeated_code_block():
    """The second copy of a block is drafted from the first, as far as the match allows (factor 1: as many tokens
    as matched)."""
    block = [11, 12, 13, 14, 15, 16, 17, 18]
    proposer = SuffixProposer(24, 0, 1.0, 0.1)
    req = _req([1] + block + [2] + block[:3], 12)
    # "13" .. matched with 3 tokens (12 13 + the 11 before: 11 12 13): the next 3 of the first copy
    assert proposer.propose(req, 16) == [14, 15, 16]
    req.all_token_ids += [14, 15]
    assert proposer.propose(req, 16) == [16, 17, 18, 2, 11]  # 5 matched: 5 drafts, across the block's end
    assert proposer.propose(req, 2) == [16, 17]  # K caps


def test_reuse_across_requests_through_the_cache():
    first = _req([5, 6] + [21, 22, 23, 24, 25, 26], 2)
    proposer = SuffixProposer(24, 10, 1.0, 0.1)
    proposer.propose(first, 4)
    proposer.release(first)  # finished: its output stays in the cache
    assert first.suffix_state is None
    second = _req([9, 9, 9, 21, 22, 23], 3)  # other prompt, same start of output
    assert proposer.propose(second, 8) == [24, 25, 26]
    off = SuffixProposer(24, 0, 1.0, 0.1)  # no cache: nothing to draft from
    off.propose(_req([5, 6] + [21, 22, 23, 24, 25, 26], 2), 4)
    assert off.propose(_req([9, 9, 9, 21, 22, 23], 3), 8) == []


def test_min_token_prob_cuts_unlikely_continuations():
    # "7" was followed by 1 (three times) and 2 (once), and ends the sequence: 1 has 3/5
    tokens = [7, 1, 7, 1, 7, 1, 7, 2, 7]
    assert SuffixProposer(24, 0, 4.0, 0.5).propose(_req(tokens, 9), 8)[:1] == [1]
    assert SuffixProposer(24, 0, 4.0, 0.7).propose(_req(tokens, 9), 8) == []
    # after "7 1" (3 times, last one followed by 7 2): the path 7 1 -> 7 -> 1 drops as its product falls
    low = SuffixProposer(24, 0, 4.0, 0.0).propose(_req(tokens[:-1] + [1, 7, 1], 11), 8)
    high = SuffixProposer(24, 0, 4.0, 0.5).propose(_req(tokens[:-1] + [1, 7, 1], 11), 8)
    assert len(high) < len(low)


def test_depth_bounds_match_plus_draft():
    block = list(range(100, 130))
    tokens = block + [1] + block[:10]
    for depth in (4, 8, 12):
        got = SuffixProposer(depth, 0, 4.0, 0.1).propose(_req(tokens, len(tokens)), 32)
        # the best match is depth - 1 tokens long... or shorter with more room: match + draft never exceed depth
        assert got == block[10:10 + len(got)] and 1 <= len(got) <= depth - 1
    assert len(SuffixProposer(8, 0, 4.0, 0.1).propose(_req(tokens, len(tokens)), 32)) == 6  # L = 2: 8 - 2


def test_draft_length_adapts_to_the_match():
    tokens = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 0]
    for matched, factor, want in [(1, 1.0, 1), (2, 1.0, 2), (4, 1.0, 4), (4, 0.5, 2), (2, 2.0, 4), (1, 0.5, 0)]:
        got = SuffixProposer(24, 0, factor, 0.1).propose(_req(tokens + tokens[:matched], 11), 16)
        assert got == tokens[matched:matched + want]


def test_eviction_keeps_the_newest_outputs():
    """Limit 3 (one request a generation: exact): each new request pushes out the oldest output."""
    proposer = SuffixProposer(24, 3, 1.0, 0.1)
    for out in ([30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]):
        r = _req([1] + out, 1)
        proposer.propose(r, 4)
        proposer.release(r)
    assert proposer.cache.num_cached == 3
    assert proposer.propose(_req([2, 30, 31], 1), 4) == []  # it joins the cache: the oldest output goes
    assert proposer.propose(_req([3, 50, 51], 1), 4) == [52, 53]  # (and the next oldest)
    assert proposer.propose(_req([4, 40, 41], 1), 4) == []
    assert proposer.cache.num_cached == 3 and len(proposer.cache.generations) == 3


def test_cache_generations_stay_within_the_limit():
    cache = SuffixCache(8, 10)
    for i in range(57):
        handle = cache.start()
        handle[0].sam.extend(handle[1], [i, i + 1])
        assert 7 <= cache.num_cached <= 10 or i < 7
        assert sum(g.started for g in cache.generations) == cache.num_cached
    assert SuffixCache(8, 0).start() is None


def test_a_dropped_generation_is_let_go_by_its_running_request():
    proposer = SuffixProposer(24, 1, 1.0, 0.1)
    long = _req([1, 2, 3], 1)
    proposer.propose(long, 4)
    gen = long.suffix_state.cached[0]
    proposer.propose(_req([9, 8], 1), 4)  # a new request takes the only place
    assert not gen.alive
    long.all_token_ids += [4]
    proposer.propose(long, 4)
    assert long.suffix_state.cached is None


def test_release_adds_the_last_tokens_and_drops_the_state():
    proposer = SuffixProposer(24, 10, 1.0, 0.1)
    r = _req([1, 60, 61], 1)
    proposer.propose(r, 4)
    r.all_token_ids += [62, 63]  # came with the request's last step
    proposer.release(r)
    assert r.suffix_state is None
    assert proposer.propose(_req([2, 60, 61, 62], 1), 4) == [63]


def test_automaton_counts_and_best_continuations():
    rng = random.Random(3)
    sam = SuffixAutomaton(5)
    seqs = [[], [], []]
    cursors = [sam.new_cursor() for _ in seqs]
    for _ in range(90):
        i = rng.randrange(3)
        t = rng.randrange(3)
        seqs[i].append(t)
        sam.append(cursors[i], t)
    for n in range(1, 6):
        for _ in range(20):
            s = [rng.randrange(3) for _ in range(n)]
            state, matched = sam.match(s)
            if matched == n:
                assert sam.count[state] == _count(seqs, s)
                follow = {q[i + n] for q in seqs for i in range(len(q) - n) if q[i:i + n] == s}
                if n < 5:  # (kept below the depth) the most frequent continuation, the smaller id on a tie
                    want = min(follow, key=lambda t: (-_count(seqs, s + [t]), t)) if follow else -1
                    assert sam.best[state] == want
            else:
                assert _count(seqs, s) == 0


def test_config():
    c = SpeculativeConfig.from_dict({"method": "suffix"})
    assert (c.method, c.num_speculative_tokens, c.suffix_decoding_max_tree_depth,
            c.suffix_decoding_max_cached_requests, c.suffix_decoding_max_spec_factor,
            c.suffix_decoding_min_token_prob) == ("suffix", 24, 24, 10000, 1.0, 0.1)
    c = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                     "suffix_decoding_max_tree_depth": 64, "suffix_decoding_max_cached_requests": 0,
                                     "suffix_decoding_max_spec_factor": 2, "suffix_decoding_min_token_prob": 0})
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob) == (8, 64, 0, 2.0, 0.0)
    assert SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 5}
                                       ).num_speculative_tokens == 5
    for bad, msg in [({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth 0 must be >= 1"),
                     ({"suffix_decoding_max_tree_depth": 2.5}, "suffix_decoding_max_tree_depth must be an integer"),
                     ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests -1"),
                     ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor -0.5"),
                     ({"suffix_decoding_max_spec_factor": "1"}, "suffix_decoding_max_spec_factor must be a number"),
                     ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob 1.5 must be in"),
                     ({"suffix_decoding_min_token_prob": True}, "suffix_decoding_min_token_prob must be a number"),
                     ({"suffix_decoding_max_tree_depth": 64}, "defaults to suffix_decoding_max_tree_depth .64."),
                     ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                     ({"prompt_lookup_max": 3}, "unsupported keys for suffix: prompt_lookup_max"),
                     ({"suffix_decoding_use_tree_spec": True}, "unsupported keys for suffix")]:
        with pytest.raises(SpeculativeConfigError, match=msg):
            SpeculativeConfig.from_dict({"method": "suffix", **bad})
    with pytest.raises(SpeculativeConfigError, match="unsupported keys for ngram: suffix_decoding_max_tree_depth"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "suffix_decoding_max_tree_depth": 4})
