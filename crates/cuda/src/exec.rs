//! Runs a [`Plan`] on the GPU: one device arena per executable, kernels launched step by step on
//! the device's stream; decode steps whose products take the matrix-vector kernels or `mmq` are
//! captured once per count of sequences as a CUDA graph and replayed.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{sys, CudaGraph};
use kiln_ir::{Among, Bucket, DType, RopeMode, CANDIDATES};
use kiln_quant::GgmlType;
use kiln_runtime::{
    DrawSpec, Executable, HostData, HostTensor, Kernel, KvCache, KvType, Plan, Rows, RuntimeError, Slot, Step, StepInputs, WeightId,
};

use crate::device::{cuda_err, Arg, Device, DeviceBuffer, Scratch};
use crate::kv::CudaKvCache;
use crate::weights::{format_name, planar_fields, CudaWeights};

/// Most activation rows the matrix-vector kernels take (`MV_ROWS` in quant.cu; more rows take
/// `mmq` or cuBLAS).
const MATVEC_ROWS: usize = 8;
/// Blocks of the first argmax phase per row.
const ARGMAX_BLOCKS: usize = 64;
/// Widest row a matrix-vector launch normalises in its last block (`4 * EPI_PER * 32 * MV_WARPS`):
/// wider rows take the norm kernel, whose block is not the tail of a launch (measured on an H200
/// at 12B shapes, rows of 3840: the last block's norm pair cost 7 µs after the output projection
/// and 14 µs after the down projection; decode 3% faster without them, 15% more once the norm
/// kernel loaded its rows as float4 in one round trip; a streamed launch's last block, staging the
/// row in its ring in one round trip, still cost ~15 µs more per launch: bench/RESULTS.md "issue
/// 4m").
const EPILOGUE_MAX: usize = 4 * NORM_VECS * 32 * MATVEC_WARPS;
/// Float4 vectors of the row each thread of a norm epilogue or prologue holds (`EPI_PER` and
/// `PRO_PER` in quant.cu; 3, for the 1B's rows of 1152, made its decode 9% slower and the
/// 270M's 2%: bench/RESULTS.md "issue 4u").
const NORM_VECS: usize = 2;
/// Partial maxima per row of the greedy head's fused argmax (`ARGMAX_SLOTS` in quant.cu).
const ARGMAX_SLOTS: usize = 256;
/// Widest Q8_0 row the one-row greedy head kernel takes (`HEAD_MAX_K` in quant.cu).
const HEAD_MAX_K: usize = 1024;
/// Warps of a greedy head block (`HEAD_WARPS` in quant.cu).
const HEAD_WARPS: usize = 8;
/// Threads of a top-k block, most values it keeps a row and values in a slice of its first
/// launch (`TOPK_THREADS`, `TOPK_MAX`, `TOPK_SLICE` in ops.cu).
const TOPK_THREADS: u32 = 256;
const TOPK_MAX: usize = 64;
const TOPK_SLICE: usize = 4096;

/// Whether the top-k kernels take `count` values of rows of `width` (the second launch stages
/// every slice's `count` keys in one block).
pub(crate) fn top_k_takes(width: usize, count: usize) -> bool {
    count > 0 && count <= TOPK_MAX && width.div_ceil(TOPK_SLICE) * count <= TOPK_SLICE
}

/// Bytes of a sequence's draw in the step buffer (`DRAW_BYTES` in ops.cu): the generator's four
/// 64-bit words, then the temperature, top-k, top-p and min-p (32 bits each).
const DRAW_BYTES: usize = 48;
/// Threads of each launch of a draw among the whole vocabulary (`DRAW_THREADS` in ops.cu).
const DRAW_THREADS: u32 = 1024;
/// Tokens of a run, the unit of that draw's partial maxima and sums (`DRAW_RUN` in ops.cu).
const DRAW_RUN: usize = 1024;
/// 32-bit words of a run's partials (`DrawParts` in ops.cu): its sum of weight shares (u64), its likeliest
/// token's key (u64), its largest logit (f32) and its flag (i32).
const DRAW_PART_WORDS: usize = 6;

/// Word offset of the top-k partials in the head buffer, after `head_values` products and the
/// argmax partials of `rows` rows: even, so that their 8-byte keys are aligned (an odd vocabulary
/// makes an odd count of products).
fn top_k_at(head_values: usize, rows: usize) -> usize {
    (head_values + 2 * ARGMAX_BLOCKS * rows).next_multiple_of(2)
}

/// Words of a top-k's partial results a row: its slices' `count` keys (two words each) and flags.
fn top_k_part_words(width: usize, count: usize) -> usize {
    width.div_ceil(TOPK_SLICE) * (2 * count + 1)
}

/// Threads of an attention block (`ATT_WARPS` warps in attention.cu).
const ATTENTION_THREADS: u32 = 512;
/// Most blocks an `attention` launch gives each (row, query head) (each over a share of the
/// positions; `ATT_SPLITS_MAX` in attention.cu, whose merge holds one value per share in registers).
const ATTENTION_SPLITS_MAX: usize = 16;

/// Largest head size the attention kernels take (`ATT_MAX_DIM` in attention.cu).
pub(crate) const ATTENTION_MAX_DIM: usize = 256;
/// Rows of a block of `attention_tiled` (`ATT_TILE_ROWS`), its threads (`ATT_TILE_WARPS` warps)
/// and the keys of a chunk (`ATT_TILE_KEYS`).
const ATTENTION_TILE_ROWS: usize = 16;
const ATTENTION_TILE_THREADS: u32 = 256;
const ATTENTION_TILE_KEYS: usize = 32;

/// Dynamic shared memory of an `attention_tiled` block for heads of `d`: its query rows, a chunk's
/// keys (rows of d + 4) and values.
pub(crate) fn attention_tile_shared(d: usize) -> usize {
    4 * (ATTENTION_TILE_ROWS * d + ATTENTION_TILE_KEYS * (d + 4) + ATTENTION_TILE_KEYS * d)
}

/// Whether the attention of `rows` new rows of `seqs` sequences with `q_heads` query heads takes
/// `attention_tiled` rather than `attention` (a block per row and head, each reading its row's
/// past from L2) on a device of `sms` multiprocessors: where the sequences have a tile of rows
/// each on average (prompts, not decode steps) and the tiles of all heads give at least a quarter
/// of the multiprocessors a block. Measured on an H200 (bench/RESULTS.md "issue 4z"): default
/// model prompts of 512 tokens 1.19x, 2048 1.9x, 256 1.03x, 64 after 2048 of context 0.57x (16
/// blocks: kept on `attention`); synthetic 12B prompts of 512 1.14x, 64 after 2048 1.11x.
fn takes_tiled_attention(rows: usize, seqs: usize, q_heads: usize, sms: usize) -> bool {
    rows >= ATTENTION_TILE_ROWS * seqs.max(1) && rows.div_ceil(ATTENTION_TILE_ROWS) * q_heads >= sms / 4
}

/// Blocks per (row, query head) of an `attention` launch over `pairs` of them (a step's rows times
/// its query heads): enough to give every multiprocessor a block (a decode step of one sequence
/// has only 4-16 heads; one of 8 sequences 32-128 pairs), at most `ATTENTION_SPLITS_MAX`; the
/// kernel uses fewer when the past is short.
fn attention_splits(pairs: usize, sms: usize) -> usize {
    (sms / pairs.max(1)).clamp(1, ATTENTION_SPLITS_MAX)
}
/// Warps of a matrix-vector block (`MV_WARPS` in quant.cu).
const MATVEC_WARPS: usize = 4;
/// Output rows (all matrices together) from which one activation row uses the 4-rows-per-warp
/// matrix-vector kernel (enough warps to fill the device).
const MATVEC4_MIN_ROWS: usize = 2048;
/// Blocks of a `matvec4` kernel resident per multiprocessor (its launch bounds: at most 128
/// registers per thread).
const MATVEC4_BLOCKS_PER_SM: usize = 4;
/// Warps of the matrix-vector kernels resident per multiprocessor.
const MATVEC_WARPS_PER_SM: usize = MATVEC4_BLOCKS_PER_SM * MATVEC_WARPS;
/// Rounds of the device's resident warps (`MATVEC_WARPS_PER_SM` each) from which a one-row
/// `matvec4` launch is persistent (measured on an H200: the 12B's greedy head, 262,144 rows, 3%
/// faster so; gate/up, 3.6 rounds, 9% slower).
const PERSISTENT_ROUNDS: usize = 16;
/// Widest gelu-product row a gate/up launch also quantizes (its warps count the finished rows of
/// each 32-row block; the one completing a block quantizes it); wider rows are quantized by a
/// separate launch before the down projection (measured on an H200, see bench/RESULTS.md
/// "issue 4h"), as are those of a launch that streams its weights (`matvecr`: a synthetic 1B's
/// 6912 rows of 1152, 11.5 µs in `matvec4` with the quantization, 8.4 µs streamed, decode 5%
/// faster; "issue 4u").
const GLU_QUANT_MAX: usize = 8192;
/// Shared-memory stages of the 4-rows-per-warp matrix-vector kernels (`MV_STAGES` in quant.cu).
const MATVEC_STAGES: usize = 3;

/// Dynamic shared memory of a `matvec4_<fmt>` block: its warps' rings of staged chunks
/// (`MV_WARPS` warps x `MV_STAGES` stages x 4 rows x the format's 16-byte pieces per chunk,
/// `Chunk<T>::NP` in quant.cu, x 32 lanes); 0 for formats loaded straight into registers.
pub(crate) fn matvec4_shared_bytes(fmt: &str) -> u32 {
    let pieces = match fmt {
        "q5_0" => 2,
        _ => 0,
    };
    (MATVEC_WARPS * MATVEC_STAGES * 4 * pieces * 32 * 16) as u32
}
/// Formats with `matvecr8_<fmt>`, `matvecr4_<fmt>` and `matvecr2_<fmt>` kernels (`KILN_RING` in
/// quant.cu).
const RING_FORMATS: [GgmlType; 8] =
    [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_0, GgmlType::Q5_K, GgmlType::Q2_K, GgmlType::Q3_K];
/// Weight bytes from which a one-row launch streams its weights through shared memory
/// (`matvecr`; measured on an H200 at 12B shapes, bench/RESULTS.md "issue 4i": the greedy head
/// 326 -> 205 µs, gate/up 25.9 -> 20.6 µs, o 6.1 -> 4.4 µs, v 4.9 -> 3.8 µs, q/k even).
const RING_MIN_BYTES: usize = 4 << 20;
/// Shared memory a `matvecr8`/`matvecr2` block gives its ring (so that 4 blocks fit a
/// multiprocessor); a `matvecr4` block, of 8 warps, 2 resident, gives twice this.
const RING_SHARED: usize = 52 << 10;
/// Most stages of a `matvecr` ring (`MVR_STAGES` in quant.cu).
const RING_MAX_STAGES: usize = 4;
/// Warps of the `matvecr8`/`matvecr2` blocks (4 resident per multiprocessor: their launch bounds)
/// and of the `matvecr4` blocks (2 resident) (`MVR_WARPS`, `MVR4_WARPS` in quant.cu).
const RING_WARPS: usize = 4;
const RING4_WARPS: usize = 8;
/// Warps of the `matvecr` kernels resident per multiprocessor.
const RING_WARPS_PER_SM: usize = 16;

/// Warps of a `matvecr` block of tiles of `rows` rows (its kernel `matvecr{rows}`).
fn ring_warps(rows: usize) -> usize {
    if rows == 4 {
        RING4_WARPS
    } else {
        RING_WARPS
    }
}

/// Shared memory a `matvecr{rows}` block gives its ring (`RING_SHARED` per 4 warps).
pub(crate) fn ring_shared(rows: usize) -> usize {
    RING_SHARED * ring_warps(rows) / RING_WARPS
}

/// How a `matvecr` launch runs: rows per tile (its kernel, `matvecr8`, `matvecr4` or `matvecr2`),
/// warps per block, ring stages, blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RingGeometry {
    rows: usize,
    warps: usize,
    stages: usize,
    blocks: usize,
}

/// The `matvecr` geometry of a one-row launch over matrices of `rows_of` rows of `k` columns in
/// format `ty` (the gate/up pair with `glu`) on a device of `sms` multiprocessors, if the launch
/// reads `RING_MIN_BYTES` or more and can be cut in tiles of 8 rows, else of 4 (blocks of 8 warps
/// with twice the ring), else of 2: two tiles fit the ring, none spans two matrices, and every
/// plane's share of a tile, and every plane's start, is a multiple of 16 bytes (bulk copies).
fn ring_geometry(ty: GgmlType, k: usize, rows_of: &[usize], glu: bool, sms: usize) -> Option<RingGeometry> {
    let planes: Vec<usize> = match planar_fields(ty) {
        Some(f) => f.iter().map(|&(_, bytes)| bytes).collect(),
        None => vec![ty.type_size()],
    };
    let per_row = k / ty.block_size();
    let row_bytes = per_row * ty.type_size();
    let total: usize = rows_of.iter().sum();
    if !RING_FORMATS.contains(&ty) || !k.is_multiple_of(ty.block_size()) || total * row_bytes < RING_MIN_BYTES {
        return None;
    }
    let fits = |rows: usize| {
        let part = if glu { rows / 2 } else { rows };
        2 * rows * row_bytes <= ring_shared(rows)
            && rows_of.iter().all(|&n| {
                let mut start = 0;
                n.is_multiple_of(part)
                    && planes.iter().all(|&per| {
                        let ok = (per * part * per_row).is_multiple_of(16) && (start * n * per_row).is_multiple_of(16);
                        start += per;
                        ok
                    })
            })
    };
    let rows = [8, 4, 2].into_iter().find(|&r| fits(r))?;
    let tiles = if glu { rows_of[0] / (rows / 2) } else { total / rows };
    let stages = (ring_shared(rows) / (rows * row_bytes)).min(RING_MAX_STAGES);
    let warps = ring_warps(rows);
    Some(RingGeometry { rows, warps, stages, blocks: tiles.min(RING_WARPS_PER_SM / warps * sms) })
}

/// The `matvecr` geometry of a launch (see `ring_geometry`) if it streams its weights through
/// shared memory: `plain` (one activation row, nothing fused into it: no norm prologue or epilogue,
/// no glu quantization) and bulk copies (sm_90 and later).
fn streamed(ty: GgmlType, k: usize, rows_of: &[usize], glu: bool, plain: bool, arch: (i32, i32), sms: usize) -> Option<RingGeometry> {
    (plain && arch.0 >= 9).then(|| ring_geometry(ty, k, rows_of, glu, sms)).flatten()
}

/// Formats with `mmq{tile}_<fmt>` kernels (`KILN_MMQ` in quant.cu): integer tensor-core products
/// of more activation rows than the matrix-vector kernels take, the weights read in their packed
/// form (other formats are dequantized to f32 for cuBLAS).
pub(crate) const MMQ_FORMATS: [GgmlType; 10] = [
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q5_K,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
];
/// Elements of one shared-memory stage of the `mmq` kernels (`MMQ_K` in quant.cu): they take
/// matrices whose rows are a multiple of it (every Gemma, Llama and Qwen width is).
const MMQ_K: usize = 128;
/// Whether a product by a `ty` matrix of `k` columns can take `mmq` on a device of `arch` (whether
/// the matrix-vector kernels take it first: `takes_matvec`). Any number of rows: at 512 rows
/// `mmq` is 1.1-2.3x faster than cuBLAS's SGEMM on the dequantized weight at 12B shapes (on an
/// H200, bench/cuda/mmq.cu; bench/RESULTS.md "issue 4s").
fn takes_mmq(ty: GgmlType, k: usize, arch: (i32, i32)) -> bool {
    MMQ_FORMATS.contains(&ty) && arch.0 >= 8 && k.is_multiple_of(MMQ_K)
}

/// Fewest activation rows of a product that takes `mmq` rather than the matrix-vector kernels
/// (measured on an H200: synthetic 270M, 4 sequences 2,381 -> 2,871 tokens/s, 6 2,871 -> 4,206,
/// 8 3,233 -> 5,566, bench/RESULTS.md "issue 4q"; synthetic 12B with long rows split into runs,
/// 4 sequences 335 -> 542, 8 447 -> 993, "issue 4y").
const MMQ_MIN_ROWS: usize = 4;
/// Widest rows (columns) of the products whose few-row `mmq` blocks each walk all of k: a block
/// over longer rows reads more activation bytes than its multiprocessor's share of the weights and
/// waits on each stage, so those launches split k into runs (`MmqBlock::shape`).
const MMQ_SHORT_K: usize = 2048;
/// Partial sums a few-row `mmq` block of the widest tile writes per run (8 a thread).
const MMQ_RUN_SUMS: usize = MMQ_THREADS as usize * 8;
/// Fewest stages (`MMQ_K` elements each) in one run of a few-row `mmq` block over part of k.
const MMQ_RUN_MIN_STEPS: usize = 4;
/// Blocks a multiprocessor that a few-row `mmq` launch over long rows aims at by splitting k.
const MMQ_RUN_BLOCKS_PER_SM: usize = 4;

/// Whether a product of `rows` activation rows by a `ty` matrix of `k` columns takes the
/// matrix-vector kernels on a device of `arch`: up to `MMQ_MIN_ROWS` - 1 rows, and up to
/// `MATVEC_ROWS` where `mmq` does not take its format.
fn takes_matvec(ty: GgmlType, k: usize, rows: usize, arch: (i32, i32)) -> bool {
    rows < MMQ_MIN_ROWS || rows <= MATVEC_ROWS && !takes_mmq(ty, k, arch)
}

/// Whether every product of `plan` takes the matrix-vector kernels at `rows` rows.
fn products_take_matvec(plan: &Plan, weights: &dyn WeightShapes, rows: usize, arch: (i32, i32)) -> Result<bool, RuntimeError> {
    for st in &plan.steps {
        if let Kernel::MatMul { w, k, .. } | Kernel::MatMulArgmax { w, k, .. } = st.kernel {
            if !takes_matvec(weights.matrix_ty(w)?, k, rows, arch) {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Threads of an `mmq` block (`MMQ_WARPS` in quant.cu).
const MMQ_THREADS: u32 = 128;

/// One shape of `mmq` block (`mmq` in quant.cu): how many activation rows it takes, its stages in
/// flight, and its kernels (`{prefix}{tile}_<fmt>`, one per tile of weight rows, widest first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmqBlock {
    /// Activation rows of a block (`MMQ_ROWS` or `MMQF_ROWS`).
    pub(crate) rows: usize,
    /// Stages of a block (`MMQ_STAGES` or `MMQF_STAGES`).
    stages: usize,
    /// Kernel name prefix.
    pub(crate) prefix: &'static str,
    /// Weight rows of a block, one kernel each, widest first.
    pub(crate) tiles: [usize; 4],
}

/// Blocks of 32 activation rows: prompts and steps of more than 8 rows.
pub(crate) const MMQ_MANY: MmqBlock = MmqBlock { rows: 32, stages: 3, prefix: "mmq", tiles: [128, 64, 32, 8] };
/// Blocks of 8 activation rows: steps of 4-8 rows. Their stages hold 8 activation rows, not 32 (more
/// blocks a multiprocessor), and their products hold weight rows in A (16 against 4 activation
/// rows' two levels), so a lane's two weight scales serve two products, not one (synthetic 270M on
/// an H200: 4 sequences 4,222 -> 4,395 tokens/s, 5 5,303 -> 5,607, 8 7,482 -> 7,804;
/// bench/RESULTS.md "issue 4w").
pub(crate) const MMQ_FEW: MmqBlock = MmqBlock { rows: 8, stages: 4, prefix: "mmqf", tiles: [128, 64, 32, 16] };
/// Every `mmq` block shape (`KILN_MMQ` in quant.cu instantiates each for every format).
pub(crate) const MMQ_BLOCKS: [MmqBlock; 2] = [MMQ_MANY, MMQ_FEW];

impl MmqBlock {
    /// The block shape for a product of `rows` activation rows.
    fn of(rows: usize) -> MmqBlock {
        if rows <= MMQ_FEW.rows {
            MMQ_FEW
        } else {
            MMQ_MANY
        }
    }

    /// Shared memory of a block of `tile` weight rows of format `ty` (`mmq_stage` in quant.cu):
    /// per stage its activation rows (272 bytes of levels and 64 of scales each) and the weight
    /// rows' share (`Tile<T>::STRIDE` bytes each; none for a format without `mmq`).
    pub(crate) fn shared(&self, ty: GgmlType, tile: usize) -> usize {
        let stride = match ty {
            GgmlType::Q2_K => 48,
            GgmlType::Q4_K | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q3_K => 80,
            GgmlType::Q6_K | GgmlType::Q5_0 | GgmlType::Q5_K | GgmlType::Q5_1 => 112,
            GgmlType::Q8_0 => 144,
            _ => 0,
        };
        self.stages * (self.rows * (272 + 64) + tile * stride)
    }

    /// Weight rows of the blocks over `n` weight rows and `rows` activation rows on `sms`
    /// multiprocessors: the widest tile that still gives every multiprocessor a block (measured on
    /// an H200 at 12B and 270M shapes, bench/cuda/mmq.cu: within 5% of the best tile but for one
    /// shape).
    fn tile(&self, n: usize, rows: usize, sms: usize) -> usize {
        let by = rows.div_ceil(self.rows);
        self.tiles.into_iter().find(|&t| n.div_ceil(t) * by >= sms).unwrap_or(self.tiles[self.tiles.len() - 1])
    }

    /// The launch of a product of `rows` activation rows of `k` columns by `n` weight rows on `sms`
    /// multiprocessors: weight rows of a block and runs k is split into (the grid's third
    /// dimension). Few-row blocks over rows longer than `MMQ_SHORT_K` take the widest tile (one
    /// warp a team: the kernel splits only those) and as many runs of at least
    /// `MMQ_RUN_MIN_STEPS` stages as give `MMQ_RUN_BLOCKS_PER_SM` blocks a multiprocessor, no run
    /// empty; other launches `tile`, one run.
    fn shape(&self, n: usize, k: usize, rows: usize, sms: usize) -> (usize, usize) {
        if *self != MMQ_FEW || k <= MMQ_SHORT_K {
            return (self.tile(n, rows, sms), 1);
        }
        let tile = self.tiles[0];
        let (blocks, steps) = (n.div_ceil(tile) * rows.div_ceil(self.rows), k / MMQ_K);
        let runs = (MMQ_RUN_BLOCKS_PER_SM * sms / blocks).clamp(1, (steps / MMQ_RUN_MIN_STEPS).max(1));
        (tile, steps.div_ceil(steps.div_ceil(runs)))
    }
}

/// The operations of the `elementwise` kernel (its `op` argument in ops.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ElementOp {
    Add = 0,
    Mul = 1,
    Gelu = 2,
    GeluMul = 3,
    Silu = 4,
    SiluMul = 5,
    Scale = 6,
    SoftCap = 7,
    /// A bias row (a weight vector) added to every row.
    Bias = 8,
}

/// A plan step the `elementwise` kernel computes: `out = op(a, b)` over rows of `width`, with the
/// op's constant `c` (scale factor, soft-cap) and `b` a slot or the bias vector `bias`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Elementwise {
    op: ElementOp,
    a: Slot,
    b: Option<Slot>,
    bias: Option<WeightId>,
    out: Slot,
    width: usize,
    c: f32,
}

/// The `elementwise` launch of `kernel`, if it is an element-wise step.
fn elementwise_of(kernel: &Kernel) -> Option<Elementwise> {
    let e = |op, a, b, out, width, c| Some(Elementwise { op, a, b, bias: None, out, width, c });
    match *kernel {
        Kernel::Add { a, b, out, width } => e(ElementOp::Add, a, Some(b), out, width, 0.0),
        Kernel::Mul { a, b, out, width } => e(ElementOp::Mul, a, Some(b), out, width, 0.0),
        Kernel::Gelu { x, out, width } => e(ElementOp::Gelu, x, None, out, width, 0.0),
        Kernel::GeluMul { gate, up, out, width } => e(ElementOp::GeluMul, gate, Some(up), out, width, 0.0),
        Kernel::Silu { x, out, width } => e(ElementOp::Silu, x, None, out, width, 0.0),
        Kernel::SiluMul { gate, up, out, width } => e(ElementOp::SiluMul, gate, Some(up), out, width, 0.0),
        Kernel::Scale { x, out, width, factor } => e(ElementOp::Scale, x, None, out, width, factor),
        Kernel::SoftCap { x, out, width, cap } => e(ElementOp::SoftCap, x, None, out, width, cap),
        Kernel::AddBias { x, bias, out, width } => {
            Some(Elementwise { op: ElementOp::Bias, a: x, b: None, bias: Some(bias), out, width, c: 0.0 })
        }
        _ => None,
    }
}

/// The activation of a gated MLP product (`GeluMul` or `SiluMul`): it picks the kernels of a
/// gate/up launch that computes the product (`ACT` in quant.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Glu {
    /// GELU-tanh (Gemma).
    Gelu,
    /// SiLU (Llama, Qwen).
    Silu,
}

impl Glu {
    /// Every activation (each has its matrix-vector kernels).
    pub(crate) const ALL: [Glu; 2] = [Glu::Gelu, Glu::Silu];

    /// The infix of its matrix-vector kernels' names (`matvec4_q4_k`, `matvec4_silu_q4_k`: `ACTN` of
    /// `KILN_MATVECS` and `KILN_RINGS` in quant.cu).
    pub(crate) fn infix(self) -> &'static str {
        match self {
            Glu::Gelu => "",
            Glu::Silu => "_silu",
        }
    }
}

/// A gated product step: its activation, gate, up, output and width.
fn glu_of(kernel: &Kernel) -> Option<(Glu, Slot, Slot, Slot, usize)> {
    match *kernel {
        Kernel::GeluMul { gate, up, out, width } => Some((Glu::Gelu, gate, up, out, width)),
        Kernel::SiluMul { gate, up, out, width } => Some((Glu::Silu, gate, up, out, width)),
        _ => None,
    }
}

/// An attention step: `Attention`, or `AttentionSoftCap` with its cap (the attention kernels' `_cap`
/// instances).
#[derive(Clone, Copy, Debug, PartialEq)]
struct AttentionStep {
    q: Slot,
    k: Slot,
    v: Slot,
    out: Slot,
    layer: usize,
    q_heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
    scale: f32,
    softcap: Option<f32>,
}

/// The attention step `kernel` is, if any.
fn attention_of(kernel: &Kernel) -> Option<AttentionStep> {
    match *kernel {
        Kernel::Attention { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale } => {
            Some(AttentionStep { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale, softcap: None })
        }
        Kernel::AttentionSoftCap { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale, softcap } => {
            Some(AttentionStep { q, k, v, out, layer, q_heads, kv_heads, head_dim, window, scale, softcap: Some(softcap) })
        }
        _ => None,
    }
}

/// Checks that the CUDA kernels take `kernel`: shapes within their limits, vectors of the lengths
/// the step reads. (Every kernel of the plan IR has a CUDA kernel; this match names them all, so a
/// new one must be decided on here.)
fn check_kernel(kernel: &Kernel, weights: &dyn WeightShapes) -> Result<(), RuntimeError> {
    match *kernel {
        Kernel::RmsNorm { weight, .. } => {
            let width = weights.vector_len(weight)?;
            if width > NORM_MAX {
                return Err(cuda_err(format!("RMS norm over {width} elements (at most {NORM_MAX})")));
            }
        }
        Kernel::Normalize { width, group, .. } => {
            if group == 0 || group > NORM_MAX || !width.is_multiple_of(group) {
                return Err(cuda_err(format!("RMS normalisation over groups of {group} of rows of {width} (at most {NORM_MAX})")));
            }
        }
        Kernel::AddBias { bias, width, .. } => {
            let len = weights.vector_len(bias)?;
            if len != width || width > u32::MAX as usize {
                return Err(cuda_err(format!("a bias of {len} elements added to rows of {width}")));
            }
        }
        Kernel::Rope { head_dim, .. } | Kernel::RopeScaled { head_dim, .. } => {
            if !head_dim.is_multiple_of(2) {
                return Err(cuda_err(format!("RoPE over heads of odd size {head_dim}")));
            }
        }
        Kernel::Attention { .. } | Kernel::AttentionSoftCap { .. } => {
            let a = attention_of(kernel).ok_or_else(|| cuda_err("an attention step without its parameters"))?;
            let (d, qh, kh) = (a.head_dim, a.q_heads, a.kv_heads);
            if d > ATTENTION_MAX_DIM || !d.is_multiple_of(32) || kh == 0 || !qh.is_multiple_of(kh) {
                return Err(cuda_err(format!(
                    "attention with head size {d}, {qh} query / {kh} key heads is not supported (head size must be a multiple of 32, at most {ATTENTION_MAX_DIM})"
                )));
            }
        }
        Kernel::MatMulTopK { n: width, count, .. } | Kernel::TopK { width, count, .. } => {
            if !top_k_takes(width, count) {
                return Err(cuda_err(format!(
                    "a top-{count} step over rows of {width} (at most {TOPK_MAX} values of rows of {})",
                    TOPK_SLICE * TOPK_SLICE / count.max(1)
                )));
            }
        }
        Kernel::Draw { width, among, .. } => {
            let fits = match among {
                Among::Candidates => width == 2 * CANDIDATES,
                Among::Vocabulary => width >= 1,
            };
            if !fits {
                return Err(cuda_err(format!("a draw {among:?} from rows of {width} (a top-{CANDIDATES}'s, or logits)")));
            }
        }
        Kernel::Embed { .. }
        | Kernel::Scale { .. }
        | Kernel::MatMul { .. }
        | Kernel::MatMulArgmax { .. }
        | Kernel::Add { .. }
        | Kernel::Mul { .. }
        | Kernel::Gelu { .. }
        | Kernel::GeluMul { .. }
        | Kernel::Silu { .. }
        | Kernel::SiluMul { .. }
        | Kernel::SoftCap { .. }
        | Kernel::LastRow { .. }
        | Kernel::Argmax { .. } => {}
    }
    Ok(())
}

/// Widest row the norm kernels take (`NORM_PER * NORM_THREADS` in ops.cu).
const NORM_MAX: usize = 8192;
/// Threads of a norm block for rows of `width` (at most `NORM_THREADS` in ops.cu).
fn norm_threads(width: usize) -> u32 {
    width.next_multiple_of(32).min(512) as u32
}

/// A norm of a matrix-vector launch's products computed by its last block (or, in a `Prologue`, of
/// its input by every block): a plan `RmsNorm` step over whole rows without residual, or a
/// post-norm with its residual add and the next pre-norm (two steps; in a `Prologue` the first may
/// be a residual `Add` instead, see `fuse_at`).
#[derive(Clone, Copy, Debug)]
enum Epilogue {
    /// One norm step.
    Norm(usize),
    /// A norm pair's two steps.
    Pair(usize, usize),
}

impl Epilogue {
    /// The plan steps of the norm (pair), in order.
    fn steps(self) -> Vec<usize> {
        match self {
            Epilogue::Norm(t) => vec![t],
            Epilogue::Pair(a, b) => vec![a, b],
        }
    }
}

/// A norm (pair) computed at the start of a matrix-vector launch from its unnormalised input (see
/// `prologue_for`).
#[derive(Clone, Copy, Debug)]
struct Prologue {
    /// The norm step or pair.
    norm: Epilogue,
    /// Whether the norm's output is also stored as f32 (a later step reads it).
    write_y: bool,
    /// Whether the norm's input is read from the private row (`CudaExecutable::rows`, row 0),
    /// where the launch before writes its products instead of their slot.
    x_private: bool,
    /// The mirror row (1 + index) holding the residual, if it is read from there.
    res_in: Option<usize>,
    /// The mirror row (1 + index) that block 0 copies the residual stream after the norm into: h
    /// of a pair, the input of a single norm.
    h_out: usize,
}

/// Rows the norm prologues use besides the arena (the blocks of a launch read their inputs while
/// other blocks write its outputs, which may reuse the inputs' words): the products of the launch
/// before, and two mirrors of the residual stream, written alternately.
const PRIVATE_ROWS: usize = 3;

/// Rows from which a one-row product is a vocabulary-sized head (see `prologue_for`).
const HEAD_ROWS: usize = 32768;
/// Widest row a matrix-vector launch normalises in every block (`Op::MatVecs::pro`): each block
/// re-reads the row and its residual, which at wider (12B) shapes costs more than the epilogue's
/// tail.
const PROLOGUE_MAX: usize = 4 * NORM_VECS * 32 * MATVEC_WARPS;

/// Dynamic shared memory a norm prologue adds to a matrix-vector block (the quantized row).
pub(crate) const PROLOGUE_SHARED: u32 = (PROLOGUE_MAX * 5 / 2) as u32;

/// One launch of an executable: a plan step, or consecutive steps fused into one kernel (decided
/// once, when the plan is prepared, where the steps' slots allow it).
#[derive(Debug)]
enum Op {
    /// One plan step.
    Step(usize),
    /// Consecutive matmuls of one format sharing their input (q/k/v, gate/up), and with `glu`
    /// the gated product of the two that follows (`GeluMul` or `SiluMul`, `Glu`): one
    /// matrix-vector launch for few rows. `biases` (one per matmul): the `AddBias` step right
    /// after it, in one-row launches that stream their weights (Qwen 2's q/k/v; no `epi` or
    /// `pro` then), whose output the launch writes its products plus the bias to. With `epi`
    /// (one matrix) the norm (pair) of its products that follows is computed by its last block.
    /// With `pro` (one activation row), the norm (pair) before the group, whose output is the
    /// group's input, is computed by every block of the launch first (no norm kernel).
    MatVecs { steps: Vec<usize>, biases: Vec<Option<usize>>, glu: Option<usize>, epi: Option<Epilogue>, pro: Option<Prologue> },
    /// A post-norm with its residual add, then the next pre-norm of its output.
    NormPair { first: usize, second: usize },
    /// The per-head q and k norms and their RoPE.
    QkNormRope([usize; 4]),
    /// The q and k steps before the attention step that follows them (see `QkSteps`) computed by
    /// that attention, for one new row.
    QkAttention { qk: QkSteps, att: usize },
}

/// The steps between the q/k projections and attention that one-row attention applies itself
/// (`Op::QkAttention`): the per-head q and k norms, if any, then the q and k RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct QkSteps {
    /// The q and k norms.
    norms: Option<[usize; 2]>,
    /// The q and k RoPE (`Rope` or `RopeScaled`).
    ropes: [usize; 2],
}

impl QkSteps {
    /// The plan steps, in order.
    fn steps(self) -> impl Iterator<Item = usize> {
        self.norms.into_iter().flatten().chain(self.ropes)
    }
}

/// The angles of a RoPE at one position (a table `set_inputs` computes once per step): base,
/// frequency scale, per-frequency divisors and head size (`RopeSpec` less its pairing).
#[derive(Clone, Debug, PartialEq)]
struct RopeTable {
    theta: f32,
    scale: f32,
    factors: Option<Vec<f32>>,
    head_dim: usize,
}

/// The angle table of a RoPE step and whether it pairs adjacent elements (2i with 2i + 1; else
/// NeoX: i with i + d / 2), if it is one.
fn rope_table(kernel: &Kernel) -> Option<(RopeTable, bool)> {
    match *kernel {
        Kernel::Rope { theta, head_dim, .. } => Some((RopeTable { theta, scale: 1.0, factors: None, head_dim }, false)),
        Kernel::RopeScaled { head_dim, ref spec, .. } => Some((
            RopeTable { theta: spec.theta, scale: spec.freq_scale, factors: spec.freq_factors.clone(), head_dim },
            spec.mode == RopeMode::Norm,
        )),
        _ => None,
    }
}

/// A launch and how its matrix-vector input and output are quantized.
#[derive(Debug)]
struct Launch {
    op: Op,
    /// The quantized-activation buffer this launch also writes its output to (the next launch's
    /// matrix-vector input).
    quant_out: Option<usize>,
    /// For a matrix-vector launch: the buffer holding its input already quantized (none: a
    /// quantize kernel runs first, into buffer 0).
    xq_in: Option<usize>,
    /// For a one-matrix matrix-vector launch: its products go to the private row 0 instead of
    /// their slot (the next launch's norm prologue is their only reader).
    private_out: bool,
}

/// What the lowering needs to know of the weights (their device copies or, in tests, the file).
trait WeightShapes {
    /// The block format of a matrix.
    fn matrix_ty(&self, w: WeightId) -> Result<GgmlType, RuntimeError>;
    /// The length of a vector kept as f32.
    fn vector_len(&self, w: WeightId) -> Result<usize, RuntimeError>;
}

impl WeightShapes for CudaWeights {
    fn matrix_ty(&self, w: WeightId) -> Result<GgmlType, RuntimeError> {
        Ok(self.matrix(w)?.ty)
    }

    fn vector_len(&self, w: WeightId) -> Result<usize, RuntimeError> {
        Ok(self.vector(w)?.bytes() / 4)
    }
}

/// Whether two slots share a word.
fn overlaps(a: Slot, b: Slot) -> bool {
    a.offset < b.offset + b.len && b.offset < a.offset + a.len
}

/// Whether one kernel may write `writes` while reading `reads`: the writes are pairwise disjoint,
/// and each write is disjoint from each read or starts at the same word as a read that the kernel
/// indexes the same way (listed in `same`, by write and read position).
fn fusable(writes: &[Slot], reads: &[Slot], same: &[(usize, usize)]) -> bool {
    let disjoint = writes.iter().enumerate().all(|(i, a)| writes[i + 1..].iter().all(|b| !overlaps(*a, *b)));
    disjoint
        && writes
            .iter()
            .enumerate()
            .all(|(wi, w)| reads.iter().enumerate().all(|(ri, r)| !overlaps(*w, *r) || (w.offset == r.offset && same.contains(&(wi, ri)))))
}

/// The launches of `plan` on a device of `arch`: fused groups where the pattern and the slots
/// allow, else single steps; then, in plans whose products all take the matrix-vector kernels,
/// norms of matrix-vector products computed in that launch, and producers of matrix-vector inputs
/// writing them quantized.
fn lower(plan: &Plan, weights: &dyn WeightShapes, arch: (i32, i32)) -> Result<Vec<Launch>, RuntimeError> {
    let steps = &plan.steps;
    let mut ops = Vec::with_capacity(steps.len());
    let mut i = 0;
    while i < steps.len() {
        let (op, used) = fuse_at(plan, i, weights, plan.rows() == 1 && arch.0 >= 9)?.unwrap_or((Op::Step(i), 1));
        ops.push(op);
        i += used;
    }
    let small = products_take_matvec(plan, weights, plan.rows(), arch)?;
    // Matrix products as matrix-vector launches; in one-row plans, norms before them computed in
    // them.
    if small {
        let mut out: Vec<Op> = Vec::with_capacity(ops.len());
        // The slot whose values each residual mirror row holds.
        let mut mirror: [Option<Slot>; 2] = [None, None];
        for op in ops {
            let op = match op {
                Op::Step(t) if matches!(steps[t].kernel, Kernel::MatMul { .. }) => {
                    Op::MatVecs { steps: vec![t], biases: vec![None], glu: None, epi: None, pro: None }
                }
                op => op,
            };
            let producer = out.len().checked_sub(2).map(|i| &out[i]);
            let pro = match out.last() {
                Some(norm) => prologue_for(plan, weights, producer, norm, &op, &mirror, arch.0 >= 9)?,
                None => None,
            };
            let writes = op_writes(plan, &op);
            for m in &mut mirror {
                if m.is_some_and(|s| writes.iter().any(|w| overlaps(*w, s))) {
                    *m = None;
                }
            }
            match (pro, op) {
                (Some(p), Op::MatVecs { steps: group, biases, glu, epi, .. }) => {
                    // The norm launch is replaced by the prologue.
                    out.pop();
                    mirror[p.h_out - 1] = match p.norm {
                        Epilogue::Pair(a, _) => Some(steps[a].kernel.out()),
                        Epilogue::Norm(t) => steps[t].kernel.reads().first().copied(),
                    };
                    out.push(Op::MatVecs { steps: group, biases, glu, epi, pro: Some(p) });
                }
                (_, op) => out.push(op),
            }
        }
        ops = out;
    }
    // Norms reading a matrix-vector launch's products into that launch.
    if small {
        let mut out: Vec<Op> = Vec::with_capacity(ops.len());
        for op in ops {
            if let Some(Op::MatVecs { steps: group, biases, glu: None, epi: epi @ None, pro: None }) = out.last_mut() {
                if let Some(e) = epilogue_for(plan, weights, group, biases, &op)? {
                    *epi = Some(e);
                    continue;
                }
            }
            out.push(op);
        }
        ops = out;
    }
    if plan.rows() == 1 {
        let mut out: Vec<Op> = Vec::with_capacity(ops.len());
        // The RoPE tables (at most ROPE_TABLES) of the fused attentions.
        let mut tables: Vec<RopeTable> = Vec::new();
        for op in ops {
            if let Op::Step(att) = op {
                let mut fused = None;
                for (qk, taken) in qk_before(&out) {
                    if qk_attention_applies(plan, weights, qk, att)? {
                        fused = Some((qk, taken));
                        break;
                    }
                }
                if let Some((qk, taken)) = fused {
                    let table = rope_table(&steps[qk.ropes[0]].kernel).map(|t| t.0);
                    if let Some(t) = table.filter(|t| tables.contains(t) || tables.len() < ROPE_TABLES) {
                        if !tables.contains(&t) {
                            tables.push(t);
                        }
                        out.truncate(out.len() - taken);
                        out.push(Op::QkAttention { qk, att });
                        continue;
                    }
                }
            }
            out.push(op);
        }
        ops = out;
    }
    let mut launches: Vec<Launch> = ops.into_iter().map(|op| Launch { op, quant_out: None, xq_in: None, private_out: false }).collect();
    for i in 1..launches.len() {
        if let Op::MatVecs { pro: Some(Prologue { x_private: true, .. }), .. } = launches[i].op {
            launches[i - 1].private_out = true;
        }
    }
    if small {
        let max_k = max_matmul_k(plan);
        // Which slot's values each quantized buffer holds, launch by launch.
        let mut held: [Option<Slot>; 2] = [None, None];
        for l in &mut launches {
            let pro = match l.op {
                Op::MatVecs { pro: Some(p), .. } => Some(p),
                _ => None,
            };
            if pro.is_some() {
                // (Its input is computed in the launch.)
            } else if let Some(x) = matvec_input(plan, &l.op) {
                // A GeluMul launch writes buffer 1 while reading its input: never from buffer 1.
                let glu = matches!(l.op, Op::MatVecs { glu: Some(_), .. });
                l.xq_in = (0..2).find(|&b| held[b] == Some(x) && !(glu && b == 1));
                if l.xq_in.is_none() {
                    held[0] = Some(x);
                }
            }
            let written = op_writes(plan, &l.op);
            for h in &mut held {
                if h.is_some_and(|s| written.iter().any(|w| overlaps(*w, s))) {
                    *h = None;
                }
            }
            if let Some(Prologue { norm: Epilogue::Norm(t) | Epilogue::Pair(_, t), .. }) = pro {
                // The launch's block 0 writes the norm's output quantized into buffer 0.
                held[0] = out_of(&steps[t].kernel);
            }
            let produced = match l.op {
                Op::NormPair { second, .. } => Some((out_of(&steps[second].kernel), 0)),
                Op::Step(t) | Op::QkAttention { att: t, .. } => match steps[t].kernel {
                    Kernel::RmsNorm { weight, width, out, .. } if weights.vector_len(weight)? == width => Some((Some(out), 0)),
                    ref k => attention_of(k).map(|a| (Some(a.out), 0)),
                },
                Op::MatVecs { glu: Some(g), ref steps, .. } => match plan.steps[steps[0]].kernel {
                    // (Unless the launch would stream its weights without the quantization; the
                    // multiprocessor count only sizes a streamed grid, so 1 serves.)
                    Kernel::MatMul { n, k, w, .. }
                        if n.is_multiple_of(32)
                            && n <= GLU_QUANT_MAX
                            && streamed(weights.matrix_ty(w)?, k, &[n, n], true, plan.rows() == 1 && pro.is_none(), arch, 1).is_none() =>
                    {
                        Some((out_of(&plan.steps[g].kernel), 1))
                    }
                    _ => None,
                },
                Op::MatVecs { epi: Some(Epilogue::Norm(t) | Epilogue::Pair(_, t)), .. } => Some((out_of(&steps[t].kernel), 0)),
                _ => None,
            };
            // (The buffers hold rows of the widest matrix input.)
            if let Some((Some(out), b)) = produced.filter(|_| launch_width(plan, &l.op) <= max_k) {
                l.quant_out = Some(b);
                held[b] = Some(out);
            }
        }
    }
    Ok(launches)
}

/// The widest matrix input of a plan (at least 32).
fn max_matmul_k(plan: &Plan) -> usize {
    plan.steps
        .iter()
        .filter_map(|st| match st.kernel {
            Kernel::MatMul { k, .. } | Kernel::MatMulArgmax { k, .. } => Some(k),
            _ => None,
        })
        .fold(32, usize::max)
}

/// Whether the decode steps of `plan` whose products do not all take the matrix-vector kernels
/// can be captured: each product takes them or `mmq` (no cuBLAS, whose scratch grows), so the
/// only scratch they need is the quantized activations of at most `plan.rows()` rows.
fn capturable_mmq(plan: &Plan, weights: &dyn WeightShapes, arch: (i32, i32)) -> Result<bool, RuntimeError> {
    let rows = plan.rows();
    if !matches!(plan.bucket, Bucket::Decode { .. }) || products_take_matvec(plan, weights, rows, arch)? {
        return Ok(false);
    }
    for st in &plan.steps {
        if let Kernel::MatMul { w, k, .. } | Kernel::MatMulArgmax { w, k, .. } = st.kernel {
            let ty = weights.matrix_ty(w)?;
            if !takes_matvec(ty, k, rows, arch) && !takes_mmq(ty, k, arch) {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

/// Elements per row of the value a producer launch may quantize.
fn launch_width(plan: &Plan, op: &Op) -> usize {
    let last = match op {
        Op::Step(t) | Op::QkAttention { att: t, .. } => *t,
        Op::NormPair { second, .. } => *second,
        Op::MatVecs { glu: Some(g), .. } => *g,
        Op::MatVecs { epi: Some(Epilogue::Norm(t) | Epilogue::Pair(_, t)), .. } => *t,
        _ => return usize::MAX,
    };
    let k = &plan.steps[last].kernel;
    match *k {
        Kernel::RmsNorm { width, .. } | Kernel::GeluMul { width, .. } | Kernel::SiluMul { width, .. } => width,
        _ => attention_of(k).map_or(usize::MAX, |a| a.q_heads * a.head_dim),
    }
}

/// The arena slots a launch writes (a matrix-vector launch's biased products also their own slots,
/// which its per-step fallback writes).
fn op_writes(plan: &Plan, op: &Op) -> Vec<Slot> {
    let s = &plan.steps;
    let idx: Vec<usize> = match op {
        Op::Step(t) => vec![*t],
        Op::MatVecs { steps, biases, glu, epi, pro } => {
            let norms = (*epi).into_iter().chain(pro.map(|p| p.norm)).flat_map(Epilogue::steps);
            steps.iter().chain(biases.iter().flatten()).chain(glu).copied().chain(norms).collect()
        }
        Op::NormPair { first, second } => vec![*first, *second],
        Op::QkNormRope(q) => q.to_vec(),
        Op::QkAttention { qk, att } => qk.steps().chain([*att]).collect(),
    };
    idx.iter().map(|&t| s[t].kernel.out()).collect()
}

/// The output slot of a norm, attention or gated product (`GeluMul`, `SiluMul`) kernel.
fn out_of(k: &Kernel) -> Option<Slot> {
    match *k {
        Kernel::RmsNorm { out, .. } => Some(out),
        _ => attention_of(k).map(|a| a.out).or_else(|| glu_of(k).map(|g| g.3)),
    }
}

/// The input slot of a matrix-vector launch that reads quantized activations from a buffer.
fn matvec_input(plan: &Plan, op: &Op) -> Option<Slot> {
    match op {
        Op::MatVecs { steps, .. } => match plan.steps[steps[0]].kernel {
            Kernel::MatMul { x, .. } => Some(x),
            _ => None,
        },
        Op::Step(t) => match plan.steps[*t].kernel {
            Kernel::MatMul { x, .. } | Kernel::MatMulArgmax { x, .. } => Some(x),
            _ => None,
        },
        _ => None,
    }
}

/// What a matrix-vector launch computes, as far as its geometry depends on it.
#[derive(Clone, Copy, Debug)]
struct MatVecShape {
    /// Activation rows.
    rows: usize,
    /// Output rows of all its matrices together.
    total: usize,
    /// Output rows of its first matrix (of each, with glu).
    n: usize,
    /// Row width (columns) of the matrices.
    k: usize,
    /// Gate/up pair with the GELU product (half of a warp's rows from each matrix).
    glu: bool,
    /// With the norm prologue.
    prologue: bool,
}

/// How a matrix-vector launch runs: its kernel family (`matvec`, `matvec1`, `matvec4`,
/// `matvec4p`), output rows per warp, warps per group of rows, and blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MatVecGeometry {
    kernel: &'static str,
    per_warp: usize,
    split: usize,
    blocks: usize,
}

impl MatVecShape {
    /// The launch geometry on a device of `sms` multiprocessors.
    fn geometry(&self, sms: usize) -> MatVecGeometry {
        let (kernel, per_warp) = match self.rows {
            1 if self.total >= MATVEC4_MIN_ROWS && self.prologue => ("matvec4p", 4),
            1 if self.total >= MATVEC4_MIN_ROWS => ("matvec4", 4),
            1 => ("matvec1", 2),
            _ => ("matvec", 2),
        };
        let groups = if self.glu { self.n.div_ceil(per_warp / 2) } else { self.total.div_ceil(per_warp) };
        // Long rows are split over 2 or 4 warps (more loads in flight per output row), unless
        // there are rows enough for two rounds of the warps the device holds at once (16 per
        // multiprocessor), or rows of at most 4 chunks per lane and groups for 7 warps per
        // multiprocessor: then each warp walks whole rows (measured on an H200 at 12B shapes: the
        // q/k/v and output projections 1.5 µs faster so, the 2048-row v projection and the long
        // down projection rows slower).
        let split = match self.k / 32 {
            _ if groups >= 2 * MATVEC_WARPS_PER_SM * sms => 1,
            c if c <= 128 && groups >= 7 * sms => 1,
            c if c >= 128 => 4,
            c if c >= 64 => 2,
            _ => 1,
        };
        // Launches of many rounds of groups (a greedy head) are persistent: as many blocks as
        // the device holds at once, each warp taking group after group.
        let mut blocks = groups.div_ceil(MATVEC_WARPS / split);
        if kernel == "matvec4" && groups >= PERSISTENT_ROUNDS * MATVEC_WARPS_PER_SM * sms {
            blocks = blocks.min(MATVEC4_BLOCKS_PER_SM * sms);
        }
        MatVecGeometry { kernel, per_warp, split, blocks }
    }
}

/// The norm epilogue of the matrix-vector group `group` (with its `biases`) for the launch `next`
/// after it (a norm or norm pair of the group's one product), if it applies.
fn epilogue_for(
    plan: &Plan,
    weights: &dyn WeightShapes,
    group: &[usize],
    biases: &[Option<usize>],
    next: &Op,
) -> Result<Option<Epilogue>, RuntimeError> {
    let steps = &plan.steps;
    let &[m] = group else { return Ok(None) };
    if biased(biases) {
        return Ok(None);
    }
    let Kernel::MatMul { out: prod, n, .. } = steps[m].kernel else { return Ok(None) };
    let same = |a: Slot, b: Slot| !overlaps(a, b) || a.offset == b.offset;
    let (e, first) = match *next {
        // The pair's slots passed `fusable` when the pair was fused.
        Op::NormPair { first, second } => (Epilogue::Pair(first, second), first),
        Op::Step(t) => match steps[t].kernel {
            Kernel::RmsNorm { x, weight, out, width, residual: None, .. } if weights.vector_len(weight)? == width && same(out, x) => {
                (Epilogue::Norm(t), t)
            }
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let Kernel::RmsNorm { x, width, .. } = steps[first].kernel else { return Ok(None) };
    // The epilogue reads and writes rows as 16-byte vectors, 128 elements per warp.
    let aligned = op_writes(plan, next).iter().chain(&steps[first].kernel.reads()).all(|s| s.offset.is_multiple_of(4));
    let ok = x == prod && width == n && n.is_multiple_of(128) && n <= EPILOGUE_MAX && aligned && steps[first].rows == steps[m].rows;
    Ok(ok.then_some(e))
}

/// Widest key row (key heads x head size) whose attention takes the q/k norms and RoPE in (every
/// Gemma 3 shape; measured on an H200: a synthetic 12B decode step, key rows of 2048, 5% faster
/// fused since the gate/up rows are quantized by their own launch (3% slower before); the 270M,
/// 256, 17% faster together with the norm prologues).
const FUSED_QK_MAX_KV: usize = 2048;

/// RoPE tables the step's `set_inputs` computes (`n_rope` in ops.cu).
const ROPE_TABLES: usize = 2;

/// The q/k steps that may end the launches `out` (an attention step following them), each with the
/// count of launches it takes: fused q/k norms and RoPE (`Op::QkNormRope`); two norm steps and two
/// RoPE steps; two RoPE steps (`qk_attention_applies` decides which, if any, apply).
fn qk_before(out: &[Op]) -> Vec<(QkSteps, usize)> {
    let mut found = Vec::new();
    let step = |back: usize| match out.len().checked_sub(back).map(|i| &out[i]) {
        Some(&Op::Step(t)) => Some(t),
        _ => None,
    };
    if let Some(&Op::QkNormRope([a, b, c, d])) = out.last() {
        found.push((QkSteps { norms: Some([a, b]), ropes: [c, d] }, 1));
    }
    if let (Some(c), Some(d)) = (step(2), step(1)) {
        if let (Some(a), Some(b)) = (step(4), step(3)) {
            found.push((QkSteps { norms: Some([a, b]), ropes: [c, d] }, 4));
        }
        found.push((QkSteps { norms: None, ropes: [c, d] }, 2));
    }
    found
}

/// Whether the q/k steps `qk` can run inside the attention step `att` after them: a one-row plan
/// whose positions are the step's, RoPE of one spec on q and k (any `RopeSpec`: its angles come
/// from a table) after per-head norms of one epsilon (if any: RMS norms of each head without
/// residual), attention reading the rotated q and k of heads a multiple of 64 wide, key rows of at
/// most `FUSED_QK_MAX_KV`, nothing else reading the normed or rotated values (the fused kernel does
/// not store them), and the attention output disjoint from q, k and v (its blocks write it while
/// others read them).
fn qk_attention_applies(plan: &Plan, weights: &dyn WeightShapes, qk: QkSteps, att: usize) -> Result<bool, RuntimeError> {
    let s = &plan.steps;
    let [rq, rk] = qk.ropes;
    let (Some((table, adjacent)), Some((table_k, adjacent_k))) = (rope_table(&s[rq].kernel), rope_table(&s[rk].kernel)) else {
        return Ok(false);
    };
    let (
        &(Kernel::Rope { x: q, positions, out: qr, heads: qh, head_dim, .. }
        | Kernel::RopeScaled { x: q, positions, out: qr, heads: qh, head_dim, .. }),
        &(Kernel::Rope { x: k, positions: pk, out: kr, heads: kh, .. }
        | Kernel::RopeScaled { x: k, positions: pk, out: kr, heads: kh, .. }),
        &Kernel::Attention { q: aq, k: ak, v, out, head_dim: ad, q_heads, kv_heads, .. },
    ) = (&s[rq].kernel, &s[rk].kernel, &s[att].kernel)
    else {
        return Ok(false);
    };
    // The raw q and k the attention reads, and the steps' outputs nothing else may read.
    let (mut raw, mut outs) = ([q, k], vec![qr, kr]);
    if let Some([nq, nk]) = qk.norms {
        let (
            &Kernel::RmsNorm { x: xq, weight: wq, out: qn, eps, residual: None, .. },
            &Kernel::RmsNorm { x: xk, weight: wk, out: kn, eps: eps_k, residual: None, .. },
        ) = (&s[nq].kernel, &s[nk].kernel)
        else {
            return Ok(false);
        };
        let per_head = |w| weights.vector_len(w).map(|n| n == head_dim);
        if qn != q || kn != k || eps != eps_k || !per_head(wq)? || !per_head(wk)? {
            return Ok(false);
        }
        (raw, outs) = ([xq, xk], vec![qn, kn, qr, kr]);
    }
    let first = qk.steps().next().unwrap_or(att);
    let except: Vec<usize> = qk.steps().chain([att]).collect();
    let read_elsewhere = outs.iter().any(|&w| read_later(plan, w, first, &except));
    let step_positions = plan.inputs.iter().any(|i| i.name == "positions" && i.slot == positions);
    Ok(plan.rows() == 1
        && step_positions
        && pk == positions
        && table == table_k
        && adjacent == adjacent_k
        && (qh, kh) == (q_heads, kv_heads)
        && aq == qr
        && ak == kr
        && ad == head_dim
        && head_dim.is_multiple_of(64)
        && kv_heads * head_dim <= FUSED_QK_MAX_KV
        && !read_elsewhere
        && [raw[0], raw[1], v].iter().all(|r| !overlaps(out, *r)))
}

/// The input, residual and width of the first step of a norm (pair) (`Epilogue`): an RMS norm, or
/// a residual add (x = b, residual a: see `fuse_at`).
fn norm_input(k: &Kernel) -> Option<(Slot, Option<Slot>, usize)> {
    match *k {
        Kernel::RmsNorm { x, residual, width, .. } => Some((x, residual, width)),
        Kernel::Add { a, b, width, .. } => Some((b, Some(a), width)),
        _ => None,
    }
}

/// Whether a later step (after `from`, not one of `except`, whose writes still count) reads values
/// of `slot` before they are overwritten, or the plan outputs them. (The arena reuses a slot's words only once its values
/// are dead, so the first later write to any of its words ends them.)
fn read_later(plan: &Plan, slot: Slot, from: usize, except: &[usize]) -> bool {
    for (j, st) in plan.steps.iter().enumerate().skip(from + 1) {
        if !except.contains(&j) && st.kernel.reads().iter().any(|r| overlaps(*r, slot)) {
            return true;
        }
        if overlaps(st.kernel.out(), slot) {
            return false;
        }
    }
    plan.outputs.iter().any(|o| overlaps(o.slot, slot))
}

/// The norm prologue of the matrix-vector group `m` for the launch `norm` before it (a norm of
/// whole rows without residual, or a norm pair, whose first step may be a residual add:
/// `fuse_at`), if it applies: a one-row plan, the group's input
/// being the norm's output, rows of at most `PROLOGUE_MAX` (a multiple of 128) elements at 16-byte
/// aligned slots. The launch's blocks run in any order, so nothing it writes may overlap what its
/// blocks read: an input whose words the launch's products reuse is read from a private row
/// instead (the products of `producer`, the launch before the norm, written there; the residual
/// from the mirror `mirror` says holds it). The norm's output is stored as f32 only if a later
/// step reads it. With `stream_heads` (sm_90 and later), a vocabulary-sized product takes none:
/// without it the launch streams its weights (the 270M's logits head, 178 MB: 68 µs in
/// `matvecr8_q8_0` against 142 µs in `matvec4p_q8_0` after its norm on an H100).
fn prologue_for(
    plan: &Plan,
    weights: &dyn WeightShapes,
    producer: Option<&Op>,
    norm: &Op,
    m: &Op,
    mirror: &[Option<Slot>; 2],
    stream_heads: bool,
) -> Result<Option<Prologue>, RuntimeError> {
    let s = &plan.steps;
    let Op::MatVecs { steps: group, biases, epi: None, pro: None, .. } = m else { return Ok(None) };
    if biased(biases) || (stream_heads && matches!(s[group[0]].kernel, Kernel::MatMul { n, .. } if n >= HEAD_ROWS)) {
        return Ok(None);
    }
    let (e, first, last) = match *norm {
        Op::NormPair { first, second } => (Epilogue::Pair(first, second), first, second),
        Op::Step(t) => match s[t].kernel {
            Kernel::RmsNorm { weight, width, residual: None, .. } if weights.vector_len(weight)? == width => (Epilogue::Norm(t), t, t),
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let (Some((x, residual, width)), &Kernel::RmsNorm { out: y, .. }, &Kernel::MatMul { x: mx, k, .. }) =
        (norm_input(&s[first].kernel), &s[last].kernel, &s[group[0]].kernel)
    else {
        return Ok(None);
    };
    if plan.rows() != 1 || mx != y || k != width || !width.is_multiple_of(128) || width > PROLOGUE_MAX || s[first].rows != s[group[0]].rows
    {
        return Ok(None);
    }
    let (norm_writes, m_writes) = (op_writes(plan, norm), op_writes(plan, m));
    let clash = |a: Slot| m_writes.iter().any(|w| overlaps(*w, a));
    // x from the private row: its producer is a plain one-matrix launch and the norm its only reader.
    let x_private = clash(x)
        && match producer {
            Some(Op::MatVecs { steps: p, glu: None, epi: None, .. }) if p.len() == 1 => {
                matches!(s[p[0]].kernel, Kernel::MatMul { out, .. } if out == x) && !read_later(plan, x, p[0], &[first])
            }
            _ => false,
        };
    // (The residual is loaded before waiting for the launch before: it must not write it.)
    if residual.is_some_and(|r| producer.is_some_and(|p| op_writes(plan, p).iter().any(|w| overlaps(*w, r)))) {
        return Ok(None);
    }
    let res_in = match residual {
        Some(r) if clash(r) => match mirror.iter().position(|h| *h == Some(r)) {
            Some(i) => Some(i + 1),
            None => return Ok(None),
        },
        _ => None,
    };
    if clash(x) && !x_private {
        return Ok(None);
    }
    let arena_reads: Vec<Slot> = [(!x_private).then_some(x), residual.filter(|_| res_in.is_none())].into_iter().flatten().collect();
    let write_y = read_later(plan, y, last, group);
    let aligned = [x].iter().chain(&residual).chain(&norm_writes).all(|s| s.offset.is_multiple_of(4));
    // Block 0 writes h (of a pair) and y (if read later) to their slots.
    let h = matches!(e, Epilogue::Pair(..)).then(|| s[first].kernel.out());
    let ok = aligned && h.is_none_or(|h| !clash(h)) && (!write_y || (!clash(y) && arena_reads.iter().all(|r| !overlaps(y, *r))));
    let h_out = if res_in == Some(1) { 2 } else { 1 };
    Ok(ok.then_some(Prologue { norm: e, write_y, x_private, res_in, h_out }))
}

/// Whether a matrix-vector group adds biases (`Op::MatVecs::biases`): then its launch streams its
/// weights, which only the `matvecr` kernels do, and they take no norm prologue or epilogue.
fn biased(biases: &[Option<usize>]) -> bool {
    biases.iter().any(Option::is_some)
}

/// The `AddBias` step right after the matmul step `m` that its matrix-vector launch can add
/// itself (`Op::MatVecs::biases`): one over the product's rows and width with a bias of that
/// width, the product read by nothing after it (the launch stores only the sum).
fn bias_after(plan: &Plan, weights: &dyn WeightShapes, m: usize) -> Result<Option<usize>, RuntimeError> {
    let s = &plan.steps;
    let (Kernel::MatMul { out, n, .. }, Some(&Step { kernel: Kernel::AddBias { x, bias, width, .. }, rows })) =
        (&s[m].kernel, s.get(m + 1))
    else {
        return Ok(None);
    };
    let ok = rows == s[m].rows && x == *out && width == *n && weights.vector_len(bias)? == width && !read_later(plan, *out, m + 1, &[]);
    Ok(ok.then_some(m + 1))
}

/// A fused launch starting at step `i` and how many steps it covers, if one applies. With
/// `biases` (one-row plans on sm_90 and later, whose products always take the matrix-vector
/// kernels) a matmul's `AddBias` step after it joins its launch (`bias_after`) where the launch
/// streams its weights: only the `matvecr` kernels add biases (in the other matrix-vector kernels
/// the bias stores slowed the launches without biases: the 270M's decode by 1.3-3.6% on an H100).
fn fuse_at(plan: &Plan, i: usize, weights: &dyn WeightShapes, biases: bool) -> Result<Option<(Op, usize)>, RuntimeError> {
    let steps = &plan.steps;
    let at = |j: usize| steps.get(j).filter(|s| s.rows == steps[i].rows).map(|s| &s.kernel);
    match steps[i].kernel {
        Kernel::MatMul { x, w, k, .. } => {
            let ty = weights.matrix_ty(w)?;
            // The matmuls, their bias steps, the slots the launch writes, the steps it covers.
            let (mut group, mut bias, mut outs, mut used) = (vec![], vec![], vec![], 0);
            while group.len() < 3 {
                match at(i + used) {
                    Some(&Kernel::MatMul { x: x2, w: w2, out, .. }) if x2 == x && weights.matrix_ty(w2)? == ty => {
                        let b = if biases { bias_after(plan, weights, i + used)? } else { None };
                        group.push(i + used);
                        bias.push(b);
                        outs.push(b.map_or(out, |b| steps[b].kernel.out()));
                        used += 1 + b.iter().count();
                    }
                    _ => break,
                }
            }
            if biased(&bias) {
                let rows_of: Vec<usize> =
                    group.iter().map(|&m| if let Kernel::MatMul { n, .. } = steps[m].kernel { n } else { 0 }).collect();
                if ring_geometry(ty, k, &rows_of, false, 1).is_none() {
                    return fuse_at(plan, i, weights, false);
                }
            }
            if let ((2, 2), Some((_, gate, up, out, _))) = ((group.len(), used), at(i + 2).and_then(glu_of)) {
                // The matrix-vector kernel reads x quantized (a copy); cuBLAS runs the steps in order.
                if gate == outs[0] && up == outs[1] && fusable(&[outs[0], outs[1], out], &[], &[]) {
                    return Ok(Some((Op::MatVecs { steps: group, biases: bias, glu: Some(i + 2), epi: None, pro: None }, 3)));
                }
            }
            // (Several matmuls, or one with its bias.)
            if used > 1 && fusable(&outs, &[x], &[]) {
                return Ok(Some((Op::MatVecs { steps: group, biases: bias, glu: None, epi: None, pro: None }, used)));
            }
        }
        Kernel::RmsNorm { x, weight, out: h, width, eps, residual: Some(r) } => {
            if let Some(&Kernel::RmsNorm { x: x2, weight: w2, out, width: width2, eps: eps2, residual: None }) = at(i + 1) {
                let whole = |w| weights.vector_len(w).map(|v| v == width);
                if x2 == h && width2 == width && eps2 == eps && width <= NORM_MAX && whole(weight)? && whole(w2)? {
                    // The output may reuse x's or the residual's words (one block per row reads its row first).
                    if fusable(&[h, out], &[x, r], &[(1, 0), (1, 1)]) {
                        return Ok(Some((Op::NormPair { first: i, second: i + 1 }, 2)));
                    }
                }
            }
        }
        Kernel::Add { a: r, b: x, out: h, width } => {
            // Llama's and Qwen's `h = r + x; y = rmsnorm(h) * w`: a norm pair whose first norm is
            // none (rms_norm2 without w1; its float4 path only: whole 128-element warps, aligned
            // rows). One block per row reads its row before writing, so h and y may reuse x's or
            // r's words.
            if let Some(&Kernel::RmsNorm { x: x2, weight: w2, out, width: width2, residual: None, .. }) = at(i + 1) {
                let aligned = [r, x, h, out].iter().all(|s| s.offset.is_multiple_of(4));
                if x2 == h
                    && width2 == width
                    && width <= NORM_MAX
                    && width.is_multiple_of(128)
                    && aligned
                    && weights.vector_len(w2)? == width
                    && fusable(&[h, out], &[x, r], &[(0, 0), (0, 1), (1, 0), (1, 1)])
                {
                    return Ok(Some((Op::NormPair { first: i, second: i + 1 }, 2)));
                }
            }
        }
        Kernel::RmsNorm { x: q, weight: wq, out: qn, residual: None, eps, .. } => {
            if let (
                Some(&Kernel::RmsNorm { x: k, weight: wk, out: kn, residual: None, eps: eps2, .. }),
                Some(&Kernel::Rope { x: rq, positions, out: qr, head_dim, theta, .. }),
                Some(&Kernel::Rope { x: rk, positions: p2, out: kr, head_dim: d2, theta: t2, .. }),
            ) = (at(i + 1), at(i + 2), at(i + 3))
            {
                let group = |w| weights.vector_len(w).map(|v| v == head_dim);
                if rq == qn && rk == kn && positions == p2 && head_dim == d2 && theta == t2 && eps == eps2
                    && head_dim.is_multiple_of(2) && head_dim <= 2048 && group(wq)? && group(wk)?
                    // qr may reuse q's words and kr k's (a block reads its head first).
                    && fusable(&[qn, kn, qr, kr], &[q, k, positions], &[(2, 0), (3, 1)])
                {
                    return Ok(Some((Op::QkNormRope([i, i + 1, i + 2, i + 3]), 4)));
                }
            }
        }
        _ => {}
    }
    Ok(None)
}

/// A captured decode step of `rows` sequences. It reads the caches' addresses and the positions
/// from the step buffer, so it replays for any sessions of the model, but bakes in the launches'
/// grids (the row count), the ring sizes of sliding layers, which depend on the caches' context,
/// and the attention kernels of the caches' element type.
struct CapturedStep {
    rows: usize,
    context: usize,
    kv: KvType,
    graph: CudaGraph,
}

// SAFETY: the graph is launched only by its executable, under the device lock.
unsafe impl Send for CapturedStep {}

/// Where things lie in an executable's step buffer (read by the kernels through `step_row`,
/// `step_token` and `step_last_row` in common.cuh): 32-bit words `[n, sequences, rows, 0]`, per row
/// `{position, sequence, its first row, the row after its last}`, the `rows` token ids, per
/// sequence its last row; then from byte `kv_at` (8-byte aligned), per layer and sequence, the key and value cache
/// addresses. Kernels read the caches' addresses from here, so a captured graph serves every
/// session's cache (before, a graph baked one cache's addresses in and was captured again
/// whenever another session stepped) and one step serves several sequences.
#[derive(Clone, Copy)]
struct StepLayout {
    rows: usize,
    seqs: usize,
    layers: usize,
}

impl StepLayout {
    /// Byte offset of the token ids.
    fn tokens_at(&self) -> usize {
        (4 + 4 * self.rows) * 4
    }

    /// Byte offset of the cache addresses.
    fn kv_at(&self) -> usize {
        ((4 + 5 * self.rows + self.seqs) * 4).next_multiple_of(8)
    }

    /// Byte offset of the sequences' draws (`DRAW_BYTES` each: the generator's state, then the
    /// temperature, top-k, top-p and min-p).
    fn draws_at(&self) -> usize {
        self.kv_at() + 16 * self.layers * self.seqs
    }

    /// Bytes of the buffer.
    fn bytes(&self) -> usize {
        self.draws_at() + DRAW_BYTES * self.seqs
    }

    /// Byte offset of layer `layer`'s cache addresses (sequence s: the pair at `16 s` from it).
    fn cache(&self, layer: usize) -> usize {
        self.kv_at() + 16 * self.seqs * layer
    }

    /// The buffer's words for `tokens` in consecutive runs of rows, one per sequence: segment
    /// `(cache, first, rows)` is `rows` rows at positions `first..` of `cache`; `draws`: the
    /// sequences' draws (none where the plan does not draw).
    fn words(&self, tokens: &[u32], segments: &[(&CudaKvCache, usize, usize)], draws: &[DrawSpec]) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.bytes() / 4);
        w.extend([tokens.len() as u32, segments.len() as u32, self.rows as u32, 0]);
        let mut first = 0;
        for (s, &(_, pos, rows)) in segments.iter().enumerate() {
            for r in 0..rows {
                w.extend([(pos + r) as u32, s as u32, first as u32, (first + rows) as u32]);
            }
            first += rows;
        }
        w.resize(self.tokens_at() / 4, 0);
        w.extend(tokens);
        w.resize(4 + 5 * self.rows, 0);
        let mut end = 0;
        for (_, _, rows) in segments {
            end += rows;
            w.push(end as u32 - 1);
        }
        w.resize(self.kv_at() / 4, 0);
        let mut table = vec![0u64; 2 * self.layers * self.seqs];
        for (s, (kv, _, _)) in segments.iter().enumerate() {
            for (l, layer) in kv.layers.iter().take(self.layers).enumerate() {
                table[2 * (l * self.seqs + s)] = layer.k.ptr();
                table[2 * (l * self.seqs + s) + 1] = layer.v.ptr();
            }
        }
        w.extend(table.iter().flat_map(|&p| [p as u32, (p >> 32) as u32]));
        for d in draws {
            w.extend(d.rng.0.iter().flat_map(|&s| [s as u32, (s >> 32) as u32]));
            w.extend([d.temperature.to_bits(), d.top_k, d.top_p.to_bits(), d.min_p.to_bits()]);
        }
        w.resize(self.bytes() / 4, 0);
        w
    }
}

/// A plan bound to the device's weights, with its own arena and step buffer.
pub struct CudaExecutable {
    plan: Arc<Plan>,
    weights: Arc<CudaWeights>,
    device: Arc<Device>,
    arena: DeviceBuffer,
    /// The step's tokens, rows, sequences and cache addresses (`StepLayout`), written before each
    /// step (one copy).
    step: DeviceBuffer,
    layout: StepLayout,
    /// Full products of greedy and top-k heads, the argmax partials, then the top-k partials (per
    /// executable: graphs bake them in).
    head: DeviceBuffer,
    head_values: usize,
    /// Vocabulary of the embedding (token ids are checked against it).
    vocab: usize,
    /// Captured steps, one per row count and context.
    graphs: Vec<CapturedStep>,
    use_graphs: bool,
    /// The scratch of captured steps whose products do not all take the matrix-vector kernels:
    /// decode plans whose products all take them or `mmq`, sized at creation (a graph keeps the
    /// addresses it was captured with).
    graph_scratch: Option<Scratch>,
    /// Most active rows for which every product takes the matrix-vector kernels.
    matvec_rows: usize,
    /// The launches, fused where possible.
    launches: Vec<Launch>,
    /// Two buffers of quantized matrix-vector inputs (`MATVEC_ROWS` rows of the widest input).
    xq: Vec<DeviceBuffer>,
    /// The private rows of the norm prologues (`PRIVATE_ROWS` rows of `PROLOGUE_MAX` floats).
    private: DeviceBuffer,
    /// The RoPE tables of the fused attentions, and their cosines and sines at the step's position
    /// (written by `set_inputs`; table i from pair `i * rope_stride` on).
    ropes: Vec<RopeTable>,
    rope: DeviceBuffer,
    rope_stride: usize,
    /// The RoPE frequency divisors of the plan's `RopeScaled` steps (`RopeSpec::freq_factors`),
    /// and each distinct vector's byte offset in `factors`.
    factors: DeviceBuffer,
    rope_factors: Vec<(Vec<f32>, u64)>,
    /// Zeroed counters and argmax slots of the fused kernels (each kernel leaves them zeroed):
    /// `MATVEC_ROWS * ARGMAX_SLOTS` keys, `MATVEC_ROWS` flags, the epilogue and argmax arrival
    /// counters, then the per-32-row counters of the quantized `GeluMul` outputs, then one
    /// arrival counter per (row, query head) of a split attention, then one per block of rows of
    /// a few-row `mmq` launch split over k.
    sync: DeviceBuffer,
    /// Byte offset of the attention counters in `sync`.
    sync_attention: u64,
    /// Byte offset of the `mmq` run counters in `sync` (they fill it to its end).
    sync_mmq: u64,
    /// The partial sums of few-row `mmq` launches split over k (`MMQ_RUN_SUMS` floats a block and
    /// run).
    mmq_parts: DeviceBuffer,
    /// The partial results of a split attention: per (row, query head) and share, `head_dim` sums,
    /// their maximum and their sum of weights.
    attention_parts: DeviceBuffer,
    /// Greedy decode steps run one ahead (`greedy_step`): the step launched ahead, if any (by the
    /// last greedy step), the cache of the last greedy step and its step count after it, and where
    /// the steps' tokens land on the host.
    ahead: Option<Ahead>,
    last_greedy: Option<(u64, u64)>,
    tokens_back: TokenSlots,
    /// Page-locked host memory the step's outputs are copied into (grown to the largest step's):
    /// a sampled step's logits arrive by one direct copy, not through the driver's staging.
    readback: Option<cudarc::driver::PinnedHostSlice<u32>>,
}

/// A greedy decode step launched before the host asked for it (`CudaExecutable::greedy_step`): it
/// processes the token the step before it chose (copied on the device into its step buffer) at
/// the length its cache had after that step (`CudaExecutable::last_greedy`: only steps and clears
/// change a cache's length, and each counts in `CudaKvCache::steps`); its token lands in `slot`.
struct Ahead {
    /// The token it processes (None: the step before's products were not finite, so it ran with
    /// token 0, set_inputs, and is never used).
    token: Option<u32>,
    /// The draw it makes (None: a greedy step).
    draw: Option<DrawSpec>,
    slot: usize,
}

/// Two page-locked host words that the greedy steps' tokens are copied to (a step and the one
/// launched ahead of it: a copy into pageable memory would wait for the whole stream), each with
/// the event recorded after its copy.
struct TokenSlots {
    words: *mut i32,
    events: [cudarc::driver::CudaEvent; 2],
}

// SAFETY: the words are only touched under the device lock, after their events.
unsafe impl Send for TokenSlots {}

impl TokenSlots {
    fn new(device: &Device) -> Result<Self, RuntimeError> {
        // SAFETY: two i32 words of page-locked memory, freed in Drop after the stream is idle.
        let words = unsafe { cudarc::driver::result::malloc_host(8, 0) }.map_err(cuda_err)? as *mut i32;
        let events = [device.ctx.new_event(None).map_err(cuda_err)?, device.ctx.new_event(None).map_err(cuda_err)?];
        Ok(TokenSlots { words, events })
    }
}

impl Drop for TokenSlots {
    fn drop(&mut self) {
        // (The executable synchronises the stream before its fields drop.)
        for e in &self.events {
            let _ = e.synchronize();
        }
        // SAFETY: allocated by malloc_host in `new`, freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.words as *mut std::ffi::c_void) };
    }
}

/// Byte offsets in `CudaExecutable::sync`.
const SYNC_FLAGS: u64 = (MATVEC_ROWS * ARGMAX_SLOTS * 8) as u64;
const SYNC_EPI: u64 = SYNC_FLAGS + 4 * MATVEC_ROWS as u64;
const SYNC_ARGMAX: u64 = SYNC_EPI + 4;
const SYNC_GLU: u64 = SYNC_ARGMAX + 4;

/// Bytes of one row of `k` quantized activations (`xq_bytes` in common.cuh).
fn xq_bytes(k: usize) -> usize {
    k * 5 / 2
}

/// Device addresses and constants of a norm epilogue (0: absent).
#[derive(Clone, Copy)]
struct EpilogueArgs {
    w1: u64,
    residual: u64,
    h: u64,
    /// A second copy of h (of the input for a single norm): a prologue's residual mirror.
    h2: u64,
    w2: u64,
    out: u64,
    xq: u64,
    eps: f32,
}

/// The device arguments of a norm pair (`CudaExecutable::pair_args`).
struct PairArgs {
    x: u64,
    /// The first norm's weights (0: none, the pair is a residual add and one norm).
    w1: u64,
    residual: u64,
    h: u64,
    w2: u64,
    out: u64,
    width: usize,
    eps: f32,
}

/// One matrix-vector launch: up to three matrices of one format (with their outputs and biases)
/// over `rows` rows of the quantized input `xq`; `glu`: the gated product (activation `act`) of two matrices
/// (quantized into `gq` too when not 0); `epi`: the norm of the products computed by the last block, or with `px`
/// (not 0) the norm of px computed first by every block, whose output is the launch's input;
/// `argmax` (not 0): only the argmax of each row is written there.
struct MatVecArgs<'a> {
    xq: u64,
    mats: &'a [MatVec],
    glu: u64,
    act: Glu,
    gq: u64,
    rows: usize,
    epi: Option<&'a EpilogueArgs>,
    argmax: u64,
    px: u64,
}

/// One matrix of a matrix-vector launch: its output address (0 for an argmax) and the address of
/// the bias added to its products (0: none; only launches that stream their weights take one).
#[derive(Clone, Copy)]
struct MatVec {
    w: WeightId,
    out: u64,
    bias: u64,
}

/// Input width of a matrix-vector group.
fn mats_k(weights: &CudaWeights, mats: &[MatVec]) -> Result<usize, RuntimeError> {
    Ok(weights.matrix(mats[0].w)?.k)
}

/// What one run of an executable covers: its active rows, their sequences, and the context of
/// the sequences' caches (which sets the ring size of sliding layers) and their element type
/// (which picks the attention kernels).
#[derive(Clone, Copy)]
struct Active {
    rows: usize,
    seqs: usize,
    context: usize,
    kv: KvType,
}

/// The kernels that read or write a KV cache, each with its instance for f16 caches
/// (`attention.cu`).
pub(crate) const KV_KERNELS: [(&str, &str); 6] = [
    ("attention", "attention_f16"),
    ("attention_qk", "attention_qk_f16"),
    ("attention_cap", "attention_cap_f16"),
    ("attention_tiled", "attention_tiled_f16"),
    ("attention_tiled_cap", "attention_tiled_cap_f16"),
    ("kv_append", "kv_append_f16"),
];

/// The name of cache kernel `base` for caches of `kv`.
fn kv_kernel(base: &str, kv: KvType) -> Result<&'static str, RuntimeError> {
    let (f32, f16) = KV_KERNELS.into_iter().find(|&(b, _)| b == base).ok_or_else(|| cuda_err(format!("'{base}' is no KV cache kernel")))?;
    Ok(match kv {
        KvType::F32 => f32,
        KvType::F16 => f16,
    })
}

/// The attention kernel of a launch for caches of `kv`: `attention_tiled` (prompts) or `attention`
/// (a block per row and head), soft-capped (`_cap`: `AttentionSoftCap`) or with the fused q/k steps
/// (`attention_qk`: RoPE, with or without norms; never soft-capped: `qk_attention_applies` takes
/// uncapped attention only).
fn attention_kernel(tiled: bool, qk: bool, capped: bool, kv: KvType) -> Result<&'static str, RuntimeError> {
    let base = match (tiled, qk, capped) {
        (true, false, false) => "attention_tiled",
        (true, false, true) => "attention_tiled_cap",
        (false, false, false) => "attention",
        (false, false, true) => "attention_cap",
        (false, true, false) => "attention_qk",
        _ => return Err(cuda_err(format!("no attention kernel with tiles {tiled}, q/k norms {qk}, soft-cap {capped}"))),
    };
    kv_kernel(base, kv)
}

/// Rows of a step in a run over `active` rows of `seqs` sequences.
fn rows_of(rows: Rows, active: usize, seqs: usize) -> usize {
    match rows {
        Rows::Active => active,
        Rows::One => seqs,
    }
}

impl CudaExecutable {
    /// Binds `plan` to `weights`, checking every kernel and weight it uses.
    pub(crate) fn new(plan: Arc<Plan>, weights: Arc<CudaWeights>, use_graphs: bool) -> Result<Self, RuntimeError> {
        let device = weights.device.clone();
        // Sequences one run of the plan takes (a one-sequence bucket: 1).
        let seqs = plan.bucket.seqs().max(1);
        let (mut head_values, mut top_k_words) = (0, 0);
        let mut vocab = usize::MAX;
        // The distinct RoPE frequency divisors of the plan's steps, uploaded once, and where each lies.
        let mut factors: Vec<f32> = Vec::new();
        let mut rope_factors: Vec<(Vec<f32>, u64)> = Vec::new();
        for step in &plan.steps {
            check_kernel(&step.kernel, &*weights)?;
            match &step.kernel {
                Kernel::Embed { table, .. } => vocab = vocab.min(weights.matrix(*table)?.n),
                Kernel::MatMul { w, .. } => {
                    weights.matrix(*w)?;
                }
                Kernel::MatMulArgmax { w, .. } => {
                    let n = weights.matrix(*w)?.n;
                    head_values = head_values.max(rows_of(step.rows, plan.rows(), seqs) * n);
                }
                Kernel::MatMulTopK { w, count, .. } => {
                    let (n, rows) = (weights.matrix(*w)?.n, rows_of(step.rows, plan.rows(), seqs));
                    head_values = head_values.max(rows * n);
                    top_k_words = top_k_words.max(rows * top_k_part_words(n, *count));
                }
                Kernel::TopK { width, count, .. } => {
                    top_k_words = top_k_words.max(rows_of(step.rows, plan.rows(), seqs) * top_k_part_words(*width, *count));
                }
                // (Its runs' partials where the top-k's lie: no plan has both.)
                Kernel::Draw { among: Among::Vocabulary, width, .. } => {
                    top_k_words = top_k_words.max(rows_of(step.rows, plan.rows(), seqs) * width.div_ceil(DRAW_RUN) * DRAW_PART_WORDS);
                }
                Kernel::RopeScaled { spec, .. } => {
                    if let Some(f) = spec.freq_factors.as_ref().filter(|f| !rope_factors.iter().any(|(g, _)| g == *f)) {
                        rope_factors.push((f.clone(), 4 * factors.len() as u64));
                        factors.extend(f);
                    }
                }
                _ => {}
            }
        }
        let arena = DeviceBuffer::new(&device.ctx, plan.arena_words * 4)?;
        let layers = plan.steps.iter().filter_map(|st| attention_of(&st.kernel)).map(|a| a.layer + 1).max().unwrap_or(0);
        let layout = StepLayout { rows: plan.rows(), seqs, layers };
        let step = DeviceBuffer::new(&device.ctx, layout.bytes())?;
        let argmax_rows = plan.rows();
        let head = DeviceBuffer::new(&device.ctx, (top_k_at(head_values, argmax_rows) + top_k_words) * 4)?;
        let launches = lower(&plan, &*weights, device.arch)?;
        tracing::debug!("{} steps in {} launches", plan.steps.len(), launches.len());
        let max_k = max_matmul_k(&plan);
        let max_n =
            plan.steps.iter().filter_map(|st| if let Kernel::MatMul { n, .. } = st.kernel { Some(n) } else { None }).fold(32, usize::max);
        let xq = (0..2).map(|_| DeviceBuffer::new(&device.ctx, MATVEC_ROWS * xq_bytes(max_k))).collect::<Result<Vec<_>, _>>()?;
        let mut matvec_rows = MATVEC_ROWS;
        while matvec_rows > 0 && !products_take_matvec(&plan, &*weights, matvec_rows, device.arch)? {
            matvec_rows -= 1;
        }
        let graph_scratch = if capturable_mmq(&plan, &*weights, device.arch)? {
            Some(Scratch::fixed(&device.ctx, plan.rows() * xq_bytes(max_k))?)
        } else {
            None
        };
        let sync_attention = (SYNC_GLU as usize + 4 * MATVEC_ROWS * max_n.div_ceil(32)) as u64;
        let (mut pairs_max, mut parts) = (0, 0);
        for st in &plan.steps {
            if let Some(AttentionStep { q_heads, head_dim, .. }) = attention_of(&st.kernel) {
                let pairs = plan.rows() * q_heads;
                pairs_max = pairs_max.max(pairs);
                let splits = attention_splits(pairs, device.sms as usize);
                if splits > 1 {
                    parts = parts.max(pairs * splits * (head_dim + 2));
                }
            }
        }
        // Few-row mmq launches over long rows: each run's partial sums, a counter per block of (x, y).
        let (mut runs_sums, mut mmq_counters) = (0, 0);
        if plan.rows() >= MMQ_MIN_ROWS {
            for st in &plan.steps {
                if let Kernel::MatMul { w, k, .. } | Kernel::MatMulArgmax { w, k, .. } = st.kernel {
                    let m = weights.matrix(w)?;
                    if takes_mmq(m.ty, k, device.arch) {
                        let (tile, runs) = MMQ_FEW.shape(m.n, k, MMQ_FEW.rows, device.sms as usize);
                        if runs > 1 {
                            runs_sums = runs_sums.max(m.n.div_ceil(tile) * runs * MMQ_RUN_SUMS);
                            mmq_counters = mmq_counters.max(m.n.div_ceil(tile));
                        }
                    }
                }
            }
        }
        let sync_mmq = (sync_attention as usize + 4 * pairs_max) as u64;
        let sync_bytes = sync_mmq as usize + 4 * mmq_counters;
        let sync = DeviceBuffer::new(&device.ctx, sync_bytes)?;
        let mmq_parts = DeviceBuffer::new(&device.ctx, runs_sums.max(1) * 4)?;
        let attention_parts = DeviceBuffer::new(&device.ctx, parts.max(1) * 4)?;
        let private = DeviceBuffer::new(&device.ctx, PRIVATE_ROWS * PROLOGUE_MAX * 4)?;
        let mut ropes = Vec::new();
        for l in &launches {
            if let Op::QkAttention { qk, .. } = l.op {
                let (table, _) = rope_table(&plan.steps[qk.ropes[0]].kernel).ok_or_else(|| cuda_err("a fused attention without RoPE"))?;
                if !ropes.contains(&table) {
                    ropes.push(table);
                }
            }
        }
        let rope_stride = ropes.iter().map(|t| t.head_dim / 2).max().unwrap_or(1);
        let rope = DeviceBuffer::new(&device.ctx, ROPE_TABLES * rope_stride * 8)?;
        let factors_buf = DeviceBuffer::new(&device.ctx, factors.len() * 4)?;
        {
            let _guard = device.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
            device.ctx.bind_to_thread().map_err(cuda_err)?;
            // SAFETY: `sync` holds `sync_bytes` bytes.
            unsafe { cudarc::driver::result::memset_d8_async(sync.ptr(), 0, sync_bytes, device.stream.cu_stream()) }.map_err(cuda_err)?;
            if !factors.is_empty() {
                // SAFETY: the buffer holds `factors.len()` floats; pageable memory is staged before return.
                unsafe { cudarc::driver::result::memcpy_htod_async(factors_buf.ptr(), &factors, device.stream.cu_stream()) }
                    .map_err(cuda_err)?;
            }
            device.sync()?;
        }
        let tokens_back = TokenSlots::new(&device)?;
        Ok(CudaExecutable {
            plan,
            weights,
            device,
            arena,
            step,
            layout,
            head,
            head_values,
            vocab,
            graphs: Vec::new(),
            use_graphs,
            graph_scratch,
            matvec_rows,
            launches,
            xq,
            private,
            ropes,
            rope,
            rope_stride,
            factors: factors_buf,
            rope_factors,
            sync,
            sync_attention,
            attention_parts,
            sync_mmq,
            mmq_parts,
            ahead: None,
            last_greedy: None,
            tokens_back,
            readback: None,
        })
    }

    fn slot(&self, s: Slot) -> u64 {
        self.arena.ptr() + 4 * s.offset as u64
    }

    /// Private row `i` of the norm prologues.
    fn private_row(&self, i: usize) -> u64 {
        self.private.ptr() + (4 * PROLOGUE_MAX * i) as u64
    }

    /// Enqueues every step of the plan for `n` active rows.
    fn enqueue(&self, run: Active, scratch: &mut Scratch) -> Result<(), RuntimeError> {
        let n = run.rows;
        let d = &*self.device;
        let (tokens, positions_in) = (self.input("tokens"), self.input("positions"));
        let mut args = vec![
            Arg::U64(self.step.ptr()),
            Arg::I32(self.layout.rows as i32),
            Arg::U64(tokens),
            Arg::U64(positions_in),
            Arg::U64(self.rope.ptr()),
            Arg::I32(self.ropes.len() as i32),
            Arg::I32(self.rope_stride as i32),
        ];
        for i in 0..ROPE_TABLES {
            let (theta, scale, factors, half) = match self.ropes.get(i) {
                Some(t) => (t.theta, t.scale, self.rope_factors(&t.factors)?, t.head_dim / 2),
                None => (0.0, 0.0, 0, 0),
            };
            args.extend([Arg::F32(theta), Arg::F32(scale), Arg::U64(factors), Arg::I32(half as i32)]);
        }
        d.launch("set_inputs", (n.max(self.ropes.len() * self.rope_stride).div_ceil(256) as u32, 1), 256, &args)?;
        scratch.quantized_of = None;
        for l in &self.launches {
            let quant_out = l.quant_out.map_or(0, |b| self.xq[b].ptr());
            if !matches!(l.op, Op::Step(_) | Op::MatVecs { .. }) {
                // (Steps through `enqueue_step` say themselves what they leave valid.)
                scratch.quantized_of = None;
            }
            match &l.op {
                Op::Step(i) => self.enqueue_step(*i, run, scratch, quant_out, l.xq_in)?,
                Op::MatVecs { steps, biases, glu, epi, pro } => {
                    let rows = rows_of(self.plan.steps[steps[0]].rows, n, run.seqs);
                    // (A group's matrices share their input, so their width, and their format.)
                    let Kernel::MatMul { w, .. } = self.plan.steps[steps[0]].kernel else {
                        return Err(cuda_err("a matrix-vector group that starts with no product"));
                    };
                    if !self.takes_matvec(w, rows)? {
                        // Each product, then its bias step (if any), in the plan's order.
                        let norms = pro.map_or(Vec::new(), |p| p.norm.steps());
                        let products = steps.iter().zip(biases).flat_map(|(m, b)| std::iter::once(m).chain(b));
                        for &i in norms.iter().chain(products).chain(glu) {
                            self.enqueue_step(i, run, scratch, 0, None)?;
                        }
                        continue;
                    }
                    let mut x = 0;
                    let mut mats = Vec::with_capacity(steps.len());
                    for (&i, b) in steps.iter().zip(biases) {
                        if let Kernel::MatMul { x: xs, w, out, .. } = self.plan.steps[i].kernel {
                            x = self.slot(xs);
                            let (out, bias) = match b.map(|b| &self.plan.steps[b].kernel) {
                                Some(&Kernel::AddBias { bias, out, .. }) => (out, self.weights.vector(bias)?.ptr()),
                                Some(_) => return Err(cuda_err("a product's bias step adds no bias")),
                                None => (out, 0),
                            };
                            mats.push(MatVec { w, out: if l.private_out { self.private_row(0) } else { self.slot(out) }, bias });
                        }
                    }
                    let (act, glu) = match glu.and_then(|g| glu_of(&self.plan.steps[g].kernel)) {
                        Some((act, _, _, out, _)) => (act, self.slot(out)),
                        None => (Glu::Gelu, 0),
                    };
                    let epi = match (epi, pro) {
                        (Some(e), _) => Some(self.epilogue_args(*e, quant_out)?),
                        (None, Some(p)) => {
                            let mut e = self.epilogue_args(p.norm, self.xq[0].ptr())?;
                            if !p.write_y {
                                e.out = 0;
                            }
                            if let Some(i) = p.res_in {
                                e.residual = self.private_row(i);
                            }
                            e.h2 = self.private_row(p.h_out);
                            Some(e)
                        }
                        (None, None) => None,
                    };
                    // A prologue's input: the first norm's.
                    let px = match pro {
                        Some(Prologue { x_private: true, .. }) => self.private_row(0),
                        Some(Prologue { norm: Epilogue::Norm(t) | Epilogue::Pair(t, _), .. }) => {
                            match norm_input(&self.plan.steps[*t].kernel) {
                                Some((x, ..)) => self.slot(x),
                                None => return Err(cuda_err("a prologue is not a norm")),
                            }
                        }
                        None => 0,
                    };
                    let xq = match l.xq_in {
                        _ if px != 0 => self.xq[0].ptr(),
                        Some(b) => self.xq[b].ptr(),
                        None => self.quantize(x, mats_k(&self.weights, &mats)?, rows)?,
                    };
                    let gq = if glu != 0 { quant_out } else { 0 };
                    self.matvecs(MatVecArgs { xq, mats: &mats, glu, act, gq, rows, epi: epi.as_ref(), argmax: 0, px })?;
                }
                &Op::NormPair { first: a, second: b } => {
                    let p = self.pair_args(a, b)?;
                    let rows = rows_of(self.plan.steps[a].rows, n, run.seqs);
                    d.launch(
                        "rms_norm2",
                        (rows as u32, 1),
                        norm_threads(p.width),
                        &[
                            Arg::U64(p.x),
                            Arg::U64(p.w1),
                            Arg::U64(p.residual),
                            Arg::U64(p.h),
                            Arg::U64(p.w2),
                            Arg::U64(p.out),
                            Arg::U64(quant_out),
                            Arg::I32(p.width as i32),
                            Arg::F32(p.eps),
                        ],
                    )?;
                }
                &Op::QkAttention { qk, att } => self.attention(att, run, quant_out, Some(qk))?,
                &Op::QkNormRope([a, b, c, e]) => {
                    let s = &self.plan.steps;
                    let (
                        Kernel::RmsNorm { x: q, weight: wq, out: qn, eps, .. },
                        Kernel::RmsNorm { x: k, weight: wk, out: kn, .. },
                        Kernel::Rope { positions, out: qr, heads: qh, head_dim, theta, .. },
                        Kernel::Rope { out: kr, heads: kh, .. },
                    ) = (&s[a].kernel, &s[b].kernel, &s[c].kernel, &s[e].kernel)
                    else {
                        return Err(cuda_err("a fused q/k norm and RoPE is not two norms and two RoPEs"));
                    };
                    let rows = rows_of(s[a].rows, n, run.seqs);
                    // The plan's positions input is the step's (`set_inputs`): the kernel computes
                    // them from the step buffer, before its predecessor ends.
                    let step = if self.slot(*positions) == positions_in { self.step.ptr() } else { 0 };
                    d.launch(
                        "qk_norm_rope",
                        ((rows * (qh + kh)) as u32, 1),
                        (head_dim / 2).next_multiple_of(32) as u32,
                        &[
                            Arg::U64(self.slot(*q)),
                            Arg::U64(self.slot(*k)),
                            Arg::U64(self.weights.vector(*wq)?.ptr()),
                            Arg::U64(self.weights.vector(*wk)?.ptr()),
                            Arg::U64(self.slot(*positions)),
                            Arg::U64(step),
                            Arg::U64(self.slot(*qn)),
                            Arg::U64(self.slot(*kn)),
                            Arg::U64(self.slot(*qr)),
                            Arg::U64(self.slot(*kr)),
                            Arg::I32(*qh as i32),
                            Arg::I32(*kh as i32),
                            Arg::I32(*head_dim as i32),
                            Arg::F32(*theta),
                            Arg::F32(*eps),
                        ],
                    )?;
                }
            }
        }
        Ok(())
    }

    fn input(&self, name: &str) -> u64 {
        self.plan.inputs.iter().find(|i| i.name == name).map_or(0, |i| self.slot(i.slot))
    }

    /// The device arguments of a norm pair (plan steps `a`, `b`): a post-norm with its residual add,
    /// or a residual add alone (no first norm: w1 null), then the norm of the sum.
    fn pair_args(&self, a: usize, b: usize) -> Result<PairArgs, RuntimeError> {
        let s = &self.plan.steps;
        let Kernel::RmsNorm { weight: w2, out, eps, .. } = s[b].kernel else {
            return Err(cuda_err("a norm pair does not end in a norm"));
        };
        let w1 = match s[a].kernel {
            Kernel::RmsNorm { weight, residual: Some(_), .. } => self.weights.vector(weight)?.ptr(),
            Kernel::Add { .. } => 0,
            _ => return Err(cuda_err("a norm pair does not start with a norm or an add")),
        };
        let Some((x, Some(r), width)) = norm_input(&s[a].kernel) else {
            return Err(cuda_err("a norm pair has no residual"));
        };
        Ok(PairArgs {
            x: self.slot(x),
            w1,
            residual: self.slot(r),
            h: self.slot(s[a].kernel.out()),
            w2: self.weights.vector(w2)?.ptr(),
            out: self.slot(out),
            width,
            eps,
        })
    }

    /// The kernel arguments of a norm epilogue (its output also quantized into `xq` when not 0).
    fn epilogue_args(&self, e: Epilogue, xq: u64) -> Result<EpilogueArgs, RuntimeError> {
        let s = &self.plan.steps;
        Ok(match e {
            Epilogue::Norm(t) => {
                let Kernel::RmsNorm { weight, out, eps, .. } = s[t].kernel else { return Err(cuda_err("an epilogue is not a norm")) };
                EpilogueArgs { w1: self.weights.vector(weight)?.ptr(), residual: 0, h: 0, h2: 0, w2: 0, out: self.slot(out), xq, eps }
            }
            Epilogue::Pair(a, b) => {
                let p = self.pair_args(a, b)?;
                EpilogueArgs { w1: p.w1, residual: p.residual, h: p.h, h2: 0, w2: p.w2, out: p.out, xq, eps: p.eps }
            }
        })
    }

    /// Quantizes `rows` rows of `k` activations at `x` into buffer 0; returns its address.
    fn quantize(&self, x: u64, k: usize, rows: usize) -> Result<u64, RuntimeError> {
        self.quantize_into(x, self.xq[0].ptr(), k, rows)
    }

    /// Quantizes `rows` rows of `k` activations at `x` into `xq`; returns `xq`.
    fn quantize_into(&self, x: u64, xq: u64, k: usize, rows: usize) -> Result<u64, RuntimeError> {
        let blocks = (rows * k).div_ceil(256) as u32;
        self.device.launch("quantize_rows", (blocks, 1), 256, &[Arg::U64(x), Arg::U64(xq), Arg::I32(k as i32), Arg::I32(rows as i32)])?;
        Ok(xq)
    }

    /// One matrix-vector launch (see `MatVecArgs`).
    fn matvecs(&self, a: MatVecArgs<'_>) -> Result<(), RuntimeError> {
        let ms = a.mats.iter().map(|m| self.weights.matrix(m.w)).collect::<Result<Vec<_>, _>>()?;
        let m = ms[0];
        let fmt = format_name(m.ty).ok_or_else(|| cuda_err(format!("no kernels for {:?}", m.ty)))?;
        let rows_of: Vec<usize> = ms.iter().map(|m| m.n).collect();
        let sync = self.sync.ptr();
        // The arguments both kernel families begin with: the matrices, their row bytes and rows,
        // the outputs; then (streamed kernels only) the biases; then the glu output, the quantized
        // input and its width.
        let mut args = Vec::with_capacity(31);
        args.extend((0..3).map(|i| Arg::U64(ms.get(i).map_or(0, |m| m.buf.ptr()))));
        args.push(Arg::U64(m.row_bytes as u64));
        args.extend((0..3).map(|i| Arg::I32(rows_of.get(i).map_or(0, |&n| n as i32))));
        args.extend((0..3).map(|i| Arg::U64(a.mats.get(i).map_or(0, |m| m.out))));
        let tail = [Arg::U64(a.glu), Arg::U64(a.xq), Arg::I32(m.k as i32)];
        // One-row launches without fused norms or glu quantization stream their weights through
        // shared memory.
        let plain = a.rows == 1 && a.px == 0 && a.epi.is_none() && a.gq == 0;
        let ring = streamed(m.ty, m.k, &rows_of, a.glu != 0, plain, self.device.arch, self.device.sms as usize);
        if let Some(RingGeometry { rows, warps, stages, blocks }) = ring {
            args.extend((0..3).map(|i| Arg::U64(a.mats.get(i).map_or(0, |m| m.bias))));
            args.extend(tail);
            args.extend([Arg::I32(stages as i32), Arg::U64(sync), Arg::U64(a.argmax), Arg::U64(sync + SYNC_ARGMAX)]);
            let shared = (stages * rows * m.row_bytes) as u32;
            let name = format!("matvecr{rows}{}_{fmt}", a.act.infix());
            return self.device.launch_shared(&name, (blocks as u32, 1, 1), 32 * warps as u32, shared, &args);
        }
        if a.mats.iter().any(|m| m.bias != 0) {
            return Err(cuda_err("a matrix-vector launch with biases that does not stream its weights (only matvecr adds biases)"));
        }
        args.extend(tail);
        let shape = MatVecShape { rows: a.rows, total: rows_of.iter().sum(), n: m.n, k: m.k, glu: a.glu != 0, prologue: a.px != 0 };
        let MatVecGeometry { kernel, per_warp, split, blocks } = shape.geometry(self.device.sms as usize);
        let e = a.epi.copied().unwrap_or(EpilogueArgs { w1: 0, residual: 0, h: 0, h2: 0, w2: 0, out: 0, xq: 0, eps: 0.0 });
        args.extend([Arg::I32(a.rows as i32), Arg::I32(split as i32)]);
        args.extend([Arg::U64(a.gq), Arg::U64(sync + SYNC_GLU)]);
        args.extend([Arg::U64(e.w1), Arg::U64(e.residual), Arg::U64(e.h), Arg::U64(e.w2), Arg::U64(e.out), Arg::U64(e.xq)]);
        let ecnt = if a.epi.is_some() && a.px == 0 { sync + SYNC_EPI } else { 0 };
        args.extend([
            Arg::U64(ecnt),
            Arg::F32(e.eps),
            Arg::U64(sync),
            Arg::U64(a.argmax),
            Arg::U64(sync + SYNC_ARGMAX),
            Arg::U64(a.px),
            Arg::U64(e.h2),
        ]);
        let ring = if per_warp == 4 { matvec4_shared_bytes(fmt) } else { 0 };
        let shared = if a.px != 0 { ring + (xq_bytes(m.k) as u32).next_multiple_of(16) } else { ring };
        let name = format!("{kernel}{}_{fmt}", a.act.infix());
        self.device.launch_shared(&name, (blocks as u32, 1, 1), 32 * MATVEC_WARPS as u32, shared, &args)
    }

    /// Whether the product of `rows` rows by matrix `w` takes the matrix-vector kernels.
    fn takes_matvec(&self, w: WeightId, rows: usize) -> Result<bool, RuntimeError> {
        let m = self.weights.matrix(w)?;
        Ok(takes_matvec(m.ty, m.k, rows, self.device.arch))
    }

    /// `out[r] = x[r] · Wᵀ` for `rows` rows: matrix-vector kernels for few rows, else x quantized
    /// and the `mmq` kernel where the format has one, else the weight dequantized to f32 and one
    /// cuBLAS GEMM.
    /// `xq_in`: the buffer holding x already quantized (else it is quantized first).
    fn matmul(&self, x: u64, w: WeightId, out: u64, rows: usize, scratch: &mut Scratch, xq_in: Option<usize>) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let m = self.weights.matrix(w)?;
        if self.takes_matvec(w, rows)? {
            let xq = match xq_in {
                Some(b) => self.xq[b].ptr(),
                None => self.quantize(x, m.k, rows)?,
            };
            return self.matvecs(MatVecArgs {
                xq,
                mats: &[MatVec { w, out, bias: 0 }],
                glu: 0,
                act: Glu::Gelu,
                gq: 0,
                rows,
                epi: None,
                argmax: 0,
                px: 0,
            });
        }
        let fmt = format_name(m.ty).ok_or_else(|| cuda_err(format!("no kernels for {:?}", m.ty)))?;
        if takes_mmq(m.ty, m.k, d.arch) {
            let xq = scratch.quantized(&d.ctx, rows * xq_bytes(m.k))?;
            if scratch.quantized_of != Some((x, m.k, rows)) {
                self.quantize_into(x, xq, m.k, rows)?;
                scratch.quantized_of = Some((x, m.k, rows));
            }
            let block = MmqBlock::of(rows);
            let (tile, runs) = block.shape(m.n, m.k, rows, d.sms as usize);
            let blocks = rows.div_ceil(block.rows) * m.n.div_ceil(tile);
            if runs > 1
                && (blocks * runs * MMQ_RUN_SUMS > self.mmq_parts.bytes() / 4 || 4 * blocks > self.sync.bytes() - self.sync_mmq as usize)
            {
                return Err(cuda_err(format!("an mmq launch of {blocks} x {runs} blocks outgrows the executable's partial sums")));
            }
            return d.launch_shared(
                &format!("{}{tile}_{fmt}", block.prefix),
                (rows.div_ceil(block.rows) as u32, m.n.div_ceil(tile) as u32, runs as u32),
                MMQ_THREADS,
                block.shared(m.ty, tile) as u32,
                &[
                    Arg::U64(m.buf.ptr()),
                    Arg::U64(m.row_bytes as u64),
                    Arg::U64(m.blocks as u64),
                    Arg::I32(m.n as i32),
                    Arg::U64(xq),
                    Arg::I32(m.k as i32),
                    Arg::I32(rows as i32),
                    Arg::U64(out),
                    Arg::U64(self.mmq_parts.ptr()),
                    Arg::U64(self.sync.ptr() + self.sync_mmq),
                ],
            );
        }
        let tmp = scratch.dequant(&d.ctx, m.n * m.k * 4)?;
        let count = (m.n * m.k / 32) as u64;
        d.launch(
            &format!("dequant_{fmt}"),
            (count.div_ceil(256) as u32, 1),
            256,
            &[
                Arg::U64(m.buf.ptr()),
                Arg::U64(m.row_bytes as u64),
                Arg::U64(m.blocks as u64),
                Arg::U64(tmp),
                Arg::I32(m.k as i32),
                Arg::U64(m.n as u64),
            ],
        )?;
        let (alpha, beta) = (1f32, 0f32);
        // Row-major out[rows, n] = x[rows, k] · W[n, k]ᵀ is column-major outᵀ = W · xᵀ.
        // SAFETY: the pointers are device buffers of the sizes the dimensions give.
        unsafe {
            cudarc::cublas::result::sgemm(
                *d.blas.handle(),
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T,
                cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N,
                m.n as i32,
                rows as i32,
                m.k as i32,
                &alpha,
                tmp as *const f32,
                m.k as i32,
                x as *const f32,
                m.k as i32,
                &beta,
                out as *mut f32,
                m.n as i32,
            )
        }
        .map_err(|e| cuda_err(format!("cuBLAS sgemm: {e}")))
    }

    /// `out[r] = argmax(x[r])` over `width` values, in two phases.
    fn argmax(&self, x: u64, out: u64, rows: usize, width: usize) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let pval = self.head.ptr() + 4 * self.head_values as u64;
        let pidx = pval + 4 * (ARGMAX_BLOCKS * self.plan.rows()) as u64;
        let blocks = ARGMAX_BLOCKS.min(width.div_ceil(256)).max(1);
        d.launch(
            "argmax_partial",
            (blocks as u32, rows as u32),
            256,
            &[Arg::U64(x), Arg::U64(pval), Arg::U64(pidx), Arg::I32(width as i32)],
        )?;
        d.launch("argmax_final", (rows as u32, 1), 32, &[Arg::U64(pval), Arg::U64(pidx), Arg::U64(out), Arg::I32(blocks as i32)])
    }

    /// `out[r]` = the `count` largest values of `x[r]` (soft-capped by `cap`) and their indices,
    /// over `rows` rows of `width` (`top_k_part`, `top_k_final`: ops.cu).
    fn top_k(&self, x: u64, out: u64, rows: usize, width: usize, count: usize, cap: Option<f32>) -> Result<(), RuntimeError> {
        let d = &*self.device;
        let slices = width.div_ceil(TOPK_SLICE);
        let part = self.head.ptr() + 4 * top_k_at(self.head_values, self.plan.rows()) as u64;
        let bad = part + 8 * (rows * slices * count) as u64;
        d.launch(
            "top_k_part",
            (slices as u32, rows as u32),
            TOPK_THREADS,
            &[Arg::U64(x), Arg::U64(part), Arg::U64(bad), Arg::I32(width as i32), Arg::I32(count as i32)],
        )?;
        d.launch(
            "top_k_final",
            (rows as u32, 1),
            TOPK_THREADS,
            &[Arg::U64(part), Arg::U64(bad), Arg::U64(out), Arg::I32(slices as i32), Arg::I32(count as i32), Arg::F32(cap.unwrap_or(0.0))],
        )
    }

    /// The element-wise step `e` over `rows` rows.
    fn elementwise(&self, e: Elementwise, rows: usize) -> Result<(), RuntimeError> {
        let b = match (e.b, e.bias) {
            (Some(b), _) => self.slot(b),
            (None, Some(bias)) => self.weights.vector(bias)?.ptr(),
            (None, None) => 0,
        };
        let len = rows * e.width;
        self.device.launch(
            "elementwise",
            (len.div_ceil(256) as u32, 1),
            256,
            &[
                Arg::U64(self.slot(e.a)),
                Arg::U64(b),
                Arg::U64(self.slot(e.out)),
                Arg::U64(len as u64),
                Arg::I32(e.op as i32),
                Arg::F32(e.c),
                Arg::I32(e.width as i32),
            ],
        )
    }

    /// The device address of RoPE frequency divisors (uploaded once, `rope_factors`; none: 0).
    fn rope_factors(&self, factors: &Option<Vec<f32>>) -> Result<u64, RuntimeError> {
        let Some(f) = factors else { return Ok(0) };
        let (_, at) = self.rope_factors.iter().find(|(g, _)| g == f).ok_or_else(|| cuda_err("RoPE factors not uploaded"))?;
        Ok(self.factors.ptr() + at)
    }

    /// A RoPE launch (`rope` or `rope_scaled`): one block per row and head of `x`, `positions`,
    /// `out` ([x, positions, out]), then the kernel's own frequency arguments `freq`.
    fn rope(
        &self,
        kernel: &str,
        [x, positions, out]: [Slot; 3],
        rows: usize,
        heads: usize,
        head_dim: usize,
        freq: &[Arg],
    ) -> Result<(), RuntimeError> {
        let args = [
            Arg::U64(self.slot(x)),
            Arg::U64(self.slot(positions)),
            Arg::U64(self.slot(out)),
            Arg::I32(heads as i32),
            Arg::I32(head_dim as i32),
        ];
        let block = (head_dim / 2).next_multiple_of(32).min(128) as u32;
        self.device.launch(kernel, ((rows * heads) as u32, 1), block, &[&args[..], freq].concat())
    }

    /// Enqueues plan step `i` for `active` rows.
    /// `quant_out`: the buffer its output is also written to quantized (0: none); `xq_in`: for a
    /// matrix product, the buffer holding its input quantized.
    fn enqueue_step(&self, i: usize, run: Active, scratch: &mut Scratch, quant_out: u64, xq_in: Option<usize>) -> Result<(), RuntimeError> {
        let step = &self.plan.steps[i];
        let active = run.rows;
        let (kernel, rows) = (&step.kernel, rows_of(step.rows, active, run.seqs));
        let d = &*self.device;
        let w = &*self.weights;
        if !matches!(kernel, Kernel::MatMul { .. }) {
            // Only a matrix product (whose output is not its input) leaves the quantized input valid.
            scratch.quantized_of = None;
        }
        match *kernel {
            Kernel::Embed { table, ids, out, width, scale } => {
                let m = w.matrix(table)?;
                let fmt = format_name(m.ty).ok_or_else(|| cuda_err(format!("no kernels for {:?}", m.ty)))?;
                d.launch(
                    &format!("embed_{fmt}"),
                    (rows as u32, 1),
                    128,
                    &[
                        Arg::U64(m.buf.ptr()),
                        Arg::U64(m.row_bytes as u64),
                        Arg::U64(m.blocks as u64),
                        Arg::U64(self.slot(ids)),
                        Arg::U64(self.slot(out)),
                        Arg::I32(width as i32),
                        Arg::F32(scale),
                    ],
                )?;
            }
            Kernel::RmsNorm { x, weight, out, width, eps, residual } => {
                let wv = w.vector(weight)?;
                let group = wv.bytes() / 4;
                let groups = rows * width / group;
                let block = norm_threads(group);
                d.launch(
                    "rms_norm",
                    (groups as u32, 1),
                    block,
                    &[
                        Arg::U64(self.slot(x)),
                        Arg::U64(wv.ptr()),
                        Arg::U64(residual.map_or(0, |r| self.slot(r))),
                        Arg::U64(self.slot(out)),
                        Arg::I32(group as i32),
                        Arg::F32(eps),
                        Arg::U64(if group == width { quant_out } else { 0 }),
                    ],
                )?;
            }
            Kernel::MatMul { x, w: wid, out, .. } => self.matmul(self.slot(x), wid, self.slot(out), rows, scratch, xq_in)?,
            Kernel::MatMulArgmax { x, w: wid, out, n, .. } => {
                if self.takes_matvec(wid, rows)? {
                    // The argmax inside the matrix-vector kernel: no products are stored.
                    let m = w.matrix(wid)?;
                    let xq = match xq_in {
                        Some(b) => self.xq[b].ptr(),
                        None => self.quantize(self.slot(x), m.k, rows)?,
                    };
                    let argmax = self.slot(out);
                    if rows == 1 && m.ty == GgmlType::Q8_0 && m.k <= HEAD_MAX_K {
                        // Persistent warps over the rows: two blocks per multiprocessor.
                        let blocks = (m.n.div_ceil(8).div_ceil(HEAD_WARPS)).min(2 * d.sms as usize);
                        let sync = self.sync.ptr();
                        d.launch(
                            "argmax_head_q8_0",
                            (blocks as u32, 1),
                            32 * HEAD_WARPS as u32,
                            &[
                                Arg::U64(m.buf.ptr()),
                                Arg::U64(m.blocks as u64),
                                Arg::I32(m.n as i32),
                                Arg::U64(xq),
                                Arg::I32(m.k as i32),
                                Arg::U64(sync),
                                Arg::U64(argmax),
                                Arg::U64(sync + SYNC_ARGMAX),
                            ],
                        )?;
                    } else {
                        self.matvecs(MatVecArgs {
                            xq,
                            mats: &[MatVec { w: wid, out: 0, bias: 0 }],
                            glu: 0,
                            act: Glu::Gelu,
                            gq: 0,
                            rows,
                            epi: None,
                            argmax,
                            px: 0,
                        })?;
                    }
                } else {
                    self.matmul(self.slot(x), wid, self.head.ptr(), rows, scratch, None)?;
                    self.argmax(self.head.ptr(), self.slot(out), rows, n)?;
                }
            }
            Kernel::Rope { x, positions, out, heads, head_dim, theta } => {
                self.rope("rope", [x, positions, out], rows, heads, head_dim, &[Arg::F32(theta)])?
            }
            Kernel::RopeScaled { x, positions, out, heads, head_dim, ref spec } => {
                let factors = self.rope_factors(&spec.freq_factors)?;
                let spec_args =
                    [Arg::F32(spec.theta), Arg::F32(spec.freq_scale), Arg::U64(factors), Arg::I32((spec.mode == RopeMode::Norm) as i32)];
                self.rope("rope_scaled", [x, positions, out], rows, heads, head_dim, &spec_args)?
            }
            Kernel::Normalize { x, out, width, group, eps } => d.launch(
                "rms_normalize",
                ((rows * width / group) as u32, 1),
                norm_threads(group),
                &[Arg::U64(self.slot(x)), Arg::U64(self.slot(out)), Arg::I32(group as i32), Arg::F32(eps)],
            )?,
            Kernel::Attention { .. } | Kernel::AttentionSoftCap { .. } => self.attention(i, run, quant_out, None)?,
            Kernel::Add { .. }
            | Kernel::Mul { .. }
            | Kernel::Gelu { .. }
            | Kernel::GeluMul { .. }
            | Kernel::Silu { .. }
            | Kernel::SiluMul { .. }
            | Kernel::Scale { .. }
            | Kernel::SoftCap { .. }
            | Kernel::AddBias { .. } => {
                let e = elementwise_of(kernel).ok_or_else(|| cuda_err("an element-wise step without its operands"))?;
                self.elementwise(e, rows)?
            }
            Kernel::LastRow { x, out, width } => d.launch(
                "copy_last_rows",
                (width.div_ceil(256) as u32, run.seqs as u32),
                256,
                &[
                    Arg::U64(self.slot(x)),
                    Arg::U64(self.slot(out)),
                    Arg::U64(self.step.ptr()),
                    Arg::I32(self.layout.rows as i32),
                    Arg::I32(width as i32),
                ],
            )?,
            Kernel::Argmax { x, out, width } => self.argmax(self.slot(x), self.slot(out), rows, width)?,
            Kernel::Draw { x, out, width, among } => {
                let (x, out, draws) = (self.slot(x), self.slot(out), self.step.ptr() + self.layout.draws_at() as u64);
                match among {
                    Among::Candidates => d.launch(
                        "draw_candidates",
                        (rows as u32, 1),
                        32,
                        &[Arg::U64(x), Arg::U64(out), Arg::I32(width as i32), Arg::U64(draws)],
                    )?,
                    Among::Vocabulary => {
                        let part = self.head.ptr() + 4 * top_k_at(self.head_values, self.plan.rows()) as u64;
                        let (grid, w) = ((width.div_ceil(DRAW_RUN) as u32, rows as u32), Arg::I32(width as i32));
                        d.launch("draw_runs_max", grid, DRAW_THREADS, &[Arg::U64(x), w, Arg::U64(part)])?;
                        d.launch("draw_runs_sum", grid, DRAW_THREADS, &[Arg::U64(x), w, Arg::U64(draws), Arg::U64(part)])?;
                        d.launch(
                            "draw_vocabulary",
                            (rows as u32, 1),
                            DRAW_THREADS,
                            &[Arg::U64(x), Arg::U64(out), w, Arg::U64(draws), Arg::U64(part)],
                        )?
                    }
                }
            }
            Kernel::MatMulTopK { x, w: wid, out, n, count, cap, .. } => {
                self.matmul(self.slot(x), wid, self.head.ptr(), rows, scratch, None)?;
                self.top_k(self.head.ptr(), self.slot(out), rows, n, count, cap)?;
            }
            Kernel::TopK { x, out, width, count, cap } => self.top_k(self.slot(x), self.slot(out), rows, width, count, cap)?,
        }
        Ok(())
    }

    /// Attention step `i` over `active` new rows (a prompt's through `attention_tiled` where
    /// `takes_tiled_attention`), its output also quantized into `quant_out` (0: not), and the KV
    /// append into each sequence's cache (checked by `check_kv`); with `qk` (see
    /// `Op::QkAttention`), the q/k norm and RoPE steps before it too.
    fn attention(&self, i: usize, run: Active, quant_out: u64, qk: Option<QkSteps>) -> Result<(), RuntimeError> {
        let active = run.rows;
        let Some(AttentionStep { mut q, mut k, v, out, layer, q_heads, kv_heads, head_dim, window, scale, softcap }) =
            attention_of(&self.plan.steps[i].kernel)
        else {
            return Err(cuda_err("not an attention step"));
        };
        // The RoPE table and pairing, and the norm weights and epsilon, of fused q/k steps (null
        // table: none; null weights: no norms).
        let (mut rope, mut adjacent, mut wq, mut wk, mut eps) = (0, false, 0, 0, 0f32);
        if let Some(qk) = qk {
            let s = &self.plan.steps;
            let (
                Some((r, adj)),
                &(Kernel::Rope { x: xq, .. } | Kernel::RopeScaled { x: xq, .. }),
                &(Kernel::Rope { x: xk, .. } | Kernel::RopeScaled { x: xk, .. }),
            ) = (rope_table(&s[qk.ropes[0]].kernel), &s[qk.ropes[0]].kernel, &s[qk.ropes[1]].kernel)
            else {
                return Err(cuda_err("fused q/k steps without their RoPE"));
            };
            let table = self.ropes.iter().position(|x| *x == r).ok_or_else(|| cuda_err("no RoPE table for a fused attention"))?;
            (rope, adjacent, q, k) = (self.rope.ptr() + (table * self.rope_stride * 8) as u64, adj, xq, xk);
            if let Some([a, b]) = qk.norms {
                let (&Kernel::RmsNorm { x: xq, weight: w1, eps: e, .. }, &Kernel::RmsNorm { x: xk, weight: w2, .. }) =
                    (&s[a].kernel, &s[b].kernel)
                else {
                    return Err(cuda_err("fused q/k norms that are not norms"));
                };
                (q, k, wq, wk, eps) = (xq, xk, self.weights.vector(w1)?.ptr(), self.weights.vector(w2)?.ptr(), e);
            }
        }
        let d = &*self.device;
        // The layer's key and value cache addresses, in the step buffer.
        let cache = self.step.ptr() + self.layout.cache(layer) as u64;
        let ring = window.map_or(0, |w| w.min(run.context)) as i32;
        // A one-row plan appends inside the attention kernel.
        let append = self.plan.rows() == 1;
        // (From the plan's rows, as `parts` was sized.)
        let splits = attention_splits(self.plan.rows() * q_heads, d.sms as usize);
        let (q, k) = (self.slot(q), self.slot(k));
        // The arguments both attention kernels begin with.
        let common = [
            Arg::U64(q),
            Arg::U64(k),
            Arg::U64(self.slot(v)),
            Arg::U64(cache),
            Arg::U64(self.slot(out)),
            Arg::U64(self.step.ptr()),
            Arg::I32(q_heads as i32),
            Arg::I32(kv_heads as i32),
            Arg::I32(head_dim as i32),
            Arg::I32(ring),
            Arg::F32(scale),
        ];
        // (Both kernels end with the soft-cap, which only their `_cap` instances read.)
        let cap = Arg::F32(softcap.unwrap_or(0.0));
        // (The tiled kernel copies query, key and value rows in 16-byte pieces.)
        let aligned = [q, k, self.slot(v)].iter().all(|p| p.is_multiple_of(16));
        if !append && qk.is_none() && aligned && takes_tiled_attention(active, run.seqs, q_heads, d.sms as usize) {
            d.launch_shared(
                attention_kernel(true, false, softcap.is_some(), run.kv)?,
                (active.div_ceil(ATTENTION_TILE_ROWS) as u32, q_heads as u32, 1),
                ATTENTION_TILE_THREADS,
                attention_tile_shared(head_dim) as u32,
                &[&common[..], &[Arg::U64(quant_out), Arg::I32(active as i32), cap]].concat(),
            )?;
        } else {
            let rest = [
                Arg::I32(append as i32),
                Arg::U64(quant_out),
                Arg::U64(wq),
                Arg::U64(wk),
                Arg::U64(rope),
                Arg::I32(adjacent as i32),
                Arg::F32(eps),
                Arg::I32(splits as i32),
                Arg::U64(self.attention_parts.ptr()),
                Arg::U64(self.sync.ptr() + self.sync_attention),
                cap,
            ];
            let name = attention_kernel(false, qk.is_some(), softcap.is_some(), run.kv)?;
            d.launch(name, ((active * q_heads * splits) as u32, 1), ATTENTION_THREADS, &[&common[..], &rest[..]].concat())?;
        }
        if append {
            return Ok(());
        }
        d.launch(
            kv_kernel("kv_append", run.kv)?,
            (active as u32, 1),
            256,
            &[
                Arg::U64(k),
                Arg::U64(self.slot(v)),
                Arg::U64(cache),
                Arg::U64(self.step.ptr()),
                Arg::I32((kv_heads * head_dim) as i32),
                Arg::I32(ring),
            ],
        )
    }

    /// Checks that `kv` has the layers the plan's attention steps expect.
    fn check_kv(&self, kv: &CudaKvCache) -> Result<(), RuntimeError> {
        for st in &self.plan.steps {
            if let Some(AttentionStep { layer, kv_heads, head_dim, window, .. }) = attention_of(&st.kernel) {
                let l = kv.layers.get(layer).ok_or_else(|| RuntimeError::StepShape(format!("the KV cache has no layer {layer}")))?;
                if l.spec.k_width() != kv_heads * head_dim || l.spec.v_width() != kv_heads * head_dim || l.spec.window != window {
                    return Err(RuntimeError::StepShape(format!("KV cache layer {layer} does not match the plan")));
                }
            }
        }
        Ok(())
    }

    /// Whether a run of `rows` rows replays a captured graph: a one-row plan, or a decode plan
    /// whose products all take the matrix-vector kernels at `rows` rows, or the matrix-vector
    /// kernels or `mmq` with the executable's own fixed scratch (cuBLAS's scratch may grow while it
    /// runs, which a capture does not allow).
    fn graphed(&self, rows: usize) -> bool {
        self.use_graphs
            && (self.plan.rows() == 1
                || matches!(self.plan.bucket, Bucket::Decode { .. }) && (rows <= self.matvec_rows || self.graph_scratch.is_some()))
    }

    /// Replays the captured step for `run` (one row per sequence), capturing it first if needed.
    fn replay(&mut self, run: Active, scratch: &mut Scratch) -> Result<(), RuntimeError> {
        let captured = self.graphs.iter().position(|g| g.rows == run.rows && g.context == run.context && g.kv == run.kv);
        let at = if let Some(at) = captured {
            at
        } else {
            let stream = self.device.stream.clone();
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(cuda_err)?;
            let before = self.device.launches.load(Ordering::Relaxed);
            let enqueued = self.enqueue(run, scratch);
            self.device.graph_kernels.store(self.device.launches.load(Ordering::Relaxed) - before, Ordering::Relaxed);
            let graph =
                stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(|e| cuda_err(format!("capturing a decode graph: {e}")));
            enqueued?;
            let graph = graph?.ok_or_else(|| cuda_err("capturing a decode graph gave no graph"))?;
            self.graphs.push(CapturedStep { rows: run.rows, context: run.context, kv: run.kv, graph });
            self.device.graph_captures.fetch_add(1, Ordering::Relaxed);
            self.graphs.len() - 1
        };
        self.graphs[at].graph.launch().map_err(|e| cuda_err(format!("launching the decode graph: {e}")))
    }
}

impl Executable for CudaExecutable {
    fn plan(&self) -> &Plan {
        &self.plan
    }

    fn run(&mut self, inputs: StepInputs<'_>, kv: &mut dyn KvCache) -> Result<Vec<HostTensor>, RuntimeError> {
        let kv = cuda_kv(kv)?;
        if kv.len != inputs.start_pos {
            return Err(RuntimeError::StepShape(format!("step starts at {} but the KV cache holds {}", inputs.start_pos, kv.len)));
        }
        self.plan.check_draws(inputs.draw.iter().len(), 1)?;
        self.execute(inputs.tokens, &[inputs.tokens.len()], &mut [kv], inputs.draw.map_or(&[], std::slice::from_ref))
    }

    fn run_batch(
        &mut self,
        tokens: &[u32],
        rows: &[usize],
        kvs: &mut [&mut dyn KvCache],
        draws: &[DrawSpec],
    ) -> Result<Vec<HostTensor>, RuntimeError> {
        self.plan.check_draws(draws.len(), kvs.len())?;
        let mut caches = kvs.iter_mut().map(|kv| cuda_kv(&mut **kv)).collect::<Result<Vec<_>, _>>()?;
        self.execute(tokens, rows, &mut caches, draws)
    }
}

/// The CUDA cache behind `kv`.
fn cuda_kv(kv: &mut dyn KvCache) -> Result<&mut CudaKvCache, RuntimeError> {
    kv.as_any_mut()
        .downcast_mut::<CudaKvCache>()
        .ok_or_else(|| RuntimeError::StepShape("the KV cache does not belong to the CUDA backend".into()))
}

impl CudaExecutable {
    /// Runs the plan over `tokens`, consecutive runs of `rows[i]` rows for the sequence whose
    /// cache is `kvs[i]` (at positions from its length on), appends their keys and values, and
    /// copies the outputs back (one row per sequence where the plan keeps their last rows).
    fn execute(
        &mut self,
        tokens: &[u32],
        rows: &[usize],
        kvs: &mut [&mut CudaKvCache],
        draws: &[DrawSpec],
    ) -> Result<Vec<HostTensor>, RuntimeError> {
        let n = tokens.len();
        if n == 0 || n > self.plan.rows() {
            return Err(RuntimeError::StepShape(format!("{n} tokens for a plan of {} rows", self.plan.rows())));
        }
        self.plan.check_batch(n, rows, kvs.len())?;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(RuntimeError::TokenOutOfRange { id: bad, vocab: self.vocab });
        }
        let (context, elem) = (kvs[0].context, kvs[0].elem);
        for (kv, &r) in kvs.iter().zip(rows) {
            if kv.elem != elem {
                return Err(RuntimeError::StepShape(format!(
                    "the caches of one step must store one element type (got {} and {})",
                    elem.name(),
                    kv.elem.name()
                )));
            }
            if !Arc::ptr_eq(&kv.device, &self.device) {
                return Err(RuntimeError::StepShape("the KV cache lives on another CUDA device".into()));
            }
            if kv.context != context {
                return Err(RuntimeError::StepShape(format!(
                    "the caches of one step must have one context size (got {context} and {})",
                    kv.context
                )));
            }
            if kv.len + r > kv.context {
                return Err(RuntimeError::KvFull { capacity: kv.context, needed: kv.len + r });
            }
            self.check_kv(kv)?;
        }
        if n == 1 && kvs.len() == 1 && self.runs_ahead() {
            return self.greedy_step(tokens[0], kvs[0], draws.first().copied());
        }
        // (A step launched ahead for another call is left to finish: its cache row lies past the
        // cache's length, and the next step at that position writes it again.)
        self.ahead = None;
        let device = self.device.clone();
        let mut scratch = device.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
        device.ctx.bind_to_thread().map_err(cuda_err)?;
        let segments: Vec<(&CudaKvCache, usize, usize)> = kvs.iter().zip(rows).map(|(kv, &r)| (&**kv, kv.len, r)).collect();
        self.upload_step(tokens, &segments, draws)?;
        let run = Active { rows: n, seqs: kvs.len(), context, kv: elem };
        if !self.graphed(n) {
            self.enqueue(run, &mut scratch)?;
        } else if n > self.matvec_rows {
            // (Taken out for the call, so that it and the executable can be borrowed apart.)
            let mut own = self.graph_scratch.take().ok_or_else(|| cuda_err("a many-row captured step without its scratch"))?;
            let replayed = self.replay(run, &mut own);
            self.graph_scratch = Some(own);
            replayed?;
        } else {
            self.replay(run, &mut scratch)?;
        }
        // Every output's words (f32 or i32), one after another in the page-locked buffer (taken
        // out for the copies, so that it and the slots can be borrowed apart).
        let shapes: Vec<[usize; 2]> =
            self.plan.outputs.iter().map(|o| [if o.rows == Rows::One { kvs.len() } else { n }, o.width]).collect();
        let words: usize = shapes.iter().map(|s| s[0] * s[1]).sum();
        let mut buf = match self.readback.take() {
            Some(b) if b.len() >= words => b,
            _ => {
                // SAFETY: page-locked memory (not write-combined: the host reads it), written by
                // the copies below before it is read.
                unsafe { device.ctx.alloc_pinned_with_flags::<u32>(words, 0) }
                    .map_err(|e| cuda_err(format!("allocating {} bytes of page-locked memory for the outputs: {e}", 4 * words)))?
            }
        };
        let back = buf.as_mut_slice().map_err(cuda_err)?;
        let mut at = 0;
        for (o, s) in self.plan.outputs.iter().zip(&shapes) {
            let len = s[0] * s[1];
            // SAFETY: the output slot holds at least `len` words; the buffer is read after the sync.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut back[at..at + len], self.slot(o.slot), device.stream.cu_stream()) }
                .map_err(cuda_err)?;
            at += len;
        }
        device.sync()?;
        let mut outs = Vec::with_capacity(self.plan.outputs.len());
        let mut at = 0;
        for (o, &shape) in self.plan.outputs.iter().zip(&shapes) {
            let words = &back[at..at + shape[0] * shape[1]];
            at += words.len();
            let data = match o.dtype {
                DType::F32 => HostData::F32(words.iter().map(|&w| f32::from_bits(w)).collect()),
                DType::I32 => HostData::I32(words.iter().map(|&w| w as i32).collect()),
            };
            outs.push(HostTensor { name: o.name.clone(), shape, data });
        }
        self.readback = Some(buf);
        for (kv, &r) in kvs.iter_mut().zip(rows) {
            kv.len += r;
            kv.steps += 1;
        }
        Ok(outs)
    }
}

impl CudaExecutable {
    /// Writes the step buffer's words for `tokens` in `segments` with `draws`
    /// (`StepLayout::words`), in stream order.
    fn upload_step(&self, tokens: &[u32], segments: &[(&CudaKvCache, usize, usize)], draws: &[DrawSpec]) -> Result<(), RuntimeError> {
        let step = self.layout.words(tokens, segments, draws);
        // SAFETY: the step buffer holds layout.bytes() bytes, as many as the words (the callers
        // check rows and sequences against the plan's); pageable memory is staged before return.
        unsafe { cudarc::driver::result::memcpy_htod_async(self.step.ptr(), &step, self.device.stream.cu_stream()) }.map_err(cuda_err)
    }

    /// Whether one-row steps of this plan may run one ahead: a captured one-row decode plan whose
    /// only output is the next token (greedy, or drawn).
    fn runs_ahead(&self) -> bool {
        matches!(self.plan.bucket, Bucket::Decode { .. })
            && self.plan.rows() == 1
            && self.graphed(1)
            && matches!(self.plan.outputs.as_slice(), [o] if o.dtype == DType::I32 && o.width == 1)
    }

    /// Launches the step for `token` at the cache's position p (with the sequence's `draw` where
    /// the plan draws), or takes the one launched ahead for it, and, when the call continues a run
    /// of such steps of this cache and the bucket and the cache have room, launches the step for
    /// position p + 1 before reading this one's token back: its token is this step's, copied on
    /// the device into its step buffer, and its draw this one's with the generator one number on
    /// (as the sampler steps past a draw: `Sampler::drew`). So the device does not idle while
    /// the host reads a token and asks for the next step (a run's steps follow each other on the
    /// device). Its cache row lies past the cache's length until the host asks for that step
    /// (with any other token or draw or in another bucket, the step runs again and writes the
    /// row again: no step reads a row past the cache's length, and a sliding layer's ring slot it
    /// overwrote held a position no later step sees).
    fn greedy_step(&mut self, token: u32, kv: &mut CudaKvCache, draw: Option<DrawSpec>) -> Result<Vec<HostTensor>, RuntimeError> {
        let device = self.device.clone();
        let mut scratch = device.lock.lock().map_err(|_| cuda_err("a previous CUDA step panicked"))?;
        device.ctx.bind_to_thread().map_err(cuda_err)?;
        let stream = device.stream.cu_stream();
        let (cache, p) = (kv.id, kv.len);
        let out = self.slot(self.plan.outputs[0].slot);
        let run = Active { rows: 1, seqs: 1, context: kv.context, kv: kv.elem };
        // (Only a run of steps of one cache with nothing between them goes ahead: sessions that
        // take turns would each waste a step.)
        let continues = self.last_greedy == Some((cache, kv.steps));
        let launched = match self.ahead.take() {
            Some(a) if continues && a.token == Some(token) && a.draw == draw => a.slot,
            _ => {
                self.upload_step(&[token], &[(&*kv, p, 1)], draw.as_slice())?;
                self.replay(run, &mut scratch)?;
                // (Either word: a copy into it still queued from a step abandoned ahead lands
                // before this one, and its event is recorded again after.)
                self.token_back(out, 0)?;
                0
            }
        };
        let Bucket::Decode { past, .. } = self.plan.bucket else {
            return Err(cuda_err("a greedy step of a plan that is not a decode plan"));
        };
        let ahead = continues && p + 2 <= past && p + 2 <= kv.context;
        let next_draw = draw.map(|d| d.next());
        if ahead {
            self.upload_step(&[0], &[(&*kv, p + 1, 1)], next_draw.as_slice())?;
            let token_at = self.step.ptr() + self.layout.tokens_at() as u64;
            // SAFETY: the token word lies in the step buffer, the output slot holds one i32
            // written by the step before (stream order).
            unsafe { cudarc::driver::result::memcpy_dtod_async(token_at, out, 4, stream) }.map_err(cuda_err)?;
            self.replay(run, &mut scratch)?;
            self.token_back(out, 1 - launched)?;
        }
        self.tokens_back.events[launched].synchronize().map_err(cuda_err)?;
        // SAFETY: the word's copy has completed (its event); nothing else writes it meanwhile.
        let got = unsafe { *self.tokens_back.words.add(launched) };
        kv.len += 1;
        kv.steps += 1;
        if ahead {
            self.ahead = Some(Ahead { token: u32::try_from(got).ok(), draw: next_draw, slot: 1 - launched });
        }
        self.last_greedy = Some((cache, kv.steps));
        Ok(vec![HostTensor { name: self.plan.outputs[0].name.clone(), shape: [1, 1], data: HostData::I32(vec![got]) }])
    }

    /// Copies the step's token at `out` to host word `slot` and records that word's event.
    fn token_back(&self, out: u64, slot: usize) -> Result<(), RuntimeError> {
        let stream = self.device.stream.cu_stream();
        // SAFETY: the word is page-locked and not read before its event; `out` holds one i32.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.tokens_back.words.add(slot), 1);
            cudarc::driver::result::memcpy_dtoh_async(dst, out, stream).map_err(cuda_err)?;
        }
        self.tokens_back.events[slot].record(&self.device.stream).map_err(cuda_err)
    }
}

impl Drop for CudaExecutable {
    fn drop(&mut self) {
        let _ = self.device.sync_exclusive();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_ir::Bucket;
    use kiln_models::synth::{gemma3, FormatMix, Gemma3Shape, LlamaArch, LlamaShape, SynthModel};
    use kiln_models::OutputMode;
    use kiln_runtime::WeightStore;

    impl WeightShapes for WeightStore {
        fn matrix_ty(&self, w: WeightId) -> Result<GgmlType, RuntimeError> {
            Ok(self.info(w).ty)
        }

        fn vector_len(&self, w: WeightId) -> Result<usize, RuntimeError> {
            let i = self.info(w);
            Ok(i.row_len * i.n_rows)
        }
    }

    /// The architecture of an H100 or H200.
    const SM90: (i32, i32) = (9, 0);

    /// The launches of a Gemma 3 plan of `bucket` (a small synthetic model, `layers` layers).
    fn launches(bucket: Bucket, mix: FormatMix) -> (Plan, Vec<Launch>) {
        let shape =
            Gemma3Shape { hidden: 512, layers: 3, q_heads: 4, kv_heads: 1, head_dim: 128, ffn: 1024, vocab: 1000, window: 8, context: 64 };
        launches_of(&shape, bucket, mix)
    }

    /// The launches of a Gemma 3 plan of `shape` and `bucket`.
    fn launches_of(shape: &Gemma3Shape, bucket: Bucket, mix: FormatMix) -> (Plan, Vec<Launch>) {
        let (plan, store) = plan_of(shape, bucket, mix);
        let l = lower(&plan, &store, SM90).unwrap();
        (plan, l)
    }

    /// A Gemma 3 plan of `shape` and `bucket` and the weights it reads.
    fn plan_of(shape: &Gemma3Shape, bucket: Bucket, mix: FormatMix) -> (Plan, WeightStore) {
        let (arch, store) = model_store(&gemma3(shape, mix, 7));
        let plan = kiln_runtime::compile(&arch.build_graph(bucket, OutputMode::NextToken).unwrap(), &store).unwrap();
        (plan, store)
    }

    /// Every model family kiln runs (the fixtures of `crates/models/tests/fixtures/families`).
    const FAMILIES: [&str; 7] = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma4"];

    /// A synthetic model written to a file of its own (the tests run in parallel) and loaded: its
    /// architecture and weights.
    fn model_store(m: &SynthModel) -> (Box<dyn kiln_models::Architecture>, WeightStore) {
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kiln-cuda-lower-{}-{call}.gguf", std::process::id()));
        m.write(&path).unwrap();
        let file = kiln_gguf::GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        file_store(file)
    }

    /// An opened model file's architecture and weights.
    fn file_store(file: kiln_gguf::GgufFile) -> (Box<dyn kiln_models::Architecture>, WeightStore) {
        let file = Arc::new(file);
        (kiln_models::architecture_from_gguf(&file).unwrap(), WeightStore::new(file).unwrap())
    }

    /// The family fixture `family`, every matrix re-encoded in `ty` where given (the fixtures mix
    /// formats, so that no gate and up matrices share one and nothing fuses them), and its
    /// architecture.
    fn family_store(family: &str, ty: Option<GgmlType>) -> (Box<dyn kiln_models::Architecture>, WeightStore) {
        let fixture = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tests/fixtures/families"))
            .join(format!("{family}.gguf"));
        let file = kiln_gguf::GgufFile::open(&fixture).unwrap();
        if let Some(ty) = ty {
            let mut m = SynthModel::from_gguf(&file);
            m.requantize_matrices(ty).unwrap();
            return model_store(&m);
        }
        file_store(file)
    }

    /// The plan of `family` (see `family_store`) for `bucket` and `mode`, checked step by step
    /// (`check_kernel`: no step the CUDA backend has no kernel for), and its launches on an sm_90.
    fn family_launches(family: &str, ty: Option<GgmlType>, bucket: Bucket, mode: OutputMode) -> (Plan, Vec<Launch>) {
        let (arch, store) = family_store(family, ty);
        let plan = kiln_runtime::compile(&arch.build_graph(bucket, mode).unwrap(), &store).unwrap();
        for st in &plan.steps {
            check_kernel(&st.kernel, &store).unwrap_or_else(|e| panic!("{family} {bucket:?}: {e}: {:?}", st.kernel));
            if let Some(a) = attention_of(&st.kernel) {
                for kv in [KvType::F32, KvType::F16] {
                    attention_kernel(false, false, a.softcap.is_some(), kv).unwrap();
                    attention_kernel(true, false, a.softcap.is_some(), kv).unwrap();
                }
            }
        }
        let l = lower(&plan, &store, SM90).unwrap_or_else(|e| panic!("{family} {bucket:?}: {e}"));
        (plan, l)
    }

    /// The names of the steps a family's plans hold, as `Kernel`'s variants print.
    fn kernel_kinds(plan: &Plan) -> Vec<String> {
        let mut kinds: Vec<String> =
            plan.steps.iter().map(|st| format!("{:?}", st.kernel).split([' ', '{']).next().unwrap_or("").to_string()).collect();
        kinds.sort();
        kinds.dedup();
        kinds
    }

    #[test]
    fn every_family_lowers_for_cuda_in_every_bucket() {
        let buckets = [
            Bucket::Prefill { rows: 128, seqs: 1 },
            Bucket::Prefill { rows: 16, seqs: 3 },
            Bucket::Decode { past: 16, seqs: 1 },
            Bucket::Decode { past: 16, seqs: 2 },
            Bucket::Decode { past: 64, seqs: 4 },
            Bucket::Decode { past: 64, seqs: 16 },
        ];
        let mut kinds = std::collections::BTreeSet::new();
        for family in FAMILIES {
            for ty in [None, Some(GgmlType::Q8_0)] {
                for bucket in buckets {
                    for mode in [OutputMode::NextToken, OutputMode::Logits, OutputMode::AllLogits] {
                        let (plan, _) = family_launches(family, ty, bucket, mode);
                        kinds.extend(kernel_kinds(&plan));
                    }
                }
            }
        }
        // Between them the families use every kernel of the plan IR but `Argmax` (an argmax of
        // stored logits: every greedy head is a `MatMulArgmax`).
        let all = [
            "Add",
            "AddBias",
            "Attention",
            "AttentionSoftCap",
            "Embed",
            "GeluMul",
            "LastRow",
            "MatMul",
            "MatMulArgmax",
            "Normalize",
            "RmsNorm",
            "Rope",
            "RopeScaled",
            "Scale",
            "SiluMul",
            "SoftCap",
        ];
        assert_eq!(kinds.iter().map(String::as_str).collect::<Vec<_>>(), all);
    }

    #[test]
    fn element_wise_steps_map_to_the_elementwise_ops() {
        let (plan, _) = family_launches("qwen2", None, Bucket::Prefill { rows: 16, seqs: 1 }, OutputMode::Logits);
        let ops: Vec<ElementOp> = plan.steps.iter().filter_map(|st| elementwise_of(&st.kernel)).map(|e| e.op).collect();
        // Per layer the q/k/v biases, the residual adds and SwiGLU's product.
        assert_eq!(ops.iter().filter(|&&o| o == ElementOp::Bias).count(), 2 * 3, "{ops:?}");
        assert_eq!(ops.iter().filter(|&&o| o == ElementOp::SiluMul).count(), 2, "{ops:?}");
        assert_eq!(ops.iter().filter(|&&o| o == ElementOp::Add).count(), 2 * 2, "{ops:?}");
        for st in &plan.steps {
            if let Some(Elementwise { op: ElementOp::Bias, bias, b, width, .. }) = elementwise_of(&st.kernel) {
                assert!(b.is_none() && bias.is_some() && width > 0);
            }
        }
        // Gemma 2's final soft-cap, Gemma 4's layer output scales.
        let (plan, _) = family_launches("gemma2", None, Bucket::Decode { past: 16, seqs: 1 }, OutputMode::Logits);
        let cap: Vec<Elementwise> = plan.steps.iter().filter_map(|st| elementwise_of(&st.kernel)).collect();
        assert!(cap.iter().any(|e| e.op == ElementOp::SoftCap && e.c == 15.0), "{cap:?}");
        let (plan, _) = family_launches("gemma4", None, Bucket::Decode { past: 16, seqs: 1 }, OutputMode::Logits);
        assert!(plan.steps.iter().filter_map(|st| elementwise_of(&st.kernel)).any(|e| e.op == ElementOp::Scale && e.c != 1.0));
        // The codes of ops.cu's `elementwise`.
        let codes = [ElementOp::Add, ElementOp::Mul, ElementOp::Gelu, ElementOp::GeluMul, ElementOp::Silu, ElementOp::SiluMul];
        assert!(codes.iter().enumerate().all(|(i, &o)| o as usize == i));
        assert_eq!((ElementOp::Scale as i32, ElementOp::SoftCap as i32, ElementOp::Bias as i32), (6, 7, 8));
    }

    #[test]
    fn the_attention_kernels_come_from_the_cache_kernel_table() {
        let all: Vec<&str> = KV_KERNELS.iter().flat_map(|&(a, b)| [a, b]).collect();
        for kv in [KvType::F32, KvType::F16] {
            for (tiled, qk, capped) in
                [(true, false, false), (true, false, true), (false, false, false), (false, false, true), (false, true, false)]
            {
                let name = attention_kernel(tiled, qk, capped, kv).unwrap();
                assert!(all.contains(&name), "{name}");
                assert_eq!(name.contains("_cap"), capped, "{name}");
                assert_eq!(name.ends_with("_f16"), kv == KvType::F16, "{name}");
            }
            assert!(attention_kernel(false, true, true, kv).is_err());
            assert!(attention_kernel(true, true, false, kv).is_err());
        }
    }

    #[test]
    fn unsupported_shapes_are_named_when_a_plan_is_checked() {
        let (_, store) = family_store("qwen2", None);
        let bias = (0..store.infos().len()).map(WeightId).find(|&w| store.info(w).name == "blk.0.attn_q.bias").unwrap();
        let slot = Slot { offset: 0, len: 1024 };
        let e = check_kernel(&Kernel::AddBias { x: slot, bias, out: slot, width: 128 }, &store).unwrap_err().to_string();
        assert!(e.contains("bias of 256 elements") && e.contains("128"), "{e}");
        assert!(check_kernel(&Kernel::AddBias { x: slot, bias, out: slot, width: 256 }, &store).is_ok());
        let att = Kernel::AttentionSoftCap {
            q: slot,
            k: slot,
            v: slot,
            out: slot,
            layer: 0,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 48,
            window: None,
            scale: 1.0,
            softcap: 50.0,
        };
        assert!(check_kernel(&att, &store).unwrap_err().to_string().contains("head size 48"));
        let norm = Kernel::Normalize { x: slot, out: slot, width: 192, group: 128, eps: 1e-6 };
        assert!(check_kernel(&norm, &store).unwrap_err().to_string().contains("groups of 128"));
    }

    #[test]
    fn llama_and_qwen_decode_steps_take_the_fused_swiglu_launch() {
        for family in ["llama", "qwen2", "qwen3"] {
            for seqs in [1, 2] {
                let (plan, l) = family_launches(family, Some(GgmlType::Q8_0), Bucket::Decode { past: 16, seqs }, OutputMode::NextToken);
                let layers = plan.steps.iter().filter(|st| attention_of(&st.kernel).is_some()).count();
                // Each layer's gate/up products and SiLU product in one matrix-vector launch, which
                // also writes its output quantized for the down projection.
                let glu: Vec<usize> = (0..l.len())
                    .filter(|&i| matches!(l[i].op, Op::MatVecs { glu: Some(g), .. } if glu_of(&plan.steps[g].kernel).map(|x| x.0) == Some(Glu::Silu)))
                    .collect();
                assert_eq!(glu.len(), layers, "{family} x{seqs}: {l:#?}");
                assert!(!plan.steps.iter().any(|st| matches!(st.kernel, Kernel::GeluMul { .. })));
                for &i in &glu {
                    assert!(l[i].quant_out.is_some(), "{family} x{seqs}");
                    assert_eq!(l[i + 1].xq_in, l[i].quant_out, "{family} x{seqs}");
                }
                // One row: the norm before the q/k/v and gate/up launches runs inside them.
                if seqs == 1 {
                    let pro = l.iter().filter(|l| matches!(l.op, Op::MatVecs { pro: Some(_), .. })).count();
                    assert!(pro >= 2 * layers, "{family}: {pro} prologues for {layers} layers: {l:#?}");
                }
            }
            // Mixed formats (the fixture's own): gate and up of different formats stay apart.
            let (plan, l) = family_launches(family, None, Bucket::Decode { past: 16, seqs: 1 }, OutputMode::NextToken);
            assert!(l.iter().all(|l| !matches!(l.op, Op::MatVecs { glu: Some(_), .. })), "{family}");
            assert!(plan.steps.iter().any(|st| matches!(st.kernel, Kernel::SiluMul { .. })));
        }
        // Gemma keeps its GELU launch.
        let (plan, l) = family_launches("gemma", Some(GgmlType::Q8_0), Bucket::Decode { past: 16, seqs: 1 }, OutputMode::NextToken);
        let glu: Vec<Glu> = l
            .iter()
            .filter_map(|l| if let Op::MatVecs { glu: Some(g), .. } = l.op { glu_of(&plan.steps[g].kernel).map(|x| x.0) } else { None })
            .collect();
        assert_eq!(glu, [Glu::Gelu; 2]);
    }

    #[test]
    fn each_family_takes_its_fused_attention_paths_where_they_apply() {
        // Per family: attentions with their q/k steps fused (with norms, without), RoPE launches
        // left, soft-capped attention steps.
        let fused = |family: &str, seqs: usize| {
            let decode = Bucket::Decode { past: 16, seqs };
            let (plan, l) = family_launches(family, Some(GgmlType::Q8_0), decode, OutputMode::NextToken);
            let qk = |norms: bool| l.iter().filter(|l| matches!(l.op, Op::QkAttention { qk, .. } if qk.norms.is_some() == norms)).count();
            let ropes = l.iter().filter(|l| matches!(l.op, Op::Step(t) if rope_table(&plan.steps[t].kernel).is_some())).count();
            let capped = plan.steps.iter().filter(|st| matches!(st.kernel, Kernel::AttentionSoftCap { .. })).count();
            // Every attention's output is written quantized for the output projection.
            for (i, x) in l.iter().enumerate() {
                let att = match x.op {
                    Op::Step(t) | Op::QkAttention { att: t, .. } => attention_of(&plan.steps[t].kernel),
                    _ => None,
                };
                if att.is_some() {
                    assert!(x.quant_out.is_some() && l[i + 1].xq_in == x.quant_out, "{family}: {x:?}");
                }
                // A fused attention reads the q and k its steps read, and the steps are its own.
                if let Op::QkAttention { qk, att } = x.op {
                    assert!(qk.steps().all(|t| t < att) && !l.iter().any(|y| matches!(y.op, Op::Step(t) if qk.steps().any(|u| u == t))));
                }
            }
            (qk(true), qk(false), ropes, capped)
        };
        // Qwen 3's q/k norms and NeoX RoPE run inside attention, and so do Llama's scaled RoPE of
        // adjacent pairs and Qwen 2's plain RoPE (no norms); Gemma 2's attention is soft-capped (two
        // RoPE launches a layer); Gemma 4's sliding layers (3 of 5) and its global ones, with
        // proportional RoPE (another table: another head size, divisors), fuse.
        assert_eq!(fused("qwen3", 1), (3, 0, 0, 0));
        assert_eq!(fused("llama", 1), (0, 3, 0, 0));
        assert_eq!(fused("qwen2", 1), (0, 2, 0, 0));
        assert_eq!(fused("gemma2", 1), (0, 0, 8, 4));
        assert_eq!(fused("gemma4", 1), (5, 0, 0, 0));
        // Several rows keep their RoPE launches (and `qk_norm_rope` where it applies).
        assert_eq!(fused("llama", 2), (0, 0, 6, 0));
        assert_eq!(fused("qwen2", 2), (0, 0, 4, 0));
        let (plan, _) = family_launches("llama", None, Bucket::Decode { past: 16, seqs: 1 }, OutputMode::NextToken);
        for st in &plan.steps {
            if let Kernel::RopeScaled { ref spec, head_dim, .. } = st.kernel {
                assert_eq!(spec.mode, RopeMode::Norm);
                assert_eq!(spec.freq_factors.as_ref().map(Vec::len), Some(head_dim / 2));
                let (table, adjacent) = rope_table(&st.kernel).unwrap();
                assert!(adjacent && table.factors.is_some() && table.head_dim == head_dim);
            }
        }
    }

    #[test]
    fn a_llama_or_qwen_decode_layer_fuses_rope_and_the_residual_adds() {
        // One row: per layer q/k/v (with the residual add and norm before them; the first layer's
        // norm alone), attention with both RoPEs, the output projection, gate/up/SiLU (with the
        // residual add and norm before them), down; then the last add with the final norm (one
        // rms_norm2 launch) and the head. Qwen 2's q, k and v (each with its bias launch) stay
        // three launches.
        for (family, qkv) in [("llama", 1), ("qwen2", 6)] {
            let decode = |seqs| family_launches(family, Some(GgmlType::Q8_0), Bucket::Decode { past: 16, seqs }, OutputMode::NextToken);
            let (plan, l) = decode(1);
            let layers = plan.steps.iter().filter(|st| attention_of(&st.kernel).is_some()).count();
            let adds = |plan: &Plan, l: &[Launch]| {
                l.iter().filter(|l| matches!(l.op, Op::Step(t) if matches!(plan.steps[t].kernel, Kernel::Add { .. }))).count()
            };
            let add_pairs = |plan: &Plan, l: &[Launch]| {
                l.iter()
                    .filter(|l| matches!(l.op, Op::NormPair { first, .. } if matches!(plan.steps[first].kernel, Kernel::Add { .. })))
                    .count()
            };
            let sums: Vec<Prologue> = l
                .iter()
                .filter_map(|l| match &l.op {
                    Op::MatVecs { pro: Some(p @ Prologue { norm: Epilogue::Pair(a, _), .. }), .. } => {
                        matches!(plan.steps[*a].kernel, Kernel::Add { .. }).then_some(*p)
                    }
                    _ => None,
                })
                .collect();
            assert_eq!((adds(&plan, &l), add_pairs(&plan, &l), sums.len()), (0, 1, 2 * layers - 1), "{family}: {l:#?}");
            // Each later add's residual is the sum an earlier launch's block 0 stored (its slot, and a
            // mirror row where the launch's products reuse its words).
            assert!(sums.iter().all(|p| p.h_out >= 1 && p.res_in.is_none_or(|r| r != p.h_out)), "{family}");
            for x in &l {
                if let Op::QkAttention { qk: QkSteps { norms: None, ropes }, att } = x.op {
                    // The fused attention reads the rotations' inputs.
                    let (Kernel::Rope { x: q, .. } | Kernel::RopeScaled { x: q, .. }) = plan.steps[ropes[0]].kernel else { panic!() };
                    assert!(attention_of(&plan.steps[att].kernel).is_some_and(|a| !overlaps(a.out, q)), "{family}");
                }
            }
            assert_eq!(l.iter().filter(|l| matches!(l.op, Op::QkAttention { .. })).count(), layers, "{family}");
            assert_eq!(l.len(), 1 + (qkv + 4) * layers + 2, "{family}: {l:#?}");
            // Two rows: every add with the norm after it in one rms_norm2 launch.
            let (plan, l) = decode(2);
            assert_eq!((adds(&plan, &l), add_pairs(&plan, &l)), (0, 2 * layers), "{family}");
        }
    }

    #[test]
    fn a_qwen2_bias_joins_its_products_launch_where_it_streams() {
        // One Qwen 2 layer wide enough for q/k/v to stream (4 MB and more a launch) in Q8_0, v in
        // Q8_0 or Q4_0 (its own launch of 0.6 MB: not streamed).
        let shape = LlamaShape {
            arch: LlamaArch::Qwen2,
            hidden: 2048,
            layers: 1,
            q_heads: 16,
            kv_heads: 4,
            head_dim: 128,
            ffn: 2048,
            vocab: 512,
            context: 512,
            rope_base: 1e6,
            rope_factor: 1.0,
            tied: true,
        };
        for (v_ty, arch) in [(GgmlType::Q8_0, SM90), (GgmlType::Q4_0, SM90), (GgmlType::Q8_0, (8, 0))] {
            let mut m = kiln_models::synth::llama(&shape, FormatMix::All(GgmlType::Q8_0), 3);
            for t in m.tensors.iter_mut().filter(|t| t.name.ends_with("attn_v.weight")) {
                let mut v = vec![0f32; t.dims.iter().product::<u64>() as usize];
                kiln_quant::dequantize(t.ty, &t.data, &mut v).unwrap();
                (t.data, t.ty) = (kiln_quant::quantize(v_ty, &v).unwrap(), v_ty);
            }
            let (model, store) = model_store(&m);
            let plan =
                kiln_runtime::compile(&model.build_graph(Bucket::Decode { past: 16, seqs: 1 }, OutputMode::NextToken).unwrap(), &store)
                    .unwrap();
            let l = lower(&plan, &store, arch).unwrap();
            let bias_steps =
                l.iter().filter(|l| matches!(l.op, Op::Step(t) if matches!(plan.steps[t].kernel, Kernel::AddBias { .. }))).count();
            let biased: Vec<&Op> = l
                .iter()
                .map(|l| &l.op)
                .filter(|op| matches!(op, Op::MatVecs { biases, .. } if biases.iter().any(Option::is_some)))
                .collect();
            let what = format!("v {v_ty:?}, sm_{}{}", arch.0, arch.1);
            if arch.0 < 9 {
                // No streamed launches: every bias its own launch.
                assert!(biased.is_empty() && bias_steps == 3, "{what}: {l:#?}");
                continue;
            }
            // The streamed q/k(/v) launch adds its biases (each step right after its product, no
            // norm prologue); a v of another format keeps its bias launch.
            let [Op::MatVecs { steps, biases, pro: None, epi: None, glu: None }] = biased[..] else { panic!("{what}: {l:#?}") };
            assert_eq!(steps.len(), if v_ty == GgmlType::Q8_0 { 3 } else { 2 }, "{what}");
            for (m, b) in steps.iter().zip(biases) {
                let (Kernel::MatMul { out, .. }, Some(Kernel::AddBias { x, .. })) =
                    (&plan.steps[*m].kernel, b.map(|b| &plan.steps[b].kernel))
                else {
                    panic!("{what}: {l:#?}")
                };
                assert!(b == &Some(m + 1) && x == out, "{what}");
            }
            assert_eq!(bias_steps, 3 - steps.len(), "{what}");
        }
    }

    #[test]
    fn many_row_decode_steps_are_captured_where_every_product_takes_mmq() {
        let shape =
            Gemma3Shape { hidden: 512, layers: 2, q_heads: 4, kv_heads: 1, head_dim: 128, ffn: 1024, vocab: 1000, window: 8, context: 64 };
        let capturable = |bucket, mix, arch| {
            let (plan, store) = plan_of(&shape, bucket, mix);
            capturable_mmq(&plan, &store, arch).unwrap()
        };
        let decode = |seqs| Bucket::Decode { past: 16, seqs };
        assert!(capturable(decode(16), FormatMix::Q4KM, SM90));
        assert!(capturable(decode(256), FormatMix::All(GgmlType::Q8_0), (8, 0)));
        // This model's rows are short: from MMQ_MIN_ROWS rows they take mmq too.
        assert!(capturable(decode(MMQ_MIN_ROWS), FormatMix::Q4KM, SM90));
        // Fewer rows take the matrix-vector kernels (captured without this scratch), as do
        // formats without mmq (the float ones) up to MATVEC_ROWS rows; then F16 takes cuBLAS; prompts are not
        // captured; mma needs sm_80.
        assert!(!capturable(decode(MMQ_MIN_ROWS - 1), FormatMix::Q4KM, SM90));
        assert!(!capturable(decode(MATVEC_ROWS), FormatMix::All(GgmlType::F16), SM90));
        assert!(!capturable(decode(16), FormatMix::All(GgmlType::F16), SM90));
        assert!(!capturable(Bucket::Prefill { rows: 16, seqs: 1 }, FormatMix::Q4KM, SM90));
        assert!(!capturable(decode(16), FormatMix::Q4KM, (7, 5)));
    }

    #[test]
    fn products_take_mmq_from_four_rows() {
        for rows in 1..MMQ_MIN_ROWS {
            assert!(takes_matvec(GgmlType::Q4_K, 640, rows, SM90));
            assert!(takes_matvec(GgmlType::Q4_K, 3840, rows, SM90));
        }
        for rows in MMQ_MIN_ROWS..=MATVEC_ROWS {
            assert!(!takes_matvec(GgmlType::Q4_K, 640, rows, SM90), "{rows}");
            assert!(!takes_matvec(GgmlType::Q8_0, MMQ_SHORT_K, rows, SM90), "{rows}");
            assert!(!takes_matvec(GgmlType::Q4_K, 3840, rows, SM90), "{rows}");
            assert!(!takes_matvec(GgmlType::Q6_K, 15360, rows, SM90), "{rows}");
            // Formats without mmq and devices without its mma stay.
            assert!(takes_matvec(GgmlType::F16, 640, rows, SM90), "{rows}");
            assert!(takes_matvec(GgmlType::Q4_K, 640, rows, (7, 5)), "{rows}");
            // In blocks of 8 activation rows.
            assert_eq!(MmqBlock::of(rows), MMQ_FEW);
        }
        assert!(!takes_matvec(GgmlType::Q4_K, 3840, MATVEC_ROWS + 1, SM90));
        assert_eq!(MmqBlock::of(MATVEC_ROWS + 1), MMQ_MANY);
    }

    #[test]
    fn decode_plans_whose_products_take_mmq_keep_them_unfused() {
        // Short rows at 4 sequences: no norm fused into a product, no input written quantized.
        let (_, l) = launches(Bucket::Decode { past: 16, seqs: MMQ_MIN_ROWS }, FormatMix::Q4KM);
        assert!(l
            .iter()
            .all(|l| l.quant_out.is_none() && !matches!(l.op, Op::MatVecs { epi: Some(_), .. } | Op::MatVecs { pro: Some(_), .. })));
        let (_, l) = launches(Bucket::Decode { past: 16, seqs: MMQ_MIN_ROWS - 1 }, FormatMix::Q4KM);
        assert!(l.iter().any(|l| l.quant_out.is_some() || matches!(l.op, Op::MatVecs { epi: Some(_), .. })), "{l:#?}");
    }

    #[test]
    fn a_gemma3_decode_step_is_five_launches_per_layer() {
        let (_, l) = launches(Bucket::Decode { past: 16, seqs: 1 }, FormatMix::All(GgmlType::Q4_K));
        let names: Vec<String> = l.iter().map(|l| format!("{:?}", l.op).split([' ', '(']).next().unwrap_or("").to_string()).collect();
        println!("{names:?}");
        // embed, then per layer: q/k/v with the norm (pair) before them, attention with the q/k
        // norms and RoPE, the output projection, gate/up/GELU with the norm pair before them, down
        // (the last with the final norm pair after it); then the head with its argmax.
        assert_eq!(l.iter().filter(|l| matches!(l.op, Op::MatVecs { pro: Some(_), .. })).count(), 6, "{l:#?}");
        assert_eq!(l.iter().filter(|l| matches!(l.op, Op::MatVecs { epi: Some(_), .. })).count(), 1, "{l:#?}");
        assert_eq!(l.iter().filter(|l| matches!(l.op, Op::QkAttention { .. })).count(), 3, "{l:#?}");
        assert_eq!(l.len(), 1 + 3 * 5 + 1, "{l:#?}");
        // The output and down projections and the head read their inputs already quantized.
        let quantized = l.iter().filter(|l| l.xq_in.is_some()).count();
        assert_eq!(quantized, 3 * 2 + 1, "{l:#?}");
    }

    #[test]
    fn the_default_models_decode_step_fuses_every_norm_into_a_launch() {
        let path = kiln_hub::ensure_default_model().unwrap();
        let file = Arc::new(kiln_gguf::GgufFile::open(&path).unwrap());
        let arch = kiln_models::architecture_from_gguf(&file).unwrap();
        let store = WeightStore::new(file).unwrap();
        let bucket = Bucket::Decode { past: 512, seqs: 1 };
        let plan = kiln_runtime::compile(&arch.build_graph(bucket, OutputMode::NextToken).unwrap(), &store).unwrap();
        let l = lower(&plan, &store, SM90).unwrap();
        let layers = 18;
        // Per layer q/k/v (two launches where v's format differs), attention, the output
        // projection, gate/up/GELU, down; the embedding and the head.
        let split_qkv = l.iter().filter(|l| matches!(&l.op, Op::MatVecs { steps, .. } if steps.len() == 1 && matches!(plan.steps[steps[0]].kernel, Kernel::MatMul { n, .. } if n == 256))).count();
        println!("{} launches, {split_qkv} separate v projections", l.len());
        for x in &l {
            println!("{:?} xq_in {:?} quant_out {:?}", x.op, x.xq_in, x.quant_out);
        }
        assert_eq!(l.iter().filter(|l| matches!(l.op, Op::NormPair { .. } | Op::QkNormRope(_))).count(), 0);
        assert_eq!(l.len(), 2 + 5 * layers + split_qkv);
    }

    #[test]
    fn gemma3_decode_steps_run_the_qk_norms_and_rope_in_attention_at_every_preset_width() {
        // The presets' attention widths (one layer, a small MLP and vocabulary): the arena must
        // not place the attention's output or the rotated k over the values its fused q/k norms
        // read, whatever the widths (at 1B it did before decode plans kept values 4 steps longer).
        for name in Gemma3Shape::PRESETS {
            let p = Gemma3Shape::preset(name).unwrap();
            let shape = Gemma3Shape { layers: 1, ffn: 512, vocab: 1000, ..p };
            let (_, l) = launches_of(&shape, Bucket::Decode { past: 512, seqs: 1 }, FormatMix::Q4KM);
            assert_eq!(l.iter().filter(|l| matches!(l.op, Op::QkAttention { .. })).count(), 1, "{name}: {l:#?}");
            assert!(l.iter().all(|l| !matches!(l.op, Op::QkNormRope(_))), "{name}");
        }
    }

    #[test]
    fn matvec_launch_geometry_at_12b_shapes() {
        // An H200 (132 multiprocessors), one activation row, rows of 3840 (15360 for down).
        let one = |total, n, k, glu, prologue| MatVecShape { rows: 1, total, n, k, glu, prologue }.geometry(132);
        let g = |kernel, per_warp, split, blocks| MatVecGeometry { kernel, per_warp, split, blocks };
        // gate/up: 7,680 groups of 2 + 2 rows, whole rows per warp, not persistent (3.6 rounds).
        assert_eq!(one(30720, 15360, 3840, true, false), g("matvec4", 4, 1, 1920));
        // q + k: 1,536 groups (11.6 warps per multiprocessor) of 120-chunk rows: not split.
        assert_eq!(one(6144, 4096, 3840, false, false), g("matvec4", 4, 1, 384));
        // v alone: 512 groups, split over 2 warps.
        assert_eq!(one(2048, 2048, 3840, false, false), g("matvec4", 4, 2, 256));
        // o: 960 groups of 128-chunk rows: not split.
        assert_eq!(one(3840, 3840, 4096, false, false), g("matvec4", 4, 1, 240));
        // down: 480-chunk rows split over 4 warps.
        assert_eq!(one(3840, 3840, 15360, false, false), g("matvec4", 4, 4, 960));
        // The greedy head (65,536 groups, 31 rounds): persistent, 4 blocks per multiprocessor;
        // with a norm prologue (its own kernel) it is not.
        assert_eq!(one(262144, 262144, 3840, false, false), g("matvec4", 4, 1, 4 * 132));
        assert_eq!(one(262144, 262144, 3840, false, true), g("matvec4p", 4, 1, 16384));
        // Few rows: 2 rows per warp; more activation rows: the multi-row kernel.
        assert_eq!(one(640, 640, 2048, false, false), g("matvec1", 2, 2, 160));
        assert_eq!(
            MatVecShape { rows: 4, total: 4096, n: 4096, k: 640, glu: false, prologue: false }.geometry(132),
            g("matvec", 2, 1, 512)
        );
    }

    #[test]
    fn prompt_plans_keep_the_attention_rows_aligned_for_the_tiled_kernel() {
        // attention_tiled copies query, key and value rows in 16-byte pieces (else the one-row
        // kernel runs): the arena keeps them at multiples of 4 words in prompt plans.
        for (rows, seqs) in [(16, 1), (64, 1), (256, 1), (512, 1), (512, 4)] {
            let (plan, _) = launches(Bucket::Prefill { rows, seqs }, FormatMix::Q4KM);
            for st in &plan.steps {
                if let Kernel::Attention { q, k, v, .. } = st.kernel {
                    assert!([q, k, v].iter().all(|s| s.offset.is_multiple_of(4)), "{rows} rows of {seqs}: {q:?} {k:?} {v:?}");
                }
            }
        }
    }

    #[test]
    fn prompts_take_the_tiled_attention_where_its_blocks_fill_the_device() {
        // Default model (4 query heads) on 132 multiprocessors: from 256 rows (64 blocks).
        assert!(!takes_tiled_attention(128, 1, 4, 132));
        assert!(takes_tiled_attention(256, 1, 4, 132));
        // 12B (16 query heads): from 64 rows.
        assert!(!takes_tiled_attention(32, 1, 16, 132));
        assert!(takes_tiled_attention(64, 1, 16, 132));
        // Decode steps (a row per sequence) and short rows of many sequences never.
        assert!(!takes_tiled_attention(64, 64, 16, 132));
        assert!(!takes_tiled_attention(300, 30, 16, 132));
        assert!(takes_tiled_attention(300, 12, 16, 132));
    }

    #[test]
    fn attention_gives_every_multiprocessor_a_block() {
        // One row of 12B (16 query heads) and 270M (4); 8 rows of 270M, of 12B; a device smaller
        // than the heads.
        assert_eq!(attention_splits(16, 132), 8);
        assert_eq!(attention_splits(4, 132), ATTENTION_SPLITS_MAX);
        assert_eq!(attention_splits(32, 132), 4);
        assert_eq!(attention_splits(128, 132), 1);
        assert_eq!(attention_splits(32, 16), 1);
    }

    #[test]
    fn one_row_launches_stream_through_shared_memory() {
        use GgmlType::*;
        let r = |ty, k, rows: &[usize], glu| ring_geometry(ty, k, rows, glu, 132);
        // Every multiprocessor holds 208 KB of rings: 4 blocks of 4 warps or 2 of 8.
        assert_eq!((ring_shared(8), ring_shared(4), ring_shared(2)), (52 << 10, 104 << 10, 52 << 10));
        let g = |rows, stages, blocks| Some(RingGeometry { rows, warps: if rows == 4 { 8 } else { 4 }, stages, blocks });
        // The 12B's launches: gate/up (Q4_K, 4 + 4 rows per 17 KB tile, 3 stages, 4 blocks per
        // multiprocessor), the greedy head (planar Q6_K, 2 stages of 25 KB), q/k/v (768 tiles), o,
        // v alone (Q6_K), down (4 rows of 15360 in blocks of 8 warps, 2 per multiprocessor: 8
        // rows exceed the ring).
        assert_eq!(r(Q4_K, 3840, &[15360, 15360], true), g(8, 3, 528));
        assert_eq!(r(Q6_K, 3840, &[262144], false), g(8, 2, 528));
        assert_eq!(r(Q4_K, 3840, &[4096, 2048], false), g(8, 3, 528));
        assert_eq!(r(Q4_K, 4096, &[3840], false), g(8, 2, 480));
        assert_eq!(r(Q6_K, 3840, &[2048], false), g(8, 2, 256));
        assert_eq!(r(Q4_K, 15360, &[3840], false), g(4, 3, 264));
        assert_eq!(r(Q6_K, 15360, &[3840], false), g(4, 2, 264));
        // 2-row tiles: rows that 4-row tiles do not cut (a ring that holds two tiles of 4 rows in
        // blocks of 4 warps holds two of 8 too).
        assert_eq!(r(Q4_K, 15360, &[3842], false), g(2, 3, 528));
        // Not: rows that cut in neither tile, a Q6_K glu pair of 3840-wide rows (the d plane's
        // share of 4 rows, 120 bytes, or 1 row is not a multiple of 16), launches under
        // RING_MIN_BYTES (the 270M's), formats without a ring kernel.
        assert_eq!(r(Q6_K, 3840, &[262141], false), None);
        assert_eq!(r(Q6_K, 3840, &[15360, 15360], true), None);
        assert_eq!(r(Q4_K, 640, &[2048, 2048], true), None);
        assert_eq!(r(Q4_1, 3840, &[262144], false), None);
        assert_eq!(r(Q4_0, 3840, &[262144], false), g(8, 3, 528));
        assert_eq!(r(Q5_K, 3840, &[262144], false), g(8, 2, 528));
        // cuda.rs's streamed-launch models (hidden 2048, MLP 32768, vocabulary 65536).
        assert_eq!(r(Q4_K, 2048, &[65536], false), g(8, 4, 528));
        assert_eq!(r(Q8_0, 2048, &[32768, 32768], true), g(8, 3, 528));
        assert_eq!(r(Q8_0, 2048, &[2048, 256, 256], false), g(8, 3, 320));
        assert_eq!(r(Q6_K, 32768, &[2048], false), None);
        assert_eq!(r(Q4_K, 15360, &[2048], false), g(4, 3, 264));
        assert_eq!(r(Q6_K, 15360, &[2048], false), g(4, 2, 264));
        assert_eq!(r(Q5_0, 15360, &[2048], false), g(4, 2, 264));
        assert_eq!(r(Q8_0, 15360, &[2048], false), None);
    }

    #[test]
    fn mmq_launches_take_the_widest_tile_that_fills_the_device() {
        let tile = |n, rows| MmqBlock::of(rows).tile(n, rows, 132);
        // A 12B gate for 512 prompt rows and for 64 sequences: 128-row tiles.
        assert_eq!(tile(15360, 512), 128);
        assert_eq!(tile(15360, 64), 128);
        // For 16 sequences one activation block: 120 blocks of 128 rows are too few, 240 of 64 not.
        assert_eq!(tile(15360, 16), 64);
        // The 270M's key rows, few weight rows: 8-row blocks (warps splitting the sub-blocks).
        assert_eq!(tile(256, 512), 8);
        assert_eq!(tile(1024, 16), 8);
        assert_eq!(tile(1024, 512), 64);
        // Partial tiles: 1000 rows (the tests' vocabulary), 150 activation rows in 5 blocks.
        assert_eq!(tile(1000, 150), 32);
        // Few rows: the 270M's gate in 16-row blocks, its head in 128-row ones.
        assert_eq!(tile(2048, 8), 16);
        assert_eq!(tile(262144, 4), 128);
    }

    #[test]
    fn few_row_mmq_launches_split_long_rows_into_runs() {
        let shape = |n, k, rows| MmqBlock::of(rows).shape(n, k, rows, 132);
        // 12B shapes at 4-8 rows: 128-row tiles, runs of at least 4 stages up to ~4 blocks a
        // multiprocessor, none empty.
        for rows in MMQ_MIN_ROWS..=MATVEC_ROWS {
            assert_eq!(shape(15360, 3840, rows), (128, 4), "gate"); // 120 x 4 blocks, runs of 8 stages
            assert_eq!(shape(4096, 3840, rows), (128, 6), "q"); // 32 x 6, runs of 5
            assert_eq!(shape(3840, 15360, rows), (128, 15), "down"); // 30 x 15, runs of 8
            assert_eq!(shape(262144, 3840, rows), (128, 1), "head");
        }
        for (n, k) in [(15360, 3840), (4096, 3840), (3840, 15360), (2304, 4608)] {
            let (_, runs) = shape(n, k, 8);
            let per = (k / MMQ_K).div_ceil(runs);
            assert!(per >= MMQ_RUN_MIN_STEPS && (runs - 1) * per < k / MMQ_K, "{n} x {k}: {runs} runs of {per}");
            assert!(n.div_ceil(128) * runs * MMQ_RUN_SUMS <= MMQ_RUN_BLOCKS_PER_SM * 132 * MMQ_RUN_SUMS);
        }
        // Short rows, and blocks of 32 rows, walk all of k.
        assert_eq!(shape(2048, 640, 8), (16, 1));
        assert_eq!(shape(640, 2048, 4), (MmqBlock::of(4).tile(640, 4, 132), 1));
        assert_eq!(shape(15360, 3840, 16), (64, 1));
    }

    #[test]
    fn mmq_takes_its_formats_on_rows_of_whole_stages() {
        for ty in MMQ_FORMATS {
            assert!(takes_mmq(ty, 640, SM90) && takes_mmq(ty, 15360, SM90), "{ty:?}");
            // Every mmq format's weight rows take shared memory (its `Tile<T>::STRIDE`).
            assert!(MMQ_MANY.shared(ty, 8) > MMQ_MANY.shared(GgmlType::F32, 8), "{ty:?}");
            // Rows not a multiple of a stage (here 5 legacy blocks) and devices without mma.
            assert!(!takes_mmq(ty, 160, SM90) && !takes_mmq(ty, 640, (7, 5)), "{ty:?}");
        }
        assert!(!takes_mmq(GgmlType::F16, 640, SM90));
        // Shared memory: the Q8_0 block of 128 rows is the largest (two blocks a multiprocessor).
        assert_eq!(MMQ_MANY.shared(GgmlType::Q8_0, 128), 3 * (32 * 336 + 128 * 144));
        assert_eq!(MMQ_FEW.shared(GgmlType::Q4_K, 64), 4 * (8 * 336 + 64 * 80));
        for block in MMQ_BLOCKS {
            let most = block.shared(GgmlType::Q8_0, 128);
            assert!(MMQ_FORMATS.iter().all(|&ty| block.shared(ty, 128) <= most));
            // (A multiprocessor has 227 KiB for its blocks.)
            assert!(most <= 227 * 1024, "{block:?}: {most}");
        }
    }

    #[test]
    fn gate_up_launches_quantize_their_products_up_to_glu_quant_max() {
        let glu_quantizes = |ffn: usize| {
            let shape =
                Gemma3Shape { hidden: 256, layers: 1, q_heads: 2, kv_heads: 1, head_dim: 128, ffn, vocab: 1000, window: 8, context: 64 };
            let (_, l) = launches_of(&shape, Bucket::Decode { past: 16, seqs: 1 }, FormatMix::All(GgmlType::Q8_0));
            let glu = l.iter().position(|l| matches!(l.op, Op::MatVecs { glu: Some(_), .. })).expect("a gate/up launch");
            // The down projection reads the gate/up launch's quantized products, or quantizes them
            // itself (a separate launch).
            assert_eq!(l[glu + 1].xq_in, l[glu].quant_out, "{l:#?}");
            l[glu].quant_out.is_some()
        };
        assert!(glu_quantizes(1024));
        assert!(glu_quantizes(GLU_QUANT_MAX));
        assert!(!glu_quantizes(GLU_QUANT_MAX + 256));
        // A gate/up launch that streams its weights (rows wider than a prologue takes, 4 MB or
        // more) leaves its products to the quantize launch: the 1B's.
        let shape = Gemma3Shape { layers: 1, vocab: 1000, ..Gemma3Shape::preset("1b").unwrap() };
        let (_, l) = launches_of(&shape, Bucket::Decode { past: 16, seqs: 1 }, FormatMix::Q4KM);
        let glu = l.iter().position(|l| matches!(l.op, Op::MatVecs { glu: Some(_), pro: None, .. })).expect("a gate/up launch");
        assert_eq!((l[glu].quant_out, l[glu + 1].xq_in), (None, None), "{l:#?}");
    }

    #[test]
    fn wide_rows_keep_the_norm_kernels() {
        // Rows wider than PROLOGUE_MAX and EPILOGUE_MAX keep the norm kernels, key rows wider
        // than FUSED_QK_MAX_KV the separate q/k norm steps.
        let shape = Gemma3Shape {
            hidden: 2048,
            layers: 2,
            q_heads: 16,
            kv_heads: 16,
            head_dim: 256,
            ffn: 1024,
            vocab: 1000,
            window: 8,
            context: 64,
        };
        let (_, l) = launches_of(&shape, Bucket::Decode { past: 16, seqs: 1 }, FormatMix::All(GgmlType::Q8_0));
        assert!(l.iter().all(|l| !matches!(l.op, Op::MatVecs { pro: Some(_), .. } | Op::QkAttention { .. })), "{l:#?}");
        assert!(l.iter().all(|l| !matches!(l.op, Op::MatVecs { epi: Some(_), .. })), "{l:#?}");
        assert_eq!(l.iter().filter(|l| matches!(l.op, Op::NormPair { .. })).count(), 4, "{l:#?}");
    }

    #[test]
    fn only_staged_formats_take_dynamic_shared_memory() {
        // Q5_0: 4 warps x 3 stages x 4 rows x 2 pieces x 32 lanes x 16 bytes, within a block's limit.
        assert_eq!(matvec4_shared_bytes("q5_0"), 48 * 1024);
        assert!(matvec4_shared_bytes("q5_0") <= 227 * 1024);
        for fmt in ["f32", "q4_0", "q8_0", "q4_k", "q6_k"] {
            assert_eq!(matvec4_shared_bytes(fmt), 0, "{fmt}");
        }
    }

    #[test]
    fn prefill_plans_keep_separate_steps_for_many_rows() {
        let (plan, l) = launches(Bucket::Prefill { rows: 16, seqs: 1 }, FormatMix::All(GgmlType::Q8_0));
        assert!(plan.rows() > MATVEC_ROWS);
        assert!(l.iter().all(|l| l.quant_out.is_none() && !matches!(l.op, Op::MatVecs { epi: Some(_), .. })));
    }
}
