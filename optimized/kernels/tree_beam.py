"""Best-first selection on the GPU: the first B prefixes in the order of reference/tree.py, in that order.

Launch geometry: one block of T threads; the kernel is built per (T, GA, NA) by `beam_for`: capacity
C = T * GA >= budget (the next power of two, at least a warp), each thread owns GA members of G and NA new
candidates in registers while they are merged, a batch holds NEWCAP = T * NA new candidates (>= C, so one parent's
children always fit). On the GPU T = C up to 1024 (GA = 1, NA = 2): a budget of 16 runs one warp, not 32 of them
(every phase costs each warp about the same instructions, so the block is no larger than the budget needs). T, C
and NEWCAP are compile-time constants: the strided loops need no 64-bit division. Everything lives in shared memory
(~47 KB at C = 1024).
Input: the per-depth top-K (lp [L, K] fp32 on the 2^-28 grid, token ids [L, K]), sorted by rank.

Order: a precedes b iff score(a) > score(b), or equal scores and tuple(a) < tuple(b) (rank tuples, a prefix
before its extensions). Scores are exact integers in units of 2^-28 (int64; the grid makes every sum exact).
Tuples are never stored: each member of G carries its TUPLE RANK t (its position in the lexicographic order of
G's tuples, a pre-order of the trie). For a child c = (p, r) at depth d+1 and a member g of depth <= d (p has
no child in G yet): tuple(g) < tuple(c) iff t(g) <= t(p); two new children compare by (t(parent), r).

Algorithm (exact; G = the first B prefixes of depth <= d, sorted, in shared memory):
    G = ranks 0..min(K, B)-1 at depth 1, t = rank
    for d = 1..L-1, in batches of whole parents (members of G at depth d, in order; at most NEWCAP new):
        per parent j (batch index jl, G position pos): children r + 1 <= min(K, B/(j+1), (B-1-pos)/(jl+1))
            (that many members of G or of the batch precede the child), and, when |G| = B, only those
            before G[B-1] (binary search over r)
        materialize the batch's children and order them: parent j's children are a sorted run (row j) and so
            are the children of one rank r across parents (column r: G order is score order), and the row
            lengths never grow along the batch (every bound above shrinks with j), so one row or one column is
            already in order, at most RUNS_MAX rows or columns are ranked by binary searches in the other runs,
            and anything else is sorted (tree_device.pair_sort: bitonic in registers, shuffles, shared memory);
            merge with G by binary-search ranks, keep the first B
        new tuple ranks: scatter 1 + (kept children) onto each old member's tuple rank, exclusive scan:
            t'(g) = base[t(g)], t'((p, r)) = base[t(p)] + 1 + r
    stop when a depth admits no member. Parents of members are G indices, remapped at every merge.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda

from .tree_device import DEVICE, SIM, TBUF, block_scan, cap_for, last_at_most, n_first, pair_sort

BMAX = 64 if SIM else 1024        # largest budget (and K)
BMAX1 = BMAX + 1
RUNS_MAX = 6                      # new candidates in at most this many sorted runs are ranked, not sorted
NEW_FACTOR = 2                    # a batch holds NEW_FACTOR * C new candidates (>= 1: at least C >= budget)
SCALE = 268435456.0               # 2^28: lp and scores as integers
PAD_Q = -(2 ** 62)                # a padding candidate's score (real scores are > -2^53)
# Launch bounds T (at T = 1024: <= 64 registers). Never with line info: NVVM 13.0 rejects launch bounds with it
# (ERROR_COMPILATION), and max_registers with it fails in nvJitLink ("Symbol name with unsupported characters"), so
# DDTREE_NUMBA_LINEINFO=1 builds the other tree kernels with line info and this one as usual.
M10 = 0x3FF                       # aux = parent << 20 | rank << 10 | tuple rank; new key = t(p) << 20 | r << 10 | p


@cuda.jit(**DEVICE)
def q_of(v):
    """An fp32 grid log-prob as an integer multiple of 2^-28 (exact)."""
    return np.int64(np.float64(v) * SCALE)


@cuda.jit(**DEVICE)
def g_before(qg, tg, qc, tp):
    """Member g (score qg, tuple rank tg) precedes a new child (score qc, parent tuple rank tp)."""
    return qg > qc or (qg == qc and tg <= tp)


def beam_for(budget: int, max_threads: int):
    """(kernel, T): the beam variant for `budget` in blocks of at most max_threads (a power of two >= a warp)."""
    (kernel, _), threads = variant_for(budget, max_threads)
    return kernel, threads


def variant_for(budget: int, max_threads: int):
    """((kernel, device body), T) for `budget` in blocks of at most max_threads; the body serves a kernel that
    picks its beam on the device (tree_list.auto_for)."""
    cap = cap_for(budget)
    threads = min(max_threads, cap)
    ga = cap // threads
    key = (threads, ga, max(1, NEW_FACTOR * ga))
    if key not in _variants:
        _variants[key] = _make_beam(*key)
    return _variants[key], threads


_variants: dict = {}


def _make_beam(T, GA, NA):
    """The beam kernel for blocks of exactly T threads, GA members and NA new candidates per thread."""
    CAPB = T * GA                 # budget capacity (and K)
    CAPB1 = CAPB + 1
    NEWCAP = T * NA               # new candidates per batch
    jit = {} if SIM else {"launch_bounds": T}

    sort_new = pair_sort(NA)

    @cuda.jit(**DEVICE)
    def body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        tid = cuda.threadIdx.x
        gq = cuda.shared.array(CAPB, np.int64)          # G: scores, aux, depths, in order
        gaux = cuda.shared.array(CAPB, np.int32)
        gdep = cuda.shared.array(CAPB, np.int8)
        nq = cuda.shared.array(NEWCAP, np.int64)        # the batch's new candidates (also the sort's exchange)
        nk = cuda.shared.array(NEWCAP, np.int32)
        lp = cuda.shared.array(CAPB, np.float32)        # this depth's lp by rank
        off = cuda.shared.array(CAPB1, np.int32)     # per-parent offsets; then kept counts / bases by tuple rank
        fr = cuda.shared.array(CAPB, np.int16)          # frontier (G indices); then the old -> new G index map
        tmp = cuda.shared.array(32, np.int64)
        buf = cuda.shared.array(TBUF, np.int64)
        rq = cuda.local.array(GA, np.int64)
        ra = cuda.local.array(GA, np.int32)
        rd = cuda.local.array(GA, np.int32)
        rp = cuda.local.array(GA, np.int32)
        sq = cuda.local.array(NA, np.int64)
        sk = cuda.local.array(NA, np.int32)
        sp = cuda.local.array(NA, np.int32)
        sj = cuda.local.array(NA, np.int32)              # a new candidate's parent row, then its rank
        hcol = cuda.shared.array(RUNS_MAX, np.int32)
        nxt = cuda.local.array(GA, np.float32)          # the next depth's lp, loaded one depth ahead
        depth = top_lp.shape[0]
        m = min(k, budget)
        for r in range(tid, m, T):
            gq[r] = q_of(top_lp[0, r])
            gaux[r] = (r << 10) | r
            gdep[r] = 1
        for a in range(GA):
            r = tid + a * T
            nxt[a] = top_lp[1, r] if r < k and depth > 1 else np.float32(0)
        e = 1
        alive = True
        while alive and e < depth:                       # children at depth e + 1 of the depth-e members
            cuda.syncthreads()
            for a in range(GA):
                r = tid + a * T
                if r < k:
                    lp[r] = nxt[a]
                if r < k and e + 1 < depth:
                    nxt[a] = top_lp[e + 1, r]
            nproc = 0
            first = True
            while True:
                nf = 0                                   # frontier: depth-e members, in order
                for c in range(0, m, T):
                    i = c + tid
                    f = 1 if i < m and gdep[i] == e else 0
                    ex, tot = block_scan(f, tmp, buf)
                    if f == 1:
                        fr[nf + ex] = i
                    nf += tot
                cuda.syncthreads()
                if first and nf == 0:
                    alive = False
                first = False
                if nproc >= nf:
                    break
                full = m == budget
                wq = gq[m - 1]
                wt = gaux[m - 1] & M10
                nrem = nf - nproc
                total = 0
                for c in range(0, nrem, T):              # how many children of each parent can enter
                    jl = c + tid
                    cnt = 0
                    if jl < nrem:
                        j = nproc + jl
                        p = fr[j]
                        cnt = min(k, budget // (j + 1), (budget - 1 - p) // (jl + 1))
                        if full and cnt > 0:
                            pq = gq[p]
                            pt = gaux[p] & M10
                            lo = 0
                            hi = cnt
                            while lo < hi:
                                mid = (lo + hi) // 2
                                if g_before(wq, wt, pq + q_of(lp[mid]), pt):
                                    hi = mid
                                else:
                                    lo = mid + 1
                            cnt = lo
                    ex, tot = block_scan(cnt, tmp, buf)
                    if jl < nrem:
                        off[jl] = total + ex
                    total += tot
                if tid == 0:
                    off[nrem] = total
                cuda.syncthreads()
                if total == 0:
                    break
                nb = last_at_most(off, 0, nrem, NEWCAP)  # batch: parents [0, nb) with off[nb] <= NEWCAP
                n = off[nb]
                for a in range(NA):                      # materialize, row-major: (parent jl, rank r)
                    s = tid + a * T
                    if s < n:
                        lo = last_at_most(off, 0, nb - 1, s)    # the last parent whose offset is <= s
                        r = s - off[lo]
                        p = fr[nproc + lo]
                        sq[a] = gq[p] + q_of(lp[r])
                        sk[a] = ((gaux[p] & M10) << 20) | (r << 10) | p
                        nq[s] = sq[a]
                        nk[s] = sk[a]
                        sj[a] = lo
                cuda.syncthreads()
                c0 = off[1] - off[0]                     # the longest row (counts never grow along the batch)
                if nb > 1 and c0 > 1:                    # else one row or one column: already in order
                    if min(nb, c0) > RUNS_MAX:
                        sort_new(nq, nk, n, PAD_Q, buf)
                    else:                                # few sorted runs: rank = sum of counts in the others
                        by_rows = nb <= c0
                        if not by_rows:                  # column r holds rows [0, h[r])
                            for r in range(tid, c0, T):
                                lo = 0
                                hi = nb
                                while lo < hi:
                                    mid = (lo + hi) // 2
                                    if off[mid + 1] - off[mid] > r:
                                        lo = mid + 1
                                    else:
                                        hi = mid
                                hcol[r] = lo
                        cuda.syncthreads()
                        for a in range(NA):
                            s = tid + a * T
                            if s < n:
                                qx = sq[a]
                                kx = sk[a]
                                jl = sj[a]
                                r = (kx >> 10) & M10
                                rank = 0
                                if by_rows:
                                    for j2 in range(nb):
                                        if j2 == jl:
                                            rank += r
                                            continue
                                        p2 = fr[nproc + j2]
                                        q2 = gq[p2]
                                        k2 = ((gaux[p2] & M10) << 20) | p2
                                        lo = 0
                                        hi = off[j2 + 1] - off[j2]
                                        while lo < hi:
                                            mid = (lo + hi) // 2
                                            if n_first(q2 + q_of(lp[mid]), k2 | (mid << 10), qx, kx):
                                                lo = mid + 1
                                            else:
                                                hi = mid
                                        rank += lo
                                else:
                                    for r2 in range(c0):
                                        if r2 == r:
                                            rank += jl
                                            continue
                                        lq = q_of(lp[r2])
                                        lo = 0
                                        hi = hcol[r2]
                                        while lo < hi:
                                            mid = (lo + hi) // 2
                                            p2 = fr[nproc + mid]
                                            if n_first(gq[p2] + lq, ((gaux[p2] & M10) << 20) | (r2 << 10) | p2,
                                                       qx, kx):
                                                lo = mid + 1
                                            else:
                                                hi = mid
                                        rank += lo
                                sj[a] = rank
                        cuda.syncthreads()
                        for a in range(NA):
                            if tid + a * T < n:
                                nq[sj[a]] = sq[a]
                                nk[sj[a]] = sk[a]
                        cuda.syncthreads()
                for a in range(GA):                      # merge: G members move down by the new before them
                    i = tid + a * T
                    if i < m:
                        qg = gq[i]
                        tg = gaux[i] & M10
                        lo = 0
                        hi = n
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if g_before(qg, tg, nq[mid], nk[mid] >> 20):
                                hi = mid
                            else:
                                lo = mid + 1
                        rq[a] = qg
                        ra[a] = gaux[i]
                        rd[a] = gdep[i]
                        rp[a] = i + lo
                for a in range(NA):                      # ... and the new ones by the G members before them
                    q = tid + a * T
                    if q < n:
                        qc = nq[q]
                        kc = nk[q]
                        tp = kc >> 20
                        lo = 0
                        hi = m
                        while lo < hi:
                            mid = (lo + hi) // 2
                            if g_before(gq[mid], gaux[mid] & M10, qc, tp):
                                lo = mid + 1
                            else:
                                hi = mid
                        sq[a] = qc
                        sk[a] = kc
                        sp[a] = q + lo
                for i in range(tid, m, T):
                    off[i] = 0
                cuda.syncthreads()
                for a in range(GA):                      # old -> new index; kept counts by tuple rank
                    i = tid + a * T
                    if i < m:
                        fr[i] = rp[a]
                        if rp[a] < budget:
                            cuda.atomic.add(off, ra[a] & M10, 1)
                for a in range(NA):
                    if tid + a * T < n and sp[a] < budget:
                        cuda.atomic.add(off, sk[a] >> 20, 1)
                cuda.syncthreads()
                base = 0
                for c in range(0, m, T):                 # exclusive scan over tuple ranks
                    i = c + tid
                    v = off[i] if i < m else 0
                    ex, tot = block_scan(v, tmp, buf)
                    if i < m:
                        off[i] = base + ex
                    base += tot
                cuda.syncthreads()
                for a in range(GA):
                    i = tid + a * T
                    if i < m and rp[a] < budget:
                        aux = ra[a]
                        par = fr[aux >> 20] if rd[a] > 1 else 0
                        gq[rp[a]] = rq[a]
                        gaux[rp[a]] = (np.int32(par) << 20) | (aux & (M10 << 10)) | off[aux & M10]
                        gdep[rp[a]] = rd[a]
                for a in range(NA):
                    if tid + a * T < n and sp[a] < budget:
                        kc = sk[a]
                        r = (kc >> 10) & M10
                        gq[sp[a]] = sq[a]
                        gaux[sp[a]] = (np.int32(fr[kc & M10]) << 20) | (r << 10) | (off[kc >> 20] + 1 + r)
                        gdep[sp[a]] = e + 1
                cuda.syncthreads()
                m = min(budget, m + n)
                nproc += nb
                if nb == nrem:
                    break
            e += 1
        cuda.syncthreads()
        for i in range(tid, m, T):                       # output in order
            aux = gaux[i]
            d = np.int64(gdep[i])
            out_tok[i] = top_id[d - 1, (aux >> 10) & M10]
            out_dep[i] = d
            out_par[i] = (aux >> 20) + 1 if d > 1 else 0
            out_score[i] = np.float64(gq[i]) / SCALE
        if tid == 0:
            out_n[0] = m

    @cuda.jit(**jit)
    def beam(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)

    return beam, body
