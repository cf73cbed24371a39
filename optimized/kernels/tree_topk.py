"""Per-depth top-K of the draft log-probs on the GPU: K <= 1024 of V <= ~500k per row, ordered by
(log-prob descending, token id ascending), exactly as reference.tree.ranked_candidates.

Launch geometry: grid (P chunks, L rows), T threads per block; a chunk is C consecutive token ids of one row,
read in sub-chunks of T * EPT (each thread loads its EPT values unrolled, so the loads are in flight together).
Two launches:
    topk_stats    per chunk: max and sum exp(x - max) in fp64 (online per sub-chunk: one exp per element, by
                  tree_device.exp_le0, plus one per sub-chunk) into the row's partials, and a 4096-bin histogram of
                  the top 12 bits of each logit's sortable key, added into the row's. No block waits for another.
    topk_filter   every block first combines the row's partials in a fixed order into lse (one warp: the same
                  bits in every block) and finds the bin b holding the K-th largest logit (int32 run sums and
                  scans), in parallel. Then per chunk: every
                  token with x >= lo(b) - band is a candidate (band: a few fp32 ulps of |x - lse|
                  plus the 2^-28 grid, so every token whose grid log-prob can equal the K-th largest one is in);
                  its composite key (sortable(lp) - 2^31) << 32 | (2^32 - 1 - id) -- larger is better, unique -- goes
                  to the block's list in shared memory, then (one global atomic a block reserves the slots) to the
                  row's candidate list. The last block of the row ranks its (at most CAP) candidates, each by a
                  count of the larger keys (count_rank, up to SMALL_RANK of them) or by a bucket sort (bucket_rank:
                  buckets by a monotone map of the log-prob, then a count of the larger keys in the key's own
                  bucket; a few barriers, no sort network), writes lp and ids of ranks < K, and zeroes the row's
                  histogram and counters for the next call. When the candidates overflow CAP (tie-heavy rows:
                  equal, integer, collapsing logits) or lo(b) is not usable (-inf, the -2^21 floor), it
                  radix-selects the K-th largest key over the whole row, recomputing each token's key per pass, and
                  sorts the K keys above it with a bitonic network (tree_device.pair_sort; exact, slow, tie-heavy
                  rows only).
Exactness: lp(x) = grid(fp32(x - lse)) is non-decreasing in x, so every token with lp >= lp_K (lp_K the
log-prob of the K-th largest logit x_K >= lo(b)) has x >= lo(b) - band; the candidates therefore hold the top K.
Per logit (sm_90 SASS): stats ~5 integer instructions for the bin, one shared atomic, ~12 fp64 for the exp (no
branch, no fp64-to-int conversion, no clamp; the whole loop ran ~65 instructions a logit in run 21, before the exp
lost its clamp and a multiply); filter one fp32 compare and a warp vote (whole sub-chunks load from one address
with constant offsets). Napkin: V = 163,840, L = 15: the logits are 9.8 MB (read from HBM once, then from the 60 MB
L2 once), 2.5 M fp64 exps (~3 us of FP64 issue over the GPU), a few thousand candidates; two launches.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import math
import os

import numpy as np
from numba import cuda

from .tree_device import (DEVICE, EXP_TAB_BITS, KERNEL, LP_FLOOR, SIM, TBUF, WARP, ballot, bin_runs_for, buckets_above,
                          exp_le0, f32_bits, find_bin_for, grid_log_prob, key_value, pair_sort, shfl_idx, shfl_xor,
                          sortable_key)

NB = 4096            # digit-0 histogram bins: the top 12 bits of the 32-bit sortable key
NB1 = NB + 1
SHIFT0 = 20          # key >> SHIFT0 is the bin
assert NB == 1 << (32 - SHIFT0)   # hist_bin's flips
CAP = 64 if SIM else 4096   # candidates selected in shared memory (more: the whole-row path)
PMAX = 128           # most chunks per row
RB = 256             # radix bins of the final select (8-bit digits)
NBK = 64 if SIM else 2048      # buckets of the final rank (bucket_rank); a multiple of the block
SMALL_RANK = 256     # at most this many candidates (and one a thread): count_rank instead of bucket_rank
LOW = 0xFFFFFFFF     # composite key: high word sortable(lp) - 2^31, low word LOW - id
NEG = -(2 ** 63)     # sorts after every composite key
# The block on the GPU (a compile-time constant there: strided loops need no division) and the blocks per SM that
# keep the grid one wave (WAVE_BLOCKS, registers <= 64). 1024: the row's last block sorts its candidates with a
# thread per key; bench/results/tree_run14/README.md (H100): top-K 38.7 / 51.6 / 74.0 us at L = 15, K = 16 / 256
# / 1024 against 42.8 / 63.3 / 94.7 with 256 threads, the same at L = 7. DDTREE_TOPK_THREADS (256, 512, 1024; read
# at import) keeps the A/B possible (bench/topk_probe.py).
TOPK_T = int(os.environ.get("DDTREE_TOPK_THREADS", "1024"))
if TOPK_T not in (256, 512, 1024):
    raise ValueError(f"DDTREE_TOPK_THREADS must be 256, 512 or 1024, got {TOPK_T}")
WAVE_BLOCKS = 1024 // TOPK_T
EPT = 2 if SIM else max(4, 2048 // TOPK_T)   # values per thread per sub-chunk (a sub-chunk is T * EPT ids)
SORT_NA = 8 if SIM else 1024 // TOPK_T   # register slots per thread of the whole-row sort: T * SORT_NA >= K
RPT = 16 if SIM else CAP // TOPK_T       # candidates per thread in bucket_rank (registers): RPT * T >= CAP
TOPK_JIT = dict(KERNEL) if SIM else dict(KERNEL, launch_bounds=(TOPK_T, WAVE_BLOCKS))   # one wave
sort_keys = pair_sort(SORT_NA, keyed=False)   # composite keys are distinct


@cuda.jit(**DEVICE)
def load_values(xr, base, lim, vals):
    """This thread's EPT logits of the sub-chunk at `base` of the row xr: vals[j] = xr[base + j * T + tid] where
    j * T + tid < lim, else -inf (padding: no max, no exp, no candidate). A whole sub-chunk (every chunk's but the
    row's last) loads without predicates from one address plus constant offsets; before, each predicated load
    recomputed its 64-bit address (~10 instructions a load)."""
    T = cuda.blockDim.x if SIM else TOPK_T
    if lim >= T * EPT:
        o = np.uint64(base + cuda.threadIdx.x)              # unsigned: no negative-index wraparound code
        for j in range(EPT):                                # constant trip count: unrolled
            vals[j] = xr[o + np.uint64(j * T)]
    else:
        for j in range(EPT):
            o = j * T + cuda.threadIdx.x
            vals[j] = xr[np.uint32(base + o)] if o < lim else np.float32(-math.inf)


@cuda.jit(**DEVICE)
def hist_bin(v):
    """sortable_key(v) >> SHIFT0 (the top 12 bits of the key) from the unsigned 32 bits u of v: the key is u with
    its sign bit set (v >= 0) or all bits flipped (v < 0), so the bin is u >> 20 with bit 11 or all 12 bits
    flipped. Unsigned: the arithmetic stays in 32 bits."""
    u = np.uint32(f32_bits(v))
    return (u >> np.uint32(SHIFT0)) ^ (np.uint32(NB - 1) if (u >> np.uint32(31)) != 0 else np.uint32(NB // 2))


@cuda.jit(**DEVICE)
def composite(x, i, ls):
    """Composite key of token i with logit x: larger = earlier in (lp desc, id asc)."""
    return ((sortable_key(grid_log_prob(x, ls)) - np.int64(0x80000000)) << 32) | (np.int64(LOW) - i)


@cuda.jit(**DEVICE)
def warp_max_sum(m, s, fbuf):
    """(M, S) on every lane of the warp: M = the warp's largest m, S = the sum of s * exp(m - M) over its lanes (0
    where m is -inf; libdevice's exp, one a lane). The same bits on every lane and on every run: butterflies, whose
    partners combine the same two values in the same order."""
    mm = m
    off = 1
    while off < WARP:
        mm = max(mm, shfl_xor(mm, off, fbuf))
        off *= 2
    v = s * math.exp(m - mm) if m > -math.inf else 0.0
    off = 1
    while off < WARP:
        v += shfl_xor(v, off, fbuf)
        off *= 2
    return mm, v


@cuda.jit(**DEVICE)
def block_partial(m, s, wm, ws, fbuf):
    """(M, S) of the whole block, valid on warp 0: each warp reduces its lanes (warp_max_sum), writes its pair, and
    after one barrier warp 0 reduces the warps' pairs the same way (a fixed order: the same bits on every run).
    Where every warp ran the second stage, and three barriers, the block's end cost ~250 instructions a warp
    (bench/results/tree_run21). The barrier also orders every thread's earlier shared-memory writes before what
    follows. wm, ws: shared float64[WARP]; fbuf: the simulator twins' scratch. Every thread calls it."""
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x if SIM else TOPK_T
    lane = tid % WARP
    warp = tid // WARP
    mw, sw = warp_max_sum(m, s, fbuf)
    if lane == 0:
        wm[warp] = mw
        ws[warp] = sw
    cuda.syncthreads()
    mb = -math.inf
    sb = 0.0
    if SIM or warp == 0:                         # (the simulator's shuffle twins need every thread)
        mb, sb = warp_max_sum(wm[lane] if lane < T // WARP else -math.inf, ws[lane] if lane < T // WARP else 0.0,
                              fbuf)
    return mb, sb


@cuda.jit(**DEVICE)
def warp_lse(part_m, part_s, row, nparts, fbuf):
    """The row's lse from its chunks' (max, sum exp) partials, on every lane of the calling warp: lane l folds slots
    l, l + WARP, ... in order, then warp_max_sum (libdevice exp and log). The same bits in every block of the row,
    whatever the timing: one warp's fixed order. (The whole block did this before, with three barriers: ~530
    instructions a warp in the filter's prologue, which 32 warps a block made ~3 us of issue, run 21.)"""
    lane = cuda.threadIdx.x % WARP
    m = part_m[row, lane] if lane < nparts else -math.inf
    s = part_s[row, lane] if lane < nparts else 0.0
    for q in range(lane + WARP, nparts, WARP):
        mq = part_m[row, q]
        mn = max(m, mq)
        if mn > -math.inf:
            s = (s * math.exp(m - mn) if m > -math.inf else 0.0) + part_s[row, q] * math.exp(mq - mn)
            m = mn
    mm, ss = warp_max_sum(m, s, fbuf)
    return mm + math.log(ss)


find_bin = find_bin_for(0 if SIM else TOPK_T)   # (the simulator's blocks come in several sizes)
run_sum, find_in_runs = bin_runs_for(0 if SIM else TOPK_T)


@cuda.jit(**TOPK_JIT)
def topk_stats(x, vocab, chunk, part_m, part_s, hist):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x if SIM else TOPK_T
    wm = cuda.shared.array(WARP, np.float64)
    ws = cuda.shared.array(WARP, np.float64)
    fbuf = cuda.shared.array(TBUF, np.float64)
    sh = cuda.shared.array(NB1, np.int32)          # NB bins and a spare one for padding
    tab = cuda.shared.array(64, np.int64)          # exp_le0's 2^(j/64), as bits
    vals = cuda.local.array(EPT, np.float32)
    nxt = cuda.local.array(EPT, np.float32)
    for i in range(tid, NB1, T):
        sh[i] = 0
    ctab = cuda.const.array_like(EXP_TAB_BITS)
    for i in range(tid, 64, T):
        tab[i] = ctab[i]
    cuda.syncthreads()
    xr = x[row]
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    m = -math.inf
    s = 0.0
    if lo < hi:
        load_values(xr, lo, hi - lo, nxt)
    for base in range(lo, hi, T * EPT):
        lim = hi - base
        for j in range(EPT):                     # this sub-chunk; the next one's loads go out before its work
            vals[j] = nxt[j]
        if T * EPT < lim:
            load_values(xr, base + T * EPT, lim - T * EPT, nxt)
        mt = np.float32(-math.inf)
        full = lim >= T * EPT
        for j in range(EPT):                     # padding counts in the spare bin NB (a masked token, -inf, is real)
            mt = max(mt, vals[j])
            b = hist_bin(vals[j]) if full or j * T + tid < lim else np.uint32(NB)
            cuda.atomic.add(sh, b, 1)
        mn = max(m, np.float64(mt))
        if mn > -math.inf:
            s *= exp_le0(m - mn, tab) if m > -math.inf else 0.0
            for j in range(EPT):
                s += exp_le0(np.float64(vals[j]) - mn, tab)     # 0 for -inf: masked tokens and padding
            m = mn
    bm, bs = block_partial(m, s, wm, ws, fbuf)    # (its barrier: every histogram atomic is done)
    for i in range(tid, NB, T):
        c = sh[i]
        if c != 0:
            cuda.atomic.add(hist, (row, i), c)
    if tid == 0:
        part_m[row, p] = bm
        part_s[row, p] = bs


@cuda.jit(**DEVICE)
def radix_select(n, k, row_x, row, ls, bins, tmp, buf, shr):
    """The k-th largest composite key of the whole row row_x[row, :n] (n >= 2 tokens; keys recomputed per pass).
    Passes of 8 bits, most significant first; it stops at the first pass whose chosen bin holds a single key (then
    one more scan finds it). Tie-heavy rows only: the candidates overflowed CAP or the histogram bin was unusable."""
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x if SIM else TOPK_T
    prefix = np.int64(0)        # the selected top digits of u = key ^ sign (unsigned order), 8 per pass
    kk = np.int64(k)
    for d in range(8):
        shift = 56 - 8 * d
        high = np.int64(1) << (8 * d)
        for i in range(tid, RB, T):
            bins[i] = 0
        cuda.syncthreads()
        for i in range(tid, n, T):
            u = composite(row_x[row, i], i, ls) ^ np.int64(NEG)
            if d == 0 or ((u >> (shift + 8)) & (high - 1)) == prefix:
                cuda.atomic.add(bins, (u >> shift) & 0xFF, 1)
        cuda.syncthreads()
        b, kk = find_bin(bins, RB, kk, tmp, buf, shr)
        prefix = (prefix << 8) | b
        alone = bins[b] == 1
        cuda.syncthreads()                           # every thread has read bins[b] before the next pass clears it
        if alone:                                    # the k-th key is the one key with these top 8 (d + 1) bits
            for i in range(tid, n, T):
                key = composite(row_x[row, i], i, ls)
                if ((key ^ np.int64(NEG)) >> shift) & ((high << 8) - 1) == prefix:
                    shr[0] = key
            cuda.syncthreads()
            key = shr[0]
            cuda.syncthreads()
            return key
    return prefix ^ np.int64(NEG)


@cuda.jit(**DEVICE)
def key_lp(key):
    """The fp32 log-prob of a composite key (its high word; the inverse of composite's)."""
    return key_value((key >> 32) + np.int64(0x80000000))


@cuda.jit(**DEVICE)
def write_top(key, r, row, top_lp, top_id):
    """Rank r of the row's top-K is the composite key `key`."""
    top_id[row, r] = np.int64(LOW) - (key & np.int64(LOW))
    top_lp[row, r] = key_lp(key)


@cuda.jit(**DEVICE)
def bucket_rank(cand, row, n, k, grp, cnt, tmp, buf, shr, top_lp, top_id):
    """Rank r < k of each of the row's n <= RPT * T distinct candidate keys (cand[row, :n], any order) written to
    top_lp / top_id[row, r]; the rank of a key is the number of larger keys. A bucket sort by a monotone map of the
    key: bucket(key) = (v(key) - v(kmin)) * (NBK - 1) / (v(kmax) - v(kmin)), v the key's fp32 log-prob (its low word,
    LOW - id, when every candidate has one log-prob), in fp64 (each step monotone, so a larger key never lands in a
    lower bucket). A key's rank is then the keys of the higher buckets plus the larger keys of its own bucket, which
    it counts by a scan of that bucket (the candidates spread over a log-prob range, a few keys a bucket; equal
    log-probs share a bucket, so a tie of c candidates costs c steps for each of them). grp: shared int64 [>= n];
    cnt: shared int32 [NBK]. Every thread calls it; about eight barriers, no sort network."""
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x if SIM else TOPK_T
    lane = tid % WARP
    mine = cuda.local.array(RPT, np.int64)
    bk = cuda.local.array(RPT, np.int32)
    slot = cuda.local.array(RPT, np.int32)
    kmin = np.int64(-NEG - 1)
    kmax = np.int64(NEG)
    for a in range(RPT):
        i = tid + a * T
        key = cand[row, i] if i < n else np.int64(NEG)
        mine[a] = key
        if i < n:
            kmin = min(kmin, key)
            kmax = max(kmax, key)
    off = 1
    while off < WARP:
        kmin = min(kmin, shfl_xor(kmin, off, buf))
        kmax = max(kmax, shfl_xor(kmax, off, buf))
        off *= 2
    if tid == 0:
        shr[0] = -NEG - 1
        shr[1] = NEG
    for b in range(tid, NBK, T):
        cnt[b] = 0
    cuda.syncthreads()
    if lane == 0:
        cuda.atomic.min(shr, 0, kmin)
        cuda.atomic.max(shr, 1, kmax)
    cuda.syncthreads()
    kmin = shr[0]
    kmax = shr[1]
    by_id = (kmin >> 32) == (kmax >> 32)             # one log-prob: the low words (LOW - id) order the keys
    if by_id:
        base = np.float64(kmin & np.int64(LOW))
        span = np.float64(kmax & np.int64(LOW)) - base
    else:
        base = np.float64(key_lp(kmin))
        span = np.float64(key_lp(kmax)) - base
    scale = (NBK - 1) / span if span > 0.0 else 0.0
    for a in range(RPT):
        if tid + a * T < n:
            key = mine[a]
            v = np.float64(key & np.int64(LOW)) if by_id else np.float64(key_lp(key))
            b = min(np.int32((v - base) * scale), np.int32(NBK - 1))
            bk[a] = b
            slot[a] = cuda.atomic.add(cnt, b, 1)
    cuda.syncthreads()
    buckets_above(cnt, NBK, NBK // T, tmp, buf)      # cnt[b] := keys in buckets above b
    for a in range(RPT):
        if tid + a * T < n:
            grp[cnt[bk[a]] + slot[a]] = mine[a]
    cuda.syncthreads()
    for a in range(RPT):
        if tid + a * T < n:
            key = mine[a]
            b = bk[a]
            r = np.int64(cnt[b])
            end = np.int64(cnt[b - 1]) if b > 0 else n
            for j in range(r, end):
                if grp[j] > key:
                    r += 1
            if r < k:
                write_top(key, r, row, top_lp, top_id)
    cuda.syncthreads()


@cuda.jit(**DEVICE)
def count_rank(cand, row, n, k, sk, buf, top_lp, top_id):
    """Rank r < k of each of the row's n <= blockDim distinct candidate keys (cand[row, :n]) written to top_lp /
    top_id[row, r], by counting the larger keys: g threads a key (g the largest power of two <= WARP with g * n <=
    blockDim), each counting the larger ones among every g-th key of sk (shared memory: the g threads of a key read g
    neighbouring keys, every key's group the same ones, so broadcasts), then a butterfly over the g partial counts.
    One barrier, where bucket_rank takes about eight; n / g reads a thread (one thread a key read all n: at ~200
    candidates that made L = 15, K = 64 1.6 us slower than bucket_rank, run 21). Every thread calls it."""
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x if SIM else TOPK_T
    if tid < n:
        sk[tid] = cand[row, tid]
    cuda.syncthreads()
    g = 1
    while g < WARP and 2 * g * n <= T:
        g *= 2
    i = tid // g
    key = sk[i] if i < n else np.int64(NEG)
    r = np.int32(0)
    if i < n:
        for j in range(tid % g, n, g):
            if sk[j] > key:
                r += 1
    off = 1
    while off < g:                               # the g lanes of a key are aligned neighbours in one warp
        r = np.int32(r + shfl_xor(r, off, buf))
        off *= 2
    if i < n and tid % g == 0 and r < k:
        write_top(key, r, row, top_lp, top_id)


@cuda.jit(**TOPK_JIT)
def topk_filter(x, vocab, chunk, k, part_m, part_s, hist, counters, cand, top_lp, top_id):
    p, row, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    T = cuda.blockDim.x if SIM else TOPK_T
    lane = tid % WARP
    nparts = cuda.gridDim.x
    keys = cuda.shared.array(CAP, np.int64)
    cnt = cuda.shared.array(NBK, np.int32)
    comp = cuda.shared.array(1, np.int32)                   # the sort's companions: unused (keyed=False)
    bins = cuda.shared.array(RB, np.int32)
    tmp = cuda.shared.array(32, np.int64)
    buf = cuda.shared.array(TBUF, np.int64)
    shr = cuda.shared.array(2, np.int64)
    nb = cuda.shared.array(1, np.int32)                     # the block's candidates so far
    lsh = cuda.shared.array(1, np.float64)                  # the row's lse, from warp 0
    fbuf = cuda.shared.array(TBUF, np.float64)
    vals = cuda.local.array(EPT, np.float32)
    nxt = cuda.local.array(EPT, np.float32)
    xr = x[row]
    lo = p * chunk
    hi = min(vocab, lo + chunk)
    if lo < hi:                                             # the first sub-chunk is in flight during the prologue
        load_values(xr, lo, hi - lo, nxt)
    # Every block finds the row's lse and cut bin itself, in parallel: no block of topk_stats waits for the others
    # (a last block's serial tail there cost ~5 us, bench/results/tree_2026-12-02.md, stop 39)
    if tid == 0:
        nb[0] = 0
    # every load of the prologue goes out before its first barrier: the histogram runs, the partials (warp 0)
    hr = hist[row]
    loc = run_sum(hr, NB)
    if SIM or tid < WARP:                                   # one warp finds lse (the simulator: every warp)
        lsw = warp_lse(part_m, part_s, row, nparts, fbuf)
        if tid == 0:
            lsh[0] = lsw
    b, kr = find_in_runs(hr, NB, k, loc, tmp, buf, shr)     # (its barriers also publish lsh[0] and nb[0])
    ls = lsh[0]
    above = k - kr + hr[b]                                  # tokens in bins >= b
    lo_x = key_value(b << SHIFT0)                           # smallest value of bin b
    lo_lp = grid_log_prob(lo_x, ls)
    whole = above > CAP or not (lo_lp > LP_FLOOR) or not (abs(lo_x) < math.inf)
    cut = np.float64(lo_x) - (abs(np.float64(lo_x) - ls) + 1.0) * 4.76837158203125e-07   # 2^-21 band
    # an fp32 threshold at or below cut (within a few ulps: a candidate more or less is harmless, a missed one
    # is not): x >= cut implies x >= cut32, compared in fp32 (no fp64 conversion per logit)
    cut32 = np.float32(cut - (abs(cut) * 2.384185791015625e-07 + 1e-30))
    if not whole:
        for base in range(lo, hi, T * EPT):
            lim = hi - base
            for j in range(EPT):
                vals[j] = nxt[j]
            if T * EPT < lim:
                load_values(xr, base + T * EPT, lim - T * EPT, nxt)
            for j in range(EPT):
                # the block's candidates go to shared memory first (keys): one shared atomic per warp and value
                # slot, lane `lead` reserving the warp's candidates, each taking its rank among them. (A global
                # atomic per warp waited ~1 us for its reply under the row's contention: 7-13 us at K = 256-1024,
                # bench/topk_ablate.py.) bal is warp-uniform: a warp without candidates, nearly all of them, skips
                # the rest; the simulator's twins need every thread, so there it never skips.
                take = vals[j] >= cut32                  # padding is -inf, cut32 is finite
                bal = ballot(take, buf)
                if SIM or bal != 0:
                    lead = cuda.popc(bal ^ (bal - 1)) - 1 if bal != 0 else 0
                    got = 0
                    if bal != 0 and lane == lead:
                        got = cuda.atomic.add(nb, 0, cuda.popc(bal))
                    got = shfl_idx(got, lead, buf)
                    if take:
                        slot = got + cuda.popc(bal & ((np.int64(1) << lane) - 1))
                        if slot < CAP:
                            keys[slot] = composite(vals[j], base + j * T + tid, ls)
    cuda.syncthreads()
    m = nb[0]                                    # more than CAP: the row's count overflows too (the whole-row path)
    if tid == 0:
        shr[0] = cuda.atomic.add(counters, (row, 0), m) if m > 0 else 0
    cuda.syncthreads()
    front = shr[0]
    for i in range(tid, min(m, CAP - front), T):
        cand[row, front + i] = keys[i]
    cuda.threadfence()
    cuda.syncthreads()
    if tid == 0:
        last = cuda.atomic.add(counters, (row, 1), 1) == nparts - 1
        if last:
            cuda.threadfence()                   # the reader's side: one thread, then the barrier
        shr[0] = 1 if last else 0
    cuda.syncthreads()
    if shr[0] == 0:
        return
    for i in range(tid, NB, T):                 # every block has read the histogram: clean it for the next call
        hist[row, i] = 0
    n = np.int64(counters[row, 0])
    if whole or n > CAP or n > RPT * T:
        thr = radix_select(vocab, k, x, row, ls, bins, tmp, buf, shr)
        if tid == 0:                                 # the k keys >= thr (distinct keys: exactly k), in any order
            shr[0] = 0
        cuda.syncthreads()
        for i in range(tid, vocab, T):
            key = composite(x[row, i], i, ls)
            if key >= thr:
                keys[cuda.atomic.add(shr, 0, 1)] = key
        cuda.syncthreads()
        sort_keys(keys, comp, k, NEG, buf)
        for r in range(tid, k, T):
            write_top(keys[r], r, row, top_lp, top_id)
    elif n <= T and n <= SMALL_RANK:
        count_rank(cand, row, n, k, keys, buf, top_lp, top_id)
    else:   # (bucket_rank's thread 0 overwrites shr[0], the flag, with a nonzero value while others may still read
            # it: harmless, as every thread that reaches this point read or will read a nonzero flag)
        bucket_rank(cand, row, n, k, keys, cnt, tmp, buf, shr, top_lp, top_id)
    if tid == 0:
        counters[row, 0] = 0
        counters[row, 1] = 0
