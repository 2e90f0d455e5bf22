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
"""
import argparse
import collections
import heapq
import json
from collections import OrderedDict

BIG = 1e15


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


def make(name, cap):
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
    raise SystemExit('policy: unknown policy %r' % name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--trace', required=True)
    ap.add_argument('--capacity', default='2000', help='comma list of capacities in blocks')
    ap.add_argument('--policy', default='leaf-lru,probation-lag', help='comma list')
    a = ap.parse_args()
    trace = load(a.trace)
    total = sum(len(c) for c in trace)
    for cap in (int(x) for x in a.capacity.split(',')):
        for name in a.policy.split(','):
            cache = make(name, cap)
            hits = sum(cache.request(chain) for chain in trace)
            print('%s capacity %d %s %.4f' % (a.trace.split('/')[-1], cap, name, hits / total),
                  flush=True)


if __name__ == '__main__':
    main()
