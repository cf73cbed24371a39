"""Tree-masked MLA attention over the latent cache: the thin CuPy launcher of kernels/mla_attention.cu.

Replaces `reference.target.absorbed_attention` for verify (tree) and decode (T = 1). Legend:
  T  tree rows (new tokens, root first)     H  heads        C  kv_lora_rank (512)    R  rope dims (64)
  L  latent row = C + R                     P  prefix rows  S  key rows = P + T      W  mask words = ceil(T/32)
  M  query rows = T * H

Mask format (shared with the tree kernels): int32 [T, W]; tree row t sees tree row j (cache slot P + j) iff
bit j % 32 of word [t, j // 32] is set; every prefix slot (< P) is visible to every row.

Backends (`plan(...).backend`, asserted by the conformance tests; chosen by shape and device, never as a
fallback):
  "wgmma" Hopper tensor-core kernel (sm_90a, compute capability 9.0), C = 512 and R = 64, split-KV + merge
  "mma"   mma.sync tensor-core kernel (sm_80+: sm_120 parts, or any part via `config=`), the same shapes
  "simt"  generic fp32 kernel for any other C <= 1024, R <= 256 (the tiny fixtures); a block per query row

Tensors are passed zero-copy as raw device pointers (bf16 has no CuPy dtype, and reading
`__cuda_array_interface__` may synchronize on the producer's stream, which is illegal inside CUDA-graph
capture). Kernels run on the current torch CUDA stream.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

__all__ = ["tree_attention", "absorbed_attention", "pack_visibility", "unpack_visibility", "plan", "Plan",
           "KernelConfig", "CONFIGS", "MAX_T", "kernel_source"]

MAX_T = 1025                    # budget 1024 + root: the largest verify block the engine sends
MMA_C, MMA_R = 512, 64          # the dims the tensor-core kernel is built for
GENERIC_MAX_C, GENERIC_MAX_R = 1024, 256
GENERIC_CAPS = (64, 256, 1024)  # mla_generic_c<cap>: the generic kernel built for C <= cap
GENERIC_KERNELS = tuple(f"mla_generic_c{cap}" for cap in GENERIC_CAPS)
GENERIC_WARPS = 8               # its block (GEN_WARPS in the .cu)
MAX_SPLITS = 256
WGMMA_ARCH = 90                 # sm_90a code (the wgmma kernel) runs on compute capability 9.0 only
_LOG2E = 1.4426950408889634
_CU_PATH = Path(__file__).parent / "kernels" / "mla_attention.cu"


# ---- the mask format --------------------------------------------------------------------------------

def pack_visibility(vis: torch.Tensor) -> torch.Tensor:
    """bool [T, T] (tree-row visibility, vis[t, j]: row t sees tree row j) -> int32 [T, ceil(T/32)] words,
    bit j % 32 of word j // 32. Pure torch, any device."""
    if vis.dim() != 2 or vis.dtype != torch.bool:
        raise ValueError(f"pack_visibility: vis must be a bool [T, T] tensor, got {vis.dtype} {tuple(vis.shape)}")
    t, n = vis.shape
    w = (n + 31) // 32
    padded = torch.zeros(t, w * 32, dtype=torch.int64, device=vis.device)
    padded[:, :n] = vis.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=vis.device) << torch.arange(32, device=vis.device)
    words = (padded.view(t, w, 32) * weights).sum(-1)                 # [T, W] in [0, 2^32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def unpack_visibility(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [T, W] -> bool [T, n]: the inverse of pack_visibility (bits past n are ignored)."""
    if words.dim() != 2 or words.dtype != torch.int32 or words.shape[1] * 32 < n:
        raise ValueError(f"unpack_visibility: words must be int32 [T, >= ceil({n}/32)], got {words.dtype} "
                         f"{tuple(words.shape)}")
    bits = (words.to(torch.int64).unsqueeze(-1) >> torch.arange(32, device=words.device)) & 1   # [T, W, 32]
    return bits.flatten(1)[:, :n].bool()


# ---- configurations and the launch plan --------------------------------------------------------------

@dataclass(frozen=True)
class KernelConfig:
    name: str        # kernel symbol in the .cu
    warps: int
    bm: int          # query rows per block
    bn: int          # keys per tile
    stages: int      # K tiles resident in shared memory
    kind: str = "mma"          # "mma" (mma.sync, sm_80+) | "wgmma" (sm_90a only: H100/H200)
    tile_cost: float = 1.0     # split model: one key tile per SM, relative to the mma kernel's (~4 us)
    pairs: bool = False        # key tiles taken two at a time (the seesaw kernel): its own smem layout

    @property
    def smem_bytes(self) -> int:     # mirrors MmaCfg::SMEM / wgm::SMEM / wgp::SMEM in the .cu
        if self.pairs:               # Q (its rope panel holds P1) + K stages + P0 + stats/mbarriers + slack
            return self.bm * 1152 + self.stages * self.bn * 1152 + self.bm * self.bn * 2 + 1536 + 1024
        if self.kind == "wgmma":
            tile = self.bm * 1152
            return tile + self.stages * self.bn * 1152 + self.bm * self.bn * 2 + 4 * self.bm * 4 + 1024
        kh = self.warps // (self.bm // 16)
        return self.bm * 1152 + self.stages * self.bn * 1152 + self.bm * self.bn * 2 + (2 * kh + 2) * self.bm * 4

    def runs_on(self, cc: int) -> bool:
        return self.kind != "wgmma" or cc == WGMMA_ARCH


COMBINE_ROWS_MIN_M = 256   # query rows from which the split merge runs mla_combine_rows (a warp per row)
COMBINE_THREADS = 256      # mla_combine's block: MLA_COMBINE_WARPS (8) warps, mirrored from the .cu

CONFIGS = {c.name: c for c in (
    KernelConfig("mla_wgmma_pair", 8, 64, 64, 2, kind="wgmma", tile_cost=0.5, pairs=True),  # H100/H200: 231,936 B
    KernelConfig("mla_wgmma_m64_n64", 8, 64, 64, 2, kind="wgmma", tile_cost=0.5),  # H100/H200: 231,424 B
    KernelConfig("mla_mma_w8_m64_n64_s2", 8, 64, 64, 2),     # sm_80+ with 227 KB opt-in: 230,912 B
    KernelConfig("mla_mma_w4_m32_n32_s1", 4, 32, 32, 1),     # 99 KB parts (sm_120, sm_86/89)
)}


@dataclass(frozen=True)
class Plan:
    backend: str                   # "wgmma" | "mma" | "simt"
    kernel: str                    # kernel symbol
    grid: tuple
    block: tuple
    smem: int
    splits: int = 1
    chunk_keys: int = 0            # keys per split (a multiple of the key tile)


def plan(t: int, h: int, c: int, r: int, s: int, sm_count: int, smem_optin: int,
         config: Optional[str] = None, num_splits: Optional[int] = None, cc: int = 0) -> Plan:
    """Pure function of the shapes and three device properties (so it is testable without a GPU); `cc` is the
    compute capability as major*10 + minor (90 on H100/H200 selects the wgmma kernel)."""
    m = t * h
    if (c, r) != (MMA_C, MMA_R):
        if config is not None or num_splits not in (None, 1):
            raise ValueError(f"config/num_splits apply to the tensor-core kernel (C={MMA_C}, R={MMA_R}); got "
                             f"C={c}, R={r}, which runs the generic kernel")
        name = next(k for cap, k in zip(GENERIC_CAPS, GENERIC_KERNELS) if c <= cap)
        return Plan("simt", name, (m, 1, 1), (GENERIC_WARPS * 32, 1, 1), 4 * (c + r + GENERIC_WARPS * (c + 2)))
    if config is None:
        fitting = [k for k in CONFIGS.values() if k.smem_bytes <= smem_optin and k.runs_on(cc)]
        if not fitting:
            raise RuntimeError(f"tree_attention: no kernel configuration fits {smem_optin} B of shared memory "
                               f"per block (smallest needs {min(k.smem_bytes for k in CONFIGS.values())} B)")
        wg = [k for k in fitting if k.kind == "wgmma"]
        cfg = wg[0] if wg else max(fitting, key=lambda k: k.smem_bytes)
    else:
        if config not in CONFIGS:
            raise ValueError(f"config {config!r} unknown; choose one of {sorted(CONFIGS)}")
        cfg = CONFIGS[config]
        if not cfg.runs_on(cc):
            raise ValueError(f"config {config!r} is sm_90a code (wgmma): it runs on compute capability 9.0 "
                             f"only, this device is {cc // 10}.{cc % 10}")
        if cfg.smem_bytes > smem_optin:
            raise ValueError(f"config {config!r} needs {cfg.smem_bytes} B of shared memory per block; this device "
                             f"allows {smem_optin} B")
    row_tiles = -(-m // cfg.bm)
    key_tiles = -(-s // cfg.bn)
    if num_splits is None:
        splits = _choose_splits(row_tiles, key_tiles, sm_count, cfg.tile_cost)
    else:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
        splits = min(num_splits, key_tiles)
    tiles_per_split = -(-key_tiles // splits)
    splits = -(-key_tiles // tiles_per_split)             # no empty split
    return Plan(cfg.kind, cfg.name, (row_tiles, splits, 1), (cfg.warps * 32, 1, 1), cfg.smem_bytes, splits,
                tiles_per_split * cfg.bn)


def _choose_splits(row_tiles: int, key_tiles: int, sm_count: int, tile_cost: float = 1.0) -> int:
    """Split the keys so the (row tile x split) blocks fill whole waves (one block per SM). Cost model in units
    of one 64x64 tile per SM for the mma kernel (~4 us on an H200; `tile_cost` scales it for faster kernels):
    waves x (tiles per block x tile_cost + 2 for the Q load and the partial write), plus, when split, the
    merge: one launch, and 4 KB of fp32 partials written and read per (row, split), which at ~3 TB/s is one
    unit per ~45 row tiles x splits."""
    best, best_cost = 1, None
    for req in range(1, min(key_tiles, MAX_SPLITS) + 1):
        tps = -(-key_tiles // req)
        splits = -(-key_tiles // tps)
        waves = -(-(row_tiles * splits) // sm_count)
        cost = waves * (tps * tile_cost + 2) + (0 if splits == 1 else 1 + row_tiles * splits / 45)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


# ---- validation ------------------------------------------------------------------------------------

def _validate(q_lat, q_pe, latent, tree_mask, softmax_scale, out):
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("latent", latent), ("tree_mask", tree_mask)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"tree_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("latent", latent)):
        if x.dtype != torch.bfloat16:
            raise TypeError(f"tree_attention: {name} must be bfloat16, got {x.dtype} (cast it before the call)")
    if tree_mask.dtype != torch.int32:
        raise TypeError(f"tree_attention: tree_mask must be int32 words (pack_visibility), got {tree_mask.dtype}")
    if q_lat.dim() != 3 or q_pe.dim() != 3 or latent.dim() != 2 or tree_mask.dim() != 2:
        raise ValueError(f"tree_attention: expected q_lat [T,H,C], q_pe [T,H,R], latent [S,C+R], tree_mask "
                         f"[T,W]; got {tuple(q_lat.shape)}, {tuple(q_pe.shape)}, {tuple(latent.shape)}, "
                         f"{tuple(tree_mask.shape)}")
    t, h, c = q_lat.shape
    r = q_pe.shape[2]
    s = latent.shape[0]
    if q_pe.shape[:2] != (t, h):
        raise ValueError(f"tree_attention: q_pe {tuple(q_pe.shape)} must share [T, H] = {(t, h)} with q_lat")
    if not 1 <= t <= MAX_T:
        raise ValueError(f"tree_attention: T = {t} tree rows; the kernel takes 1..{MAX_T} (budget 1024 + root)")
    if h < 1 or c < 1 or r < 1:
        raise ValueError(f"tree_attention: empty dimension in H={h}, C={c}, R={r}")
    if latent.shape[1] != c + r:
        raise ValueError(f"tree_attention: latent rows have {latent.shape[1]} values; expected C + R = {c + r}")
    if s < t:
        raise ValueError(f"tree_attention: latent has {s} rows but must hold the prefix plus the T = {t} tree rows")
    w = (t + 31) // 32
    if tuple(tree_mask.shape) != (t, w):
        raise ValueError(f"tree_attention: tree_mask must be [T, ceil(T/32)] = {(t, w)}, got "
                         f"{tuple(tree_mask.shape)}")
    if (c, r) != (MMA_C, MMA_R) and (c > GENERIC_MAX_C or r > GENERIC_MAX_R):
        raise ValueError(f"tree_attention: C={c}, R={r} is neither the tensor-core shape ({MMA_C}, {MMA_R}) nor "
                         f"within the generic kernel's C <= {GENERIC_MAX_C}, R <= {GENERIC_MAX_R}")
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"tree_attention: softmax_scale must be a finite positive number, got {softmax_scale!r}")
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("latent", latent), ("tree_mask", tree_mask)):
        if not x.is_contiguous():
            raise ValueError(f"tree_attention: {name} must be contiguous (strides {x.stride()}); call .contiguous()")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (t, h, c) \
                or not out.is_contiguous():
            raise ValueError(f"tree_attention: out must be a contiguous bfloat16 [T, H, C] = {(t, h, c)} tensor")
    tensors = [("q_lat", q_lat), ("q_pe", q_pe), ("latent", latent), ("tree_mask", tree_mask)]
    if out is not None:
        tensors.append(("out", out))
    for name, x in tensors:
        if x.device.type != "cuda":
            raise ValueError(f"tree_attention: {name} is on {x.device}; the kernel needs CUDA tensors (use "
                             f"reference.target.absorbed_attention on the CPU)")
    dev = q_lat.device
    for name, x in tensors:
        if x.device != dev:
            raise ValueError(f"tree_attention: {name} is on {x.device}, q_lat on {dev}: all on one device")
        if x.data_ptr() % 16:
            raise ValueError(f"tree_attention: {name} must start on a 16-byte boundary (data_ptr % 16 = "
                             f"{x.data_ptr() % 16}); pass a fresh or .clone()d tensor")
    return t, h, c, r, s, w


# ---- compile and launch ----------------------------------------------------------------------------

def kernel_source() -> str:
    return _CU_PATH.read_text()


_modules: dict = {}
_lock = threading.Lock()


def _cupy():
    try:
        import cupy
    except ImportError as e:       # not a fallback: say what to install
        raise RuntimeError("tree_attention needs CuPy (pip install cupy-cuda13x, or the project's [gpu] extra)") \
            from e
    return cupy


def _device_module(index: int, defines: tuple = ()):
    """Per device (and variant): compiled module, kernels with their smem limits raised, device properties.
    `defines`: extra -D options selecting kernel variants (MLA_SKIP_RESCALE=1, ...; see the .cu header)."""
    key = (index, tuple(defines))
    with _lock:
        if key in _modules:
            return _modules[key]
        cupy = _cupy()
        props = torch.cuda.get_device_properties(index)
        cc = props.major * 10 + props.minor
        with cupy.cuda.Device(index) as device:
            smem_optin = int(device.attributes["MaxSharedMemoryPerBlockOptin"])
            # CuPy's NVRTC path compiles for the current device itself (-arch=sm_XX, cubin); the loaded binary's
            # version is checked below. On 9.0 the module must be sm_90a code (wgmma): NVRTC takes the
            # -arch=sm_90a given here over the -arch=sm_90 CuPy appends, and the wgmma kernel exists only if
            # it did. A missing kernel is recorded and raised when a plan asks for it (tree_attention).
            options = ("-std=c++17",) + (("-arch=sm_90a",) if cc == WGMMA_ARCH else ()) \
                + tuple(f"-D{d}" for d in defines)
            module = cupy.RawModule(code=kernel_source(), options=options)
            kernels, missing = {}, {}
            for cfg in CONFIGS.values():
                if not cfg.runs_on(cc):
                    continue
                try:
                    fn = module.get_function(cfg.name)
                except Exception as e:   # noqa: BLE001 - kept, raised with what to do when it is asked for
                    missing[cfg.name] = f"{type(e).__name__}: {e}"
                    continue
                if cfg.smem_bytes <= smem_optin:
                    fn.max_dynamic_shared_size_bytes = cfg.smem_bytes
                kernels[cfg.name] = fn
            for name in ("mla_combine", "mla_combine_rows") + GENERIC_KERNELS:
                kernels[name] = module.get_function(name)
            built = kernels["mla_combine"].binary_version
            if built != cc:
                raise RuntimeError(f"tree_attention: the module was built for sm_{built}, the device is sm_{cc}; "
                                   f"CuPy/NVRTC does not know this architecture: upgrade cupy-cuda13x")
            info = dict(arch=f"sm_{cc}" + ("a" if cc == WGMMA_ARCH else ""), cc=cc,
                        sm_count=int(props.multi_processor_count), smem_optin=smem_optin, name=props.name,
                        missing=missing, options=options)
            _modules[key] = (kernels, info)
        return _modules[key]


def device_info(device: torch.device | int | None = None) -> dict:
    """arch, SM count, smem opt-in and name of a device (compiles the module on first use)."""
    index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index \
        if isinstance(device, int) else device.index
    return dict(_device_module(index)[1])


def kernel_attributes(device_index: int = 0, defines: tuple = ()) -> dict:
    """Registers / local memory per kernel as loaded (for reports)."""
    kernels, _ = _device_module(device_index, defines)
    return {k: dict(num_regs=f.num_regs, local_bytes=f.local_size_bytes) for k, f in kernels.items()}


def plan_for(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, config: Optional[str] = None,
             num_splits: Optional[int] = None) -> Plan:
    t, h, c = q_lat.shape
    info = _device_module(q_lat.device.index)[1]
    return plan(t, h, c, q_pe.shape[2], latent.shape[0], info["sm_count"], info["smem_optin"], config, num_splits,
                info["cc"])


_streams: dict = {}


def _cupy_stream(ptr: int, index: int):
    """CuPy's view of a torch stream, cached. ExternalStream is deprecated in CuPy 14 for Stream.from_external
    (the __cuda_stream__ protocol); it still works and needs nothing from the torch side."""
    key = (ptr, index)
    if key not in _streams:
        import warnings
        cupy = _cupy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            _streams[key] = cupy.cuda.ExternalStream(ptr, index)
    return _streams[key]


def tree_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, tree_mask: torch.Tensor,
                   softmax_scale: float, *, out: Optional[torch.Tensor] = None, num_splits: Optional[int] = None,
                   config: Optional[str] = None, defines: tuple = (),
                   seq_len: Optional[torch.Tensor] = None) -> torch.Tensor:
    """o_lat [T, H, C] bf16 = absorbed MLA of q_lat [T,H,C], q_pe [T,H,R] over latent [P+T, C+R] with the whole
    prefix visible and the tree rows masked by tree_mask int32 [T, ceil(T/32)] (pack_visibility).

    seq_len (graph mode): an int32 [1] device tensor holding S = P + T; `latent` is then a buffer of at least S
    rows whose length only sizes the plan (splits), and the kernel reads S when it runs, so one CUDA graph
    serves every prefix up to latent.shape[0]. The caller guarantees T <= S <= latent.shape[0].
    A row that sees no key at all (P = 0 and its own bit clear) gets zeros, where the reference gives NaN.
    `num_splits` / `config` override the plan, `defines` selects a compiled variant (tests, benches)."""
    t, h, c, r, s, w = _validate(q_lat, q_pe, latent, tree_mask, softmax_scale, out)
    if seq_len is not None and (not isinstance(seq_len, torch.Tensor) or seq_len.dtype != torch.int32
                                or seq_len.numel() != 1 or seq_len.device != q_lat.device):
        raise ValueError("tree_attention: seq_len must be an int32 tensor of one element on the device of q_lat")
    p = s - t
    dev = q_lat.device
    if out is None:
        out = torch.empty((t, h, c), dtype=torch.bfloat16, device=dev)
    kernels, info = _device_module(dev.index, defines)
    pl = plan(t, h, c, r, s, info["sm_count"], info["smem_optin"], config, num_splits, info["cc"])
    if pl.kernel in info["missing"]:
        raise RuntimeError(f"tree_attention: kernel {pl.kernel} is missing from the module built with "
                           f"{info['options']} ({info['missing'][pl.kernel]}): this NVRTC did not compile sm_90a "
                           f"code (needs the CUDA >= 12.0 NVRTC); pass config='mla_mma_w8_m64_n64_s2' to run the "
                           f"mma.sync kernel")
    cupy = _cupy()
    import numpy as np
    ptr = lambda x: np.uint64(x.data_ptr())                                      # noqa: E731
    i32 = np.int32
    scale_log2 = np.float32(softmax_scale * _LOG2E)
    dyn = np.uint64(0) if seq_len is None else ptr(seq_len)
    stream = torch.cuda.current_stream(dev)
    with cupy.cuda.Device(dev.index), _cupy_stream(stream.cuda_stream, dev.index):
        if pl.backend == "simt":
            kernels[pl.kernel](pl.grid, pl.block, (ptr(q_lat), ptr(q_pe), ptr(latent), ptr(tree_mask), ptr(out),
                                                   i32(t), i32(h), i32(c), i32(r), i32(p), i32(s), i32(w),
                                                   scale_log2, dyn), shared_mem=pl.smem)
            return out
        m = t * h
        if pl.splits == 1:
            o_part = lse = None
        else:
            o_part = torch.empty((pl.splits, m, c), dtype=torch.float32, device=dev)   # [splits, M, C]
            lse = torch.empty((pl.splits, m), dtype=torch.float32, device=dev)         # [splits, M] (log2)
        null = np.uint64(0)
        kernels[pl.kernel](pl.grid, pl.block,
                           (ptr(q_lat), ptr(q_pe), ptr(latent), ptr(tree_mask), ptr(out),
                            null if o_part is None else ptr(o_part), null if lse is None else ptr(lse),
                            i32(t), i32(h), i32(p), i32(s), i32(w), i32(pl.chunk_keys), scale_log2, dyn),
                           shared_mem=pl.smem)
        if o_part is not None:   # many rows: a warp per row; few (decode): a block per row and column slice
            rows = m >= COMBINE_ROWS_MIN_M
            kernels["mla_combine_rows" if rows else "mla_combine"](
                (-(-m // 4) if rows else m, c // 128, 1), (128 if rows else COMBINE_THREADS, 1, 1),
                (ptr(o_part), ptr(lse), ptr(out), i32(m), i32(c), i32(pl.splits)))
    return out


def absorbed_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, visible: torch.Tensor,
                       softmax_scale: float) -> torch.Tensor:
    """The signature of reference.target.absorbed_attention (visible bool [T, S]), for drop-in use and tests.
    The kernel needs the prefix fully visible: checked here (one device sync; the engine calls tree_attention
    with the packed mask directly)."""
    t = q_lat.shape[0]
    s = latent.shape[0]
    if visible.dtype != torch.bool or tuple(visible.shape) != (t, s):
        raise ValueError(f"absorbed_attention: visible must be bool [T, S] = {(t, s)}, got {visible.dtype} "
                         f"{tuple(visible.shape)}")
    p = s - t
    if p > 0 and not bool(visible[:, :p].all()):
        raise ValueError("absorbed_attention: the kernel needs every prefix slot visible to every row (the tree "
                         "mask covers only the last T slots); this visibility hides part of the prefix")
    return tree_attention(q_lat, q_pe, latent, pack_visibility(visible[:, p:].contiguous()), softmax_scale)
