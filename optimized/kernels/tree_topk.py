"""Per-depth top-K of the draft log-probs on the GPU: K <= 1024 of V <= ~500k per row, ordered by
(log-prob descending, token id ascending), exactly as reference.tree.ranked_candidates.

Launch geometry: grid (P chunks, L rows), T threads per block; a chunk is C consecutive token ids of one row.
Four launches of the same two kernels (a pass is a parameter):
    topk_stats            per chunk (max, sum exp(x - max)) in fp64; zeroes the histograms and counters
    topk_hist level 0..2  radix select on the 32-bit sortable key of the grid log-prob: 11 + 11 + 10 bits;
                          each level finds the bucket holding the K-th largest key from the previous level's
                          histogram (every block redundantly, so no extra launch) and histograms the next digit
    topk_gather           the threshold key T is known: keys > T go to the row's candidate list (K - k3 of
                          them); keys == T are taken lowest id first (an ordered scan per chunk, chunks in id
                          order); the last block of the row (atomic counter) sorts the K candidates by
                          (key desc, id asc) with a bitonic sort in shared memory and writes lp and ids.
Napkin: V = 163,840, L = 15: the logits are 9.8 MB (read once from HBM, then 3-4 times from the 60 MB L2),
~2.5 M fp64 exps; at 4 TB/s + L2 the floor is ~3 us, the launches (~2-4 us each on the device) dominate.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import math

import numpy as np
from numba import cuda

from .tree_device import TBUF, block_scan, grid_log_prob, lse_of_row, sortable_key

NB = 2048            # histogram bins (11-bit digits; the last digit uses 1024)
KMAX = 1024          # largest K (the budget limit)
PMAX = 128           # most chunks per row
PMAX1 = PMAX + 1
TMAX = 1024          # largest block
TOP = 2 ** 31 - 1    # composite candidate = key * 2^31 + (TOP - id): larger is better


@cuda.jit(device=True)
def find_bucket(hist, row, level, nbins, k, tmp, buf, shr):
    """Bucket of hist[row, level, :nbins] holding the k-th largest key (1-based) and k's rank inside it."""
    tid = cuda.threadIdx.x
    per = (nbins + cuda.blockDim.x - 1) // cuda.blockDim.x
    local = np.int64(0)
    for q in range(tid * per, min(nbins, (tid + 1) * per)):         # q-th bin from the top
        local += hist[row, level, nbins - 1 - q]
    before, total = block_scan(local, tmp, buf)
    if before < k <= before + local:
        cum = before
        for q in range(tid * per, min(nbins, (tid + 1) * per)):
            c = hist[row, level, nbins - 1 - q]
            if cum + c >= k:
                shr[0] = nbins - 1 - q
                shr[1] = k - cum
                break
            cum += c
    cuda.syncthreads()
    b, kr = shr[0], shr[1]
    cuda.syncthreads()
    return b, kr


@cuda.jit
def topk_stats(x, vocab, chunk, part_m, part_s, hist, counters):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    red = cuda.shared.array(TMAX, np.float64)
    nh = hist.shape[1] * hist.shape[2]                          # zero this row's histograms
    per = (nh + cuda.gridDim.x - 1) // cuda.gridDim.x
    for i in range(p * per + tid, min(nh, (p + 1) * per), T):
        hist[row, i // hist.shape[2], i % hist.shape[2]] = 0
    if p == 0 and tid == 0:
        counters[row, 0] = 0
        counters[row, 1] = 0
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    m = -math.inf
    for i in range(lo + tid, hi, T):
        v = np.float64(x[row, i])
        if v > m:
            m = v
    red[tid] = m
    s = T // 2
    while s > 0:
        cuda.syncthreads()
        if tid < s and red[tid + s] > red[tid]:
            red[tid] = red[tid + s]
        s //= 2
    cuda.syncthreads()
    m = red[0]
    acc = 0.0
    if m > -math.inf:
        for i in range(lo + tid, hi, T):
            acc += math.exp(np.float64(x[row, i]) - m)
    cuda.syncthreads()
    red[tid] = acc
    s = T // 2
    while s > 0:
        cuda.syncthreads()
        if tid < s:
            red[tid] += red[tid + s]
        s //= 2
    cuda.syncthreads()
    if tid == 0:
        part_m[row, p] = m
        part_s[row, p] = red[0]

@cuda.jit
def topk_hist(x, vocab, chunk, part_m, part_s, lse, hist, sel, level, k):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    sh = cuda.shared.array(NB, np.int32)
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(TBUF, np.int64)
    shr = cuda.shared.array(2, np.int64)
    shl = cuda.shared.array(1, np.float64)
    for i in range(tid, NB, T):
        sh[i] = 0
    if tid == 0:
        shl[0] = lse_of_row(part_m, part_s, row, cuda.gridDim.x) if level == 0 else lse[row]
    b1 = np.int64(0)
    b2 = np.int64(0)
    if level == 1:
        b1, k1 = find_bucket(hist, row, 0, NB, k, tmp, buf, shr)
        if p == 0 and tid == 0:
            sel[row, 0] = b1
            sel[row, 1] = k1
    elif level == 2:
        b1 = sel[row, 0]
        b2, k2 = find_bucket(hist, row, 1, NB, sel[row, 1], tmp, buf, shr)
        if p == 0 and tid == 0:
            sel[row, 2] = b2
            sel[row, 3] = k2
    cuda.syncthreads()
    ls = shl[0]
    if level == 0 and p == 0 and tid == 0:
        lse[row] = ls
    prefix = (b1 << 11) | b2
    lo = p * chunk
    for i in range(lo + tid, min(vocab, lo + chunk), T):
        key = sortable_key(grid_log_prob(x[row, i], ls))
        if level == 0:
            cuda.atomic.add(sh, key >> 21, 1)
        elif level == 1:
            if (key >> 21) == b1:
                cuda.atomic.add(sh, (key >> 10) & 0x7FF, 1)
        elif (key >> 10) == prefix:
            cuda.atomic.add(sh, key & 0x3FF, 1)
    cuda.syncthreads()
    for i in range(tid, NB, T):
        c = sh[i]
        if c != 0:
            cuda.atomic.add(hist, (row, level, i), c)

@cuda.jit
def topk_gather(x, vocab, chunk, lse, hist, sel, k, counters, cand, eq_ids, eq_cnt, top_lp, top_id):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    nparts = cuda.gridDim.x
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(TBUF, np.int64)
    shr = cuda.shared.array(2, np.int64)
    off = cuda.shared.array(PMAX1, np.int64)
    keys = cuda.shared.array(KMAX, np.int64)
    b3, need = find_bucket(hist, row, 2, NB // 2, sel[row, 3], tmp, buf, shr)
    thr = (sel[row, 0] << 21) | (sel[row, 2] << 10) | b3          # the K-th largest key
    ngt = k - need                                                 # keys > thr, all taken
    ls = lse[row]
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    n_eq = np.int64(0)
    for i in range(lo + tid, hi, T):
        key = sortable_key(grid_log_prob(x[row, i], ls))
        if key > thr:
            slot = cuda.atomic.add(counters, (row, 0), 1)
            cand[row, slot] = key * (TOP + 1) + (TOP - i)
        elif key == thr:
            n_eq += 1
    _, eq_total = block_scan(n_eq, tmp, buf)
    if eq_total > 0:                     # ties at the threshold: lowest ids first, in id order
        per = (hi - lo + T - 1) // T
        s0 = min(hi, lo + tid * per)
        s1 = min(hi, s0 + per)
        mine = np.int64(0)
        for i in range(s0, s1):
            if sortable_key(grid_log_prob(x[row, i], ls)) == thr:
                mine += 1
        r, _ = block_scan(mine, tmp, buf)
        for i in range(s0, s1):
            if r < need and sortable_key(grid_log_prob(x[row, i], ls)) == thr:
                eq_ids[row, p, r] = i
                r += 1
    if tid == 0:
        eq_cnt[row, p] = min(eq_total, need)
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        shr[0] = 1 if cuda.atomic.add(counters, (row, 1), 1) == nparts - 1 else 0
    cuda.syncthreads()
    if shr[0] == 0:
        return
    # The last block of this row: append the tied ids in chunk order, sort, write. What other blocks wrote
    # is read with atomics (served by L2), so no stale L1 line can be seen.
    cuda.threadfence()
    if tid == 0:
        base = np.int64(0)
        for q in range(nparts):
            off[q] = base
            base += cuda.atomic.add(eq_cnt, (row, q), 0)
        off[nparts] = base
    cuda.syncthreads()
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
                keys[ngt + pos] = thr * (TOP + 1) + (TOP - cuda.atomic.add(eq_ids, (row, q, r), 0))
    bitonic_sort_desc(keys, n2)
    for r in range(tid, k, T):
        tok = TOP - (keys[r] & TOP)
        top_id[row, r] = tok
        top_lp[row, r] = grid_log_prob(x[row, tok], ls)
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
