"""Per-depth top-K of the draft log-probs on the GPU: K <= 1024 of V <= ~500k per row, ordered by
(log-prob descending, token id ascending), exactly as reference.tree.ranked_candidates.

Launch geometry: grid (P chunks, L rows), T threads per block; a chunk is C consecutive token ids of one row,
read in sub-chunks of T * EPT (each thread first loads its EPT values, unrolled, so the loads are in flight
together: the kernels are latency bound, not bandwidth bound). Five launches of three kernels:
    topk_stats            per chunk online (max, sum exp(x - max)) in fp64; the last block of the row (atomic
                          counter) combines the chunks in a fixed order (deterministic) into lse[row]; zeroes
                          the histograms and counters
    topk_hist level 0..2  radix select on the 32-bit sortable key of the grid log-prob: 11 + 11 + 10 bits;
                          each level finds the bucket holding the K-th largest key from the previous level's
                          histogram (every block redundantly, from a shared-memory copy) and histograms the next
                          digit
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

from .tree_device import SIM, TBUF, block_scan, grid_log_prob, sortable_key

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


@cuda.jit
def topk_stats(x, vocab, chunk, part_m, part_s, lse, hist, counters, done):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x
    nparts = cuda.gridDim.x
    red_m = cuda.shared.array(TMAX, np.float64)
    red_s = cuda.shared.array(TMAX, np.float64)
    last = cuda.shared.array(1, np.int32)
    vals = cuda.local.array(EPT, np.float32)
    nh = hist.shape[1] * hist.shape[2]                          # zero this row's histograms
    per = (nh + nparts - 1) // nparts
    for i in range(p * per + tid, min(nh, (p + 1) * per), T):
        hist[row, i // hist.shape[2], i % hist.shape[2]] = 0
    if p == 0 and tid == 0:
        counters[row, 0] = 0
        counters[row, 1] = 0
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    m = -math.inf                                               # online (max, sum exp(x - max))
    s = 0.0
    for base in range(lo, hi, T * EPT):
        load_values(x, row, base, hi, vals)
        for j in range(EPT):
            if base + j * T + tid < hi:
                v = np.float64(vals[j])
                if v > m:
                    s = s * math.exp(m - v) + 1.0 if m > -math.inf else 1.0
                    m = v
                elif v > -math.inf:
                    s += math.exp(v - m)
    red_m[tid] = m
    red_s[tid] = s
    h = T // 2
    while h > 0:
        cuda.syncthreads()
        if tid < h:
            a_m, a_s, b_m, b_s = red_m[tid], red_s[tid], red_m[tid + h], red_s[tid + h]
            mm = max(a_m, b_m)
            if mm > -math.inf:
                red_s[tid] = a_s * math.exp(a_m - mm) + b_s * math.exp(b_m - mm)
            red_m[tid] = mm
        h //= 2
    cuda.syncthreads()
    if tid == 0:
        part_m[row, p] = red_m[0]
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


@cuda.jit
def topk_hist(x, vocab, chunk, lse, hist, sel, level, k):
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
    ls = lse[row]
    prefix = (b1 << 11) | b2
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    for base in range(lo, hi, T * EPT):
        load_values(x, row, base, hi, vals)
        for j in range(EPT):
            if base + j * T + tid < hi:
                key = sortable_key(grid_log_prob(vals[j], ls))
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
    bins = cuda.shared.array(NB, np.int32)
    vals = cuda.local.array(EPT, np.float32)
    b3, need = find_bucket(hist, row, 2, NB // 2, sel[row, 3], bins, tmp, buf, shr)
    thr = (sel[row, 0] << 21) | (sel[row, 2] << 10) | b3          # the K-th largest key
    ngt = k - need                                                 # keys > thr, all taken
    ls = lse[row]
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    n_eq = np.int64(0)
    for base in range(lo, hi, T * EPT):
        load_values(x, row, base, hi, vals)
        for j in range(EPT):
            i = base + j * T + tid
            if i < hi:
                key = sortable_key(grid_log_prob(vals[j], ls))
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
