#!/usr/bin/python3
"""Structural facts behind cachestore/README.md's "Learned eviction" section (issue 17).

  /usr/bin/python3 cachestore/tools/trace_analysis.py --trace T.jsonl --capacity 1000,2000

Prints, per capacity:
  * Belady as the C++ ReplayBelady runs it (bypass, no leases, not leaf-first; on equal next use
    the larger id goes first), with the share of cached blocks whose parent is not cached
    (orphans, sampled every 20 requests) and the share of accesses that find a cached block
    behind a missing one (cached, yet no hit); then the same with the opposite tie order.
  * belady-leaf (policy_model.py's, = C++ ReplayBeladyLeaf): of all re-accesses, by the gap
    since the block's previous access (log2 bins of 1 + gap / capacity), how many found the block
    cached.
With --knowledge, instead: what a frequency ranking must know, and when, to reach its ceiling
(the rankings of `knowledge_rankings`, replayed by policy_model.py's leaf-first cache), and how
well what is known online at a root's second and third request predicts that it will be hot.
Then, once: of the requests whose root block is new, the share whose root is requested again
(and the median number of requests until it is), by request length (log2 bins of blocks) and the AUC of the length for it; and over all
re-accesses, the AUC for "accessed again within 4 caches of 2,000 blocks" of the last gap in
accesses, in milliseconds (the trace's timestamps) and of the access count.
"""
import argparse
import collections
import heapq
import json
import math

import numpy as np

import policy_model as pm


def auc(scores, labels):
    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=float)
    ranks = np.empty(len(s))
    # Average ranks over ties so a constant score gives 0.5.
    order = s.argsort(kind='stable')
    sorted_s = s[order]
    ranks_sorted = np.arange(1, len(s) + 1, dtype=float)
    start = 0
    while start < len(s):
        end = start
        while end + 1 < len(s) and sorted_s[end + 1] == sorted_s[start]:
            end += 1
        ranks_sorted[start:end + 1] = (start + end + 2) / 2
        start = end + 1
    ranks[order] = ranks_sorted
    n1, n0 = y.sum(), len(y) - y.sum()
    return (ranks[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)


def belady_orphans(trace, cap, deeper_first):
    nxt, last = [None] * len(trace), {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = [last.get(h, 10**12) for h in trace[i]]
        for h in trace[i]:
            last[h] = i
    parent = {}
    for chain in trace:
        for j, h in enumerate(chain):
            parent.setdefault(h, chain[j - 1] if j else None)
    tie = (lambda h: -h) if deeper_first else (lambda h: h)
    cached, heap, hits, total, behind, orphan_shares = {}, [], 0, 0, 0, []
    for i, chain in enumerate(trace):
        k = 0
        while k < len(chain) and chain[k] in cached:
            k += 1
        hits, total = hits + k, total + len(chain)
        behind += sum(1 for h in chain[k:] if h in cached)
        for j, h in enumerate(chain):
            nu = nxt[i][j]
            if h not in cached and len(cached) >= cap:
                while True:
                    p, x = heap[0]
                    if tie(x) in cached and cached[tie(x)] == -p:
                        break
                    heapq.heappop(heap)
                if -heap[0][0] <= nu:
                    continue  # the newcomer is needed last: not cached
                del cached[tie(heapq.heappop(heap)[1])]
            cached[h] = nu
            heapq.heappush(heap, (-nu, tie(h)))
        if i % 20 == 0 and cached:
            orphan_shares.append(sum(1 for h in cached if parent[h] is not None and
                                     parent[h] not in cached) / len(cached))
    return hits / total, sum(orphan_shares) / len(orphan_shares), behind / total


def belady_leaf_hits_by_gap(trace, cap):
    info = pm.next_use_positions(trace)

    class Spy(pm.BeladyLeaf):
        def __init__(self):
            super().__init__(cap, info)
            self.prev, self.reuses, self.found = {}, collections.Counter(), collections.Counter()

        def on_access(self, h, hit):
            super().on_access(h, hit)
            if h in self.prev:
                b = min(6, int(math.log2(1 + (self.now - self.prev[h]) / cap)))
                self.reuses[b] += 1
                self.found[b] += 1 if hit else 0
            self.prev[h] = self.now

    cache = pm.RankedCache(cap, Spy())
    hits = sum(cache.request(chain) for chain in trace)
    return hits / sum(len(c) for c in trace), cache.pol


class Frequency(pm.Policy):
    """Leaf-first ranking by a per-block value, LRU among equal values: `value(policy, h)` is
    called at each access; None puts the block on probation (below every valued block)."""

    def __init__(self, cap, value):
        super().__init__(cap)
        self.value, self.n, self.p = value, collections.Counter(), {}

    def on_access(self, h, hit):
        self.t += 1
        self.n[h] += 1
        v = self.value(self, h)
        self.p[h] = self.t - pm.BIG if v is None else v * pm.BIG / 1e6 + self.t

    def prio(self, h):
        return self.p[h]


def root_uses(trace):
    """Root block -> the indices of the requests it heads."""
    uses = collections.defaultdict(list)
    for i, chain in enumerate(trace):
        if chain:
            uses[chain[0]].append(i)
    return uses


def knowledge_rankings(uses_in_all):
    """(name, value) pairs: oracles that know a block's total number of uses (from its k-th use
    on) or only whether it is hot (>= 8 uses), against online counts. Values are in units that
    dominate recency except `count-bonus`, which adds half a cache of recency per earlier use."""
    first = lambda k: (lambda p, h: None if p.n[h] < k else uses_in_all[h])
    rows = [('oracle: total uses, known from the 1st use', first(1)),
            ('oracle: total uses, known from the 2nd use', first(2)),
            ('oracle: total uses, known from the 3rd use', first(3)),
            ('oracle: hot (>= 8 uses) or not, known from the 2nd use',
             lambda p, h: None if p.n[h] < 2 else (1 if uses_in_all[h] >= 8 else 0))]
    for k in (3, 4, 8):
        rows.append(('online: uses so far >= %d, or not' % k,
                     lambda p, h, k=k: None if p.n[h] < 2 else (1 if p.n[h] >= k else 0)))
    rows.append(('online: uses so far (LFU with unbounded history)',
                 lambda p, h: None if p.n[h] < 2 else p.n[h]))
    rows.append(('online: count-bonus, LRU + half a cache per earlier use',
                 lambda p, h: None if p.n[h] < 2 else 0.5e6 / pm.BIG * p.cap * (p.n[h] - 1)))
    return rows


def knowledge(trace, caps):
    total = sum(len(c) for c in trace)
    uses_in_all = collections.Counter(h for chain in trace for h in chain)
    for cap in caps:
        lru = pm.RankedCache(cap, pm.LeafLru(cap))
        base = sum(lru.request(chain) for chain in trace) / total
        print('capacity %d leaf-lru %.4f' % (cap, base))
        for name, value in knowledge_rankings(uses_in_all):
            cache = pm.RankedCache(cap, Frequency(cap, value))
            rate = sum(cache.request(chain) for chain in trace) / total
            print('  %-58s %.4f (%.3fx leaf-lru)' % (name, rate, rate / base), flush=True)
    # Hindsight: the mean number of uses still to come, by uses so far (a class table).
    n, left, count = collections.Counter(), collections.Counter(), collections.Counter()
    for chain in trace:
        for h in chain:
            n[h] += 1
            c = min(n[h], 8)
            left[c] += uses_in_all[h] - n[h]
            count[c] += 1
    print('uses still to come, mean by uses so far: ' +
          ', '.join('%s%d: %.2f' % ('>=' if c == 8 else '', c, left[c] / count[c])
                    for c in sorted(count)))
    uses = root_uses(trace)
    for k in (2, 3):
        roots = [v for v in uses.values() if len(v) >= k]
        hot = [1 if len(v) >= 8 else 0 for v in roots]
        # One system prompt heading every request (the conversation trace) leaves no roots to
        # tell apart.
        if not 0 < sum(hot) < len(hot):
            print('roots used >= %d times: %d, all %s: no AUC' %
                  (k, len(roots), 'hot' if hot and hot[0] else 'cold'))
            continue
        feats = {'requests since the previous use': [v[k - 1] - v[k - 2] for v in roots],
                 'requests since the first use': [v[k - 1] - v[0] for v in roots],
                 'request length': [len(trace[v[k - 1]]) for v in roots],
                 'position in the trace': [v[k - 1] for v in roots],
                 'distinct chains so far': [len(set(tuple(trace[i]) for i in v[:k])) for v in roots]}
        print('roots used >= %d times: %d, of them hot (>= 8 uses): %d; AUC for "hot" at the use '
              '%d (0.5 = no signal; the larger of a and 1 - a):' % (k, len(roots), sum(hot), k))
        for name, f in feats.items():
            a = auc(f, hot)
            print('  %-34s %.3f' % (name, max(a, 1 - a)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--trace', required=True)
    ap.add_argument('--capacity', default='2000')
    ap.add_argument('--knowledge', action='store_true',
                    help='what a frequency ranking must know, and when (see the docstring)')
    a = ap.parse_args()
    lines = [json.loads(line) for line in open(a.trace) if line.strip()]
    trace = [r['hash_ids'] for r in lines]
    if a.knowledge:
        knowledge(trace, [int(x) for x in a.capacity.split(',')])
        return
    for cap in (int(x) for x in a.capacity.split(',')):
        for deeper_first in (True, False):
            rate, orphans, behind = belady_orphans(trace, cap, deeper_first)
            print('capacity %d belady (%s first) %.4f: orphans %.3f of cached blocks, %.4f of '
                  'accesses cached behind a missing block' %
                  (cap, 'deeper' if deeper_first else 'parent', rate, orphans, behind))
        rate, spy = belady_leaf_hits_by_gap(trace, cap)
        print('capacity %d belady-leaf %.4f; re-accesses found cached by gap since the previous '
              'access:' % (cap, rate))
        for b in sorted(spy.reuses):
            lo, hi = 2**b - 1, 2**(b + 1) - 1
            print('  %d-%d caches: %d of %d (%.2f)' % (lo, hi, spy.found[b], spy.reuses[b],
                                                      spy.found[b] / spy.reuses[b]))
    uses = root_uses(trace)
    seen, lengths, reused, first_gap = set(), [], [], []
    for i, chain in enumerate(trace):
        if not chain or chain[0] in seen:
            continue
        seen.add(chain[0])
        lengths.append(len(chain))
        later = [j for j in uses[chain[0]] if j > i]
        reused.append(1 if later else 0)
        if later:
            first_gap.append(later[0] - i)
    lengths, reused = np.array(lengths), np.array(reused)
    print('requests with a new root: %d, root requested again: %.3f (median %d requests later), '
          'AUC of the length %.3f' % (len(lengths), reused.mean(), np.median(first_gap),
                                      auc(lengths, reused)))
    for b in range(int(math.log2(lengths.max())) + 1):
        m = (lengths >= 2**b) & (lengths < 2**(b + 1))
        if m.any():
            print('  %d-%d blocks: %d requests, %.3f reused' % (2**b, 2**(b + 1) - 1, m.sum(),
                                                              reused[m].mean()))
    if all('timestamp' in r for r in lines):
        seq = [(h, r['timestamp']) for r in lines for h in r['hash_ids']]
        nxt, last = [0] * len(seq), {}
        for i in range(len(seq) - 1, -1, -1):
            nxt[i] = last.get(seq[i][0], 10**12)
            last[seq[i][0]] = i
        prev, count, rows = {}, collections.Counter(), []
        for i, (h, ts) in enumerate(seq):
            if h in prev:
                j = prev[h]
                rows.append((j - i, seq[j][1] - ts, count[h], 1 if nxt[i] - i <= 8000 else 0))
            prev[h] = i
            count[h] += 1
        r = np.array(rows, dtype=float)
        print('re-accesses %d, accessed again within 8,000 accesses: %.3f; AUC of -gap in '
              'accesses %.3f, -gap in ms %.3f, count %.3f' %
              (len(r), r[:, 3].mean(), auc(r[:, 0], r[:, 3]), auc(r[:, 1], r[:, 3]),
               auc(r[:, 2], r[:, 3])))


if __name__ == '__main__':
    main()
