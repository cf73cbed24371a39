"""Device helpers shared by the tree kernels: warp primitives with simulator twins, block scan, the grid
log-prob of reference/tree.py, and the sortable key of an fp32 value.

The CUDA simulator (NUMBA_ENABLE_CUDASIM=1) has no warp intrinsics and no libdevice, so each primitive that
needs them has a twin chosen at import: the simulator twin emulates the same lane semantics through shared
memory and block barriers (every thread of the block must call it, which the callers here always do), with
a warp of WARP = 4 lanes so that a 16-thread block already exercises the two-level logic of `block_scan`.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import os

import numpy as np
from numba import config, cuda

SIM = bool(config.ENABLE_CUDASIM)
# DDTREE_NUMBA_LINEINFO=1: the tree kernels (not the beam: tree_beam.BEAM_JIT says why) carry source line info
# (for `ncu --set full` source counters; the code is optimized the same). Read when the kernel modules are imported.
KERNEL = {"lineinfo": True} if os.environ.get("DDTREE_NUMBA_LINEINFO") == "1" and not SIM else {}
# device functions are inlined into their kernels at the NVVM level, so their local arrays can live in registers
DEVICE = {"device": True} if SIM else {"device": True, "forceinline": True}
WARP = 4 if SIM else 32
TBUF = WARP * WARP if SIM else 1     # scratch of the simulator twins: one slot per thread
FULL_MASK = 0xFFFFFFFF

LP_GRID_INV = 268435456.0           # 2^28
LP_GRID = 1.0 / 268435456.0         # 2^-28
LP_FLOOR = -2097152.0               # -2^21
RINT_MAGIC = 6755399441055744.0     # 1.5 * 2^52: (v + M) - M rounds half-even for |v| < 2^51

if SIM:
    @cuda.jit(**DEVICE)
    def shfl_up(x, off, buf):
        """Value of lane - off (own value on lanes < off). buf: int64[blockDim] scratch (simulator only).
        Every twin ends with a barrier, so buf is free again when the next one writes it."""
        tid = cuda.threadIdx.x
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid - off] if tid % WARP >= off else x
        cuda.syncthreads()
        return y

    @cuda.jit(**DEVICE)
    def shfl_idx(x, src, buf):
        """Value of lane `src` of this warp."""
        tid = cuda.threadIdx.x
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid - tid % WARP + src]
        cuda.syncthreads()
        return y

    @cuda.jit(**DEVICE)
    def shfl_xor(x, mask, buf):
        """Value of lane ^ mask (mask < WARP)."""
        tid = cuda.threadIdx.x
        buf[tid] = x
        cuda.syncthreads()
        y = buf[tid ^ mask]
        cuda.syncthreads()
        return y

    @cuda.jit(**DEVICE)
    def ballot(pred, buf):
        """Bit l set iff lane l of this warp passed a true pred."""
        tid = cuda.threadIdx.x
        buf[tid] = 1 if pred else 0
        cuda.syncthreads()
        base = tid - tid % WARP
        bits = 0
        for lane in range(WARP):
            if buf[base + lane] != 0:
                bits |= 1 << lane
        cuda.syncthreads()
        return bits

    @cuda.jit(**DEVICE)
    def warp_sync():
        """Orders the warp's shared-memory accesses (a block barrier: the simulator's callers run one warp)."""
        cuda.syncthreads()

    @cuda.jit(**DEVICE)
    def f32_bits(x):
        """The int32 bit pattern of an fp32 value."""
        return np.int64(np.array([x], dtype=np.float32).view(np.int32)[0])

    @cuda.jit(**DEVICE)
    def f32_from_bits(b):
        """The fp32 value of an int32 bit pattern."""
        return np.array([b], dtype=np.int64).astype(np.int32).view(np.float32)[0]

    @cuda.jit(**DEVICE)
    def f64_from_bits(b):
        """The fp64 value of an int64 bit pattern."""
        return np.array([b], dtype=np.int64).view(np.float64)[0]

    @cuda.jit(**DEVICE)
    def f64_lo_bits(x):
        """The low 32 bits of an fp64 value's bit pattern, as a signed int32 value."""
        return np.int64(np.array([x], dtype=np.float64).view(np.int32)[0])    # little-endian: word 0 is low

    @cuda.jit(**DEVICE)
    def f64_from_hi(h):
        """The fp64 value whose high 32 bits are h and low 32 bits are 0."""
        return np.array([np.int64(h) << 32], dtype=np.int64).view(np.float64)[0]
else:
    @cuda.jit(device=True, inline=True)
    def shfl_up(x, off, buf):
        return cuda.shfl_up_sync(FULL_MASK, x, off)

    @cuda.jit(device=True, inline=True)
    def shfl_idx(x, src, buf):
        return cuda.shfl_sync(FULL_MASK, x, src)

    @cuda.jit(device=True, inline=True)
    def shfl_xor(x, mask, buf):
        return cuda.shfl_xor_sync(FULL_MASK, x, mask)

    @cuda.jit(device=True, inline=True)
    def ballot(pred, buf):
        return cuda.ballot_sync(FULL_MASK, pred)

    @cuda.jit(device=True, inline=True)
    def warp_sync():
        cuda.syncwarp(FULL_MASK)

    @cuda.jit(device=True, inline=True)
    def f32_bits(x):
        return np.int64(cuda.libdevice.float_as_int(x))

    @cuda.jit(device=True, inline=True)
    def f32_from_bits(b):
        return cuda.libdevice.int_as_float(np.int32(b))

    @cuda.jit(device=True, inline=True)
    def f64_from_bits(b):
        return cuda.libdevice.longlong_as_double(np.int64(b))

    @cuda.jit(device=True, inline=True)
    def f64_lo_bits(x):
        return cuda.libdevice.double2loint(x)

    @cuda.jit(device=True, inline=True)
    def f64_from_hi(h):
        return cuda.libdevice.hiloint2double(np.int32(h), np.int32(0))


@cuda.jit(**DEVICE)
def block_scan(val, tmp, buf):
    """Exclusive prefix sum of one int64 per thread over the block, and the block total.

    Every thread calls it. blockDim.x must be a multiple of WARP and at most WARP * WARP.
    tmp: shared int64[WARP]; buf: shared int64[blockDim] (used by the simulator twins only).
    """
    tid = cuda.threadIdx.x
    lane = tid % WARP
    warp = tid // WARP
    nwarps = cuda.blockDim.x // WARP
    x = np.int64(val)
    off = 1
    while off < WARP:                            # inclusive scan inside the warp
        y = shfl_up(x, off, buf)
        if lane >= off:
            x += y
        off *= 2
    if lane == WARP - 1:
        tmp[warp] = x
    cuda.syncthreads()
    t = tmp[lane] if lane < nwarps else np.int64(0)
    off = 1
    while off < WARP:                            # every warp scans the warp totals (no extra barrier)
        y = shfl_up(t, off, buf)
        if lane >= off:
            t += y
        off *= 2
    before = shfl_idx(t, warp - 1 if warp > 0 else 0, buf)
    total = shfl_idx(t, nwarps - 1, buf)
    cuda.syncthreads()                           # tmp may be reused right after
    if warp == 0:
        before = np.int64(0)
    return before + x - np.int64(val), total


@cuda.jit(**DEVICE)
def buckets_above(cnt, nbk, per, tmp, buf):
    """cnt[b] := the sum of cnt over the buckets above b (a scan in descending bucket order; each thread sums a run
    of `per` buckets, nbk = per * blockDim); ends with a barrier. The bucket ranks' start (bucket_rank, the two-level
    and segment selections): a key's rank is then cnt[its bucket] plus the larger keys in its own bucket."""
    tid = cuda.threadIdx.x
    loc = np.int64(0)
    for q in range(tid * per, (tid + 1) * per):
        loc += cnt[nbk - 1 - q]
    before, _ = block_scan(loc, tmp, buf)
    for q in range(tid * per, (tid + 1) * per):
        c = cnt[nbk - 1 - q]
        cnt[nbk - 1 - q] = np.int32(before)
        before += c
    cuda.syncthreads()


@cuda.jit(**DEVICE)
def warp_scan32(x, buf):
    """Inclusive prefix sum of an int32 over the warp's lanes, kept in int32 (one shuffle a step, where block_scan's
    int64 takes two). Every lane calls it."""
    lane = cuda.threadIdx.x % WARP
    off = 1
    while off < WARP:
        y = shfl_up(x, off, buf)
        if lane >= off:
            x = np.int32(x + y)
        off *= 2
    return x


def cap_for(budget: int) -> int:
    """C: the budget rounded up to a power of two, at least a warp (the beam kernels' capacity, host side)."""
    cap = WARP
    while cap < budget:
        cap *= 2
    return cap


_find_bins: dict = {}


def bin_runs_for(T: int):
    """(run_sum, find_in_runs): find_bin's two halves for blocks of T threads (0: cuda.blockDim.x, read at run time),
    for a caller that issues run_sum's loads before barriers of its own (tree_topk's filter prologue):
        run_sum(bins, nbins) -> the total of this thread's run of ceil(nbins / T) bins, counted from the top bin
        find_in_runs(bins, nbins, k, local, tmp, buf, shr) -> (b, r) as find_bin, from every thread's run_sum.
    The scans are int32 (one shuffle a step; counts stay below 2^31) and the run loops have a constant trip count
    where T and nbins are constants (unrolled, each bin one predicated load)."""
    if T in _find_bins:
        return _find_bins[T][1:]

    @cuda.jit(**DEVICE)
    def run_sum(bins, nbins):
        tid = cuda.threadIdx.x
        nt = T if T > 0 else cuda.blockDim.x
        per = (nbins + nt - 1) // nt
        local = np.int32(0)
        for j in range(per):
            q = tid * per + j
            if q < nbins:                        # (an unsigned index: no negative-index wraparound code)
                local = np.int32(local + bins[np.uint32(nbins - 1 - q)])
        return local

    @cuda.jit(**DEVICE)
    def find_in_runs(bins, nbins, k, local, tmp, buf, shr):
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        nt = T if T > 0 else cuda.blockDim.x
        per = (nbins + nt - 1) // nt
        x = warp_scan32(np.int32(local), buf)    # the runs inside the warp
        if lane == WARP - 1:
            tmp[warp] = x
        cuda.syncthreads()
        # every warp scans the warp totals itself (block_scan's scheme, without its closing barrier)
        t = warp_scan32(np.int32(tmp[lane]) if lane < nt // WARP else np.int32(0), buf)
        before = shfl_idx(t, warp - 1 if warp > 0 else 0, buf)
        cum = np.int64((before if warp > 0 else 0) + x - local)    # the items in the bins above this run
        if cum < k <= cum + local:
            for j in range(per):
                q = tid * per + j
                if q < nbins:
                    c = bins[np.uint32(nbins - 1 - q)]
                    if cum + c >= k:
                        shr[0] = nbins - 1 - q
                        shr[1] = k - cum
                        break
                    cum += c
        cuda.syncthreads()
        b, r = shr[0], shr[1]
        cuda.syncthreads()                       # shr and tmp free again
        return b, r

    @cuda.jit(**DEVICE)
    def find_bin(bins, nbins, k, tmp, buf, shr):
        return find_in_runs(bins, nbins, k, run_sum(bins, nbins), tmp, buf, shr)

    _find_bins[T] = (find_bin, run_sum, find_in_runs)
    return run_sum, find_in_runs


def find_bin_for(T: int):
    """Device function find_bin(bins, nbins, k, tmp, buf, shr) for blocks of T threads (0: cuda.blockDim.x, read at
    run time): (b, r), the bin of bins[:nbins] holding the k-th largest item (1-based, counted from the top bin) and
    k's rank inside it. Each thread sums a run of bins, one block scan finds the run, its thread the bin. shr: shared
    int64 [>= 2]."""
    bin_runs_for(T)
    return _find_bins[T][0]


@cuda.jit(**DEVICE)
def first_digit(diff, ref_u):
    """(d0, prefix) for an MSD radix select of int64 keys in 8-bit digits of u = key ^ -2^63: d0, the first digit
    in which the keys differ (diff: nonzero, a bit set where some keys differ), and prefix, the d0 top digits they
    all share, read from one key's ref_u."""
    hi = np.uint32((diff >> 32) & 0xFFFFFFFF)
    top = 63 - cuda.clz(hi) if hi != 0 else 31 - cuda.clz(np.uint32(diff & 0xFFFFFFFF))   # highest differing bit
    d0 = (63 - top) // 8
    prefix = np.int64(0)
    if d0 > 0:
        prefix = (ref_u >> (64 - 8 * d0)) & ((np.int64(1) << (8 * d0)) - 1)
    return d0, prefix


@cuda.jit(**DEVICE)
def count_prefix(row, base, n, v, strict, a, b, c, budget):
    """#{r < n : row[base + r] > v (strict) or >= v, and a + b * (r + c) <= budget}, the row non-increasing: both
    hold on a prefix of the ranks (a binary search, no division). The second is the product bound of the two-level
    and segment selections; a = b = c = budget = 0 switches it off."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        w = row[base + mid]
        if (w > v or (not strict and w == v)) and a + b * (mid + c) <= budget:
            lo = mid + 1
        else:
            hi = mid
    return lo


@cuda.jit(**DEVICE)
def last_at_most(arr, lo, hi, v):
    """The last index i in [lo, hi] with arr[i] <= v, arr non-decreasing and arr[lo] <= v (binary search)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if arr[mid] <= v:
            lo = mid
        else:
            hi = mid - 1
    return lo


@cuda.jit(**DEVICE)
def grid_log_prob(x, lse):
    """reference.tree.draft_log_probs for one fp32 logit: fp32(x - lse), floored at -2^21, rounded half-even
    onto the 2^-28 grid, -0.0 -> +0.0. Returns the fp32 value (exactly representable)."""
    v = np.float64(np.float32(np.float64(x) - lse))
    if not v >= LP_FLOOR:                        # also -inf (masked token)
        v = LP_FLOOR
    v = v * LP_GRID_INV
    v = (v + RINT_MAGIC) - RINT_MAGIC
    v = v * LP_GRID + 0.0
    return np.float32(v)


EXP_TAB = np.array([2.0 ** (j / 64) for j in range(64)])   # 2^(j/64), each correctly rounded
EXP_TAB_BITS = EXP_TAB.view(np.int64)   # their bit patterns: exp_le0's table (it adds 2^k to the exponent field)
EXP_INV = 92.33248261689366             # 64 / ln 2
EXP_HI = 0.01083042469326756            # ln 2 / 64 to 32 significant bits (k * EXP_HI is exact for |k| < 2^21)
EXP_LO = 2.9815858269852933e-12         # ln 2 / 64 - EXP_HI


@cuda.jit(**DEVICE)
def exp_le0(d, tab):
    """exp(d) in fp64 for d <= 0 (0 below -700, where it is below 1e-304), within 2 ulp (4e-16 relative, measured
    against 50-digit decimals; libdevice's exp: 1 ulp) in about a third of libdevice's instructions: d = (64 k + j)
    ln2/64 + r with |r| <= ln2/128 (Cody-Waite), exp(r) by a degree-5 Taylor polynomial (truncation < 4e-17),
    times 2^(j/64) 2^k: tab (EXP_TAB_BITS in shared memory) holds the bits of 2^(j/64), and 2^k is an integer add to
    their exponent field, exact (above -700 the product stays normal, so (2^(j/64) 2^k) p rounds as (2^(j/64) p)
    2^k did). Branch-free (the -700 test is a select at the end) and without an fp64-to-integer conversion: t = d *
    64/ln2 + 1.5 * 2^52 holds the rounded 64 k + j in the low 32 bits of its mantissa. On the GPU d is not clamped
    first: below -700 (and at -inf: masked tokens, padding) t and k are garbage that the select discards; the
    simulator clamps at -700 (its numpy integers would warn on the garbage's overflow)."""
    dc = max(d, -700.0) if SIM else d
    t = dc * EXP_INV + RINT_MAGIC
    kf = t - RINT_MAGIC
    k = f64_lo_bits(t)                                      # kf as an int32: -64630 <= k <= 0 above -700
    r = dc - kf * EXP_HI
    r = r - kf * EXP_LO
    p = 1.0 + r * (1.0 + r * (0.5 + r * (0.16666666666666666 + r * (0.041666666666666664
                                                                  + r * 0.008333333333333333))))
    e = f64_from_bits(tab[k & 63] + (np.int64(k >> 6) << 52)) * p
    return e if d > -700.0 else 0.0


@cuda.jit(**DEVICE)
def sortable_key(f):
    """Monotone map of an fp32 value to an int64 in [0, 2^32): a < b  <=>  key(a) < key(b) (no -0.0, no NaN)."""
    b = f32_bits(f)
    if b < 0:
        return np.int64(0x7FFFFFFF) - (b & 0x7FFFFFFF)
    return np.int64(0x80000000) + b


@cuda.jit(**DEVICE)
def key_value(key):
    """Inverse of sortable_key: the fp32 value of a key in [0, 2^32)."""
    if key >= np.int64(0x80000000):
        return f32_from_bits(key - np.int64(0x80000000))
    return f32_from_bits((np.int64(0x7FFFFFFF) - key) - np.int64(0x80000000))


PAD_K = 0x7FFFFFFF                  # the companion of a padding element (sorts after every real one)


@cuda.jit(**DEVICE)
def n_first(qa, ka, qb, kb):
    """Pair a precedes pair b in pair_sort's order: q descending, then k ascending."""
    return qa > qb or (qa == qb and ka < kb)


_pair_sorts: dict = {}


def pair_sort(NA, keyed=True):
    """Device function sort(nq, nk, n, pad_q, buf): sorts the pairs (nq int64, nk int32)[:n] in shared memory in
    place by (q descending, k ascending), for blocks of T threads with T * NA >= S, S the power of two >= n. Every
    thread of the block calls it. A bitonic network over S: element i is held by thread i % T in register slot
    i // T; stages whose partner is in the same thread swap registers, partners in the same warp exchange through
    shuffles (warps holding padding only skip them), others through shared memory (two barriers). Padding is
    (pad_q, PAD_K): pad_q must sort after every real q. buf: the simulator twins' scratch. keyed=False: distinct
    q only, nk is neither read nor written (the shuffles move q alone)."""
    if (NA, keyed) in _pair_sorts:
        return _pair_sorts[(NA, keyed)]

    @cuda.jit(**DEVICE)
    def store(nq, nk, sq, sk, lim):
        """This thread's register slots with element index < lim back to shared memory."""
        T = cuda.blockDim.x
        for a in range(NA):
            i = cuda.threadIdx.x + a * T
            if i < lim:
                nq[i] = sq[a]
                if keyed:
                    nk[i] = sk[a]

    @cuda.jit(**DEVICE)
    def sort(nq, nk, n, pad_q, buf):
        tid = cuda.threadIdx.x
        T = cuda.blockDim.x
        lane = tid % WARP
        sq = cuda.local.array(NA, np.int64)
        sk = cuda.local.array(NA, np.int32)
        lg_t = 0
        while (1 << lg_t) < T:
            lg_t += 1
        S = 1
        while S < n:
            S *= 2
        for a in range(NA):
            i = tid + a * T
            if i < n:
                sq[a] = nq[i]
                sk[a] = nk[i] if keyed else 0
            else:
                sq[a] = pad_q
                sk[a] = PAD_K if keyed else 0
        size = 2
        while size <= S:
            st = size // 2
            while st > 0:
                if st >= T:                              # partner in this thread
                    sa = st >> lg_t
                    for a in range(NA):                  # (a, b) constant after unrolling: registers, not a stack
                        for b in range(a + 1, NA):
                            i = tid + a * T
                            if (a ^ b) != sa or i >= S:
                                continue
                            first = n_first(sq[a], sk[a], sq[b], sk[b])
                            if first != ((i & size) == 0):
                                q0, k0 = sq[a], sk[a]
                                sq[a], sk[a] = sq[b], sk[b]
                                sq[b], sk[b] = q0, k0
                elif st < WARP:                          # partner in this warp
                    for a in range(NA):
                        i = tid + a * T
                        if not SIM and i - lane >= S:    # the whole warp holds padding only (warp-uniform; the
                            continue                     #   simulator twins need every thread)
                        oq = shfl_xor(sq[a], st, buf)
                        ok = shfl_xor(np.int64(sk[a]), st, buf) if keyed else np.int64(0)
                        lower = (i & st) == 0
                        mine_first = n_first(sq[a], sk[a], oq, ok)
                        if mine_first != (lower == ((i & size) == 0)):
                            sq[a] = oq
                            sk[a] = np.int32(ok)
                else:                                    # partner in another warp: through shared memory
                    cuda.syncthreads()
                    store(nq, nk, sq, sk, S)
                    cuda.syncthreads()
                    for a in range(NA):
                        i = tid + a * T
                        if i < S:
                            j = i ^ st
                            oq = nq[j]
                            ok = nk[j] if keyed else 0
                            mine_first = n_first(sq[a], sk[a], oq, ok)
                            if mine_first != ((i < j) == ((i & size) == 0)):
                                sq[a] = oq
                                sk[a] = ok
                st //= 2
            size *= 2
        cuda.syncthreads()
        store(nq, nk, sq, sk, n)
        cuda.syncthreads()

    _pair_sorts[(NA, keyed)] = sort
    return sort
