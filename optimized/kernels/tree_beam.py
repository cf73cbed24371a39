"""Best-first selection on the GPU: the first B prefixes in the order of reference/tree.py, in that order.

Launch geometry: one block of T threads (the selection is a chain of small dependent steps; latency bound).
Input: the per-depth top-K (lp [L, K] fp32 on the 2^-28 grid, token ids [L, K]), sorted by rank.

Order: node a precedes b iff score(a) > score(b), or equal scores and tuple(a) < tuple(b). A rank tuple is
packed as digits rank+1 of 11 bits, five per int64 word, three words (L <= 15, K <= 1024); a missing digit is
0, so comparing the words lexicographically puts a prefix before its extensions. Scores are exact fp64 sums
(the grid), so two key facts hold exactly: children of one parent come in rank order, and for parents
p before q the child (p, r) comes before (q, r).

Algorithm (exact; G_d = the first B prefixes of depth <= d, kept sorted in shared memory):
    G_1 = ranks 0..min(K, B)-1 at depth 1
    for d = 2..L:
        parents = members of G at depth d-1, in order (block scan compaction)
        new     = their children that precede w = G[B-1] (all of them while |G| < B); per parent j only
                  ranks r with (j+1)(r+1) <= B can matter (the (j+1)(r+1)-1 children above-left of (j, r)
                  all precede it), each parent's count by binary search over its ranks
        if new is empty: stop (no depth-d member, so no deeper one either)
        sort new (bitonic on an index permutation), merge with G by binary-search ranks, keep the first B
    output G in order; parents found by binary search for the parent key (score - lp, tuple minus a digit).
Shared memory: ~43 KB (lp row, two score and depth buffers, the new candidates' scores and permutation while they
number <= 1024, offsets and parents). Tuples and larger candidate sets live in global scratch.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda

from .tree_device import KERNEL, TBUF, block_scan

BMAX = 1024         # largest budget
GS = 2 * BMAX       # two buffers of G scores
KMAX = 1024         # largest K
NEWSH = 1024        # new candidates sorted in shared memory up to this many (else in global scratch)
DIGIT = 11          # bits per rank digit
PER_WORD = 5        # digits per int64 word


@cuda.jit(device=True)
def tup_less(a0, a1, a2, b0, b1, b2):
    if a0 != b0:
        return a0 < b0
    if a1 != b1:
        return a1 < b1
    return a2 < b2


@cuda.jit(device=True)
def with_digit(t0, t1, t2, e, r):
    """Tuple words with digit e (depth e+1) set to rank r (stored as r + 1)."""
    v = np.int64(r + 1) << (DIGIT * (PER_WORD - 1 - e % PER_WORD))
    w = e // PER_WORD
    if w == 0:
        return t0 + v, t1, t2
    if w == 1:
        return t0, t1 + v, t2
    return t0, t1, t2 + v


@cuda.jit(device=True)
def digit_of(t0, t1, t2, e):
    """Rank at depth e+1 (-1 when the tuple is shorter)."""
    w = e // PER_WORD
    word = t0 if w == 0 else (t1 if w == 1 else t2)
    return ((word >> (DIGIT * (PER_WORD - 1 - e % PER_WORD))) & 0x7FF) - 1


@cuda.jit(device=True)
def new_before(a, b, ns, nt):
    """Permutation entry a sorts before b (-1 is a padding entry, after everything)."""
    if b < 0:
        return a >= 0
    if a < 0:
        return False
    if ns[a] != ns[b]:
        return ns[a] > ns[b]
    return tup_less(nt[a, 0], nt[a, 1], nt[a, 2], nt[b, 0], nt[b, 1], nt[b, 2])


@cuda.jit(device=True)
def sort_new(pm, n2, ns, nt):
    """Bitonic sort of the permutation pm[:n2] (n2 a power of two) into tree order."""
    tid = cuda.threadIdx.x
    size = 2
    while size <= n2:
        stride = size // 2
        while stride > 0:
            cuda.syncthreads()
            for i in range(tid, n2, cuda.blockDim.x):
                j = i ^ stride
                if j > i:
                    a = pm[i]
                    b = pm[j]
                    if new_before(b, a, ns, nt) if (i & size) == 0 else new_before(a, b, ns, nt):
                        pm[i] = b
                        pm[j] = a
            stride //= 2
        size *= 2
    cuda.syncthreads()


@cuda.jit(device=True)
def count_g_before(gs, g_tup, cur, m, s, t0, t1, t2):
    """How many of G[cur][:m] (sorted) precede the key (s, t)."""
    lo = 0
    hi = m
    while lo < hi:
        mid = (lo + hi) // 2
        sm = gs[cur * BMAX + mid]
        if sm > s or (sm == s and tup_less(g_tup[cur, mid, 0], g_tup[cur, mid, 1], g_tup[cur, mid, 2],
                                           t0, t1, t2)):
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(**KERNEL)
def beam(top_lp, top_id, k, budget, g_tup, nt, ns_g, pm_g, out_tok, out_dep, out_par, out_score,
         out_n):
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    lp = cuda.shared.array(KMAX, np.float32)          # the current depth's lp by rank
    gs = cuda.shared.array(GS, np.float64)            # G scores, two buffers
    ns_s = cuda.shared.array(NEWSH, np.float64)
    pm_s = cuda.shared.array(NEWSH, np.int32)
    off = cuda.shared.array(BMAX, np.int32)           # per-parent offset into the new candidates
    par = cuda.shared.array(BMAX, np.int32)           # G index of each parent
    g_dep = cuda.shared.array(GS, np.int8)            # G depths, two buffers
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(TBUF, np.int64)
    depth = top_lp.shape[0]
    m = min(k, budget)
    for r in range(tid, m, T):
        gs[r] = np.float64(top_lp[0, r])
        g_tup[0, r, 0] = np.int64(r + 1) << (DIGIT * (PER_WORD - 1))
        g_tup[0, r, 1] = 0
        g_tup[0, r, 2] = 0
        g_dep[r] = 1
    cur = 0
    for e in range(1, depth):                         # children at depth e + 1, lp row e
        cuda.syncthreads()
        for r in range(tid, k, T):
            lp[r] = top_lp[e, r]
        npar = np.int64(0)
        for c in range(0, m, T):                      # parents: G members at depth e, in order
            i = c + tid
            flag = 1 if i < m and g_dep[cur * BMAX + i] == e else 0
            ex, tot = block_scan(flag, tmp, buf)
            if flag == 1:
                par[npar + ex] = i
            npar += tot
        full = m == budget
        ws = gs[cur * BMAX + m - 1]
        w0, w1, w2 = g_tup[cur, m - 1, 0], g_tup[cur, m - 1, 1], g_tup[cur, m - 1, 2]
        cuda.syncthreads()
        nnew = np.int64(0)
        for c in range(0, npar, T):                   # per parent: how many children enter
            j = c + tid
            cnt = np.int64(0)
            if j < npar:
                p = par[j]
                ps = gs[cur * BMAX + p]
                p0, p1, p2 = g_tup[cur, p, 0], g_tup[cur, p, 1], g_tup[cur, p, 2]
                cnt = min(k, budget // (j + 1))
                if full:
                    lo = np.int64(0)
                    hi = cnt
                    while lo < hi:
                        mid = (lo + hi) // 2
                        cs = ps + np.float64(lp[mid])
                        c0, c1, c2 = with_digit(p0, p1, p2, e, mid)
                        if cs > ws or (cs == ws and tup_less(c0, c1, c2, w0, w1, w2)):
                            lo = mid + 1
                        else:
                            hi = mid
                    cnt = lo
            ex, tot = block_scan(cnt, tmp, buf)
            if j < npar:
                off[j] = nnew + ex
            nnew += tot
        cuda.syncthreads()
        if nnew == 0:
            break
        n2 = 1
        while n2 < nnew:
            n2 *= 2
        ns = ns_s if nnew <= NEWSH else ns_g
        pm = pm_s if nnew <= NEWSH else pm_g
        for s in range(tid, n2, T):                   # materialize the new candidates
            if s < nnew:
                lo = np.int64(0)
                hi = npar
                while hi - lo > 1:                    # last parent whose offset is <= s
                    mid = (lo + hi) // 2
                    if off[mid] <= s:
                        lo = mid
                    else:
                        hi = mid
                r = s - off[lo]
                p = par[lo]
                ns[s] = gs[cur * BMAX + p] + np.float64(lp[r])
                c0, c1, c2 = with_digit(g_tup[cur, p, 0], g_tup[cur, p, 1], g_tup[cur, p, 2], e, r)
                nt[s, 0] = c0
                nt[s, 1] = c1
                nt[s, 2] = c2
                pm[s] = s
            else:
                pm[s] = -1
        sort_new(pm, n2, ns, nt)
        nxt = 1 - cur
        for i in range(tid, m, T):                    # merge: G members move down by the new before them
            s = gs[cur * BMAX + i]
            t0, t1, t2 = g_tup[cur, i, 0], g_tup[cur, i, 1], g_tup[cur, i, 2]
            lo = np.int64(0)
            hi = nnew
            while lo < hi:
                mid = (lo + hi) // 2
                x = pm[mid]
                if ns[x] > s or (ns[x] == s and tup_less(nt[x, 0], nt[x, 1], nt[x, 2], t0, t1, t2)):
                    lo = mid + 1
                else:
                    hi = mid
            pos = i + lo
            if pos < budget:
                gs[nxt * BMAX + pos] = s
                g_tup[nxt, pos, 0] = t0
                g_tup[nxt, pos, 1] = t1
                g_tup[nxt, pos, 2] = t2
                g_dep[nxt * BMAX + pos] = g_dep[cur * BMAX + i]
        for q in range(tid, min(nnew, budget), T):    # ... and the new ones by the G before them
            x = pm[q]
            s = ns[x]
            t0, t1, t2 = nt[x, 0], nt[x, 1], nt[x, 2]
            pos = q + count_g_before(gs, g_tup, cur, m, s, t0, t1, t2)
            if pos < budget:
                gs[nxt * BMAX + pos] = s
                g_tup[nxt, pos, 0] = t0
                g_tup[nxt, pos, 1] = t1
                g_tup[nxt, pos, 2] = t2
                g_dep[nxt * BMAX + pos] = e + 1
        m = min(budget, m + nnew)
        cur = nxt
    cuda.syncthreads()
    for i in range(tid, m, T):                        # output in order; parents by key search
        s = gs[cur * BMAX + i]
        t0, t1, t2 = g_tup[cur, i, 0], g_tup[cur, i, 1], g_tup[cur, i, 2]
        d = np.int64(g_dep[cur * BMAX + i])
        r = digit_of(t0, t1, t2, d - 1)
        out_tok[i] = top_id[d - 1, r]
        out_dep[i] = d
        out_score[i] = s
        if d == 1:
            out_par[i] = 0
        else:
            q0, q1, q2 = with_digit(t0, t1, t2, d - 1, -1 - (r + 1))   # subtract the digit
            q = count_g_before(gs, g_tup, cur, m, s - np.float64(top_lp[d - 1, r]), q0, q1, q2)
            out_par[i] = q + 1
    if tid == 0:
        out_n[0] = m

