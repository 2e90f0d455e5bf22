#!/usr/bin/python3
"""Python model of `kvrelay trace-replay` for screening eviction policies quickly (issue 17).

Same replay rule as ReplayRequestInto (cachestore/adaptive_policy.cc): a request's hits are its
longest run of leading cached blocks; then every block is accessed in order, inserted if missing
(its parent is the previous block), the request's blocks leased while it runs, eviction leaf-first
(a block with a cached child never goes). One tick per block access. Its leaf-lru reproduces the
C++ figure on the Mooncake trace (0.1464 at 2,000 blocks); its doorkeeper is exact (the C++
RecentFilter is a 4-way table of 16-bit fingerprints), so probation figures differ by ~1%.

  /usr/bin/python3 cachestore/tools/policy_model.py --trace T.jsonl --capacity 1000,2000 \\
      --policy leaf-lru,probation-lag,bip-block,lirs,lhd,lru2

Policies (constants in cache-fulls of block accesses unless said otherwise):
  leaf-lru         LRU over leaves.
  probation-lru    doorkeeper: a block not accessed within 8 caches is inserted below all others.
  probation-lag    + a re-fetched block (seen, but missed) ranks 1 cache behind a hit (the C++
                   default's third ranking). probation-lag:L sets the lag to L caches.
  penalty:U:S      bounded insertion penalty: unseen blocks U caches behind, re-fetched S.
  bip-block:E, bip-req:E, bip-root:E   bimodal insertion (Qureshi et al. ISCA'07): a miss
                   inserts at the LRU end (the newest such block goes first) unless chosen with
                   probability E (by block hash, by request, by root block); a hit moves to MRU.
  lirs:H           LIRS (Jiang & Zhang SIGMETRICS'02) with stack pruning, H = resident-HIR share
                   of the cache (default 0.01), non-resident entries bounded to 2 caches; the
                   victim is the first evictable resident HIR block, else the oldest LIR leaf.
  lhd              least hit density (Beckmann et al. NSDI'18): classes by lifetime access count
                   (0..5+), ages in 1/16 cache, hit/eviction age histograms halved every 4
                   caches, ranks re-computed every 1/16 cache.
  lru2, lru3       LRU-K (O'Neil et al. SIGMOD'93): rank by the K-th last access within 8
                   caches; blocks with fewer accesses go first.
  learned:W        LRB-style (Song et al. NSDI'20): evict the lowest-scored of 64 sampled
                   evictable leaves; the score is an online logistic regression for "accessed
                   within W caches" (default 1), refitted every 2,048 labels (class Learned).
  learned-hindsight  the same model fitted once on every label of a first pass (sees the future:
                   the best this model and its features can do).
Offline references (they read the trace's future):
  belady-leaf      furthest next use among evictable leaves, requests leased, every block
                   inserted: the C++ ReplayBeladyLeaf (0.3742 at 2k blocks of the shared trace).
  relaxed-oracle:W sampled eviction with a perfect "accessed within W caches" label.
  noisy-oracle:S   sampled eviction by log(next-use distance) + Gaussian noise of sigma S.
--report-auc prints, for the sampled policies, the AUC of the score among eviction candidates for
"accessed within 2 caches".
"""
import argparse
import collections
import heapq
import json
import math
import random
from collections import OrderedDict

import numpy as np

BIG = 1e15
NEVER = 1e12  # next use of a block never used again (below BIG, so ranks stay exact)


def load(path):
    return [json.loads(line)['hash_ids'] for line in open(path) if line.strip()]


def mix64(x):
    x = (x + 0x9e3779b97f4a7c15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class RankedCache:
    """Leaf-first cache ordered by a policy's priority (lowest goes first), lazy min-heap as the
    BlockIndex: a popped entry whose priority grew is re-queued."""

    def __init__(self, cap, pol):
        self.cap, self.pol = cap, pol
        self.present, self.parent = set(), {}
        self.nch = collections.Counter()
        self.heap, self.leased = [], set()
        pol.cache = self

    def evictable(self, h):
        return h in self.present and self.nch[h] == 0 and h not in self.leased

    def evict(self):
        while self.heap:
            p, h = heapq.heappop(self.heap)
            if not self.evictable(h):
                continue
            q = self.pol.prio(h)
            if q > p + 1e-9:
                heapq.heappush(self.heap, (q, h))
                continue
            self.present.discard(h)
            par = self.parent.pop(h)
            if par is not None:
                self.nch[par] -= 1
                if self.evictable(par):
                    heapq.heappush(self.heap, (self.pol.prio(par), par))
            self.pol.on_evict(h)
            return True
        return False

    def rerank(self):
        self.heap = [(self.pol.prio(h), h) for h in self.present if self.evictable(h)]
        heapq.heapify(self.heap)

    def request(self, chain):
        hits = 0
        while hits < len(chain) and chain[hits] in self.present:
            hits += 1
        self.pol.on_request(chain)
        leased, par = [], None
        for h in chain:
            if h in self.present:
                self.pol.on_access(h, True)
            else:
                while len(self.present) >= self.cap and self.evict():
                    pass
                if len(self.present) >= self.cap:
                    break
                self.present.add(h)
                self.parent[h] = par
                if par is not None:
                    self.nch[par] += 1
                self.pol.on_access(h, False)
            self.leased.add(h)
            leased.append(h)
            par = h
        for h in leased:
            self.leased.discard(h)
            if self.evictable(h):
                heapq.heappush(self.heap, (self.pol.prio(h), h))
        return hits


class Policy:
    def __init__(self, cap):
        self.cap, self.t = cap, 0

    def on_request(self, chain):
        self.chain = chain

    def on_evict(self, h):
        pass

    def after_request(self):
        pass


class LeafLru(Policy):
    def __init__(self, cap):
        super().__init__(cap)
        self.last = {}

    def on_access(self, h, hit):
        self.t += 1
        self.last[h] = self.t

    def prio(self, h):
        return self.last[h]


class Penalty(Policy):
    """Doorkeeper over `history` caches; unseen blocks rank `unseen` caches behind (None: below
    everything, i.e. probation), re-fetched blocks `refetch` caches behind, until their next hit."""

    def __init__(self, cap, unseen=None, refetch=0.0, history=8):
        super().__init__(cap)
        self.seen, self.p = {}, {}
        self.history, self.unseen, self.refetch = history * cap, unseen, refetch

    def on_access(self, h, hit):
        self.t += 1
        if hit:
            self.p[h] = self.t
        else:
            q = self.seen.get(h)
            if q is None or self.t - q > self.history:
                self.p[h] = (self.t - BIG) if self.unseen is None else self.t - self.unseen * self.cap
            else:
                self.p[h] = self.t - self.refetch * self.cap
        self.seen[h] = self.t

    def prio(self, h):
        return self.p[h]


class Bip(Policy):
    def __init__(self, cap, eps, select):
        super().__init__(cap)
        self.p, self.eps, self.select, self.requests = {}, eps, select, 0

    def on_request(self, chain):
        self.chain = chain
        self.requests += 1

    def on_access(self, h, hit):
        self.t += 1
        key = {'block': h, 'req': self.requests * 1000003, 'root': self.chain[0]}[self.select]
        if hit or (mix64(key) % 1000000) < self.eps * 1000000:
            self.p[h] = self.t
        else:
            self.p[h] = -self.t - BIG  # LRU end: the newest such block goes first

    def prio(self, h):
        return self.p[h]


class Lhd(Policy):
    def __init__(self, cap, age_units=16, max_age=256, classes=6, decay_caches=4.0):
        super().__init__(cap)
        self.unit, self.max_age, self.classes = max(1, cap / age_units), max_age, classes
        self.hits = [[0.0] * max_age for _ in range(classes)]
        self.evicts = [[0.0] * max_age for _ in range(classes)]
        self.density = [[1.0] * max_age for _ in range(classes)]
        self.decay_every, self.rerank_every = int(decay_caches * cap), max(1, cap // age_units)
        self.next_decay, self.next_rerank = self.decay_every, self.rerank_every
        self.last, self.klass, self.count = {}, {}, collections.Counter()

    def age(self, h):
        return min(self.max_age - 1, int((self.t - self.last[h]) / self.unit))

    def on_access(self, h, hit):
        self.t += 1
        if hit:
            self.hits[self.klass[h]][self.age(h)] += 1
        self.klass[h] = min(self.count[h], self.classes - 1)
        self.count[h] += 1
        self.last[h] = self.t
        if self.t >= self.next_decay:
            self.next_decay += self.decay_every
            for c in range(self.classes):
                hit_above = events_above = lifetime_above = 0.0
                for a in range(self.max_age - 1, -1, -1):
                    hit_above += self.hits[c][a]
                    events_above += self.hits[c][a] + self.evicts[c][a]
                    lifetime_above += events_above
                    self.density[c][a] = hit_above / lifetime_above if lifetime_above else 0.0
                self.hits[c] = [x / 2 for x in self.hits[c]]
                self.evicts[c] = [x / 2 for x in self.evicts[c]]
        if self.t >= self.next_rerank:
            self.next_rerank += self.rerank_every
            self.cache.rerank()

    def on_evict(self, h):
        self.evicts[self.klass[h]][self.age(h)] += 1

    def prio(self, h):
        return self.density[self.klass[h]][self.age(h)] + 1e-12 * self.last[h]


class LruK(Policy):
    def __init__(self, cap, k, history=8):
        super().__init__(cap)
        self.k, self.history, self.times = k, history * cap, {}

    def on_access(self, h, hit):
        self.t += 1
        ts = self.times.setdefault(h, collections.deque())
        ts.append(self.t)
        while ts and self.t - ts[0] > self.history:
            ts.popleft()
        while len(ts) > self.k:
            ts.popleft()

    def prio(self, h):
        ts = self.times[h]
        return ts[0] if len(ts) >= self.k else ts[-1] - BIG


class Lirs:
    """Own structure (not a ranking): LIR blocks keep 1 - H of the cache, resident HIR blocks the
    rest; a HIR block re-accessed while still in the stack S becomes LIR."""

    def __init__(self, cap, hir=0.01, nonresident_caches=2.0):
        self.cap, self.lhir = cap, max(2, int(cap * hir))
        self.S, self.Q = OrderedDict(), OrderedDict()
        self.lir, self.res, self.parent = set(), set(), {}
        self.nch, self.leased = collections.Counter(), set()
        self.max_nonres, self.nonres, self.warm = int(cap * nonresident_caches), 0, False

    def prune(self):
        while self.S:
            b = next(iter(self.S))
            if b in self.lir:
                break
            del self.S[b]
            if b not in self.res:
                self.nonres -= 1

    def demote_bottom(self):
        b = next(iter(self.S))
        self.lir.discard(b)
        del self.S[b]
        self.Q[b] = 1
        self.prune()

    def to_top(self, x):
        if x in self.S:
            self.S.move_to_end(x)
        else:
            self.S[x] = 1

    def evictable(self, b):
        return self.nch[b] == 0 and b not in self.leased

    def evict(self):
        self.warm = True
        victim = next((b for b in self.Q if self.evictable(b)), None)
        if victim is None:
            victim = next((b for b in self.S if b in self.lir and self.evictable(b)), None)
            if victim is None:
                return False
            self.lir.discard(victim)
            del self.S[victim]
        else:
            del self.Q[victim]
            if victim in self.S:
                self.nonres += 1
        self.res.discard(victim)
        p = self.parent.pop(victim)
        if p is not None:
            self.nch[p] -= 1
        while self.nonres > self.max_nonres:
            b = next(b for b in self.S if b not in self.res)
            del self.S[b]
            self.nonres -= 1
            self.prune()
        self.prune()
        return True

    def access(self, x, resident):
        if resident:
            if x in self.lir:
                self.to_top(x)
                self.prune()
            elif x in self.S:
                del self.Q[x]
                self.lir.add(x)
                self.to_top(x)
                self.demote_bottom()
            else:
                self.to_top(x)
                self.Q.move_to_end(x)
            return
        if not self.warm and len(self.lir) < self.cap - self.lhir:
            self.lir.add(x)
            self.to_top(x)
        elif x in self.S:
            self.nonres -= 1
            self.lir.add(x)
            self.to_top(x)
            self.demote_bottom()
        else:
            self.to_top(x)
            self.Q[x] = 1
        self.res.add(x)

    def request(self, chain):
        hits = 0
        while hits < len(chain) and chain[hits] in self.res:
            hits += 1
        par = None
        for h in chain:
            if h in self.res:
                self.access(h, True)
            else:
                while len(self.res) >= self.cap and self.evict():
                    pass
                if len(self.res) >= self.cap:
                    break
                self.parent[h] = par
                if par is not None:
                    self.nch[par] += 1
                self.access(h, False)
            self.leased.add(h)
            par = h
        self.leased.clear()
        return hits


def next_use_positions(trace):
    """For each request, the flat position (request offset + index) of each block's next access,
    NEVER when there is none: the oracles' clock, immune to a request cut short by a full cache."""
    offsets, total = [], 0
    for chain in trace:
        offsets.append(total)
        total += len(chain)
    nxt, last = [None] * len(trace), {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = [last.get(h, NEVER) for h in trace[i]]
        for j, h in enumerate(trace[i]):
            last[h] = offsets[i] + j
    return offsets, nxt


class OracleClock(Policy):
    """Knows each access's flat position and the accessed block's next use (offline only)."""

    def __init__(self, cap, trace_info):
        super().__init__(cap)
        self.offsets, self.nxt = trace_info
        self.req, self.pos, self.now, self.next = -1, 0, 0, {}

    def on_request(self, chain):
        self.chain = chain
        self.req += 1
        self.pos = 0

    def on_access(self, h, hit):
        self.t += 1
        self.now = self.offsets[self.req] + self.pos
        self.next[h] = self.nxt[self.req][self.pos]
        self.depth = self.pos
        self.pos += 1


class BeladyLeaf(OracleClock):
    """The constrained optimum of this replay rule (greedy): leaf-first, the request's blocks
    leased, every block inserted; evict the evictable leaf used furthest in the future (on a tie
    the deeper block, as the C++ ReplayBelady's heap order does)."""

    def __init__(self, cap, trace_info):
        super().__init__(cap, trace_info)
        self.depth_of = {}

    def on_access(self, h, hit):
        super().on_access(h, hit)
        self.depth_of[h] = self.depth

    def prio(self, h):
        return -self.next[h] - 1e-4 * self.depth_of[h]


class SampledCache(RankedCache):
    """LRB's eviction step (Song et al., NSDI 2020): the victim is the lowest-scored of 64
    evictable leaves drawn at random (all of them when fewer), so a score may change with time."""

    def __init__(self, cap, pol, sample=64, seed=1):
        super().__init__(cap, pol)
        self.sample, self.rng = sample, random.Random(seed)
        self.ev_list, self.ev_pos = [], {}

    def _sync(self, h):
        if self.evictable(h):
            if h not in self.ev_pos:
                self.ev_pos[h] = len(self.ev_list)
                self.ev_list.append(h)
        elif h in self.ev_pos:
            i = self.ev_pos.pop(h)
            last = self.ev_list.pop()
            if i < len(self.ev_list):
                self.ev_list[i], self.ev_pos[last] = last, i

    def evict(self):
        if not self.ev_list:
            return False
        n = len(self.ev_list)
        cand = (list(self.ev_list) if n <= self.sample else
                [self.ev_list[self.rng.randrange(n)] for _ in range(self.sample)])
        scores = self.pol.score(cand)
        victim = cand[min(range(len(cand)), key=scores.__getitem__)]
        self.present.discard(victim)
        self._sync(victim)
        par = self.parent.pop(victim)
        if par is not None:
            self.nch[par] -= 1
            self._sync(par)
        self.pol.on_evict(victim)
        return True

    def request(self, chain):
        hits = 0
        while hits < len(chain) and chain[hits] in self.present:
            hits += 1
        self.pol.on_request(chain)
        truth = getattr(self.pol, 'truth', None)
        if truth is not None and truth is not self.pol:
            truth.on_request(chain)
        leased, par = [], None
        for h in chain:
            if truth is not None and truth is not self.pol:
                truth.on_access(h, h in self.present)
            if h in self.present:
                self.leased.add(h)
                self._sync(h)
                self.pol.on_access(h, True)
            else:
                while len(self.present) >= self.cap and self.evict():
                    pass
                if len(self.present) >= self.cap:
                    break
                self.present.add(h)
                self.parent[h] = par
                if par is not None:
                    self.nch[par] += 1
                    self._sync(par)
                self.leased.add(h)
                self.pol.on_access(h, False)
            leased.append(h)
            par = h
        for h in leased:
            self.leased.discard(h)
            self._sync(h)
        self.pol.after_request()
        return hits


class RelaxedOracle(OracleClock):
    """A perfect LRB label: a candidate reused within W caches of accesses is kept, the others go
    first (LRU among equals). The ceiling of a binary 'reused within W' predictor."""

    def __init__(self, cap, trace_info, window=1.0):
        super().__init__(cap, trace_info)
        self.window, self.last = window * cap, {}

    def on_access(self, h, hit):
        super().on_access(h, hit)
        self.last[h] = self.t

    def score(self, hs):
        return [(BIG if self.next[h] - self.now <= self.window else 0) + self.last[h] for h in hs]

    def after_request(self):
        pass


class NoisyOracle(OracleClock):
    """log(next-use distance) plus Gaussian noise of sigma (one draw per access): how good a
    predictor of the next use must be; `--report-auc` prints its AUC among candidates."""

    def __init__(self, cap, trace_info, sigma):
        super().__init__(cap, trace_info)
        self.sigma, self.noise, self.rng, self.pairs = sigma, {}, random.Random(7), []

    def on_access(self, h, hit):
        super().on_access(h, hit)
        self.noise[h] = self.rng.gauss(0, self.sigma)

    def score(self, hs):
        out = [-math.log(max(1, self.next[h] - self.now) / self.cap) + self.noise[h] for h in hs]
        record_pairs(self, hs, out)
        return out

    def after_request(self):
        pass


def record_pairs(pol, hs, scores):
    """Samples 5% of (score, reused within 2 caches) among candidates for --report-auc."""
    info = getattr(pol, 'truth', None)
    if info is None:
        return
    for h, sc in zip(hs, scores):
        if pol.auc_rng.random() < 0.05:
            pol.pairs.append((sc, 1 if info.next[h] - info.now <= 2 * pol.cap else 0))


class Learned(Policy):
    """LRB-style learned eviction score, trained online: every 1/16 cache of accesses the
    features of 32 random evictable blocks are recorded; one cache of accesses later each gets its
    label (was it accessed within that cache: the relaxed Belady boundary); every 2,048 labels a
    logistic regression is refitted on that window (features standardized on it, 50 full-batch
    gradient steps, warm start). Until the first fit, LRU. Features: log lifetime access count,
    log age, the last 3 reuse gaps (log, in caches) with presence bits, log depth, log request
    length, log children ever cached, last access a hit, log blocks after it in its request,
    count x age."""

    FEATURES = 14

    def __init__(self, cap, window=1.0, fixed=None, keep_all=False):
        super().__init__(cap)
        self.window = window * cap
        self.last, self.count, self.gaps = {}, collections.Counter(), {}
        self.depth, self.reqlen, self.tail, self.lasthit = {}, {}, {}, {}
        self.kids = collections.Counter()
        self.pending, self.open, self.reused = collections.deque(), collections.defaultdict(list), {}
        self.xs, self.ys, self.all_xs, self.all_ys, self.keep_all = [], [], [], [], keep_all
        self.w, self.mu, self.sd = None, None, None
        if fixed is not None:
            self.w, self.mu, self.sd = fixed
        self.fixed = fixed is not None
        self.rng, self.next_sample, self.pos = random.Random(1), 0, 0

    def on_request(self, chain):
        self.chain, self.pos = chain, 0

    def on_access(self, h, hit):
        self.t += 1
        if h in self.last:
            g = self.gaps.setdefault(h, [])
            g.append(self.t - self.last[h])
            del g[:-3]
        for key in self.open.pop(h, ()):
            self.reused[key] = self.t - key[1] <= self.window
        if self.pos > 0 and not hit:
            self.kids[self.chain[self.pos - 1]] += 1
        self.last[h] = self.t
        self.count[h] += 1
        n = len(self.chain)
        self.depth[h], self.reqlen[h], self.tail[h] = self.pos, n, n - 1 - self.pos
        self.lasthit[h] = hit
        self.pos += 1

    def features(self, h):
        g = self.gaps.get(h, ())
        f = [math.log1p(self.count[h]), math.log1p((self.t - self.last[h]) / self.cap)]
        f += [math.log1p(g[-1 - k] / self.cap) if len(g) > k else 5.0 for k in range(3)]
        f += [1.0 if len(g) > k else 0.0 for k in range(3)]
        f += [math.log1p(self.depth[h]), math.log1p(self.reqlen[h]), math.log1p(self.kids[h]),
              1.0 if self.lasthit[h] else 0.0, math.log1p(self.tail[h]), f[0] * f[1]]
        return f

    def after_request(self):
        if self.t >= self.next_sample and self.cache.ev_list:
            self.next_sample = self.t + max(1, self.cap // 16)
            ev = self.cache.ev_list
            for _ in range(32):
                h = ev[self.rng.randrange(len(ev))]
                self.pending.append(((h, self.t), self.features(h)))
                self.open[h].append((h, self.t))
        while self.pending and self.t - self.pending[0][0][1] > self.window:
            key, f = self.pending.popleft()
            self.xs.append(f)
            self.ys.append(1.0 if self.reused.pop(key, False) else 0.0)
        if len(self.xs) >= 2048:
            if self.keep_all:
                self.all_xs += self.xs
                self.all_ys += self.ys
            if not self.fixed:
                self.w, self.mu, self.sd = fit_logistic(self.xs, self.ys, self.w)
            self.xs, self.ys = [], []

    def score(self, hs):
        if self.w is None:
            return [self.last[h] for h in hs]
        x = (np.array([self.features(h) for h in hs]) - self.mu) / self.sd
        out = list(x @ self.w[:-1] + self.w[-1])
        record_pairs(self, hs, out)
        return out


def fit_logistic(xs, ys, warm=None, steps=50, rate=1.0, l2=1e-3):
    x, y = np.array(xs), np.array(ys)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = np.hstack([(x - mu) / sd, np.ones((len(y), 1))])
    w = np.zeros(z.shape[1]) if warm is None else warm.copy()
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(z @ w)))
        w -= rate * (z.T @ (p - y) / len(y) + l2 * w)
    return w, mu, sd


def auc(pairs):
    s = np.array([p[0] for p in pairs])
    y = np.array([p[1] for p in pairs])
    ranks = np.empty(len(s))
    ranks[s.argsort()] = np.arange(1, len(s) + 1)
    n1, n0 = y.sum(), len(y) - y.sum()
    return (ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0) if n1 and n0 else float('nan')


def make(name, cap, trace_info=None):
    kind, _, arg = name.partition(':')
    args = [float(a) for a in arg.split(':')] if arg else []
    if kind == 'leaf-lru':
        return RankedCache(cap, LeafLru(cap))
    if kind == 'probation-lru':
        return RankedCache(cap, Penalty(cap))
    if kind == 'probation-lag':
        return RankedCache(cap, Penalty(cap, refetch=args[0] if args else 1.0))
    if kind == 'penalty':
        return RankedCache(cap, Penalty(cap, unseen=args[0], refetch=args[1]))
    if kind.startswith('bip-'):
        return RankedCache(cap, Bip(cap, args[0] if args else 1 / 16, kind[4:]))
    if kind == 'lirs':
        return Lirs(cap, args[0] if args else 0.01)
    if kind == 'lhd':
        return RankedCache(cap, Lhd(cap))
    if kind in ('lru2', 'lru3'):
        return RankedCache(cap, LruK(cap, int(kind[3])))
    if kind == 'belady-leaf':
        return RankedCache(cap, BeladyLeaf(cap, trace_info))
    if kind == 'relaxed-oracle':
        return SampledCache(cap, RelaxedOracle(cap, trace_info, args[0] if args else 1.0))
    if kind == 'noisy-oracle':
        return SampledCache(cap, NoisyOracle(cap, trace_info, args[0] if args else 1.0))
    if kind == 'learned':
        return SampledCache(cap, Learned(cap, args[0] if args else 1.0))
    raise SystemExit('policy: unknown policy %r' % name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--trace', required=True)
    ap.add_argument('--capacity', default='2000', help='comma list of capacities in blocks')
    ap.add_argument('--policy', default='leaf-lru,probation-lag', help='comma list')
    ap.add_argument('--report-auc', action='store_true',
                    help='for sampled policies: AUC of the score among eviction candidates for '
                    '"used again within 2 caches"')
    a = ap.parse_args()
    trace = load(a.trace)
    total = sum(len(c) for c in trace)
    info = next_use_positions(trace)
    for cap in (int(x) for x in a.capacity.split(',')):
        for name in a.policy.split(','):
            if name == 'learned-hindsight':
                # The same model fitted once on every label of a first pass (hindsight), then
                # replayed with those weights: what the features can do at best for this model.
                first = make('learned', cap, info)
                first.pol.keep_all = True
                for chain in trace:
                    first.request(chain)
                fixed = (fit_logistic(first.pol.all_xs, first.pol.all_ys, steps=300)
                         if first.pol.all_xs else None)  # no window of labels: LRU throughout
                cache = SampledCache(cap, Learned(cap, fixed=fixed))
            else:
                cache = make(name, cap, info)
            if a.report_auc and isinstance(cache, SampledCache):
                cache.pol.truth = (cache.pol if isinstance(cache.pol, OracleClock) else
                                   OracleClock(cap, info))
                cache.pol.pairs, cache.pol.auc_rng = [], random.Random(3)
            hits = sum(cache.request(chain) for chain in trace)
            extra = ''
            if a.report_auc and getattr(cache.pol, 'pairs', None):
                extra = ' candidate-auc %.3f' % auc(cache.pol.pairs)
            print('%s capacity %d %s %.4f%s' % (a.trace.split('/')[-1], cap, name, hits / total,
                                                extra), flush=True)


if __name__ == '__main__':
    main()
