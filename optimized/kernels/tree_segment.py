"""Best-first selection grown a deviation at a time: the first B prefixes in the order of reference/tree.py, in that
order, for trees whose nodes leave the all-rank-0 chain at most twice. Same input (the per-depth top-K: lp [L, K]
fp32 on the 2^-28 grid, token ids [L, K], sorted by rank) and the same output, node for node, as tree_beam's kernel.

Why: draft-like trees are a long chain with short branches (the tree bench's rows: every node has at most 2
deviations, bench/segment_model.py). tree_beam merges one depth per step (33-245 us on them, H100); here the tree is a
set of SEGMENTS (a deviation, then rank 0 onward), found in two deviation levels whatever the depth.

A node is its depth d and its deviations (depths whose rank is not 0); score = z[d] + its deviations' penalties
(lp[i][r] - lp[i][0] <= 0), z[d] the chain's score. Exact (decided on the device; block-uniform; otherwise the
caller runs another beam):
    U = the best score of a prefix with 3 deviations (rank-1 deviations, a DP over depths; none if L < 3 or K < 2):
        every node with more than 2 deviations scores <= U.
    theta = max(U, s_B - 1), s_B a lower bound of the B-th best of the L * K "start" nodes z[j] + lp[j][r] (the
        chain and the nodes one deviation off it at their last depth): the smallest start score in the bucket that
        holds the B-th best. B distinct nodes score >= s_B, so the first B nodes score > theta.
    E = the nodes with <= 2 deviations scoring > theta inside the product bound (a node is preceded by every node
        whose tuple is componentwise <= on each of its prefixes: sum_{e <= d} prod_{j <= e} (r_j + 1) <= B):
        the chain; level 1, segments leaving the chain (or the root) at depth j + 1 with rank r >= 1 (a binary
        search per chain node in the sorted row); level 2, segments leaving a level-1 node (a binary search each).
        A segment runs on at rank 0 while its score stays > theta and the product bound holds.
    If U exists and |E| < B: decline (not enough nodes above U to exclude deeper deviations). Else the first
        n = min(B, |E|) of E in order: score descending, then rank tuple ascending, compared as events (each
        deviation (depth p, rank r) then the end at depth d + 1, 15 bits each: ends before deviations, a later
        deviation before an earlier one, then by rank), which orders tuples as the reference does. E is ranked by
        buckets of the score and a count of the larger nodes in the node's own bucket (ties: by the event code).
Capacities (C = T * GA >= budget): 2 C segments, 4 C nodes; more: decline.
Shared memory: the launch's dynamic pool (segment_layout; 132 C bytes, 33 KB at C = 256), the same bytes the
    two-level selection used before it declined (tree_shallow.pool_bytes); the rows' lp are kept as fp32 (compared
    with fp64 bounds, exact: lp_of) and their room is reused by the ranking's arrays, and the product bound's terms
    are derived from the segment's ranks (seg_prod) instead of stored, so that budgets up to 256 fit 48 KB beside
    tree_beam's body (12 KB at C = 256; the bodies' static arrays would not: 26 + 42 + 12 KB). Up to C = 128
    (WIDE_CMAX) the pool has room for the layout of tree_run20's timing (int64 rows, 4 C buckets, 200 C bytes); the
    fp32 rows and 2 C buckets made budget 64 slower (tree_run22: 30.7 / 34.7 against 27.6 / 30.9 us; with this
    layout again, tree_run23: 28.0 / 30.9).
Measured (tree_run20, H100, the beam stage alone, budget 64, 64 threads): 30.2 / 33.4 us on draft-like rows at L = 7 /
    15 (trees 7 / 12 deep) against tree_beam's 32.7 / 53.5: latency-bound (two warps, ~15 barrier phases); in one
    warp (budgets <= 32) slower than the list beam (27.9 against 15.2 us), so the auto beam does not use it.
    tree_run22 (H100): budget 256, 256 threads, 33.9 / 41.2 us against tree_beam's 59.3 / 110.4 (draft-like L = 7 /
    15); its own launch at 1024 (1,024 threads), 55.3 / 90.3 against 93.8 / 245.3, but on 2-deep normal rows 44.7 /
    51.3 against 28.1 / 32.6, so that launch now leaves trees at most 2 deep to tree_beam (at_most_two_deep).
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda, types   # pool arrays: numba types (the simulator takes no numpy scalar class)

from .tree_beam import SCALE, q_of, variant_for
from .tree_device import (DEVICE, LP_GRID, SIM, TBUF, block_scan, buckets_above, cap_for, count_prefix,
                          find_bin_for, last_at_most)

SEGMENT_BMAX = 64 if SIM else 256   # largest budget in the shallow kernel (C = 256: a 33 KB pool beside 13 KB static)
BIG_BMAX = 1024             # largest budget of the segment's own launch (segment_kernel_for; C = 1024: a 176 KB pool)
BIG_CAPN = 7                # its node capacity per unit of C (draft-like L = 15, budget 1024: 6,416 nodes in E)
WIDE_CMAX = 32 if SIM else 128   # up to this C the rows are int64, the buckets 4 C (segment_layout: 25 KB at 128;
                                 # the simulator's budgets 33-64 run the fp32 rows)
LMAX = 15                   # most depths (tree_list.MAX_DEPTH)
LMAX1 = LMAX + 1            # (a shared array's size must be one constant, not an expression)
NONE = -(2 ** 62)           # no bound
EV_DEV = 17                 # event codes: an end at depth p is p (2..16); a deviation at depth p with rank r is
EV_STEP = 1024              #   EV_DEV + (16 - p) * EV_STEP + r (17..16,400): 15 bits each


@cuda.jit(**DEVICE)
def seg_len(zz, depth, i, pen, spar, mult, theta, budget):
    """Nodes of a segment that starts at depth i (its first node is in E): it runs on at rank 0 while the score
    zz[e] + pen stays > theta and the product bound spar + (e - i + 1) * mult <= budget holds."""
    e = i
    while e < depth and zz[e + 1] + pen > theta and spar + (e + 2 - i) * mult <= budget:
        e += 1
    return e - i + 1


@cuda.jit(**DEVICE)
def lp_of(v):
    """A bound in units of 2^-28 as an fp64 lp: an fp32 row value w > lp_of(v) exactly when q_of(w) > v (v / 2^28
    is exact for |v| < 2^53; the rows' q_of lie in [-2^49, 0], so a v beyond that compares the same either way)."""
    return np.float64(v) * LP_GRID


@cuda.jit(**DEVICE)
def ev_dev(p, r):
    return np.int64(EV_DEV + (16 - p) * EV_STEP + r)


def segment_layout(T: int, GA: int, capn: int = 4) -> dict:
    """The body's arrays in the launch's dynamic shared memory (in the shallow kernel shared with the two-level
    selection's, which runs first: tree_shallow.pool_bytes), as element offsets of their own dtype, and "bytes", the
    pool it needs; capn C nodes. "wide" (C <= WIDE_CMAX, where the pool has room): the rows' scores as int64 (units
    of 2^-28) and bucket counts for 4 C; else the rows as fp32 (compared with fp64 bounds, lp_of) and 2 C buckets
    (4 C with more than 4 C nodes, in the segment's own launch). The rows (read until the level-2 segments are made)
    share their room with the ranking's arrays."""
    C = T * GA
    wide = C <= WIDE_CMAX
    caps, nlp, nbk = 2 * C, LMAX * C, (4 if wide or capn > 4 else 2) * C
    capn *= C
    union = 8 * caps                                          # int64 s_pen first, then the union (8-aligned)
    i32 = union + max((8 if wide else 4) * nlp, 12 * capn)    # cnt, s_par, s_pseg, s_node0, ioff
    i16 = i32 + 4 * (nbk + 3 * caps + capn)                   # s_i, s_r
    return {"C": C, "wide": wide, "CAPS": caps, "CAPN": capn, "NLP": nlp, "NBK": nbk, "lq": union // 4,
            "lq64": union // 8, "g_sc": union // 8, "g_id": union // 4 + 2 * capn, "cnt": i32 // 4,
            "s_par": i32 // 4 + nbk, "s_pseg": i32 // 4 + nbk + caps, "s_node0": i32 // 4 + nbk + 2 * caps,
            "ioff": i32 // 4 + nbk + 3 * caps, "s_i": i16 // 2, "s_r": i16 // 2 + caps, "bytes": i16 + 4 * caps}


def segment_for(T: int, GA: int, capn: int = 4):
    """Device function segment(top_lp, top_id, k, budget, out_*) -> bool for blocks of T threads (C = T * GA >=
    budget): True when it wrote the tree (see the module docstring), False (nothing written) when the caller must
    run another beam. Every thread calls it; the result is block-uniform. Its arrays live in the launch's dynamic
    shared memory: launch with at least segment_layout(T, GA, capn)["bytes"] of it."""
    key = (T, GA, capn)
    if key in _segments:
        return _segments[key]
    lay = segment_layout(T, GA, capn)
    C = lay["C"]
    CAPS = lay["CAPS"]          # segments
    CAPN = lay["CAPN"]          # nodes
    NBK = lay["NBK"]            # buckets (a multiple of T)
    NLP = lay["NLP"]
    RPN = CAPN // T             # nodes per thread
    WIDE = lay["wide"]
    O_LQ, O_LW, O_GSC, O_GID, O_CNT = lay["lq"], lay["lq64"], lay["g_sc"], lay["g_id"], lay["cnt"]
    O_PAR, O_PSEG, O_NODE0, O_IOFF, O_I, O_R = (lay[n] for n in ("s_par", "s_pseg", "s_node0", "ioff", "s_i", "s_r"))
    find_bin = find_bin_for(T)

    @cuda.jit(**DEVICE)
    def rq(lq, lw, i):
        """Row value i in units of 2^-28: the int64 rows lw when WIDE, else the fp32 rows lq (the other is unused)."""
        if WIDE:
            return lw[i]
        return q_of(lq[i])

    @cuda.jit(**DEVICE)
    def prefix(lq, lw, base, k, v, a, b, budget):
        """count_prefix of the row at base: ranks scoring > v (units of 2^-28) within the product bound."""
        if WIDE:
            return count_prefix(lw, base, k, v, True, a, b, 1, budget)
        return count_prefix(lq, base, k, lp_of(v), True, a, b, 1, budget)

    @cuda.jit(**DEVICE)
    def start_pass(lq, lw, zz, depth, k, lo, scale, bb, cnt, shr):
        """Over the start scores zz[d] + row d's rank r (a constant trip count over the depths: the loads go out
        together): bb < 0, count each into its bucket; else the smallest score in bucket bb into shr[0]."""
        tid = cuda.threadIdx.x
        for d in range(LMAX):
            if d < depth:
                for a in range(GA):
                    r = tid + a * T
                    if r < k:
                        v = zz[d] + rq(lq, lw, d * C + r)
                        b = min(np.int32(np.float64(v - lo) * scale), np.int32(NBK - 1))
                        if bb < 0:
                            cuda.atomic.add(cnt, b, 1)
                        elif b == bb:
                            cuda.atomic.min(shr, 0, v)

    @cuda.jit(**DEVICE)
    def seg_of(node0, nseg, x):
        """The segment holding node x (node0 non-decreasing; empty segments share the next one's start)."""
        return last_at_most(node0, 0, nseg - 1, x)

    @cuda.jit(**DEVICE)
    def seg_prod(s, s_i, s_r, s_pseg):
        """(the product sum at segment s's parent, its multiplier) for the product bound (see seg_len): the chain
        (0, 1); a level-1 segment leaving the chain at depth i with rank r (i - 1, r + 1); a level-2 one leaving
        level-1 segment p at depth i with rank r (p's sum at depth i - 1, p's multiplier times r + 1)."""
        if s == 0:
            return np.int64(0), np.int64(1)
        p = s_pseg[s]
        if p < 0:
            return np.int64(s_i[s] - 1), np.int64(s_r[s] + 1)
        mp = np.int64(s_r[p] + 1)
        return np.int64(s_i[p] - 1) + np.int64(s_i[s] - s_i[p]) * mp, mp * np.int64(s_r[s] + 1)

    @cuda.jit(**DEVICE)
    def code_of(s, d, s_i, s_r, s_pseg):
        """The event code of the node at depth d of segment s (smaller = earlier tuple)."""
        end = np.int64(d + 1)
        if s == 0:
            return end << 30
        e1 = ev_dev(s_i[s], s_r[s])
        p = s_pseg[s]
        if p < 0:
            return (e1 << 30) | (end << 15)
        return (ev_dev(s_i[p], s_r[p]) << 30) | (e1 << 15) | end

    @cuda.jit(**DEVICE)
    def segment(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        tid = cuda.threadIdx.x
        p64 = cuda.shared.array(0, types.int64)      # the dynamic pool (segment_layout)
        p32 = cuda.shared.array(0, types.int32)
        p16 = cuda.shared.array(0, types.int16)
        pf = cuda.shared.array(0, types.float32)
        lq = pf[O_LQ:O_LQ + NLP]                     # the rows' lp (fp32 grid values), row d at d * C; until level 2
        lw = p64[O_LW:O_LW + NLP]                    #   (or when WIDE, in the same room, as int64 units of 2^-28)
        g_sc = p64[O_GSC:O_GSC + CAPN]               # then in its room: nodes grouped by bucket, score and node
        g_id = p32[O_GID:O_GID + CAPN]
        zz = cuda.shared.array(LMAX1, np.int64)      # chain scores by depth
        sc = cuda.shared.array(4, np.int64)          # [1] U, [2] / [3] the lowest / highest start score
        cnt = p32[O_CNT:O_CNT + NBK]
        s_par = p32[O_PAR:O_PAR + CAPS]              # segments: parent node (-1: the root), parent segment (-1: none
        s_pseg = p32[O_PSEG:O_PSEG + CAPS]           #   or the chain), first depth, its rank, penalty (units of
        s_i = p16[O_I:O_I + CAPS]                    #   2^-28), first node; the product bound's terms: seg_prod
        s_r = p16[O_R:O_R + CAPS]
        s_pen = p64[0:CAPS]
        s_node0 = p32[O_NODE0:O_NODE0 + CAPS]
        ioff = p32[O_IOFF:O_IOFF + CAPN]             # item offsets; then each node's output index
        tmp = cuda.shared.array(32, np.int64)
        buf = cuda.shared.array(TBUF, np.int64)
        shr = cuda.shared.array(2, np.int64)
        mine = cuda.local.array(RPN, np.int64)
        bk = cuda.local.array(RPN, np.int32)
        rk = cuda.local.array(RPN, np.int32)
        sg = cuda.local.array(RPN, np.int32)         # each node's segment, found once
        depth = top_lp.shape[0]
        for d in range(LMAX):                        # a constant trip count: the loads go out together
            if d < depth:
                for a in range(GA):
                    r = tid + a * T
                    if r < k:
                        if WIDE:
                            lw[d * C + r] = q_of(top_lp[d, r])
                        else:
                            lq[d * C + r] = top_lp[d, r]
        for b in range(tid, NBK, T):
            cnt[b] = 0
        cuda.syncthreads()
        if tid == 0:                                 # chain scores, U, the start scores' range
            z = np.int64(0)
            zz[0] = z
            b0 = np.int64(0)                         # best prefix with 0..3 rank-1 deviations
            b1 = np.int64(NONE)
            b2 = np.int64(NONE)
            b3 = np.int64(NONE)
            u = np.int64(NONE)
            lo = rq(lq, lw, k - 1)
            for d in range(depth):
                q0 = rq(lq, lw, d * C)
                lo = min(lo, z + rq(lq, lw, d * C + k - 1))
                z += q0
                zz[d + 1] = z
                if k > 1:
                    q1 = rq(lq, lw, d * C + 1)
                    n3 = max(b3 + q0 if b3 > NONE else NONE, b2 + q1 if b2 > NONE else NONE)
                    n2 = max(b2 + q0 if b2 > NONE else NONE, b1 + q1 if b1 > NONE else NONE)
                    n1 = max(b1 + q0 if b1 > NONE else NONE, b0 + q1)
                    b0 += q0
                    b1, b2, b3 = n1, n2, n3
                    u = max(u, b3)
            sc[1] = u
            sc[2] = lo
            sc[3] = rq(lq, lw, 0)
        cuda.syncthreads()
        u = sc[1]
        theta = u
        if depth * k >= budget:                      # start scores z[j] + lp[j][r]: the B-th best one's bucket, and
            lo = sc[2]                               #   the smallest score in it
            span = np.float64(sc[3] - lo)
            scale = (NBK - 1) / span if span > 0.0 else 0.0
            start_pass(lq, lw, zz, depth, k, lo, scale, -1, cnt, shr)
            cuda.syncthreads()
            bb, _ = find_bin(cnt, NBK, budget, tmp, buf, shr)
            if tid == 0:
                shr[0] = np.int64(-NONE)
            cuda.syncthreads()
            start_pass(lq, lw, zz, depth, k, lo, scale, bb, cnt, shr)
            for b in range(tid, NBK, T):
                cnt[b] = 0
            cuda.syncthreads()
            theta = max(u, shr[0] - 1)
        # the chain: depths 1..e0
        e0 = 0
        for e in range(1, depth + 1):
            if zz[e] > theta and e <= budget:
                e0 = e
        # level 1: items j = 0..m1-1 (the parent: the root, then the chain node at depth j); deviations at depth j + 1
        m1 = min(e0, depth - 1) + 1
        base = np.int64(0)
        for c0 in range(0, m1, T):
            j = c0 + tid
            c = np.int64(0)
            if j < m1:
                c = max(0, prefix(lq, lw, j * C, k, theta - zz[j], j, 1, budget) - 1)
            ex, tot = block_scan(c, tmp, buf)
            if j < m1:
                ioff[j] = np.int32(base + ex)
            base += tot
        cuda.syncthreads()
        n1 = base
        nseg = 1 + n1
        if nseg > CAPS:
            return False
        if tid == 0:                                 # segment 0: the chain
            s_par[0] = -1
            s_pseg[0] = -1
            s_i[0] = 1
            s_r[0] = 0
            s_pen[0] = 0
        for s in range(tid, n1, T):
            j = last_at_most(ioff, 0, m1 - 1, s)
            r = 1 + s - ioff[j]
            g = 1 + s
            s_par[g] = j - 1
            s_pseg[g] = -1
            s_i[g] = np.int16(j + 1)
            s_r[g] = np.int16(r)
            s_pen[g] = rq(lq, lw, j * C + r) - rq(lq, lw, j * C)
        cuda.syncthreads()
        # nodes of the chain and the level-1 segments
        base = np.int64(0)
        for c0 in range(0, nseg, T):
            g = c0 + tid
            ln = np.int64(0)
            if g < nseg:
                if g == 0:
                    ln = e0
                else:
                    spar, mult = seg_prod(g, s_i, s_r, s_pseg)
                    ln = seg_len(zz, depth, np.int64(s_i[g]), s_pen[g], spar, mult, theta, budget)
            ex, tot = block_scan(ln, tmp, buf)
            if g < nseg:
                s_node0[g] = np.int32(base + ex)
            base += tot
        cuda.syncthreads()
        nn1 = base
        if nn1 > CAPN:
            return False
        # level 2: items = the level-1 nodes x in [e0, nn1); deviations at depth d + 1 off node x (depth d)
        nit = nn1 - e0
        base = np.int64(0)
        for c0 in range(0, nit, T):
            it = c0 + tid
            c = np.int64(0)
            if it < nit:
                x = e0 + it
                g = last_at_most(s_node0, 1, nseg - 1, x)
                d = s_i[g] + x - s_node0[g]
                if d < depth:
                    spar, mult = seg_prod(g, s_i, s_r, s_pseg)
                    sn = spar + (d - s_i[g] + 1) * mult
                    c = max(0, prefix(lq, lw, d * C, k, theta - zz[d] - s_pen[g], sn, mult, budget) - 1)
            ex, tot = block_scan(c, tmp, buf)
            if it < nit:
                ioff[it] = np.int32(base + ex)
            base += tot
        cuda.syncthreads()
        n2 = base
        if nseg + n2 > CAPS:
            return False
        for s in range(tid, n2, T):
            it = last_at_most(ioff, 0, nit - 1, s)
            r = 1 + s - ioff[it]
            x = e0 + it
            g = last_at_most(s_node0, 1, nseg - 1, x)
            d = s_i[g] + x - s_node0[g]
            h = nseg + s
            s_par[h] = x
            s_pseg[h] = g
            s_i[h] = np.int16(d + 1)
            s_r[h] = np.int16(r)
            s_pen[h] = s_pen[g] + rq(lq, lw, d * C + r) - rq(lq, lw, d * C)
        cuda.syncthreads()
        base = nn1
        for c0 in range(0, n2, T):
            s = c0 + tid
            ln = np.int64(0)
            if s < n2:
                h = nseg + s
                spar, mult = seg_prod(h, s_i, s_r, s_pseg)
                ln = seg_len(zz, depth, np.int64(s_i[h]), s_pen[h], spar, mult, theta, budget)
            ex, tot = block_scan(ln, tmp, buf)
            if s < n2:
                s_node0[nseg + s] = np.int32(base + ex)
            base += tot
        cuda.syncthreads()
        ne = base
        nseg += n2
        if ne > CAPN or (u > NONE and ne < budget):
            return False
        n = min(np.int64(budget), ne)
        # rank E: buckets by score (larger first), then the larger nodes of the own bucket
        lo = theta + 1 if theta > NONE else np.int64(NONE)
        span = np.float64(sc[3] - lo)
        scale = (NBK - 1) / span if span > 0.0 else 0.0
        for a in range(RPN):
            x = tid + a * T
            if x < ne:
                g = seg_of(s_node0, nseg, x)
                sg[a] = g
                v = zz[s_i[g] + x - s_node0[g]] + s_pen[g]
                mine[a] = v
                b = min(np.int32(np.float64(v - lo) * scale), np.int32(NBK - 1))
                bk[a] = b
                rk[a] = cuda.atomic.add(cnt, b, 1)
        cuda.syncthreads()
        buckets_above(cnt, NBK, NBK // T, tmp, buf)  # cnt[b] := nodes in buckets above b
        for a in range(RPN):
            x = tid + a * T
            if x < ne:
                p = cnt[bk[a]] + rk[a]
                g_sc[p] = mine[a]
                g_id[p] = x
        cuda.syncthreads()
        for a in range(RPN):
            x = tid + a * T
            rk[a] = np.int32(n)
            if x < ne:
                v = mine[a]
                b = bk[a]
                r = np.int64(cnt[b])
                if r < n:
                    end = np.int64(cnt[b - 1]) if b > 0 else ne
                    g = sg[a]
                    mc = np.int64(-1)                # this node's code, computed on the first tie
                    for j in range(r, end):
                        w = g_sc[j]
                        if w > v:
                            r += 1
                        elif w == v and g_id[j] != x:
                            if mc < 0:
                                mc = code_of(g, s_i[g] + x - s_node0[g], s_i, s_r, s_pseg)
                            y = g_id[j]
                            gy = seg_of(s_node0, nseg, y)
                            if code_of(gy, s_i[gy] + y - s_node0[gy], s_i, s_r, s_pseg) < mc:
                                r += 1
                    if r < n:
                        rk[a] = np.int32(r)
                        ioff[x] = np.int32(r)
        cuda.syncthreads()
        for a in range(RPN):                         # write out in order
            r = rk[a]
            if r < n:
                x = tid + a * T
                g = sg[a]
                i = s_i[g]
                d = i + x - s_node0[g]
                out_tok[r] = top_id[d - 1, s_r[g] if d == i else 0]
                out_dep[r] = d
                par = x - 1 if d > i else s_par[g]
                out_par[r] = np.int64(ioff[par]) + 1 if par >= 0 else 0
                out_score[r] = np.float64(mine[a]) / SCALE
        if tid == 0:
            out_n[0] = n
        return True

    _segments[key] = segment
    return segment


_segments: dict = {}


@cuda.jit(**DEVICE)
def at_most_two_deep(top_lp, k, budget, tmp, buf):
    """True when the tree has no node deeper than 2, by the two-level selection's exact count (tree_shallow.py): at
    least B prefixes of depth <= 2 precede (0, 0, 0) (scores > s3, plus (0) and (0, 0) when they tie it), or L <= 2.
    Reads the rows from global memory (a binary search in row 1 per depth-1 rank, one block scan per T ranks); every
    thread calls it, the result is block-uniform."""
    depth = top_lp.shape[0]
    if depth <= 2:
        return True
    a0 = q_of(top_lp[0, 0])
    b0 = q_of(top_lp[1, 0])
    s3 = a0 + b0 + q_of(top_lp[2, 0])
    row1 = top_lp[1]
    total = np.int64(0)
    for c0 in range(0, k, cuda.blockDim.x):
        r1 = c0 + cuda.threadIdx.x
        c = np.int64(0)
        if r1 < k:
            qa = q_of(top_lp[0, r1])
            c = (1 if qa > s3 else 0) + count_prefix(row1, 0, k, lp_of(s3 - qa), True, 0, 0, 0, 0)
            if r1 == 0:
                c += (1 if a0 == s3 else 0) + (1 if a0 + b0 == s3 else 0)
        _, tot = block_scan(c, tmp, buf)
        total += tot
    return total >= budget


def segment_kernel_for(budget: int, max_threads: int):
    """(kernel, T, smem): the segment selection in its own launch (the launcher uses it above SEGMENT_BMAX, up to
    BIG_BMAX, where its pool of 176 C bytes does not fit beside tree_beam's body): it writes the tree and its node
    count, or out_n = -1 when it declines; then beam_unless_for's kernel runs tree_beam's body only if out_n < 0.
    It declines at once trees at most 2 deep (at_most_two_deep), which tree_beam builds in two steps: on those it was
    slower (tree_run22, H100, budget 1024, normal rows: 44.7 / 51.3 us against tree_beam's 28.1 / 32.6).
    smem exceeds 48 KB: launch it through tree_numba._launch_big, which raises the kernel's dynamic limit."""
    if not 1 <= budget <= BIG_BMAX:
        raise ValueError(f"the segment's own launch takes budgets up to {BIG_BMAX}, got {budget}")
    cap = cap_for(budget)
    T = min(max_threads, cap)
    key = (T, cap // T)
    if key not in _big:
        segment = segment_for(T, cap // T, BIG_CAPN)
        jit = {} if SIM else {"launch_bounds": T}

        @cuda.jit(**jit)
        def segment_alone(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
            tmp = cuda.shared.array(32, np.int64)
            buf = cuda.shared.array(TBUF, np.int64)
            if (at_most_two_deep(top_lp, k, budget, tmp, buf)
                    or not segment(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)):
                if cuda.threadIdx.x == 0:
                    out_n[0] = -1

        _big[key] = segment_alone
    return _big[key], T, segment_layout(T, cap // T, BIG_CAPN)["bytes"]


def beam_unless_for(budget: int, max_threads: int):
    """(kernel, T): tree_beam's body for `budget` (beam_for's geometry), run only when the segment's own launch
    declined (out_n[0] < 0 on entry); otherwise it returns at once."""
    (_, body), threads = variant_for(budget, max_threads)
    key = id(body)                                # one kernel per tree_beam variant
    if key not in _unless:
        jit = {} if SIM else {"launch_bounds": threads}

        @cuda.jit(**jit)
        def beam_unless(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
            if out_n[0] >= 0:
                return
            body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)

        _unless[key] = beam_unless
    return _unless[key], threads


_big: dict = {}
_unless: dict = {}
