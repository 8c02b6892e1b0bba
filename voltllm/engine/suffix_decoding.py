"""Suffix decoding (`--speculative-config '{"method": "suffix", ...}'`, vLLM's method, from Arctic Inference): drafts
from the continuations of the sequence's latest tokens seen before, in the request's own prompt and output and in a
cache of recent requests' outputs.

Each source is a suffix automaton (`SuffixAutomaton`): every substring of its sequences is a state, reached from
the root by its tokens; one sequence token is an amortized O(1) append, and each state counts its occurrences.
Counts are kept for substrings of at most `suffix_decoding_max_tree_depth` (D) tokens only, so one append updates at
most D counts (those of the new end's suffixes up to D tokens), as a suffix tree cut at depth D would hold them.

A proposal takes the pattern, the sequence's last D tokens, and for each match length L (1 .. len(pattern) - 1) whose
suffix of the pattern occurs in the source, follows the most frequent continuation token by token while the
product of its empirical probabilities (count(s t) / count(s)) stays >= suffix_decoding_min_token_prob, for at most
min(K, floor(L * suffix_decoding_max_spec_factor), D - L) tokens (the match and the draft within depth D). The draft
with the highest score (the sum of those probabilities; the longer match on a tie) wins; the cache's draft replaces
the request's own only with a higher score. Drafts are verified as every speculative method's (engine/speculative.py).

The cache (`SuffixCache`) holds the outputs of up to suffix_decoding_max_cached_requests requests (0: none; each
joins at its first proposal and grows as it decodes). It is kept in generations of about a quarter of the limit
each: when a new request would exceed the limit, the oldest generation is dropped whole (its automaton freed), so it
keeps between three quarters of the limit and the limit (exactly the limit for limits up to 4), oldest out first.
A request's own automaton lives on the request (`Request.suffix_state`) and is dropped when it finishes or is
aborted (`SuffixProposer.release`).
"""
from __future__ import annotations

from collections import deque
from typing import Optional

# the cache's generations (at most this many, each of about limit / GENERATIONS requests)
GENERATIONS = 4


class SuffixAutomaton:
    """A suffix automaton over one or more token sequences (appended in any interleaving), with depth-bounded
    occurrence counts. State 0 is the root (the empty string); `nxt[s]` maps a token to the state of the extended
    string, `link[s]` is the state of its longest suffix in another state, `length[s]` its longest string's
    length; a state holds the strings of lengths length[link[s]] + 1 .. length[s], which all occur at the same ends.
    `count[s]` is that number of ends, kept for states holding a string of at most `depth` tokens; `best[s]` the
    token of its most frequent continuation (the smaller id on a tie; -1: none), kept for states holding a string of
    fewer than `depth` tokens: one child's count grows at a time, so the best is the old one or that child."""

    def __init__(self, depth: int):
        self.depth = depth
        self.nxt: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.count: list[int] = [0]
        self.best: list[int] = [-1]
        self.appends = 0  # tokens appended: a match made at one count holds while it stays

    @property
    def num_states(self) -> int:
        return len(self.length)

    def new_cursor(self) -> list[int]:
        """A sequence's place in the automaton: [state of the whole sequence, state of its last min(depth, n)
        tokens, n]."""
        return [0, 0, 0]

    def append(self, cursor: list[int], token: int) -> None:
        """Extend the cursor's sequence by one token, and count the new end of each of its suffixes of <= depth
        tokens; the states of the old end's suffixes, each now followed by the token, may take it as their best."""
        before = cursor[1]
        self.appends += 1
        last = self._extend(cursor[0], token)
        n = cursor[2] + 1
        length, link, depth = self.length, self.link, self.depth
        if n <= depth:
            short = last
        else:  # the last depth - 1 tokens before, then the token (a clone may have taken the old state's place)
            v = cursor[1]
            while v and length[link[v]] >= depth - 1:
                v = link[v]
            short = self.nxt[v][token]
        cursor[0], cursor[1], cursor[2] = last, short, n
        count = self.count
        v = short
        while v > 0:
            count[v] += 1
            v = link[v]
        nxt, best = self.nxt, self.best
        v = before  # (its chain runs through any state split off it)
        while v != -1:
            b = best[v]
            if b != token:
                if b < 0:
                    best[v] = token
                else:
                    mine, theirs = count[nxt[v][token]], count[nxt[v][b]]
                    if mine > theirs or mine == theirs and token < b:
                        best[v] = token
            v = link[v]

    def extend(self, cursor: list[int], tokens) -> None:
        for t in tokens:
            self.append(cursor, t)

    def _new(self, length: int, nxt: dict, link: int, count: int, best: int) -> int:
        self.nxt.append(nxt)
        self.link.append(link)
        self.length.append(length)
        self.count.append(count)
        self.best.append(best)
        return len(self.length) - 1

    def _extend(self, last: int, token: int) -> int:
        """The state of the sequence whose state is `last`, one token longer (created, or split off one)."""
        nxt, length, link = self.nxt, self.length, self.link
        q = nxt[last].get(token)
        if q is not None:  # another sequence has this string already
            return q if length[q] == length[last] + 1 else self._split(last, q, token)
        cur = self._new(length[last] + 1, {}, 0, 0, -1)
        p = last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            link[cur] = q if length[p] + 1 == length[q] else self._split(p, q, token)
        return cur

    def _split(self, p: int, q: int, token: int) -> int:
        """Move the strings of q up to length[p] + 1 tokens into a state of their own (they now also end where q's
        longer strings do not), redirecting p's suffixes' transitions to it."""
        nxt, link = self.nxt, self.link
        c = self._new(self.length[p] + 1, dict(nxt[q]), link[q], self.count[q], self.best[q])
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = c
            p = link[p]
        link[q] = c
        return c

    def match(self, tokens, v: int = 0, n: int = 0) -> tuple[int, int]:
        """(state, length) of the longest suffix of the text matched at (v, n) followed by `tokens` that occurs in
        the automaton (from the root: of `tokens`), kept to at most `depth` tokens."""
        nxt, link, length, depth = self.nxt, self.link, self.length, self.depth
        for t in tokens:
            while v and t not in nxt[v]:
                v = link[v]
                n = length[v]
            child = nxt[v].get(t)
            if child is not None:
                v, n = child, n + 1
                if n > depth:
                    n = depth
                    while length[link[v]] >= depth:
                        v = link[v]
        return v, n


class Draft:
    __slots__ = ("tokens", "score", "match_len")

    def __init__(self, tokens: list[int], score: float, match_len: int):
        self.tokens, self.score, self.match_len = tokens, score, match_len


_EMPTY = Draft([], 0.0, 0)


def _path(sources: list[tuple[SuffixAutomaton, int]], cap: int, min_prob: float) -> tuple[list[int], list[float]]:
    """The most frequent continuation of the context held by `sources` (an automaton and the context's state in it;
    over several, the best of each one's best tokens by their summed counts, the smaller id on a tie), up to `cap`
    tokens while its probability stays >= min_prob; with the running sum of those probabilities after each
    token."""
    tokens: list[int] = []
    scores: list[float] = []
    prob, score = 1.0, 0.0
    while len(tokens) < cap:
        if len(sources) == 1:
            sam, s = sources[0]
            best = sam.best[s]
            if best < 0:
                break
            total, best_n = sam.count[s], sam.count[sam.nxt[s][best]]
        else:
            total, best, best_n = 0, -1, 0
            for sam, s in sources:
                total += sam.count[s]
            for tok in {sam.best[s] for sam, s in sources}:
                if tok < 0:
                    continue
                n = 0
                for sam, s in sources:
                    child = sam.nxt[s].get(tok)
                    if child is not None:
                        n += sam.count[child]
                if n > best_n or n == best_n and tok < best:
                    best, best_n = tok, n
            if best < 0:
                break
        prob *= best_n / total
        if prob < min_prob:
            break
        tokens.append(best)
        score += prob
        scores.append(score)
        sources = [(sam, sam.nxt[s][best]) for sam, s in sources if best in sam.nxt[s]]
    return tokens, scores


# a run of match lengths hi .. lo (hi >= lo >= 1) whose contexts are the same states: [(automaton, state), ...]
Group = tuple[int, int, list[tuple[SuffixAutomaton, int]]]


def best_draft(groups: list[Group], depth: int, max_tokens: int, factor: float, min_prob: float) -> Draft:
    """The best-scoring draft over the match lengths, given as groups, longest first. Each match length L may take
    min(max_tokens, floor(L * factor), depth - L) tokens; a shorter match replaces the best only with a higher
    score. A group's path is found once (the most any of its lengths may take); a group whose lengths cannot reach
    the best's score (a score is at most its token count) or whose states have no continuation is skipped."""
    best = _EMPTY
    for hi, lo, sources in groups:
        if min(max_tokens, int(hi * factor + 1e-6), depth - lo) <= best.score:
            continue
        if not any(sam.nxt[v] for sam, v in sources):  # (the others' counts still weigh in the probabilities)
            continue
        caps = [(L, min(max_tokens, int(L * factor + 1e-6), depth - L)) for L in range(hi, lo - 1, -1)]
        tokens, scores = _path(sources, max(c for _, c in caps), min_prob)
        for L, cap in caps:
            n = min(cap, len(tokens))
            if n and scores[n - 1] > best.score:
                best = Draft(tokens[:n], scores[n - 1], L)
    return best


def _chain(sam: SuffixAutomaton, state: int, longest: int) -> list[tuple[int, int, int]]:
    """(hi, lo, state) for the match lengths longest .. 1 of the string matched at `state` (its suffixes, walking
    suffix links: each state holds the lengths length[link] + 1 .. length)."""
    link, length = sam.link, sam.length
    out = []
    v, hi = state, longest
    while hi >= 1:
        while length[link[v]] >= hi:
            v = link[v]
        lo = length[link[v]] + 1
        out.append((hi, lo, v))
        hi = lo - 1
    return out


def _merge(chains: list[tuple[SuffixAutomaton, list[tuple[int, int, int]]]]) -> list[Group]:
    """The groups of several automata's chains: runs of match lengths over which every automaton matching them
    keeps its state (an automaton whose match is shorter joins below its length)."""
    if len(chains) == 1:
        sam, chain = chains[0]
        return [(hi, lo, [(sam, v)]) for hi, lo, v in chain]
    groups: list[Group] = []
    at = [0] * len(chains)
    top = max(chain[0][0] for _, chain in chains)
    hi = top
    while hi >= 1:
        lo, sources = 1, []
        for i, (sam, chain) in enumerate(chains):
            if chain[0][0] < hi:  # matches shorter: joins at its length
                lo = max(lo, chain[0][0] + 1)
                continue
            while chain[at[i]][1] > hi:
                at[i] += 1
            g_hi, g_lo, v = chain[at[i]]
            lo = max(lo, g_lo)
            sources.append((sam, v))
        groups.append((hi, lo, sources))
        hi = lo - 1
    return groups


class _Generation:
    __slots__ = ("sam", "started", "alive", "serial")

    def __init__(self, depth: int, serial: int):
        self.sam = SuffixAutomaton(depth)
        self.started = 0  # requests whose outputs it holds
        self.alive = True
        self.serial = serial


class SuffixCache:
    """The outputs of recent requests (suffix_decoding_max_cached_requests of them at most), in generations of
    automata; the oldest generation goes whole when a new request would pass the limit."""

    def __init__(self, depth: int, max_requests: int):
        self.depth, self.max_requests = depth, max_requests
        n = min(GENERATIONS, max_requests) or 1
        self.per_generation = -(-max_requests // n)
        self.generations: deque[_Generation] = deque()
        self.num_cached = 0
        self._serials = 0

    def start(self) -> Optional[tuple[_Generation, list[int]]]:
        """A new request's place for its output (None when the cache is off)."""
        if self.max_requests == 0:
            return None
        if not self.generations or self.generations[-1].started >= self.per_generation:
            self._serials += 1
            self.generations.append(_Generation(self.depth, self._serials))
        gen = self.generations[-1]
        gen.started += 1
        self.num_cached += 1
        while self.num_cached > self.max_requests:
            old = self.generations.popleft()
            old.alive = False
            self.num_cached -= old.started
        return gen, gen.sam.new_cursor()

    def groups(self, tokens: list[int], longest: int, matches: dict[int, list[int]]) -> list[Group]:
        """The match-length groups of the suffixes of the request's tokens (up to `longest` of them) in the
        generations. `matches` keeps the request's match in each generation ([state, length, the generation's
        appends, tokens]): one that no append has changed since goes on with the new tokens only (most
        generations hold finished requests' outputs); the others match the last `depth` tokens anew."""
        chains = []
        for gen in self.generations:
            sam = gen.sam
            m = matches.get(gen.serial)
            if m is not None and m[2] == sam.appends:
                state, n = sam.match(tokens[m[3]:], m[0], m[1])
            else:
                state, n = sam.match(tokens[-self.depth:])
            matches[gen.serial] = [state, n, sam.appends, len(tokens)]
            if n:
                chains.append((sam, _chain(sam, state, min(n, longest))))
        if len(matches) > len(self.generations):  # (a dropped generation's)
            live = {gen.serial for gen in self.generations}
            for serial in [s for s in matches if s not in live]:
                del matches[serial]
        return _merge(chains) if chains else []


class SuffixState:
    """One request's suffix-decoding state: the automaton of its prompt and output, and its output's place in the
    cache."""
    __slots__ = ("sam", "cursor", "seen", "cached", "cached_seen", "matches")

    def __init__(self, depth: int, cached: Optional[tuple[_Generation, list[int]]]):
        self.sam = SuffixAutomaton(depth)
        self.cursor = self.sam.new_cursor()
        self.seen = 0  # tokens in the automaton
        self.cached = cached
        self.cached_seen = 0  # output tokens in the cache
        self.matches: dict[int, list[int]] = {}  # its match in each generation of the cache (SuffixCache.groups)


class SuffixProposer:
    """Drafts for the scheduler's decoding requests (SpeculativeConfig's suffix_decoding_* settings)."""

    def __init__(self, depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float):
        self.depth, self.factor, self.min_prob = depth, max_spec_factor, min_token_prob
        self.cache = SuffixCache(depth, max_cached_requests)

    def propose(self, req, k: int) -> list[int]:
        """Up to k drafts after the request's tokens (req.all_token_ids), its state brought up to date first."""
        state = req.suffix_state
        if state is None:
            state = req.suffix_state = SuffixState(self.depth, self.cache.start())
        tokens = req.all_token_ids
        self._sync(state, tokens, req.num_prompt_tokens)
        if k <= 0:
            return []
        pattern = tokens[-self.depth:]
        longest = len(pattern) - 1
        own = _merge([(state.sam, _chain(state.sam, state.cursor[1], longest))]) if longest else []
        draft = best_draft(own, self.depth, k, self.factor, self.min_prob)
        if self.cache.generations and longest:
            groups = self.cache.groups(tokens, longest, state.matches)
            shared = best_draft(groups, self.depth, k, self.factor, self.min_prob)
            if shared.score > draft.score:
                draft = shared
        return draft.tokens

    def release(self, req) -> None:
        """A finished or aborted request: the rest of its output joins the cache, its own automaton is dropped."""
        state = req.suffix_state
        if state is not None:
            self._sync_cached(state, req.all_token_ids, req.num_prompt_tokens)
            req.suffix_state = None

    def _sync(self, state: SuffixState, tokens: list[int], num_prompt: int) -> None:
        if state.seen < len(tokens):
            state.sam.extend(state.cursor, tokens[state.seen:])
            state.seen = len(tokens)
        self._sync_cached(state, tokens, num_prompt)

    @staticmethod
    def _sync_cached(state: SuffixState, tokens: list[int], num_prompt: int) -> None:
        if state.cached is None:
            return
        gen, cursor = state.cached
        if not gen.alive:  # its generation was dropped: let its automaton go
            state.cached = None
            return
        start = num_prompt + state.cached_seen
        if start < len(tokens):
            gen.sam.extend(cursor, tokens[start:])
            state.cached_seen = len(tokens) - num_prompt
