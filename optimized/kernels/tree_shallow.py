"""Best-first selection when the tree is at most two deep: the first B prefixes in the order of reference/tree.py
picked from an explicit candidate set in one pass, with no step per depth. Same input (the per-depth top-K: lp [L, K]
fp32 on the 2^-28 grid, token ids [L, K], sorted by rank) and the same output, node for node, as tree_beam's kernel.

Why: on normal (flat) draft rows the tree is one or two deep, and tree_beam still pays its full merge step (sort,
merge, tuple ranks: a dozen barriers and block scans) at each depth: 10.7 us at budget 64 and 16.7 us at 256 (H100,
tree_run19) for trees of depth 2.

When (exact; decided on the device, block-uniform; otherwise the caller runs tree_beam's body):
    L <= 2, or at least B prefixes of depth <= 2 precede (0, 0, 0), the best depth-3 prefix: every deeper prefix
    scores <= s3 = score(0, 0, 0) and has a tuple >= (0, 0, 0), so it comes after (0, 0, 0) and is not taken. The
    count is a lower bound that suffices: depth-1 and depth-2 prefixes (ranks < K) scoring > s3, plus (0) and
    (0, 0) when they tie s3 (their tuples are prefixes of (0, 0, 0); any other tie has a larger tuple).
Candidates: (r1) for r1 < K, and (r1, r2) for r2 < min(K, B // (r1 + 1) - 1): (r1, r2) is preceded by every
    (r1', r2') with r1' <= r1, r2' <= r2 and by every (r1') with r1' <= r1 (scores >= and tuples <=), so among the
    first B only if (r1 + 1)(r2 + 2) <= B. When L >= 3 only candidates scoring >= s3 are kept (the first B precede
    (0, 0, 0)). At most B (1 + ln B) of them; each has a unique 63-bit key, larger = earlier:
        key = (score - low) << 21 | (2^21 - 1 - tuple code),  tuple code = r1 << 11 | (r2 + 1, 0 for (r1))
    (low: a lower bound of the kept scores; needs score - low < 2^42, i.e. 16,384 nats: the call is declined, and
    tree_beam runs, on rows that spread wider.) Tuple codes order (r1) < (r1, r2) < (r1, r2 + 1) < (r1 + 1) as the
    reference's rank tuples do.
Ranking (bucket_rank's method): buckets by a monotone map of the key, a descending scan of the bucket counts, a
    scatter; a key's rank is the keys of higher buckets plus the larger keys of its own bucket, counted only for
    keys whose bucket starts below n = min(B, candidates) (the rest are not taken). Depth-1 nodes record their
    output index first, so depth-2 nodes can name their parent.
Launch geometry: tree_beam's (T threads, T * GA = C >= budget); the arrays (~26 KB at C = 256) in the launch's
    dynamic shared memory, which the segment selection reuses when this one declines (pool_bytes), beside tree_beam's
    body (~12 KB, static).
Measured (tree_run20, H100, the beam stage alone): 10.2 / 12.0 us on normal rows at budget 256 (L = 7 / 15) against
    tree_beam's 16.5; at budget 64 11.1 / 9.4 against 10.6 / 12.1; in one warp (budgets <= 32) 8.7 against 6.4, so
    the one-warp auto beam (tree_list.auto_for) does not use it.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda, types   # pool arrays: numba types (the simulator takes no numpy scalar class)

from .tree_beam import SCALE, q_of, variant_for
from .tree_device import DEVICE, SIM, TBUF, block_scan, buckets_above, cap_for, count_prefix, last_at_most
from .tree_segment import SEGMENT_BMAX, segment_for, segment_layout

SHALLOW_BMAX = 64 if SIM else 256   # largest budget (C <= 256: the candidates' keys fit shared memory)
PER_NODE = 8                        # candidate capacity per unit of C: B (1 + ln B) <= 7.1 B up to B = 256
TC_BITS = 21                        # tuple code bits: r1 (10) << 11 | r2 + 1 (11)
TC_MASK = (1 << TC_BITS) - 1
R2_MASK = 0x7FF
SPAN_MAX = 1 << 42                  # score - low (units of 2^-28) below this: the key fits 63 bits
LOW_BITS = 24                       # block scan of (strict count << 24 | candidates of r1)
LOW_MASK = (1 << LOW_BITS) - 1
NONE = -(2 ** 62)                   # no s3 (L <= 2)


def two_level_bytes(T: int, GA: int) -> int:
    """The dynamic shared memory two_level_for(T, GA) needs: int64 la, lb [C] and the keys [PER_NODE C], then
    int32 off [C] and the bucket counts [4 C]."""
    C = T * GA
    return 8 * (2 * C + PER_NODE * C) + 4 * (C + 4 * C)


def pool_bytes(T: int, GA: int, seg: bool) -> int:
    """The dynamic shared memory of a shallow_for kernel: the two-level selection's arrays, then (seg) the segment
    selection's in the same bytes (it runs only after the two-level one declined)."""
    return max(two_level_bytes(T, GA), segment_layout(T, GA)["bytes"] if seg else 0)


def two_level_for(T: int, GA: int):
    """Device function two_level(top_lp, top_id, k, budget, out_*) -> bool for blocks of T threads holding GA
    ranks each (C = T * GA >= k): True when it wrote the tree (at most two deep, see the module docstring), False
    (nothing written) when the caller must run another beam. Every thread calls it; the result is block-uniform.
    Its arrays live in the launch's dynamic shared memory: launch with at least two_level_bytes(T, GA) of it."""
    key = (T, GA)
    if key in _two_levels:
        return _two_levels[key]
    C = T * GA
    CAPC = PER_NODE * C             # candidate keys
    RPT = CAPC // T                 # per thread, in registers
    NBK = 4 * C                     # buckets (a multiple of T)
    PER = NBK // T
    O_OFF = 2 * (2 * C + CAPC)      # int32 offsets in the pool, after the int64 arrays
    O_CNT = O_OFF + C

    @cuda.jit(**DEVICE)
    def two_level(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        tid = cuda.threadIdx.x
        p64 = cuda.shared.array(0, types.int64)      # the dynamic pool (two_level_bytes)
        p32 = cuda.shared.array(0, types.int32)
        la = p64[0:C]                                # depth-1 and depth-2 scores by rank (units of 2^-28)
        lb = p64[C:2 * C]
        grp = p64[2 * C:2 * C + CAPC]                # the keys, grouped by bucket
        off = p32[O_OFF:O_OFF + C]                   # candidates before rank r1's, then r1's output index
        cnt = p32[O_CNT:O_CNT + NBK]
        tmp = cuda.shared.array(32, np.int64)
        buf = cuda.shared.array(TBUF, np.int64)
        mine = cuda.local.array(RPT, np.int64)
        bk = cuda.local.array(RPT, np.int32)
        rk = cuda.local.array(RPT, np.int32)
        depth = top_lp.shape[0]
        for a in range(GA):
            r = tid + a * T
            if r < k:
                la[r] = q_of(top_lp[0, r])
                lb[r] = q_of(top_lp[1, r]) if depth > 1 else np.int64(0)
        for b in range(tid, NBK, T):
            cnt[b] = 0
        cuda.syncthreads()
        a0 = la[0]
        s3 = a0 + lb[0] + q_of(top_lp[2, 0]) if depth > 2 else np.int64(NONE)
        if depth > 2:
            low = s3
        elif depth == 2:
            low = la[k - 1] + lb[k - 1]
        else:
            low = la[k - 1]
        base = np.int64(0)
        for a in range(GA):                          # per depth-1 rank: kept candidates, and the strict count
            r1 = tid + a * T
            part = np.int64(0)
            if r1 < k:
                qa = la[r1]
                if depth > 2:
                    if qa >= s3:
                        part = 1 + count_prefix(lb, 0, k, s3 - qa, False, 0, r1 + 1, 2, budget)
                    strict = (1 if qa > s3 else 0) + count_prefix(lb, 0, k, s3 - qa, True, 0, 0, 0, 0)
                    if r1 == 0:
                        strict += (1 if a0 == s3 else 0) + (1 if a0 + lb[0] == s3 else 0)
                    part |= np.int64(strict) << LOW_BITS
                elif depth == 2:
                    part = 1 + count_prefix(lb, 0, k, np.int64(NONE), True, 0, r1 + 1, 2, budget)
                else:
                    part = 1
            ex, tot = block_scan(part, tmp, buf)
            if r1 < k:
                off[r1] = np.int32((base + ex) & LOW_MASK)
            base += tot
        nc = base & LOW_MASK
        ok = depth <= 2 or (base >> LOW_BITS) >= budget
        if not ok or nc > CAPC or a0 - low >= SPAN_MAX:
            return False
        n = min(np.int64(budget), nc)
        kmax = ((a0 - low) << TC_BITS) | TC_MASK     # the key of (0), the largest
        scale = (NBK - 1) / np.float64(kmax)
        cuda.syncthreads()
        for a in range(RPT):                         # materialize, bucket, count
            s = tid + a * T
            if s < nc:
                r1 = last_at_most(off, 0, k - 1, s)
                j = s - off[r1]
                q = la[r1] + (lb[j - 1] if j > 0 else np.int64(0))
                key = ((q - low) << TC_BITS) | (TC_MASK - ((r1 << 11) | j))
                mine[a] = key
                b = min(np.int32(np.float64(key) * scale), np.int32(NBK - 1))
                bk[a] = b
                rk[a] = cuda.atomic.add(cnt, b, 1)   # the key's slot in its bucket
        cuda.syncthreads()
        buckets_above(cnt, NBK, PER, tmp, buf)       # cnt[b] := keys in buckets above b
        for a in range(RPT):
            if tid + a * T < nc:
                grp[cnt[bk[a]] + rk[a]] = mine[a]
        cuda.syncthreads()
        for a in range(RPT):                         # ranks; the taken depth-1 nodes record their output index
            rk[a] = np.int32(n)
            if tid + a * T < nc:
                key = mine[a]
                b = bk[a]
                r = np.int64(cnt[b])
                if r < n:
                    end = np.int64(cnt[b - 1]) if b > 0 else nc
                    for j in range(r, end):
                        if grp[j] > key:
                            r += 1
                    if r < n:
                        rk[a] = np.int32(r)
                        tc = TC_MASK - (key & TC_MASK)
                        if tc & R2_MASK == 0:
                            off[tc >> 11] = np.int32(r)
        cuda.syncthreads()
        for a in range(RPT):                         # write out in order
            r = rk[a]
            if r < n:
                key = mine[a]
                tc = TC_MASK - (key & TC_MASK)
                r1 = tc >> 11
                j = tc & R2_MASK
                out_score[r] = np.float64((key >> TC_BITS) + low) / SCALE
                if j == 0:
                    out_tok[r] = top_id[0, r1]
                    out_dep[r] = 1
                    out_par[r] = 0
                else:
                    out_tok[r] = top_id[1, j - 1]
                    out_dep[r] = 2
                    out_par[r] = np.int64(off[r1]) + 1
        if tid == 0:
            out_n[0] = n
        return True

    _two_levels[key] = two_level
    return two_level


_two_levels: dict = {}


def shallow_for(budget: int, max_threads: int):
    """(kernel, T, smem): the two-level selection, else (budgets up to SEGMENT_BMAX) the segment selection
    (tree_segment.py), else tree_beam's body, for budgets up to SHALLOW_BMAX; tree_beam's geometry (beam_for).
    Launch it with smem bytes of dynamic shared memory: kernel[1, T, stream, smem]."""
    if budget > SHALLOW_BMAX:
        raise ValueError(f"the two-level selection takes budgets up to {SHALLOW_BMAX}, got {budget}")
    (_, bbody), threads = variant_for(budget, max_threads)
    cap = cap_for(budget)
    key = (threads, max(1, cap // threads), budget <= SEGMENT_BMAX)
    if key not in _kernels:
        _kernels[key] = _make_shallow(bbody, *key)
    return _kernels[key], threads, pool_bytes(*key)


_kernels: dict = {}


def _make_shallow(bbody, T, GA, seg):
    two_level = two_level_for(T, GA)
    segment = segment_for(T, GA) if seg else None
    jit = {} if SIM else {"launch_bounds": T}

    if seg:
        @cuda.jit(**jit)
        def beam_segment(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
            if two_level(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
                return
            if not segment(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
                bbody(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)

        return beam_segment

    @cuda.jit(**jit)
    def beam_shallow(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        if not two_level(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
            bbody(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)

    return beam_shallow
