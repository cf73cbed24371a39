"""Per-depth top-K of the draft log-probs on the GPU: K <= 1024 of V <= ~500k per row, ordered by
(log-prob descending, token id ascending), exactly as reference.tree.ranked_candidates.

Launch geometry: grid (P chunks, L rows), T threads per block; a chunk is C consecutive token ids of one row,
read in sub-chunks of T * EPT (each thread first loads its EPT values, unrolled, so the loads are in flight
together). Four launches of three kernels:
    topk_stats            per chunk: the block's max logit, then sum exp(x - max) in fp64 (one exp per element,
                          no branch); the last block of the row (atomic counter) combines the chunks in a fixed
                          order (deterministic) into lse[row]. The same pass histograms digit 0 of the logits'
                          sortable keys.
    topk_hist level 1, 2  radix select on the 32-bit sortable key of the raw fp32 LOGIT (11 + 11 + 10 bits;
                          integer work only): each level finds the bucket holding the K-th largest key from the
                          previous level's histogram (every block redundantly, from a shared-memory copy) and
                          histograms the next digit.
    topk_gather           x_K = the K-th largest logit, lp_K = its grid log-prob. The log-prob is a non-decreasing
                          function of the logit, so lp_K is the K-th largest log-prob, every token with lp > lp_K has
                          x > x_K, and a token with lp == lp_K has x >= x_K or x within a few fp32 ulps of
                          x_K - lse below it (grid_log_prob's fp32 rounding can merge distinct logits). So the fp64
                          log-prob is formed only for x > x_K (fewer than K), x == x_K and that thin band; every
                          other token is settled by one integer compare. Tokens with lp > lp_K are all taken, ties
                          at lp_K lowest id first (ordered per chunk, chunks in id order); the last block of the row
                          sorts the K by (lp desc, id asc) with a bitonic sort in shared memory, writes lp and ids,
                          and zeroes the row's histograms and counters for the next call.
                          When lp_K is the floor -2^21 (or x_K is not finite) every token takes the fp64 path.
Napkin: V = 163,840, L = 15: the logits are 9.8 MB (read once from HBM, then 3 times from the 60 MB L2),
2.5 M fp64 exps (~4 us of FP64 issue on an H200); the launches (~2-4 us each on the device) dominate.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import math

import numpy as np
from numba import cuda

from .tree_device import KERNEL, LP_FLOOR, SIM, TBUF, block_scan, grid_log_prob, key_value, sortable_key

NB = 2048            # histogram bins (11-bit digits; the last digit uses 1024)
KMAX = 1024          # largest K (the budget limit)
PMAX = 128           # most chunks per row
PMAX1 = PMAX + 1
TMAX = 1024          # largest block
TOP = 2 ** 31 - 1    # composite candidate = key * 2^31 + (TOP - id): larger is better
EPT = 2 if SIM else 16   # values per thread per sub-chunk (a sub-chunk is T * EPT ids)


@cuda.jit(device=True)
def find_bucket(hist, row, level, nbins, k, bins, tmp, buf, shr):
    """Bucket of hist[row, level, :nbins] holding the k-th largest key (1-based) and k's rank inside it.
    bins: shared int32[NB], receives a copy of the histogram (four loads in flight per thread)."""
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    i = tid
    while i + 3 * T < nbins:
        a = hist[row, level, i]
        b = hist[row, level, i + T]
        c = hist[row, level, i + 2 * T]
        d = hist[row, level, i + 3 * T]
        bins[i] = a
        bins[i + T] = b
        bins[i + 2 * T] = c
        bins[i + 3 * T] = d
        i += 4 * T
    while i < nbins:
        bins[i] = hist[row, level, i]
        i += T
    cuda.syncthreads()
    per = (nbins + T - 1) // T
    local = np.int64(0)
    for q in range(tid * per, min(nbins, (tid + 1) * per)):         # q-th bin from the top
        local += bins[nbins - 1 - q]
    before, total = block_scan(local, tmp, buf)
    if before < k <= before + local:
        cum = before
        for q in range(tid * per, min(nbins, (tid + 1) * per)):
            c = bins[nbins - 1 - q]
            if cum + c >= k:
                shr[0] = nbins - 1 - q
                shr[1] = k - cum
                break
            cum += c
    cuda.syncthreads()
    b, kr = shr[0], shr[1]
    cuda.syncthreads()
    return b, kr


@cuda.jit(device=True)
def load_values(x, row, base, hi, vals):
    """This thread's EPT logits of the sub-chunk at `base` (clamped in-bounds; the caller masks i >= hi)."""
    T = cuda.blockDim.x
    for j in range(EPT):                                    # constant trip count: unrolled
        vals[j] = x[row, min(base + j * T + cuda.threadIdx.x, hi - 1)]


@cuda.jit(**KERNEL)
def topk_stats(x, vocab, chunk, part_m, part_s, lse, hist, done):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    nparts = cuda.gridDim.x
    red_m = cuda.shared.array(TMAX, np.float64)
    red_s = cuda.shared.array(TMAX, np.float64)
    sh = cuda.shared.array(NB, np.int32)
    last = cuda.shared.array(1, np.int32)
    vals = cuda.local.array(EPT, np.float32)
    for i in range(tid, NB, T):
        sh[i] = 0
    cuda.syncthreads()
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    m = np.float32(-math.inf)                                   # pass 1: max, digit-0 histogram of the keys
    for base in range(lo, hi, T * EPT):
        load_values(x, row, base, hi, vals)
        for j in range(EPT):
            if base + j * T + tid < hi:
                v = vals[j]
                m = max(m, v)
                cuda.atomic.add(sh, sortable_key(v) >> 21, 1)
    red_m[tid] = np.float64(m)
    h = T // 2
    while h > 0:
        cuda.syncthreads()
        if tid < h:
            red_m[tid] = max(red_m[tid], red_m[tid + h])
        h //= 2
    cuda.syncthreads()
    mb = red_m[0]
    s = 0.0                                                     # pass 2: sum exp(x - block max), fp64
    if mb > -math.inf:
        for base in range(lo, hi, T * EPT):
            load_values(x, row, base, hi, vals)
            for j in range(EPT):
                if base + j * T + tid < hi:
                    s += math.exp(np.float64(vals[j]) - mb)    # exp(-inf) = 0 for masked tokens
    red_s[tid] = s
    h = T // 2
    while h > 0:
        cuda.syncthreads()
        if tid < h:
            red_s[tid] += red_s[tid + h]
        h //= 2
    for i in range(tid, NB, T):
        c = sh[i]
        if c != 0:
            cuda.atomic.add(hist, (row, 0, i), c)
    cuda.syncthreads()
    if tid == 0:
        part_m[row, p] = mb
        part_s[row, p] = red_s[0]
        cuda.threadfence()
        last[0] = 1 if cuda.atomic.add(done, row, 1) == nparts - 1 else 0
    cuda.syncthreads()
    if last[0] == 0:
        return
    # Last block of the row: lse = M + log(sum_p s_p exp(m_p - M)), combined over PMAX fixed slots in a fixed
    # pairing, so the bits do not depend on which block came last or on T.
    cuda.threadfence()
    for q in range(tid, PMAX, T):
        red_m[q] = cuda.atomic.add(part_m, (row, q), 0.0) if q < nparts else -math.inf
    h = PMAX // 2
    while h > 0:
        cuda.syncthreads()
        for q in range(tid, h, T):
            red_m[q] = max(red_m[q], red_m[q + h])
        h //= 2
    cuda.syncthreads()
    mx = red_m[0]
    cuda.syncthreads()
    for q in range(tid, PMAX, T):
        red_s[q] = 0.0
        if q < nparts:
            sq = cuda.atomic.add(part_s, (row, q), 0.0)
            if sq > 0.0:
                red_s[q] = sq * math.exp(cuda.atomic.add(part_m, (row, q), 0.0) - mx)
    h = PMAX // 2
    while h > 0:
        cuda.syncthreads()
        for q in range(tid, h, T):
            red_s[q] += red_s[q + h]
        h //= 2
    cuda.syncthreads()
    if tid == 0:
        lse[row] = mx + math.log(red_s[0])
        done[row] = 0


@cuda.jit(**KERNEL)
def topk_hist(x, vocab, chunk, hist, sel, level, k):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    sh = cuda.shared.array(NB, np.int32)
    bins = cuda.shared.array(NB, np.int32)
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(TBUF, np.int64)
    shr = cuda.shared.array(2, np.int64)
    vals = cuda.local.array(EPT, np.float32)
    for i in range(tid, NB, T):
        sh[i] = 0
    b1 = np.int64(0)
    b2 = np.int64(0)
    if level == 1:
        b1, k1 = find_bucket(hist, row, 0, NB, k, bins, tmp, buf, shr)
        if p == 0 and tid == 0:
            sel[row, 0] = b1
            sel[row, 1] = k1
    elif level == 2:
        b1 = sel[row, 0]
        b2, k2 = find_bucket(hist, row, 1, NB, sel[row, 1], bins, tmp, buf, shr)
        if p == 0 and tid == 0:
            sel[row, 2] = b2
            sel[row, 3] = k2
    cuda.syncthreads()
    prefix = (b1 << 11) | b2
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    for base in range(lo, hi, T * EPT):
        load_values(x, row, base, hi, vals)
        for j in range(EPT):
            if base + j * T + tid < hi:
                key = sortable_key(vals[j])
                if level == 1:
                    if (key >> 21) == b1:
                        cuda.atomic.add(sh, (key >> 10) & 0x7FF, 1)
                elif (key >> 10) == prefix:
                    cuda.atomic.add(sh, key & 0x3FF, 1)
    cuda.syncthreads()
    for i in range(tid, NB, T):
        c = sh[i]
        if c != 0:
            cuda.atomic.add(hist, (row, level, i), c)


@cuda.jit(device=True)
def lp_key_if_near(v, kx, thr, thr_x, ls, band, slow):
    """sortable key of grid_log_prob(v) when it can reach the threshold's (x >= x_K, or inside the band below
    it, or slow mode), else -1 (certainly below: no fp64 work)."""
    if kx >= thr or slow or np.float64(thr_x) - np.float64(v) <= band:
        return sortable_key(grid_log_prob(v, ls))
    return np.int64(-1)


@cuda.jit(**KERNEL)
def topk_gather(x, vocab, chunk, lse, hist, sel, k, counters, cand, eq_ids, eq_cnt, top_lp, top_id):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    nparts = cuda.gridDim.x
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(TBUF, np.int64)
    shr = cuda.shared.array(2, np.int64)
    off = cuda.shared.array(PMAX1, np.int64)
    keys = cuda.shared.array(KMAX, np.int64)
    bins = cuda.shared.array(NB, np.int32)
    vals = cuda.local.array(EPT, np.float32)
    b3, _ = find_bucket(hist, row, 2, NB // 2, sel[row, 3], bins, tmp, buf, shr)
    thr = (sel[row, 0] << 21) | (sel[row, 2] << 10) | b3           # key of the K-th largest logit x_K
    thr_x = key_value(thr)
    ls = lse[row]
    thr_lp = grid_log_prob(thr_x, ls)                              # the K-th largest log-prob
    thr_lk = sortable_key(thr_lp)
    slow = not (thr_lp > LP_FLOOR) or not (abs(thr_x) < math.inf)
    band = (abs(np.float64(thr_x) - ls) + 1.0) * 4.76837158203125e-07      # 2^-21: >= 4 fp32 ulps + the grid
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    n_eq = np.int64(0)
    for base in range(lo, hi, T * EPT):
        load_values(x, row, base, hi, vals)
        for j in range(EPT):
            i = base + j * T + tid
            if i < hi:
                lk = lp_key_if_near(vals[j], sortable_key(vals[j]), thr, thr_x, ls, band, slow)
                if lk > thr_lk:
                    slot = cuda.atomic.add(counters, (row, 0), 1)
                    cand[row, slot] = lk * (TOP + 1) + (TOP - i)
                elif lk == thr_lk:
                    n_eq += 1
    _, eq_total = block_scan(n_eq, tmp, buf)
    if eq_total > 0:                     # ties at the threshold: lowest ids first, in id order (up to K per chunk)
        per = (hi - lo + T - 1) // T
        s0 = min(hi, lo + tid * per)
        s1 = min(hi, s0 + per)
        mine = np.int64(0)
        for i in range(s0, s1):
            v = x[row, i]
            if lp_key_if_near(v, sortable_key(v), thr, thr_x, ls, band, slow) == thr_lk:
                mine += 1
        r, _ = block_scan(mine, tmp, buf)
        for i in range(s0, s1):
            v = x[row, i]
            if r < k and lp_key_if_near(v, sortable_key(v), thr, thr_x, ls, band, slow) == thr_lk:
                eq_ids[row, p, r] = i
                r += 1
    if tid == 0:
        eq_cnt[row, p] = min(eq_total, k)
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        shr[0] = 1 if cuda.atomic.add(counters, (row, 1), 1) == nparts - 1 else 0
    cuda.syncthreads()
    if shr[0] == 0:
        return
    # The last block of this row: the ngt tokens above lp_K, then the first K - ngt ties in chunk order; sort,
    # write. What other blocks wrote is read with atomics (served by L2), so no stale L1 line can be seen.
    cuda.threadfence()
    ngt = np.int64(cuda.atomic.add(counters, (row, 0), 0))
    need = k - ngt
    base_q = np.int64(0)
    for c in range(0, nparts, T):                                  # off[q] = sum of eq_cnt[:q]
        q = c + tid
        cnt = np.int64(cuda.atomic.add(eq_cnt, (row, q), 0)) if q < nparts else np.int64(0)
        ex, tot = block_scan(cnt, tmp, buf)
        if q < nparts:
            off[q] = base_q + ex
        base_q += tot
    if tid == 0:
        off[nparts] = base_q
    n2 = 1
    while n2 < k:
        n2 *= 2
    for r in range(tid, n2, T):
        keys[r] = cuda.atomic.add(cand, (row, r), 0) if r < ngt else np.int64(-1)
    cuda.syncthreads()
    for q in range(nparts):
        for r in range(tid, off[q + 1] - off[q], T):
            pos = off[q] + r
            if pos < need:
                keys[ngt + pos] = thr_lk * (TOP + 1) + (TOP - cuda.atomic.add(eq_ids, (row, q, r), 0))
    bitonic_sort_desc(keys, n2)
    for r in range(tid, k, T):
        tok = TOP - (keys[r] & TOP)
        top_id[row, r] = tok
        top_lp[row, r] = grid_log_prob(x[row, tok], ls)
    nh = hist.shape[1] * hist.shape[2]                             # clean for the next call
    for i in range(tid, nh, T):
        hist[row, i // hist.shape[2], i % hist.shape[2]] = 0
    if tid == 0:
        counters[row, 0] = 0
        counters[row, 1] = 0


@cuda.jit(device=True)
def bitonic_sort_desc(keys, n):
    """Sort keys[:n] descending in place (n a power of two); every thread of the block calls it."""
    tid = cuda.threadIdx.x
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            cuda.syncthreads()
            for i in range(tid, n, cuda.blockDim.x):
                j = i ^ stride
                if j > i:
                    a = keys[i]
                    b = keys[j]
                    if (a < b) == ((i & size) == 0):
                        keys[i] = b
                        keys[j] = a
            stride //= 2
        size *= 2
    cuda.syncthreads()
