"""Best-first selection by one warp: the reference's heap, with the candidate frontier kept as a sorted list in
registers. Same input (the per-depth top-K, lp [L, K] fp32 on the 2^-28 grid, token ids [L, K]) and the same
output, node for node, as tree_beam's kernel; an alternative to it for small budgets, picked by Config.list_max.

Why: tree_beam processes one depth per step (a dozen barriers and block scans each), so a deep draft-like tree
costs ~5 us per depth at budget 16 whatever the budget. This kernel pops one node per step, whatever the depth:
the cost is ~budget steps of a few warp shuffles, ballots and compares, with no block barrier.

Algorithm (exactly reference.tree.build_tree's heap): the frontier F (candidates not yet taken: the next sibling
and the first child of every taken node) is kept sorted in the order of reference/tree.py -- score descending,
then rank tuple ascending. Position p of F is lane p % WARP, register row p // WARP, of the warp (W rows: capacity
C = W * WARP). A step takes F[0] (a shuffle from lane 0) as node i = 1, 2, ... (lane 0 records it in shared
memory; the warp writes the nodes out at the end), forms its next sibling and first child, finds their positions
by ballots over "precedes the new candidate" (F is sorted, so the count of set bits is the position), and moves
every member by -1, 0 or +1 positions (shuffles from the rows above, at and below). Members pushed to a position
>= C are dropped: |F| <= i + 1 (a step adds at most one), so F overflows only once i >= C, when at most
budget - i <= C nodes remain to be taken, and a member with C members before it can never be taken (budget <= 2 C).

Scores are int64 in units of 2^-28, exact (tree_beam's q_of); the sibling's score is the parent's, recovered as
the node's score minus its own lp (exact), plus the sibling's lp. Equal scores (lp exactly 0, equal logits) are
ordered by the rank tuples, rebuilt from the taken nodes' parents and ranks in shared memory (`tuple_less`: at
most MAX_DEPTH steps up each chain; only on ties). A member's aux packs its parent node, its rank and its depth.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda

from .tree_beam import PAD_Q, SCALE, q_of, variant_for
from .tree_device import DEVICE, SIM, TBUF, WARP, ballot, shfl_idx, shfl_xor, warp_sync

MAX_DEPTH = 15                    # most depths (tree_numba.build_tree checks; the aux's depth has 4 bits)
LIST_BMAX = 64 if SIM else 256    # largest budget: W = LIST_BMAX / (2 * WARP) rows (simulator: 8 rows of 4 lanes)
PAR_SHIFT = 14                    # aux = parent << 14 | rank << 4 | depth
RANK_SHIFT = 4
M10 = 0x3FF
M4 = 0xF
FAR = 1 << 30                     # the position of an absent new candidate


@cuda.jit(**DEVICE)
def tuple_digits(aux, dig, npar, nrank):
    """dig[:depth] = the rank tuple of the candidate `aux`: its parent's tuple (the taken nodes' npar/nrank chain,
    a depth less per step) and its own rank. Returns the depth."""
    depth = aux & M4
    dig[depth - 1] = (aux >> RANK_SHIFT) & M10
    x = aux >> PAR_SHIFT
    j = depth - 2
    while x != 0:
        dig[j] = nrank[x]
        x = npar[x]
        j -= 1
    return depth


@cuda.jit(**DEVICE)
def tuple_less(aa, ab, npar, nrank):
    """The rank tuple of candidate aa precedes that of candidate ab (lexicographic, a proper prefix first)."""
    dig_a = cuda.local.array(MAX_DEPTH, np.int32)
    dig_b = cuda.local.array(MAX_DEPTH, np.int32)
    da = tuple_digits(aa, dig_a, npar, nrank)
    db = tuple_digits(ab, dig_b, npar, nrank)
    for j in range(min(da, db)):
        if dig_a[j] != dig_b[j]:
            return dig_a[j] < dig_b[j]
    return da < db


@cuda.jit(**DEVICE)
def precedes(qa, aa, qb, ab, npar, nrank):
    """Candidate a comes before candidate b in the tree's order."""
    return qa > qb or (qa == qb and tuple_less(aa, ab, npar, nrank))


def list_for(budget: int):
    """(kernel, WARP): the list variant with the fewest rows whose capacity holds half of `budget`."""
    return _variant(budget)[0], WARP


def _variant(budget: int):
    """(kernel, device body) of list_for's variant."""
    if budget > LIST_BMAX:
        raise ValueError(f"the warp-list beam takes budgets up to {LIST_BMAX}, got {budget}")
    rows = 1
    while 2 * rows * WARP < budget:
        rows *= 2
    if rows not in _variants:
        _variants[rows] = _make_list(rows)
    return _variants[rows]


_variants: dict = {}


@cuda.jit(**DEVICE)
def shallow(top_lp, k, budget, buf):
    """The tree has no node deeper than 2, up to ties (a speed choice only: both beams are exact): at least
    `budget` prefixes of depth <= 2 score >= s3, the score of (0, 0, 0), the best a depth-3 node can have (rows are
    sorted). One warp (every lane gets the answer): each lane counts its depth-1 ranks r with q0[r] >= s3 and their
    children by a binary search in the sorted depth-2 row."""
    if top_lp.shape[0] < 3:
        return True
    s3 = q_of(top_lp[0, 0]) + q_of(top_lp[1, 0]) + q_of(top_lp[2, 0])
    cnt = np.int64(0)
    for r in range(cuda.threadIdx.x, k, WARP):
        q0 = q_of(top_lp[0, r])
        if q0 >= s3:
            lo = 0
            hi = k
            while lo < hi:
                mid = (lo + hi) // 2
                if q0 + q_of(top_lp[1, mid]) >= s3:
                    lo = mid + 1
                else:
                    hi = mid
            cnt += 1 + lo
    off = 1
    while off < WARP:
        cnt += shfl_xor(cnt, off, buf)
        off *= 2
    return cnt >= budget


def auto_for(budget: int):
    """(kernel, WARP) for budgets up to WARP: one warp that runs tree_beam's body (~5 us a depth, ~1 us at depth 1)
    on trees of depth <= 2 by `shallow`, and the warp-list body (~0.45 us a node) on deeper ones."""
    if budget > WARP:
        raise ValueError(f"the auto beam takes budgets up to {WARP}, got {budget}")
    if "auto" not in _variants:
        _variants["auto"] = _make_auto()
    return _variants["auto"], WARP


def _make_auto():
    lbody = _variant(WARP)[1]                                    # both bodies' variants for budgets <= WARP:
    bbody = variant_for(WARP, WARP)[0][1]                        #   one warp a block
    jit = {} if SIM else {"launch_bounds": WARP}

    @cuda.jit(**jit)
    def beam_auto(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        buf = cuda.shared.array(TBUF, np.int64)
        if shallow(top_lp, k, budget, buf):
            bbody(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)
        else:
            lbody(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)

    return beam_auto


def _make_list(W):
    """The kernel for W register rows per lane (capacity C = W * WARP, budgets <= 2 C), one warp a block."""
    C = W * WARP
    KMAX = 2 * C                  # K = min(budget, V) <= budget <= 2 C
    NMAX = KMAX + 1               # taken nodes and the root
    NLP = MAX_DEPTH * KMAX        # (a shared array's size must be one constant, not an expression)
    jit = {} if SIM else {"launch_bounds": WARP}

    @cuda.jit(**DEVICE)
    def body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        lane = cuda.threadIdx.x
        lps = cuda.shared.array(NLP, np.float32)     # lp by (depth, rank)
        npar = cuda.shared.array(NMAX, np.int16)                 # taken node -> parent node, own rank, depth,
        nrank = cuda.shared.array(NMAX, np.int16)                #   score (written out at the end: a global
        ndep = cuda.shared.array(NMAX, np.int8)                  #   load of its token id inside the loop would
        nsc = cuda.shared.array(NMAX, np.int64)                  #   stall every step on L2 latency)
        buf = cuda.shared.array(TBUF, np.int64)
        fq = cuda.local.array(W, np.int64)                       # F: scores and aux, by position
        fa = cuda.local.array(W, np.int32)
        gq = cuda.local.array(W, np.int64)                       # F after the step
        ga = cuda.local.array(W, np.int32)
        depth = top_lp.shape[0]
        for d in range(depth):
            for r in range(lane, k, WARP):
                lps[d * KMAX + r] = top_lp[d, r]
        for w in range(W):
            fq[w] = PAD_Q
            fa[w] = 0
        warp_sync()
        if lane == 0:
            fq[0] = q_of(lps[0])                                 # rank 0 at depth 1, parent the root
            fa[0] = 1
        count = 0
        while count < budget:
            hq = shfl_idx(fq[0], 0, buf)                         # take F[0]
            ha = shfl_idx(fa[0], 0, buf)
            if hq == PAD_Q:
                break
            count += 1
            par = ha >> PAR_SHIFT
            r = (ha >> RANK_SHIFT) & M10
            d = ha & M4
            if lane == 0:
                npar[count] = par
                nrank[count] = r
                ndep[count] = d
                nsc[count] = hq
            warp_sync()
            q1 = PAD_Q                                           # the new candidates, in order: (q1, a1) first
            a1 = 0
            q2 = PAD_Q
            a2 = 0
            if r + 1 < k:                                        # next sibling
                row = (d - 1) * KMAX
                q1 = hq - q_of(lps[row + r]) + q_of(lps[row + r + 1])
                a1 = (par << PAR_SHIFT) | ((r + 1) << RANK_SHIFT) | d
            if d < depth:                                        # first child
                cq = hq + q_of(lps[d * KMAX])
                ca = (count << PAR_SHIFT) | (d + 1)
                if q1 == PAD_Q or precedes(cq, ca, q1, a1, npar, nrank):
                    q2 = q1
                    a2 = a1
                    q1 = cq
                    a1 = ca
                else:
                    q2 = cq
                    a2 = ca
            c1 = 0                                               # members after the head before each new one
            c2 = 0
            for w in range(W):
                live = (w > 0 or lane > 0) and fq[w] != PAD_Q
                b1 = live and q1 != PAD_Q and precedes(fq[w], fa[w], q1, a1, npar, nrank)
                b2 = live and q2 != PAD_Q and precedes(fq[w], fa[w], q2, a2, npar, nrank)
                c1 += cuda.popc(ballot(b1, buf))
                c2 += cuda.popc(ballot(b2, buf))
            p1 = c1 if q1 != PAD_Q else FAR
            p2 = c2 + 1 if q2 != PAD_Q else FAR                  # c2 >= c1: everything before n1 is before n2
            for w in range(W):                                   # position p takes old position p + 1 - (new before p)
                p = w * WARP + lane
                s = p + 1 - (1 if p1 < p else 0) - (1 if p2 < p else 0)
                sl = s % WARP
                sw = s // WARP                                   # w - 1, w or w + 1
                vq = shfl_idx(fq[w], sl, buf)
                va = shfl_idx(fa[w], sl, buf)
                if w > 0:
                    xq = shfl_idx(fq[w - 1], sl, buf)
                    xa = shfl_idx(fa[w - 1], sl, buf)
                    if sw == w - 1:
                        vq = xq
                        va = xa
                if w < W - 1:
                    xq = shfl_idx(fq[w + 1], sl, buf)
                    xa = shfl_idx(fa[w + 1], sl, buf)
                    if sw == w + 1:
                        vq = xq
                        va = xa
                if sw >= W:
                    vq = PAD_Q
                    va = 0
                if p == p1:
                    vq = q1
                    va = a1
                elif p == p2:
                    vq = q2
                    va = a2
                gq[w] = vq
                ga[w] = va
            for w in range(W):
                fq[w] = gq[w]
                fa[w] = ga[w]
        warp_sync()
        for i in range(lane, count, WARP):                       # output in order
            d = np.int64(ndep[i + 1])
            out_tok[i] = top_id[d - 1, nrank[i + 1]]
            out_dep[i] = d
            out_par[i] = npar[i + 1]
            out_score[i] = np.float64(nsc[i + 1]) / SCALE
        if lane == 0:
            out_n[0] = count

    @cuda.jit(**jit)
    def beam_list(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n):
        body(top_lp, top_id, k, budget, out_tok, out_dep, out_par, out_score, out_n)

    return beam_list, body
