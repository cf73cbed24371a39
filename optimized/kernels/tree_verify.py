"""Tree compile, acceptance walk and KV commit on the GPU (the stages after build_tree).

compile_rows   grid over (row, word) pairs, COMPILE_W a block of COMPILE_T threads: every block first copies the
               parents to shared memory (one coalesced load), then each of its first COMPILE_W threads walks its
               row's ancestor chain (<= L steps) there and writes one 32-bit word of the packed visibility; word-0
               threads also write ids, positions, parents and depths of their row. The booleans of the block's
               words are one contiguous range of the [n+1, n+1] matrix: the words go through shared memory and the
               block writes that range a byte a thread (consecutive threads, consecutive bytes), where a thread
               writing its own word's 32 booleans made every warp store touch 32 sectors. tree_run23 (H100): that
               store pattern took compile at budget 1024 from 18.2 to 13.4 us, but with 128 words a block (32
               bytes a thread, a division each) budget 64 from 6.2 to 9.0; hence 64 words a block and the byte's
               row and column stepped without a division: tree_run24, 6.3-6.8 / 6.8-7.6 / 9.8-10.4 us at budget
               64 / 256 / 1024.
               Packed format: words per row W = ceil((n+1)/32); bit b of word w of row i is vis[i, 32w+b];
               bits past column n are 0; stored in int32 (the uint32 bit pattern).
follow         one block: per step, the threads scan the rows for the child of the current node carrying the
               target's choice (siblings have distinct tokens: at most one match); <= L+1 steps.
commit_kv      one thread per (column word) of the latent cache: for j = 0..len-1 moves row start+acc[j] to
               start+j. acc is strictly increasing with acc[j] >= j, so the source of a later j is never a
               slot an earlier j wrote: every source is read before anything overwrites it (the parallel
               "read all, then write" rule holds per column, and columns are independent).
gather_rows    features of the accepted rows, in accepted order; rows >= len are zeroed.
"""
from .. import _numba_compat  # noqa: F401,I001  (first: the numpy.row_stack shim)

import numpy as np
from numba import cuda

from .tree_beam import BMAX1 as ROWS_MAX   # budget + 1 rows at most
from .tree_device import KERNEL

COMPILE_T = 128                            # compile_rows' block size (its launch must use it)
COMPILE_W = 64                             # (row, word) pairs a block: their booleans are 16 bytes a thread


@cuda.jit(**KERNEL)
def compile_rows(tokens, depths, parents, root_arr, root_val, start, ids, positions, par_out, dep_out, vis, bits):
    rows = ids.shape[0]
    words = bits.shape[1]
    tid = cuda.threadIdx.x
    sp = cuda.shared.array(ROWS_MAX, np.int16)      # parent of node j (j >= 1), read from shared memory
    sw = cuda.shared.array(COMPILE_W, np.int64)     # the block's words, for the booleans
    for j in range(tid, rows - 1, COMPILE_T):
        sp[j + 1] = parents[j]
    cuda.syncthreads()
    total = rows * words
    g0 = cuda.blockIdx.x * COMPILE_W
    g = g0 + tid
    if tid < COMPILE_W:
        word = np.int64(0)
        if g < total:
            i = g // words
            w = g - i * words
            if w == 0:
                if i == 0:
                    ids[0] = root_arr[0] if root_val < 0 else root_val
                    positions[0] = start
                    par_out[0] = -1
                    dep_out[0] = 0
                else:
                    ids[i] = tokens[i - 1]
                    positions[i] = start + depths[i - 1]
                    par_out[i] = sp[i]
                    dep_out[i] = depths[i - 1]
            j = np.int64(i)
            while j >= 0:                    # i, its parent, ..., the root
                if j // 32 == w:
                    word |= np.int64(1) << (j % 32)
                j = np.int64(sp[j]) if j > 0 else np.int64(-1)
            bits[i, w] = np.int32(word - (np.int64(1) << 32) if word >= (np.int64(1) << 31) else word)
        sw[tid] = word
    cuda.syncthreads()
    if g0 >= total:
        return
    gl = min(g0 + COMPILE_W, total) - 1      # the block's last (row, word) pair
    i0 = g0 // words
    i1 = gl // words
    f0 = np.int32(i0 * rows + (g0 - i0 * words) * 32)
    f1 = np.int32(i1 * rows + min((gl - i1 * words) * 32 + 32, rows))
    rows32 = np.int32(rows)
    f = f0 + tid
    i = f // rows32                          # (row, column) of byte f, then stepped without a division
    col = f - i * rows32
    while f < f1:                            # the booleans of the block's words, byte by byte
        vis[i, col] = (sw[i * words + col // 32 - g0] >> (col % 32)) & 1 == 1
        f += COMPILE_T
        col += COMPILE_T
        while col >= rows32:
            col -= rows32
            i += 1


@cuda.jit(**KERNEL)
def follow(ids, parents, choices, accepted, length, bonus):
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    rows = ids.shape[0]
    sh = cuda.shared.array(3, np.int64)      # current node, its choice, the matching child
    for i in range(tid, rows, T):
        accepted[i] = -1
    if tid == 0:
        sh[0] = 0
        accepted[0] = 0
    n_acc = 1
    while True:
        cuda.syncthreads()
        cur = sh[0]
        want = choices[cur]
        if tid == 0:
            sh[2] = -1
        cuda.syncthreads()
        for i in range(tid + 1, rows, T):
            if parents[i] == cur and ids[i] == want:
                sh[2] = i
        cuda.syncthreads()
        nxt = sh[2]
        if nxt < 0:
            if tid == 0:
                length[0] = n_acc
                bonus[0] = want
            return
        if tid == 0:
            accepted[n_acc] = nxt
            sh[0] = nxt
        n_acc += 1



@cuda.jit(**KERNEL)
def commit_kv(kv, start, accepted, length):
    col = cuda.grid(1)
    if col >= kv.shape[1]:
        return
    for j in range(length[0]):
        src = accepted[j]
        if src != j:
            kv[start + j, col] = kv[start + src, col]


@cuda.jit(**KERNEL)
def gather_rows(src, accepted, length, out):
    g = cuda.grid(1)
    cols = out.shape[1]
    if g >= out.shape[0] * cols:
        return
    j = g // cols
    c = g - j * cols
    if j < length[0]:
        out[j, c] = src[accepted[j], c]
    else:
        out[j, c] = 0
