"""Best-first selection by threshold: the first B prefixes in the order of reference/tree.py, in that order, found
as the set of prefixes at or before a threshold instead of grown a depth at a time (tree_beam) or a node at a time
(tree_list). Same input (the per-depth top-K: lp [L, K] fp32 on the 2^-28 grid, token ids [L, K], sorted by rank)
and the same output, node for node, as tree_beam's kernel.

Why: tree_beam merges every depth into its sorted set (~5 us a depth on deep, draft-like trees: 110 us at budget
256, L = 15, H100); the list beam pops a node at a time. Here a depth costs one level of a breadth-first
enumeration (a binary search per parent, a block scan, a binary search per child), and the order is made once.

Order and threshold: x precedes y iff score(x) > score(y), or equal scores and tuple(x) < tuple(y) (rank tuples,
a prefix before its extensions). A threshold tau = (score s, tuple t) admits E(tau) = {x : x precedes tau or is
tau}; t = +inf (the tuple of no node, after all of them) admits {score >= s}. E(tau) is prefix-closed (a parent
precedes its children), so it is enumerated level by level from the root: the children of parent p that enter
are a prefix of its ranks (scores fall and tuples rise along them), found by a binary search in the sorted row.
Each node carries its relation to t's digits (before, on t's path, after: `state`), which decides whether a child
of equal score enters.

Algorithm (exact):
    tau = (the B-th depth-1 score, +inf) when K >= B (then |E(tau)| >= B), else (-inf, +inf)
    loop: enumerate E(tau) breadth-first into a buffer of at most CAP = CAP_FACTOR * C nodes (C = B rounded up to
          a power of two); if it did not overflow, stop. Else the buffer (CAP > B nodes, all at or before tau, a
          prefix-closed set) gives a later threshold with |E| >= B still: its B-th best score theta if theta > s
          (tau = (theta, +inf)); else (equal scores straddle rank B) the node of score theta that is B-th in the
          order, found by the buffer's preorder (tau = that node). Each step moves tau strictly earlier, so it ends.
    final: the B-th score theta by a radix select (when equal scores straddle rank B, the cut among them by
          breadth-first index if they share a depth); the kept B nodes sorted by (score descending, breadth-first
          index ascending), which is the reference's order (breadth-first order is the rank tuples' order within a
          depth) unless equal scores meet across depths: a check after the sort, and then everything again by the
          preorder of E (subtree sizes bottom-up, preorder top-down, a level at a time; the lexicographic order of
          rank tuples). Written out with parents as output indices.
The host prototype on the bench's rows (bench/results/tree_2026-12-02.md, stop 33): one enumeration on normal
rows (2-4 levels), 1-3 on draft-like ones at CAP_FACTOR = 4. Measured (stop 34, H100): exact, but faster than
tree_beam only on the deepest rows (L = 15, budget 64 / 256: 42.0 / 107.2 us against 53.7 / 110.4); a level costs
~3.5 us, not the ~1.3 us its steps add up to (the notes say what is suspected). Hence opt-in.

Launch geometry: one block of T threads (T = min(beam_threads, THREADS_MAX, C), a power of two); each thread holds
C / T row values and sort slots. Shared memory (44 KB at budget 512, the largest): the enumerated nodes (score
int64, parent int16, aux uint16: rank | depth << 10 | (state + 1) << 14; CAP = 4 C of them), the parents' child
offsets (int32 [CAP + 1], then the output index of each node), the row (int64 [C]), the sort pairs (12 B x C), 256
radix bins. The preorder's arrays (first child, subtree size, size scan, preorder, preorder -> node: int32 [5, CAP])
are a global scratch of the workspace: only the tie routes read them.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda

from .tree_beam import PAD_Q, SCALE, q_of
from .tree_device import (DEVICE, SIM, TBUF, WARP, block_scan, cap_for, count_prefix, find_bin_for, first_digit,
                          last_at_most, pair_sort)
from .tree_list import MAX_DEPTH

CAP_FACTOR = 4                    # the enumeration buffer holds CAP_FACTOR * C nodes (>= 2: a step must move tau)
LOWEST = -(2 ** 62)               # a threshold score below every score (scores are > -2^53)
NEG = -(2 ** 63)                  # u = key ^ NEG orders int64 keys as unsigned
RB = 256                          # radix bins (8-bit digits)
BIG = 2 ** 30                     # a preorder past every node
M10 = 0x3FF                       # aux = rank | depth << 10 | (state + 1) << 14
SCRATCH_ROWS = 5                  # int32 scratch rows: first child, subtree size, size scan, preorder, preorder -> node
STATS = 5                         # stats: enumerations, tuple thresholds, nodes and levels of the final one, routes
                                  #   (bit 0: ordered by preorder; bit 1: ties at rank B cut by breadth-first index)
BMAX_THRESH = 64 if SIM else 512  # largest budget: the nodes (4 C of them) live in shared memory (44 KB at 512)
# At most 512 threads: the kernel keeps ~130 values live; 1024 threads leave 64 registers a thread (ptxas, sm_90:
# 288 B of spill stores), 512 leave 128 (12 B). Its levels hold a few nodes a thread either way.
THREADS_MAX = 512


def scratch_nodes(budget: int) -> int:
    """Nodes of the enumeration buffer for `budget` (the workspace's scratch size)."""
    return CAP_FACTOR * cap_for(budget)


def thresh_for(budget: int, max_threads: int):
    if budget > BMAX_THRESH:
        raise ValueError(f"the threshold beam takes budgets up to {BMAX_THRESH}, got {budget}")
    """(kernel, T): the threshold beam for `budget` in blocks of at most min(max_threads, THREADS_MAX) (a power of
    two >= a warp)."""
    cap = cap_for(budget)
    threads = min(max_threads, THREADS_MAX, cap)
    key = (threads, cap // threads, CAP_FACTOR)
    if key not in _variants:
        _variants[key] = _make_thresh(*key)
    return _variants[key], threads


_variants: dict = {}


@cuda.jit(**DEVICE)
def n_children(qrow, k, sp, ps, d, tq, tm, tdig):
    """Children of a parent (score sp, state ps, depth d; the root: 0, its state, 0) that enter E(tau), tau =
    (tq, digits tdig[:tm]; tm = -1: +inf). State: -1 before t, 0 on t's path (a prefix of t), +1 after t. A child
    of rank r of a parent on the path is before t for r < t_d, on it for r == t_d, after it for r > t_d, and after
    it when the parent is t itself (d == tm)."""
    need = tq - sp
    if ps < 0:
        return count_prefix(qrow, 0, k, need, False, 0, 0, 0, 0)
    b = count_prefix(qrow, 0, k, need, True, 0, 0, 0, 0)
    if ps > 0 or d == tm:
        return b
    a = count_prefix(qrow, 0, k, need, False, 0, 0, 0, 0)
    t = tdig[d]
    return a if a <= t else max(t + 1, b)


@cuda.jit(**DEVICE)
def child_state(ps, d, r, tm, tdig):
    if ps != 0:
        return ps
    if d == tm:
        return 1
    t = tdig[d]
    return -1 if r < t else (0 if r == t else 1)


def _make_thresh(T, GA, CAPF):
    """The kernel for blocks of exactly T threads, GA row values and sort slots per thread."""
    CAPB = T * GA                 # C: budget capacity (and K)
    CAP = CAPF * CAPB             # enumeration buffer (nodes)
    CAP1 = CAP + 1
    LEV = MAX_DEPTH + 1
    jit = {} if SIM else {"launch_bounds": T}
    sort_pairs = pair_sort(GA)

    find_bin = find_bin_for(T)

    @cuda.jit(**DEVICE)
    def key_of(sc, pre, i, mode, thr):
        """(valid, key): mode 0 every node by score; among the nodes of score thr, mode 1 by -preorder and mode 2
        by -index (breadth-first order)."""
        if mode == 0:
            return True, sc[i]
        return sc[i] == thr, -np.int64(pre[i]) if mode == 1 else -np.int64(i)

    @cuda.jit(**DEVICE)
    def kth_largest(sc, pre, n, kk, mode, thr, bins, tmp, buf, shr):
        """(v, m, eq): v the kk-th largest key of the n nodes (key_of), counted with multiplicity; it is the m-th
        of the eq keys equal to v. 8-bit passes, most significant first, from the first digit in which the keys
        differ (their AND and OR); stops when the chosen bin holds one key."""
        tid = cuda.threadIdx.x
        if tid == 0:
            shr[0] = 0
            shr[1] = -1
            shr[2] = 0
        cuda.syncthreads()
        acc_or = np.int64(0)
        acc_and = np.int64(-1)
        cnt = np.int64(0)
        for i in range(tid, n, T):
            ok, key = key_of(sc, pre, i, mode, thr)
            if ok:
                u = key ^ np.int64(NEG)
                acc_or |= u
                acc_and &= u
                cnt += 1
        cuda.atomic.or_(shr, 0, acc_or)
        cuda.atomic.and_(shr, 1, acc_and)
        cuda.atomic.add(shr, 2, cnt)
        cuda.syncthreads()
        acc_or = shr[0]
        acc_and = shr[1]
        cnt = shr[2]
        cuda.syncthreads()
        diff = acc_or ^ acc_and
        if diff == 0:                                # one distinct key
            return acc_or ^ np.int64(NEG), np.int64(kk), cnt
        d0, prefix = first_digit(diff, acc_or)
        kk = np.int64(kk)
        for d in range(d0, 8):
            shift = 56 - 8 * d
            high = np.int64(1) << (8 * d)
            for i in range(tid, RB, T):
                bins[i] = 0
            cuda.syncthreads()
            for i in range(tid, n, T):
                ok, key = key_of(sc, pre, i, mode, thr)
                u = key ^ np.int64(NEG)
                if ok and (d == d0 or ((u >> (shift + 8)) & (high - 1)) == prefix):
                    cuda.atomic.add(bins, (u >> shift) & 0xFF, 1)
            cuda.syncthreads()
            b, kk = find_bin(bins, RB, kk, tmp, buf, shr)
            prefix = (prefix << 8) | b
            cnt = np.int64(bins[b])
            cuda.syncthreads()                       # every thread has read bins[b] before it is cleared
            if cnt == 1:                             # the one key with these top 8 (d + 1) bits
                for i in range(tid, n, T):
                    ok, key = key_of(sc, pre, i, mode, thr)
                    if ok and ((key ^ np.int64(NEG)) >> shift) & ((high << 8) - 1) == prefix:
                        shr[0] = key
                cuda.syncthreads()
                key = shr[0]
                cuda.syncthreads()
                return key, np.int64(1), np.int64(1)
        return prefix ^ np.int64(NEG), kk, cnt

    @cuda.jit(**DEVICE)
    def preorder(n, nlev, lev, par, ints, tmp, buf):
        """ints[3, i]: node i's preorder among the n enumerated nodes (the root excluded, from 0). Subtree sizes
        (ints[1]) and their inclusive scans along each level (ints[2]) bottom-up, then preorder top-down:
        pre(c) = pre(parent) + 1 + the sizes of c's earlier siblings (contiguous in the level)."""
        tid = cuda.threadIdx.x
        fc = ints[0]
        sz = ints[1]
        scan = ints[2]
        pre = ints[3]
        e = nlev
        while e >= 1:
            a0 = lev[e - 1]
            a1 = lev[e]
            carry = np.int64(0)
            for c in range(a0, a1, T):
                i = c + tid
                v = np.int64(0)
                if i < a1:
                    v = np.int64(1)
                    if e < nlev:
                        b0 = fc[i]
                        b1 = fc[i + 1] if i + 1 < a1 else lev[e + 1]
                        if b1 > b0:
                            v += scan[b1 - 1] - scan[b0] + sz[b0]
                    sz[i] = v
                ex, tot = block_scan(v, tmp, buf)
                if i < a1:
                    scan[i] = carry + ex + v
                carry += tot
            cuda.syncthreads()
            e -= 1
        for e in range(1, nlev + 1):
            for i in range(lev[e - 1] + tid, lev[e], T):
                ex = scan[i] - sz[i]
                if e == 1:
                    pre[i] = ex
                else:
                    p = par[i]
                    f = fc[p]
                    pre[i] = pre[p] + 1 + ex - (scan[f] - sz[f])
            cuda.syncthreads()

    @cuda.jit(**DEVICE)
    def enumerate_set(top_lp, k, tq, tm, tdig, sc, par, aux, fc, offs, qrow, lev, tmp, buf):
        """E(tau) breadth-first into sc / par / aux (shared) and the parents' first-child offsets fc (global, for
        the preorder): at most CAP nodes, level e at lev[e-1]..lev[e]. Returns (n, levels, overflowed)."""
        tid = cuda.threadIdx.x
        nxt = cuda.local.array(GA, np.int64)
        depth = top_lp.shape[0]
        root_state = 0 if tm >= 1 else -1
        for a in range(GA):
            r = tid + a * T
            nxt[a] = q_of(top_lp[0, r]) if r < k else np.int64(0)
        if tid == 0:
            lev[0] = 0
        n = 0
        nlev = 0
        over = False
        for d in range(depth):                       # parents at depth d (0: the root), children at depth d + 1
            cuda.syncthreads()
            for a in range(GA):
                r = tid + a * T
                if r < k:
                    qrow[r] = nxt[a]
                    if d + 1 < depth:
                        nxt[a] = q_of(top_lp[d + 1, r])
            cuda.syncthreads()
            f0 = lev[d - 1] if d > 0 else 0
            nf = lev[d] - f0 if d > 0 else 1
            total = np.int64(0)
            for c in range(0, nf, T):
                j = c + tid
                cnt = 0
                if j < nf:
                    if d == 0:
                        cnt = n_children(qrow, k, np.int64(0), root_state, 0, tq, tm, tdig)
                    else:
                        i = f0 + j
                        cnt = n_children(qrow, k, sc[i], (np.int64(aux[i]) >> 14) - 1, d, tq, tm, tdig)
                ex, tot = block_scan(cnt, tmp, buf)
                if j < nf:
                    offs[j] = min(total + ex, CAP)       # (clamped: only slots < CAP are materialized)
                total += tot
            lim = min(total, CAP - n)
            if tid == 0:
                offs[nf] = min(total, CAP)
            cuda.syncthreads()
            if d > 0:
                for j in range(tid, nf, T):
                    fc[f0 + j] = n + min(offs[j], lim)
            for s in range(tid, lim, T):             # child s: parent = the last j with offs[j] <= s
                lo = last_at_most(offs, 0, nf - 1, s)
                r = s - offs[lo]
                if d == 0:
                    p = -1
                    sp = np.int64(0)
                    ps = root_state
                else:
                    p = f0 + lo
                    sp = sc[p]
                    ps = (np.int64(aux[p]) >> 14) - 1
                i = n + s
                sc[i] = sp + qrow[r]
                par[i] = p
                aux[i] = r | ((d + 1) << 10) | ((child_state(ps, d, r, tm, tdig) + 1) << 14)
            n += lim
            if lim > 0:
                nlev = d + 1
            if tid == 0:
                lev[d + 1] = n
            if total > lim:
                over = True
            if over or lim == 0:
                break
        cuda.syncthreads()
        return n, nlev, over

    @cuda.jit(**DEVICE)
    def compact_sort(sc, pre, usepre, n, theta, cut, count, nq, nk, tmp, buf):
        """nq / nk[:count] = (score, key) of the kept nodes (score > theta, or == theta and key <= cut), sorted by
        (score descending, key ascending); key: the preorder if usepre, else the node index."""
        tid = cuda.threadIdx.x
        base = 0
        for c in range(0, n, T):
            i = c + tid
            keep = 0
            k2 = 0
            if i < n:
                k2 = pre[i] if usepre else i
                if sc[i] > theta or (sc[i] == theta and k2 <= cut):
                    keep = 1
            ex, tot = block_scan(keep, tmp, buf)
            if keep == 1:
                nq[base + ex] = sc[i]
                nk[base + ex] = k2
            base += tot
        cuda.syncthreads()                           # the compaction's writes before the sort reads them
        sort_pairs(nq, nk, count, PAD_Q, buf)

    @cuda.jit(**DEVICE)
    def body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n, ints, stats):
        tid = cuda.threadIdx.x
        sc = cuda.shared.array(CAP, np.int64)           # the enumerated nodes: score, parent, aux
        par = cuda.shared.array(CAP, np.int16)
        aux = cuda.shared.array(CAP, np.uint16)
        offs = cuda.shared.array(CAP1, np.int32)         # a level's parents: offsets of their children; output index
        qrow = cuda.shared.array(CAPB, np.int64)         # the children's row of scores (lp in 2^-28 units)
        nq = cuda.shared.array(CAPB, np.int64)           # the kept nodes: score, index or preorder
        nk = cuda.shared.array(CAPB, np.int32)
        bins = cuda.shared.array(RB, np.int32)
        lev = cuda.shared.array(LEV, np.int32)
        tdig = cuda.shared.array(MAX_DEPTH, np.int32)   # tau's rank digits
        tmp = cuda.shared.array(WARP, np.int64)
        buf = cuda.shared.array(TBUF, np.int64)
        shr = cuda.shared.array(3, np.int64)
        fc = ints[0]
        pre = ints[3]
        tq = q_of(top_lp[0, budget - 1]) if k >= budget else np.int64(LOWEST)
        tm = -1
        rounds = 0
        ties = 0
        count = 0
        usepre = False
        done = False
        routes = 0
        # One call site per phase (the kernel's code is the cost of a cold instruction cache at every launch):
        # each pass of the outer loop enumerates E(tau); the inner loop orders it, once by breadth-first index and
        # once more by preorder where equal scores meet across depths (or straddle rank B in an overflowed buffer).
        while not done:
            n, nlev, over = enumerate_set(top_lp, k, tq, tm, tdig, sc, par, aux, fc, offs, qrow, lev, tmp, buf)
            rounds += 1
            usepre = False
            while True:
                if usepre:
                    preorder(n, nlev, lev, par, ints, tmp, buf)
                theta = np.int64(LOWEST)
                m = np.int64(0)
                eq = np.int64(0)
                if over or n > budget:
                    theta, m, eq = kth_largest(sc, pre, n, budget, 0, 0, bins, tmp, buf, shr)
                if over and theta > tq:                  # the buffer's B-th score moves tau
                    tq = theta
                    tm = -1
                    break
                straddle = eq != m
                if straddle and not usepre:              # ties at rank B: do they share a depth?
                    if tid == 0:
                        shr[1] = 0
                        shr[2] = MAX_DEPTH + 1
                    cuda.syncthreads()
                    for i in range(tid, n, T):
                        if sc[i] == theta:
                            d = (np.int64(aux[i]) >> 10) & 15
                            cuda.atomic.max(shr, 1, d)
                            cuda.atomic.min(shr, 2, d)
                    cuda.syncthreads()
                    mixed = shr[1] != shr[2]
                    cuda.syncthreads()
                    if over or mixed:                    # an overflowed buffer always needs tau's tuple
                        usepre = True
                        continue
                cut = BIG
                if straddle:
                    v, _, _ = kth_largest(sc, pre, n, m, 1 if usepre else 2, theta, bins, tmp, buf, shr)
                    cut = -v
                if over:                                 # tau = the B-th node (by preorder)
                    ties += 1
                    for i in range(tid, n, T):
                        if sc[i] == theta and pre[i] == cut:
                            shr[0] = i
                    cuda.syncthreads()
                    if tid == 0:
                        e = shr[0]
                        dt = (np.int64(aux[e]) >> 10) & 15
                        shr[1] = dt
                        while dt > 0:
                            tdig[dt - 1] = np.int64(aux[e]) & M10
                            e = par[e]
                            dt -= 1
                    cuda.syncthreads()
                    tq = theta
                    tm = shr[1]
                    cuda.syncthreads()
                    break
                count = min(n, budget)
                if straddle and not usepre:
                    routes |= 2
                compact_sort(sc, pre, usepre, n, theta, cut, count, nq, nk, tmp, buf)
                if usepre:
                    done = True
                    break
                if tid == 0:
                    shr[0] = 0
                cuda.syncthreads()
                for j in range(1 + tid, count, T):       # equal scores across depths among the kept ones?
                    da = (np.int64(aux[nk[j]]) >> 10) & 15
                    if nq[j] == nq[j - 1] and da != (np.int64(aux[nk[j - 1]]) >> 10) & 15:
                        shr[0] = 1
                cuda.syncthreads()
                mixed = shr[0] != 0
                cuda.syncthreads()
                if mixed:                                # rare (lp == 0 chains, contrived logits): by preorder
                    usepre = True
                    continue
                done = True
                break
        if usepre:                                       # preorder -> node
            node = ints[4]
            for i in range(tid, n, T):
                node[pre[i]] = i
            cuda.syncthreads()
            for j in range(tid, count, T):
                nk[j] = node[nk[j]]
            cuda.syncthreads()
        for j in range(tid, count, T):                   # node -> output index
            offs[nk[j]] = j
        cuda.syncthreads()
        for j in range(tid, count, T):
            e = nk[j]
            a = np.int64(aux[e])
            d = (a >> 10) & 15
            out_tok[j] = top_id[d - 1, a & M10]
            out_dep[j] = d
            out_par[j] = offs[par[e]] + 1 if d > 1 else 0
            out_score[j] = np.float64(nq[j]) / SCALE
        if tid == 0:
            out_n[0] = count
            stats[0] = rounds
            stats[1] = ties
            stats[2] = n
            stats[3] = nlev
            stats[4] = routes | (1 if usepre else 0)

    @cuda.jit(**jit)
    def beam_thresh(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n, ints, stats):
        body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n, ints, stats)

    return beam_thresh
